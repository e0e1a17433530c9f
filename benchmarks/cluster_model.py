"""A model of the distributed sparse step for S shard actors × N trainer actors: calibrated on one
configuration, checked against loopback-cluster measurements, then projected to many machines.

What runs (issue 31). `benchmarks/trainer_scaling.py`'s measurement (a loopback multi-node Ray
cluster, configs/ctr.toml's CTR model, `threshold` selection on the shards, trainer actors
calling the shards directly) for every (S, N) in --grid, one fresh worker process each, plus an
idle "ping round" microbenchmark (the coordinator calls S no-op actors and waits for all) for
the per-round latency λ(S) and the machine CPU one actor call costs. All of it is repeated
(--repeats, interleaved: every point once, then again) and each point is its median run — on
this 2-core machine one run of a point moves by tens of percent, and the calibration takes
differences of two points, so single runs put that noise into every prediction.

The model (`predict`, a pure function; tests/test_cluster_model.py). One step of one trainer
is its rounds to every shard (lookup, clipped row sums with the pooled-output gradients: R_t = 2;
the per-example norms are computed on the trainer, cluster.norms_on_trainer), between
them its own compute, and on the shards their compute; then the coordinator's rounds
(reduction with the selection, write-back: R_c = 2) and its own compute (noise, ledger,
dense update); the coordinator also sends each trainer its task (one call per trainer).
From S = N = 1 measured at two batches, b₀ and b₀/4, S = 1 with the most trainers measured
(N_max, 4 by default) at b₀ (on this machine), and idle ping rounds:
  t_T, t_S, t_C  CPU seconds per step of the trainer, the shard and the coordinator processes,
                 each split into a part per step and a part per example, f + c·b (the line
                 through the two batches; f ≥ 0);
  W              the whole machine's busy CPU seconds per step (Ray's daemons included), split
                 the same way, after taking out κ per actor call;
  X₀             bytes per step between trainers/coordinator and shards (payload arrays, ∝ b);
  λ(S)           the idle ping round to S actors;
  τ_x            the calibration point's step beyond its critical path (CPU + rounds × λ), per byte
                 of the step: moving the payloads (serialization, the object store's copies) on
                 the path, which an idle ping does not show;
  κ, g_C         from S = 1, N = N_max against S = N = 1: the machine's CPU outside the role processes
                 per extra actor call *with the step's payloads* (an idle ping's is recorded beside
                 it: far less), and the coordinator's CPU per extra trainer (each trainer's task and
                 its dense gradient to sum). Slopes, so taken over the widest span measured: the
                 noise of two runs is divided by the most extra calls (9 at N = 4, 3 at N = 2 —
                 and N = 2 at S = 1 ran with the coordinator's CPU above N = 4's in all four runs
                 of 2026-11-27, 85–95 ms against 54–63, so a slope through it was twice too
                 steep). Without that point: the ping's κ and g_C = 0.
For (S, N, b), every per-example part scaled by b (and, for other tables, by w = F·D/(F₀·D₀)),
written t(b) = f + w·c·b:
  calls    = R_t·N·S + R_c·S + N                               actor calls per step
  critical = (R_t + R_c)·λ(S) + f_T + w·c_T·b/N + f_S + w·c_S·b/S + t_C(b) + g_C·(N − 1)
             + τ_x·max(X/N, X/S)                               one trainer's path, the others in parallel
  cpu      = W(b) + (N − 1)·f_T + (S − 1)·f_S + κ·(calls − calls(1, 1)) + g_C·(N − 1)
                                                               all work, wherever it runs (each process
                                                               pays its own part per step)
  network  = max(X/N over a trainer's link, X/S over a shard's link)/β, X = w·X₀·b/b₀
  loopback (one machine, `cores`):   step = max(critical, cpu/cores)
  many machines (one actor each):    step = critical + network + (R_t + R_c)·rtt
The loopback form is what the measurements check (error per (S, N) point other than the two
calibration points, goal: within 25%);
the many-machine form adds what loopback cannot show, links of β bytes/s and a round trip per
round, and assumes a machine per actor (cores ≥ the actor's threads) and no overlap of compute
with transfers (pessimistic). Its inputs beyond the calibration (β, rtt, Criteo-1TB's shape)
are stated with the projection; λ(S) beyond the measured S is the line fitted through the
measured ones (the caller's fan-out cost grows with S).

Projection: S = N ∈ {8, 32, 128} at b = 65,536 on Criteo-1TB's shape (the 26 published
cardinalities, each capped at the 40M hash size; D = 128 as in MLPerf's DLRM), 25 and 100 Gb/s.

    python benchmarks/cluster_model.py [--quick] [--grid 1,2,4] [--batch 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (TIMING_PRIVACY, announce_machine, ctr_dataset, fmt_bytes, format_table, run_worker,  # noqa: E402
                     worker_entry, write_results)

TRAINER_ROUNDS = 2  # trainer → every shard: lookup, clipped row sums (the norms on the trainer)
COORDINATOR_ROUNDS = 2  # coordinator → every shard: reduction + selection, write-back
#: Criteo-1TB's 26 categorical cardinalities (days 0–23, as MLPerf's DLRM reference lists them)
CRITEO_1TB_CARDINALITIES = (
    227605432, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 130229467, 3067956, 405282, 10, 2209, 11938, 155, 4, 976,
    14, 292775614, 40790948, 187188510, 590152, 12973, 108, 36)
CRITEO_HASH = 40_000_000
CRITEO_DIM = 128
LINKS_GBPS = (25, 100)
RTT_S = 50e-6  # one round trip inside a datacenter network (assumed; stated in RESULTS)
MODEL_GOAL = 0.25  # the model within 25% of every loopback measurement it is checked against


def latency_line(latency: dict) -> tuple[float, float]:
    """(λ₀, λ₁) of λ(S) = λ₀ + λ₁·S, least squares through the measured {S: seconds}."""
    xs, ys = [float(s) for s in latency], [float(v) for v in latency.values()]  # keys may be JSON strings
    if len(xs) == 1:
        return ys[0], 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, max(slope, 0.0)


def round_latency(latency: dict, shards: int) -> float:
    """λ(S): the measured value at a measured S, else the fitted line."""
    measured = {int(s): float(v) for s, v in latency.items()}
    if shards in measured:
        return measured[shards]
    lam0, lam1 = latency_line(latency)
    return lam0 + lam1 * shards


def calls_per_step(shards: int, trainers: int) -> int:
    """Actor calls per step: each trainer's rounds to every shard, the coordinator's, and one task per trainer."""
    return TRAINER_ROUNDS * trainers * shards + COORDINATOR_ROUNDS * shards + trainers


def _split(cal: dict, key: str, scale: float, share: int = 1) -> float:
    """One role's CPU seconds per step: its part per step, plus its part per example scaled by
    `scale` (batch and width against the calibration) and divided among `share` actors."""
    fixed = cal.get("fixed", {}).get(key, 0.0)
    return fixed + (cal[key] - fixed) * scale / share


def predict(cal: dict, shards: int, trainers: int, batch: float, *, cores: Optional[float] = None,
            link_bytes_per_s: Optional[float] = None, rtt_s: float = 0.0, width: float = 1.0) -> dict:
    """The modelled step (seconds) for S = `shards`, N = `trainers` at expected batch `batch`.

    `cal`: the calibration (keys batch, trainer_cpu_s, shard_cpu_s, coordinator_cpu_s,
    machine_cpu_s — each at the calibration batch —, optionally `fixed` {key: the part of it
    per step, not per example}, bytes_per_step, latency_s {S: s}, call_cpu_s); `cores`: one
    machine with that many cores (loopback: the step is at least all its CPU work over the
    cores); `link_bytes_per_s`: a machine per actor joined by links of that speed (adds the
    transfer time of the busiest link and `rtt_s` per round); `width`: per-example work and
    bytes relative to the calibration model (F·D / F₀·D₀)."""
    scale = batch / cal["batch"] * width
    rounds = TRAINER_ROUNDS + COORDINATOR_ROUNDS
    per_trainer = cal.get("coordinator_per_trainer_s", 0.0) * (trainers - 1)
    total_bytes = scale * cal["bytes_per_step"]
    # τ_x: the payloads' move on the path, the busiest role's share of the step's bytes
    transfer = cal.get("transfer_s_per_byte", 0.0) * max(total_bytes / trainers, total_bytes / shards)
    critical = rounds * round_latency(cal["latency_s"], shards) + (
        _split(cal, "trainer_cpu_s", scale, trainers) + _split(cal, "shard_cpu_s", scale, shards)
        + _split(cal, "coordinator_cpu_s", scale) + per_trainer) + transfer
    calls = calls_per_step(shards, trainers)
    # Every trainer and every shard process pays its own part per step (measured once at S = N = 1).
    fixed = cal.get("fixed", {})
    extra_processes = (trainers - 1) * fixed.get("trainer_cpu_s", 0.0) + (shards - 1) * fixed.get("shard_cpu_s", 0.0)
    cpu = (_split(cal, "machine_cpu_s", scale) + extra_processes + per_trainer
           + cal["call_cpu_s"] * (calls - calls_per_step(1, 1)))
    out = {"critical_s": critical, "transfer_s": transfer, "cpu_s": cpu, "calls": calls, "bytes_per_shard": total_bytes / shards,
           "bytes_per_trainer": total_bytes / trainers}
    step = critical
    if cores is not None:
        step = max(step, cpu / cores)
    if link_bytes_per_s is not None:
        out["network_s"] = max(total_bytes / trainers, total_bytes / shards) / link_bytes_per_s + rounds * rtt_s
        step += out["network_s"]
    out["step_s"] = step
    return out


def criteo_shape() -> dict:
    """Criteo-1TB's tables under the 40M hash: rows per table, total rows, bytes of the tables at D = 128."""
    rows = [min(c, CRITEO_HASH) for c in CRITEO_1TB_CARDINALITIES]
    return {"rows": rows, "total_rows": sum(rows), "table_bytes": sum(rows) * CRITEO_DIM * 4,
            "features": len(rows), "dim": CRITEO_DIM}


# ---- measurements ----------------------------------------------------------------------------------

def ping_worker(spec: dict) -> dict:
    """Idle ping rounds: the driver calls S no-op actors (1 CPU each, a loopback cluster of
    `nodes` nodes like the step's) and waits for all; median round time per S, and machine CPU
    per call."""
    import ray
    from ray.cluster_utils import Cluster

    from trainer_scaling import machine_busy_seconds

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": spec["head_cpus"]})
    for _ in range(spec["nodes"] - 1):
        cluster.add_node(num_cpus=spec["node_cpus"])
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)

    @ray.remote(num_cpus=1, scheduling_strategy="SPREAD")
    class Nop:
        def ping(self):
            return None

    out: dict = {"latency_s": {}, "call_cpu_s": {}}
    try:
        for s in spec["shards"]:
            actors = [Nop.remote() for _ in range(s)]
            ray.get([a.ping.remote() for a in actors])
            for _ in range(20):
                ray.get([a.ping.remote() for a in actors])
            times = []
            busy0 = machine_busy_seconds()
            for _ in range(spec["rounds"]):
                t = time.perf_counter()
                ray.get([a.ping.remote() for a in actors])
                times.append(time.perf_counter() - t)
            out["call_cpu_s"][str(s)] = (machine_busy_seconds() - busy0) / (spec["rounds"] * s)
            out["latency_s"][str(s)] = statistics.median(times)
            for a in actors:
                ray.kill(a)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def step_spec(data: Path, shards: int, trainers: int, batch: int, steps: int, nodes: int, config: str) -> dict:
    """trainer_scaling.measure's spec for S shards and N trainer actors on a loopback cluster."""
    overrides = [f"data.path={data}", "data.synth=", "train.selection=threshold", f"train.batch_size={batch}",
                 "data.validation_fraction=0", *TIMING_PRIVACY, "privacy.threshold=auto", f"cluster.num_shards={shards}",
                 "cluster.backend=ray", f"cluster.num_trainers={trainers}", "cluster.trainer_placement=actors",
                 "cluster.cpus_per_trainer=1", "cluster.cpus_per_shard=1"]
    return {"overrides": overrides, "nodes": nodes, "head_cpus": 2,
            "node_cpus": max(2, -(-(trainers + shards) // (nodes - 1)) + 1), "config": config, "warmup": 2,
            "steps": steps}


def _role_seconds(point: dict) -> dict:
    return {"trainer_cpu_s": point["trainers"][0]["cpu_ms_per_step"] / 1e3,
            "shard_cpu_s": sum(point["shard_cpu_ms_per_step"]) / 1e3,
            "coordinator_cpu_s": point["coordinator_cpu_ms_per_step"] / 1e3,
            "machine_cpu_s": point["machine_cpu_ms_per_step"] / 1e3}


def calibration(point: dict, small: Optional[dict], ping: dict, more_trainers: Optional[dict] = None) -> dict:
    """The model's inputs from the S = N = 1 measurements (at the batch, and `small` at a
    quarter of it: the part of each role's CPU per step, f of f + c·b, is where the line
    through the two meets b = 0, at least 0 and at most the whole) and the ping rounds."""
    batch = point["batch_mean"]
    cal: dict = {"batch": batch, **_role_seconds(point),
                 "bytes_per_step": point["all_bytes_per_step"]["to"] + point["all_bytes_per_step"]["from"],
                 "latency_s": {int(s): v for s, v in ping["latency_s"].items()},
                 "call_cpu_s": statistics.median(ping["call_cpu_s"].values())}
    if small is not None:
        lo, b_lo = _role_seconds(small), small["batch_mean"]
        cal["fixed"] = {k: min(max(v - (v - lo[k]) / (batch - b_lo) * batch, 0.0), v)
                        for k, v in _role_seconds(point).items()}
        cal["small_batch"] = b_lo
    cal["ping_call_cpu_s"] = cal["call_cpu_s"]
    if more_trainers is not None:
        n_more = more_trainers["num_trainers"]
        if more_trainers["num_shards"] != 1 or n_more < 2:
            raise ValueError(f"the second calibration point must be S = 1 with N >= 2, got S = "
                             f"{more_trainers['num_shards']}, N = {n_more}")
        one, two = _role_seconds_all(point), _role_seconds_all(more_trainers)
        extra_calls = calls_per_step(1, n_more) - calls_per_step(1, 1)
        cal["call_cpu_s"] = max((two["rest"] - one["rest"]) / extra_calls, 0.0)
        cal["coordinator_per_trainer_s"] = max(two["coordinator"] - one["coordinator"], 0.0) / (n_more - 1)
        cal["second_point"] = [1, n_more]
    if "step_ms_median" in point and cal["bytes_per_step"] > 0:
        # τ_x: what of the calibration point's step its CPU and idle rounds do not explain, per byte
        beyond = point["step_ms_median"] / 1e3 - predict(cal, 1, 1, batch)["critical_s"]
        cal["transfer_s_per_byte"] = max(beyond, 0.0) / cal["bytes_per_step"]
    return cal


def median_run(runs: Sequence[dict]) -> dict:
    """Of repeated measurements of one (S, N, b), the run whose step time is the median (the
    lower median for an even count), returned whole so its CPU and byte figures stay that run's;
    every repeat's step time is kept beside it (`repeat_step_ms`, in measurement order)."""
    if not runs:
        raise ValueError("median_run needs at least one run")
    ordered = sorted(runs, key=lambda r: r["step_ms_median"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["repeat_step_ms"] = [r["step_ms_median"] for r in runs]
    return chosen


def median_ping(pings: Sequence[dict]) -> dict:
    """Repeated ping rounds: per S, the median of the repeats' round latency and CPU per call."""
    keys = pings[0]["latency_s"].keys()
    return {"latency_s": {s: statistics.median(p["latency_s"][s] for p in pings) for s in keys},
            "call_cpu_s": {s: statistics.median(p["call_cpu_s"][s] for p in pings) for s in keys},
            "repeats": len(pings)}


def _most_trainers(points: dict) -> Optional[dict]:
    """The second calibration point: S = 1 with the most trainers measured (None if only N = 1)."""
    n = max((k[1] for k in points if k[0] == 1), default=1)
    return points[(1, n)] if n > 1 else None


def _calibration_points(cal: dict) -> list:
    return [[1, 1]] + ([list(cal["second_point"])] if "second_point" in cal else [])


def check_rows(cal: dict, points: Sequence[dict], cores: float) -> list[dict]:
    """Measured against predicted (loopback form) for every measured (S, N)."""
    rows = []
    for p in points:
        pred = predict(cal, p["num_shards"], p["num_trainers"], p["batch_mean"], cores=cores)
        measured = p["step_ms_median"] / 1e3
        rows.append({"shards": p["num_shards"], "trainers": p["num_trainers"], "batch": p["batch_mean"],
                     "measured_s": measured, "predicted_s": pred["step_s"], "critical_s": pred["critical_s"],
                     "cpu_bound_s": pred["cpu_s"] / cores, "error": pred["step_s"] / measured - 1,
                     "machine_cpu_s": p["machine_cpu_ms_per_step"] / 1e3, "predicted_cpu_s": pred["cpu_s"],
                     "repeat_step_s": [v / 1e3 for v in p.get("repeat_step_ms", [p["step_ms_median"]])],
                     "calibration": [p["num_shards"], p["num_trainers"]] in _calibration_points(cal)})
    return rows


def role_rows(cal: dict, points: Sequence[dict]) -> list[dict]:
    """Where each measured step's CPU went, against the model: per trainer process, per shard
    process, the coordinator, and the rest of the machine (Ray's daemons, the driver: machine
    CPU less the roles'), each measured and modelled (seconds per step). The model's rest is the
    calibration point's rest plus κ per extra actor call, so the four add up to `predict`'s cpu."""
    rows = []
    for p in points:
        shards, trainers = p["num_shards"], p["num_trainers"]
        scale = p["batch_mean"] / cal["batch"]
        trainer, shard = _split(cal, "trainer_cpu_s", scale, trainers), _split(cal, "shard_cpu_s", scale, shards)
        coordinator = _split(cal, "coordinator_cpu_s", scale) + cal.get("coordinator_per_trainer_s", 0.0) * (trainers - 1)
        rest = (_split(cal, "machine_cpu_s", scale) - _split(cal, "trainer_cpu_s", scale)
                - _split(cal, "shard_cpu_s", scale) - _split(cal, "coordinator_cpu_s", scale)
                + cal["call_cpu_s"] * (calls_per_step(shards, trainers) - calls_per_step(1, 1)))
        measured = _role_seconds_all(p)
        rows.append({"shards": shards, "trainers": trainers,
                     "trainer": (measured["trainer"], trainer), "shard": (measured["shard"], shard),
                     "coordinator": (measured["coordinator"], coordinator), "rest": (measured["rest"], rest)})
    return rows


def _role_seconds_all(point: dict) -> dict:
    """Measured CPU seconds per step: the mean trainer process, the mean shard process, the
    coordinator, and the machine's rest."""
    trainers = [t["cpu_ms_per_step"] / 1e3 for t in point["trainers"]]
    shards = [v / 1e3 for v in point["shard_cpu_ms_per_step"]]
    coordinator = point["coordinator_cpu_ms_per_step"] / 1e3
    rest = point["machine_cpu_ms_per_step"] / 1e3 - sum(trainers) - sum(shards) - coordinator
    return {"trainer": statistics.fmean(trainers), "shard": statistics.fmean(shards), "coordinator": coordinator,
            "rest": rest}


def projections(cal: dict, calibration_dims: tuple[int, int], sizes: Sequence[int] = (8, 32, 128),
                batch: int = 65536) -> list[dict]:
    """The many-machine form on Criteo-1TB's shape, S = N = each size, each link speed."""
    shape = criteo_shape()
    width = shape["features"] * shape["dim"] / (calibration_dims[0] * calibration_dims[1])
    rows = []
    for size in sizes:
        for gbps in LINKS_GBPS:
            pred = predict(cal, size, size, batch, link_bytes_per_s=gbps * 1e9 / 8, rtt_s=RTT_S, width=width)
            rows.append({"shards": size, "trainers": size, "batch": batch, "gbps": gbps, **pred,
                         "examples_per_s": batch / pred["step_s"], "table_bytes_per_shard": shape["table_bytes"] / size})
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="26 × 2,000 rows, S, N ∈ {1, 2}, 2 timed steps")
    parser.add_argument("--config", default="configs/ctr.toml")
    parser.add_argument("--grid", default="1,2,4", help="the S and N values measured (every pair)")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=None, help="total rows of the 26 tables (default 520,000)")
    parser.add_argument("--examples", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved repeats of every point, each point its median run (default 3; --quick 1)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    started = time.time()
    machine = announce_machine()
    grid = [1, 2] if args.quick and args.grid == "1,2,4" else [int(x) for x in args.grid.split(",") if x]
    if 1 not in grid:
        raise SystemExit("--grid must include 1: the model is calibrated at S = N = 1")
    rows = args.rows or (52_000 if args.quick else 520_000)
    examples = args.examples or (10_000 if args.quick else 50_000)
    steps = args.steps or (2 if args.quick else 6)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    data = ctr_dataset(rows, examples)
    cores = float(machine.get("logical_cores") or 2)
    pings, runs, smalls = [], {}, []
    # Repeats are interleaved (every point once, then again) so a slow spell of the machine
    # lands on every point alike rather than on one; each point is then its median run.
    for rep in range(args.repeats):
        tag = f" (repeat {rep + 1} of {args.repeats})" if args.repeats > 1 else ""
        print(f"--- ping rounds{tag}", flush=True)
        ping = run_worker(__file__, {"kind": "ping", "shards": grid, "rounds": 20 if args.quick else 200,
                                     "nodes": args.nodes, "head_cpus": 2, "node_cpus": max(2, max(grid))}, timeout=900)
        if "error" in ping:
            raise SystemExit(f"ping rounds failed: {ping['error']}")
        print("    " + ", ".join(f"S={s}: {1e3 * v:.2f} ms" for s, v in ping["latency_s"].items()), flush=True)
        pings.append(ping)
        for s in grid:
            for n in grid:
                print(f"--- S={s} N={n}{tag}", flush=True)
                spec = step_spec(data, s, n, args.batch, steps, args.nodes, args.config)
                res = run_worker(Path(__file__).with_name("trainer_scaling.py"), spec, timeout=1800)
                if "error" in res:
                    print(f"    failed: {res['error']}", flush=True)
                    continue
                print(f"    {res['step_ms_median']:.1f} ms/step, machine CPU {res['machine_cpu_ms_per_step']:.0f} "
                      "ms/step", flush=True)
                runs.setdefault((s, n), []).append(res)
        print(f"--- S=1 N=1 at batch {args.batch // 4}{tag} (calibration: work per step against per example)",
              flush=True)
        small = run_worker(Path(__file__).with_name("trainer_scaling.py"),
                           step_spec(data, 1, 1, args.batch // 4, steps, args.nodes, args.config), timeout=1800)
        if "error" in small:
            print(f"    failed: {small['error']}", flush=True)
        else:
            smalls.append(small)
    ping = median_ping(pings)
    points = [median_run(runs[key]) for key in sorted(runs)]
    base = next((p for p in points if p["num_shards"] == 1 and p["num_trainers"] == 1), None)
    if base is None:
        raise SystemExit("the calibration point S = N = 1 failed")
    small = median_run(smalls) if smalls else None
    if small is None:
        print("    the small-batch point failed: every role's CPU taken as per example", flush=True)
    cal = calibration(base, small, ping, _most_trainers({(p["num_shards"], p["num_trainers"]): p for p in points}))
    from widedp.trainer.config import load_config

    m = load_config(args.config, []).model
    dims = (26, m.embedding_dim)
    checks = check_rows(cal, points, cores)
    proj = projections(cal, dims)
    print(format_table(["S", "N", "measured ms", "predicted ms", "error", "critical ms", "CPU/cores ms"],
                       [[r["shards"], r["trainers"], f"{1e3 * r['measured_s']:.1f}", f"{1e3 * r['predicted_s']:.1f}",
                         f"{100 * r['error']:+.0f}%", f"{1e3 * r['critical_s']:.1f}", f"{1e3 * r['cpu_bound_s']:.1f}"]
                        for r in checks]))
    print(format_table(["S = N", "Gb/s", "step ms", "examples/s", "bytes per shard", "tables per shard"],
                       [[r["shards"], r["gbps"], f"{1e3 * r['step_s']:.1f}", f"{r['examples_per_s']:,.0f}",
                         fmt_bytes(r["bytes_per_shard"]), fmt_bytes(r["table_bytes_per_shard"])] for r in proj]))
    payload = {"config": args.config, "rows": rows, "examples": examples, "batch": args.batch, "grid": grid,
               "repeats": args.repeats, "pings": pings,
               "nodes": args.nodes, "cores": cores, "calibration_dims": dims, "ping": ping, "calibration": cal,
               "small_point": small,
               "points": points, "checks": checks, "projections": proj, "criteo": criteo_shape(), "rtt_s": RTT_S}
    write_results("cluster_model", payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


def coordinator_per_trainer_with_reduction(scaling: dict) -> Optional[tuple[float, dict]]:
    """(g_C with cluster.dense_reduction = "trainers": the least-squares slope of the coordinator's
    CPU per step against N over §2c′'s rows — N = 1 and the "(trainers)" rows —, floored at 0;
    those points {N: seconds}), or None without two N."""
    cpu = {}
    for r in scaling.get("results", []):
        if "error" in r or not r["label"].startswith("ray"):
            continue
        if r["num_trainers"] == 1 or "(trainers)" in r["label"]:
            cpu[int(r["num_trainers"])] = float(r["coordinator_cpu_ms_per_step"]) / 1e3
    if len(cpu) < 2:
        return None
    ns = sorted(cpu)
    mean_n, mean_c = statistics.fmean(ns), statistics.fmean(cpu[n] for n in ns)
    slope = sum((n - mean_n) * (cpu[n] - mean_c) for n in ns) / sum((n - mean_n) ** 2 for n in ns)
    return max(0.0, slope), cpu


def reduction_projection(cal: dict, doc: dict, proj: Sequence[dict]) -> list[str]:
    """The projection again with §2c′'s coordinator CPU per extra trainer measured with the dense
    part reduced among the trainers (benchmarks/results/coordinator_scaling.json beside this
    model's file), at each size's fastest link."""
    path = Path(__file__).resolve().parent / "results" / "coordinator_scaling.json"
    if not path.exists() or not proj or not doc.get("calibration_dims"):
        return []
    fitted = coordinator_per_trainer_with_reduction(json.loads(path.read_text()))
    if fitted is None:
        return []
    g_c, points = fitted
    reduced = {(r["shards"], r["gbps"]): r for r in projections(dict(cal, coordinator_per_trainer_s=g_c),
                                                                 tuple(doc["calibration_dims"]))}
    fastest = max(LINKS_GBPS)
    rows = ["", "With the dense part reduced among the trainers (`cluster.dense_reduction = \"trainers\"`, RESULTS §2c′: "
            "the coordinator's CPU per step " + ", ".join(f"N = {n}: {1e3 * c:.1f} ms" for n, c in sorted(points.items()))
            + f"; least-squares slope {1e3 * g_c:.1f} ms per extra trainer, floored at 0) in place of the "
            f"{1e3 * cal.get('coordinator_per_trainer_s', 0.0):.1f} ms above, at {fastest} Gb/s:", "",
            "| S = N | step ms, coordinator sums | step ms, trainers reduce | examples/s, trainers reduce |",
            "|---:|---:|---:|---:|"]
    for r in proj:
        if r["gbps"] != fastest:
            continue
        other = reduced[(r["shards"], r["gbps"])]
        rows.append(f"| {r['shards']} | {1e3 * r['step_s']:.1f} | {1e3 * other['step_s']:.1f} | "
                    f"{other['examples_per_s']:,.0f} |")
    return rows


def results_section(doc: dict) -> tuple[list[str], list]:
    """docs/RESULTS.md's section (benchmarks/make_results.py)."""
    cal = doc["calibration"]
    pts = {(p["num_shards"], p["num_trainers"]): p for p in doc.get("points", [])}
    if (1, 1) in pts:
        # The calibration and predictions are recomputed from the stored measurements, so the
        # section always shows this file's model (the measurements are the run's).
        cal = calibration(pts[(1, 1)], doc.get("small_point"), doc["ping"], _most_trainers(pts))
    checks = check_rows(cal, doc["points"], doc["cores"]) if doc.get("points") else doc["checks"]
    proj = projections(cal, tuple(doc["calibration_dims"])) if doc.get("calibration_dims") else doc["projections"]
    lam = ", ".join(f"S = {s}: {1e3 * float(v):.2f} ms" for s, v in doc["ping"]["latency_s"].items())
    lines = [f"`{doc['config']}`'s CTR model (26 tables, {doc['rows']:,} rows in all), `threshold` selection on the "
             f"shards, S shard actors × N trainer actors calling them directly, on a loopback cluster of {doc['nodes']} "
             f"Ray nodes on this {doc['cores']:g}-core machine, expected batch {doc['batch']:,}. The model "
             "(`benchmarks/cluster_model.py`'s docstring) is calibrated at S = N = 1"
             + (f" and S = 1, N = {cal['second_point'][1]}" if "second_point" in cal else " only")
             + ": CPU per step of the trainer "
             f"{1e3 * cal['trainer_cpu_s']:.1f} ms, the shard {1e3 * cal['shard_cpu_s']:.1f} ms, the coordinator "
             f"{1e3 * cal['coordinator_cpu_s']:.1f} ms, the machine {1e3 * cal['machine_cpu_s']:.1f} ms"
             + (" (of which per step, whatever the batch, from a second run at batch "
                f"{cal['small_batch']:,.0f}: " + ", ".join(f"{k.split('_')[0]} {1e3 * v:.1f} ms" for k, v in
                                                        cal["fixed"].items()) + ")" if "fixed" in cal else "") + "; "
             f"{fmt_bytes(cal['bytes_per_step'])} per step"
             + (f", moved on the path at {1e9 * cal['transfer_s_per_byte']:.2f} ns per byte (τ_x: the calibration "
                "step beyond its CPU and idle rounds)" if "transfer_s_per_byte" in cal else "")
             + f"; idle ping rounds λ(S) {lam}; "
             + (f"from S = 1, N = {cal['second_point'][1]}: {1e3 * cal['call_cpu_s']:.1f} ms of machine "
                "CPU outside the role processes per "
                f"extra actor call with the step's payloads (an idle ping call: {1e3 * cal['ping_call_cpu_s']:.1f} ms) "
                f"and {1e3 * cal['coordinator_per_trainer_s']:.1f} ms of coordinator CPU per extra trainer"
                if "second_point" in cal else f"{1e6 * cal['call_cpu_s']:.0f} µs of machine CPU per actor call")
             + ". Every other row is a prediction checked "
             "against its measurement (loopback form: max(critical path, CPU work / cores)). "
             + (f"Each point is the median of {doc['repeats']} interleaved runs (that run's figures; every run's step "
                "in the last column), the ping rounds the median of as many." if doc.get("repeats", 1) > 1 else
                "One run per point."), "",
             "| S | N | measured ms | predicted ms | error | critical path ms | CPU work / cores ms | machine CPU ms (measured / predicted) | each run's step ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in checks:
        tag = " (calibration)" if r["calibration"] else ""
        each = ", ".join(f"{1e3 * v:.0f}" for v in r.get("repeat_step_s", [r["measured_s"]]))
        lines.append(f"| {r['shards']} | {r['trainers']}{tag} | {1e3 * r['measured_s']:.1f} | {1e3 * r['predicted_s']:.1f} | "
                     f"{100 * r['error']:+.0f}% | {1e3 * r['critical_s']:.1f} | {1e3 * r['cpu_bound_s']:.1f} | "
                     f"{1e3 * r['machine_cpu_s']:.0f} / {1e3 * r['predicted_cpu_s']:.0f} | {each} |")
    roles = role_rows(cal, doc["points"]) if doc.get("points") else []
    if roles:
        lines += ["", "Where each step's CPU went, ms per step, measured / modelled (a trainer and a shard: the mean "
                  "process; the rest: the machine's busy CPU less the roles' processes — Ray's raylets, GCS, object "
                  "stores, the driver):", "",
                  "| S | N | each trainer | each shard | coordinator | the rest | all |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in roles:
            n, m = r["trainers"], r["shards"]
            meas = n * r["trainer"][0] + m * r["shard"][0] + r["coordinator"][0] + r["rest"][0]
            model = n * r["trainer"][1] + m * r["shard"][1] + r["coordinator"][1] + r["rest"][1]
            cells = [f"{1e3 * r[k][0]:.0f} / {1e3 * r[k][1]:.0f}" for k in ("trainer", "shard", "coordinator", "rest")]
            lines.append(f"| {m} | {n} | " + " | ".join(cells) + f" | {1e3 * meas:.0f} / {1e3 * model:.0f} |")
    shape = doc["criteo"]
    lines += ["", f"Projection (many-machine form: a machine per actor, the busiest link's transfer and "
              f"{1e6 * doc['rtt_s']:.0f} µs per round added to the loopback path (τ_x's serialization kept), no "
              "overlap of compute and transfer) on Criteo-1TB's shape: "
              f"the 26 published cardinalities capped at the 40M hash size ({shape['total_rows']:,} rows, "
              f"{fmt_bytes(shape['table_bytes'])} of tables at D = {shape['dim']}), per-example work and bytes scaled "
              f"by F·D relative to the calibration model, λ(S) beyond the measured S from the line through the "
              "measured ones.", "",
              "| S = N | link | step ms | examples/s | critical path ms | transfer ms | bytes per shard per step | tables per shard |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in proj:
        lines.append(f"| {r['shards']} | {r['gbps']} Gb/s | {1e3 * r['step_s']:.1f} | {r['examples_per_s']:,.0f} | "
                     f"{1e3 * r['critical_s']:.1f} | {1e3 * r['network_s']:.1f} | {fmt_bytes(r['bytes_per_shard'])} | "
                     f"{fmt_bytes(r['table_bytes_per_shard'])} |")
    g_c = cal.get("coordinator_per_trainer_s", 0.0)
    if g_c > 0 and proj:
        big = max(proj, key=lambda r: r["trainers"])
        share = g_c * (big["trainers"] - 1) / big["step_s"]
        lines += ["", f"At S = N = {big['trainers']} the coordinator's work per extra trainer ({1e3 * g_c:.1f} ms, "
                  f"measured from N = 1 to {cal['second_point'][1]} at S = 1: each trainer's task and its dense "
                  "gradient summed) is "
                  f"{100 * share:.0f}% of the projected step: it runs serially on one process, so beyond a few dozen "
                  "trainers the step is bound by it — summing the trainers' dense gradients among themselves (a "
                  "tree or ring reduction) instead of at the coordinator is what would take it off the path."]
    lines += reduction_projection(cal, doc, proj)
    checked = [r for r in checks if not r["calibration"]]
    worst = max(checked, key=lambda r: abs(r["error"])) if checked else None
    goals = []
    if worst is not None:
        ok = all(abs(r["error"]) <= MODEL_GOAL for r in checked)
        off = [f"S = {r['shards']}, N = {r['trainers']}: {100 * r['error']:+.0f}%" for r in checked
               if abs(r["error"]) > MODEL_GOAL]
        goals.append((f"the many-machine model within {100 * MODEL_GOAL:.0f}% of the loopback measurements it is "
                      "checked against (S, N ∈ {" + ", ".join(str(g) for g in doc["grid"]) + "})",
                      f"{len(checked)} predicted points; worst S = {worst['shards']}, N = {worst['trainers']}: "
                      f"{100 * worst['error']:+.0f}%", "**met**" if ok else "**missed**",
                      "" if ok else "outside: " + "; ".join(off) + _miss_reason(doc, cal, checks, roles, worst)))
    return lines, goals


def _miss_reason(doc: dict, cal: dict, checks: Sequence[dict], roles: Sequence[dict], worst: dict) -> str:
    """What the measurements say the model lacks: at the worst point, each role's measured CPU
    against its modelled CPU; machine CPU per extra actor call, measured between the fewest and
    most calls, against the idle ping's; and the calibration point's step against its own
    critical path."""
    pts = {(p["num_shards"], p["num_trainers"]): p for p in doc.get("points", [])}
    parts = []
    at = next((r for r in roles if (r["shards"], r["trainers"]) == (worst["shards"], worst["trainers"])), None)
    if at is not None:
        ratio = {k: at[k][0] / at[k][1] for k in ("trainer", "shard", "coordinator", "rest") if at[k][1] > 0}
        parts.append(f"at S = {at['shards']}, N = {at['trainers']} every process used more CPU per step than "
                     "modelled (" + ", ".join(f"{k} {v:.1f}×" for k, v in ratio.items()) + ")")
        by = {(r["shards"], r["trainers"]): r for r in roles}
        n_max, s_max = max(k[1] for k in by), max(k[0] for k in by)
        if (s_max, 1) in by and (s_max, n_max) in by and n_max > 1:
            lo, hi = by[(s_max, 1)]["shard"], by[(s_max, n_max)]["shard"]
            parts.append(f"on this 2-core machine S + N + 1 busy processes share the cores and a process's CPU for the "
                         f"same work grows with the contention (each of S = {s_max} shards: {1e3 * lo[1]:.0f} ms "
                         f"modelled, {1e3 * lo[0]:.0f} measured at N = 1, {1e3 * hi[0]:.0f} at N = {n_max} for the "
                         f"same rows and batch, arriving in {3 * n_max + 2} calls instead of 5: per-call costs and "
                         "contention together) — contention is a cost of the loopback check that a machine per actor "
                         "would not pay")
    lo = min(pts, key=lambda k: calls_per_step(*k)) if pts else (1, 1)
    hi = max(pts, key=lambda k: calls_per_step(*k)) if pts else (1, 1)
    extra = calls_per_step(*hi) - calls_per_step(*lo)
    if extra > 0:
        slope = (pts[hi]["machine_cpu_ms_per_step"] - pts[lo]["machine_cpu_ms_per_step"]) / extra
        parts.append(f"machine CPU grows {slope:.1f} ms per extra actor call from S, N = {lo} to {hi} against the "
                     f"model's {1e3 * cal['call_cpu_s']:.1f} ms (an idle ping call: "
                     f"{1e3 * cal.get('ping_call_cpu_s', cal['call_cpu_s']):.1f} ms)")
    base = next((r for r in checks if r["calibration"]), None)
    if base is not None and base["measured_s"] > base["critical_s"]:
        parts.append(f"at the calibration point the step ({1e3 * base['measured_s']:.0f} ms) exceeds its critical path "
                     f"({1e3 * base['critical_s']:.0f} ms: CPU + rounds × ping) — serialization and transfers on the "
                     "path that a ping does not show")
    return ("; " + "; ".join(parts) + "; so the projections below are optimistic (lower bounds on the step)") if parts else ""


def worker(spec: dict) -> dict:
    if spec.get("kind") == "ping":
        return ping_worker(spec)
    raise ValueError(f"unknown worker kind {spec.get('kind')!r}")


if __name__ == "__main__":
    if not worker_entry(worker):
        main()
