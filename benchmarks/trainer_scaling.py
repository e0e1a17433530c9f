"""Data-parallel trainers as Ray actors: throughput, per-trainer CPU time and bytes, N = 1, 2, 4.

A loopback multi-node Ray cluster (`ray.cluster_utils.Cluster`: a head and worker nodes, each
its own raylet and object store, on this machine) runs the CTR model of configs/ctr.toml (26
tables, D = 16, expected batch --batch, default 1024) with S shard actors and N trainer actors
(`cluster.trainer_placement = "actors"`, trainer/engine/trainers.py), each trainer calling the
shards directly. Per N, measured in one run each:
  - step time (median) and examples per second;
  - per trainer: CPU seconds per step of its own process (`StepStats.trainer_cpu_s`) and
    bytes per step it sends to / receives from the shards (its `DirectShardGroup` counters);
  - the coordinator's own bytes per step to / from the shards (reductions, selection, release);
  - the node each trainer ran on.
Beside them, the same step in one process (in-process shards, one trainer) and the ratios.
On this 2-core machine the trainers' processes share two cores, so the scaling claim is in
work per trainer (CPU time, bytes: ∝ 1/N) — not in wall clock, which a machine with a core
per trainer gives (run this there: same command).

    python benchmarks/trainer_scaling.py [--quick] [--trainers 1,2,4]
"""

from __future__ import annotations

import argparse
import os
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (TIMING_PRIVACY, announce_machine, ctr_dataset, fmt_bytes, format_table, run_worker, worker_entry,
                     write_results)


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _process_time(_actor_self) -> float:
    return time.process_time()


def shard_cpu_seconds(shards) -> list[float]:
    """Each shard actor's process CPU seconds so far (Ray shards; [] in-process)."""
    actors = getattr(shards, "actors", None)
    if not actors:
        return []
    import ray

    return ray.get([actor.__ray_call__.remote(_process_time) for actor in actors])


def measure(spec: dict) -> dict:
    """One configuration in this (worker) process: start the loopback cluster if asked, build
    the run, `warmup` untimed steps, then `steps` timed ones."""
    import numpy as np

    from widedp.trainer.config import load_config
    from widedp.trainer.run.train import build_run

    cluster = None
    overrides = list(spec["overrides"])
    if spec.get("nodes"):
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": spec["head_cpus"]})
        for _ in range(spec["nodes"] - 1):
            cluster.add_node(num_cpus=spec["node_cpus"])
        cluster.wait_for_nodes()
        overrides.append(f"cluster.address={cluster.address}")
    cfg = load_config(spec["config"], overrides)
    cfg.validate()
    t0 = time.perf_counter()
    run = build_run(cfg)
    build_s = time.perf_counter() - t0
    engine = run.engine
    try:
        for _ in range(int(spec["warmup"])):
            engine.step()
        traffic0 = engine.shard_traffic()
        coord0 = engine.shards.bytes_to_shards, engine.shards.bytes_from_shards
        per_trainer0 = engine.trainers.shard_bytes()
        shard_cpu0, machine0, coordinator0 = shard_cpu_seconds(engine.shards), machine_busy_seconds(), time.process_time()
        main_thread0 = time.thread_time()
        times, batch, cpu = [], [], []
        for _ in range(int(spec["steps"])):
            start = time.perf_counter()
            stats = engine.step()
            times.append(time.perf_counter() - start)
            batch.append(stats.batch_size)
            cpu.append(stats.trainer_cpu_s)
        n = len(times)
        coordinator_cpu = (time.process_time() - coordinator0) / n
        main_thread_cpu = (time.thread_time() - main_thread0) / n
        machine_cpu = (machine_busy_seconds() - machine0) / n
        shard_cpu = [(b - a) / n for a, b in zip(shard_cpu0, shard_cpu_seconds(engine.shards))]
        traffic1 = engine.shard_traffic()
        coord1 = engine.shards.bytes_to_shards, engine.shards.bytes_from_shards
        per_trainer1 = engine.trainers.shard_bytes()
        nodes = engine.trainers.nodes() if hasattr(engine.trainers, "nodes") else ["coordinator"] * len(per_trainer1)
        med = statistics.median(times)
        trainer_rows = []
        for i, ((t0b, f0b), (t1b, f1b)) in enumerate(zip(per_trainer0, per_trainer1)):
            trainer_rows.append({"trainer": i, "node": nodes[i][:8], "cpu_ms_per_step": 1e3 * float(np.mean([c[i] for c in cpu])),
                                 "bytes_to_shards_per_step": (t1b - t0b) / n, "bytes_from_shards_per_step": (f1b - f0b) / n})
        return {
            "num_trainers": cfg.cluster.num_trainers, "num_shards": cfg.cluster.num_shards,
            "backend": cfg.cluster.backend, "trainer_actors": cfg.cluster.trainer_actors,
            "nodes": spec.get("nodes", 0), "build_s": build_s, "steps_timed": n,
            "step_ms": [1e3 * t for t in times], "step_ms_median": 1e3 * med,
            "examples_per_sec": float(np.mean(batch)) / med, "batch_mean": float(np.mean(batch)),
            "trainers": trainer_rows,
            "coordinator_bytes_per_step": {"to": (coord1[0] - coord0[0]) / n, "from": (coord1[1] - coord0[1]) / n},
            "all_bytes_per_step": {"to": (traffic1[0] - traffic0[0]) / n, "from": (traffic1[1] - traffic0[1]) / n},
            # CPU seconds per step: the driver (coordinator, and in-process everything), each shard
            # actor's process (empty in-process), and the whole machine (/proc/stat: every process,
            # Ray's daemons included — meaningful on an otherwise idle machine only)
            "coordinator_cpu_ms_per_step": 1e3 * coordinator_cpu, "shard_cpu_ms_per_step": [1e3 * c for c in shard_cpu],
            # of which the driver's main thread (the engine's own work, serialization of calls
            # included); the rest is its Ray client threads' (transport)
            "coordinator_main_thread_cpu_ms_per_step": 1e3 * main_thread_cpu,
            "machine_cpu_ms_per_step": 1e3 * machine_cpu,
        }
    finally:
        run.close()
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()


def partitioned_copy(data: Path, parts: int) -> Path:
    """The data set `data` written as `parts` parts beside it (once; reused when present)."""
    from widedp.trainer.data.format.partitioned import is_partitioned, write_partitioned

    out = data.parent / f"{data.name}-parts{parts}"
    if not is_partitioned(out):
        write_partitioned(data, out, parts)
    return out


def merge_repeats(reps: list[dict]) -> dict:
    """One configuration's repeats as one result: the timed steps of every repeat pooled (median
    over all of them), CPU seconds and bytes per step averaged over the repeats, each repeat's
    own median kept (`repeat_step_ms_medians`); the first failure if any repeat failed."""
    failed = [r for r in reps if "error" in r]
    if failed:
        return dict(failed[0])
    if len(reps) == 1:
        return dict(reps[0], repeat_step_ms_medians=[reps[0]["step_ms_median"]])

    def mean(values):
        return float(sum(values) / len(values))

    out = dict(reps[0])
    steps = [t for r in reps for t in r["step_ms"]]
    batch = mean([r["batch_mean"] for r in reps])
    med = statistics.median(steps)
    out.update(step_ms=steps, step_ms_median=med, steps_timed=len(steps), batch_mean=batch,
               examples_per_sec=batch / (med / 1e3), repeat_step_ms_medians=[r["step_ms_median"] for r in reps],
               coordinator_cpu_ms_per_step=mean([r["coordinator_cpu_ms_per_step"] for r in reps]),
               coordinator_main_thread_cpu_ms_per_step=mean([r.get("coordinator_main_thread_cpu_ms_per_step", math.nan)
                                                             for r in reps]),
               machine_cpu_ms_per_step=mean([r["machine_cpu_ms_per_step"] for r in reps]),
               shard_cpu_ms_per_step=[mean(c) for c in zip(*[r["shard_cpu_ms_per_step"] for r in reps])],
               wall_s=sum(r["wall_s"] for r in reps), build_s=mean([r["build_s"] for r in reps]))
    for key in ("coordinator_bytes_per_step", "all_bytes_per_step"):
        out[key] = {d: mean([r[key][d] for r in reps]) for d in ("to", "from")}
    out["trainers"] = [dict(t, **{k: mean([r["trainers"][i][k] for r in reps])
                                  for k in ("cpu_ms_per_step", "bytes_to_shards_per_step", "bytes_from_shards_per_step")})
                       for i, t in enumerate(reps[0]["trainers"])]
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="26 x 2,000 rows, 2 timed steps")
    parser.add_argument("--config", default="configs/ctr.toml")
    parser.add_argument("--trainers", default="1,2,4")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=3, help="Ray nodes of the loopback cluster (head included)")
    parser.add_argument("--rows", type=int, default=None, help="total rows of the 26 tables (default 520,000)")
    parser.add_argument("--examples", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--selection", default="threshold")
    parser.add_argument("--batch", type=int, default=1024, help="expected batch (train.batch_size; default 1024)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every configuration this many times, interleaved (N=1, N=2, N=1, N=2, ...); "
                             "the step-time median is over the timed steps of all repeats")
    parser.add_argument("--dense-reduction", default="coordinator",
                        help="comma-separated cluster.dense_reduction values, each N run with each "
                             "(coordinator: the coordinator adds the trainers' dense sums; trainers: a gloo reduce)")
    parser.add_argument("--partitioned", action="store_true",
                        help="train from the data set written as max(--trainers) parts (widedp convert partition): "
                             "each trainer reads and samples its own parts")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    started = time.time()
    machine = announce_machine()
    rows = args.rows or (52_000 if args.quick else 520_000)
    examples = args.examples or (10_000 if args.quick else 50_000)
    steps = args.steps or (2 if args.quick else 8)
    data = ctr_dataset(rows, examples)
    trainers = [int(n) for n in args.trainers.split(",") if n]
    reductions = [r for r in args.dense_reduction.split(",") if r]
    if args.partitioned:
        data = partitioned_copy(data, max(trainers))
    base = [f"data.path={data}", "data.synth=", f"train.selection={args.selection}", f"train.batch_size={args.batch}",
            "data.validation_fraction=0", *TIMING_PRIVACY, "privacy.threshold=auto", f"cluster.num_shards={args.shards}",
            *(["train.recalibrate=false"] if args.partitioned else [])]
    results: list[dict] = []
    specs = [("in-process", {"overrides": [*base, "cluster.backend=local", "cluster.num_trainers=1"]})]
    for n in trainers:
        for reduction in (reductions if n > 1 else reductions[:1]):
            label = f"ray N={n}" + (f" ({reduction})" if len(reductions) > 1 and n > 1 else "")
            specs.append((label, {"overrides": [*base, "cluster.backend=ray", f"cluster.num_trainers={n}",
                                                "cluster.trainer_placement=actors", "cluster.cpus_per_trainer=1",
                                                "cluster.cpus_per_shard=1", f"cluster.dense_reduction={reduction}"],
                                  "nodes": args.nodes, "head_cpus": 2,
                                  "node_cpus": max(2, -(-(n + args.shards) // (args.nodes - 1)) + 1)}))
    runs: dict[str, list[dict]] = {label: [] for label, _ in specs}
    for rep in range(args.repeats):  # interleaved, so a slow minute of the machine hits every configuration
        for label, spec in specs:
            spec.update(config=args.config, warmup=2, steps=steps)
            print(f"--- {label}" + (f" (repeat {rep + 1} of {args.repeats})" if args.repeats > 1 else ""), flush=True)
            res = run_worker(__file__, spec, timeout=1800)
            if "error" in res:
                print(f"    failed: {res['error']}", flush=True)
            runs[label].append(res)
    for label, _ in specs:
        res = merge_repeats(runs[label])
        res["label"] = label
        results.append(res)
    ok = [r for r in results if "error" not in r]
    one = next((r for r in ok if r["label"] == "ray N=1"), None)
    local = next((r for r in ok if r["label"] == "in-process"), None)
    table = []
    for r in ok:
        cpu = [t["cpu_ms_per_step"] for t in r["trainers"]]
        to = [t["bytes_to_shards_per_step"] + t["bytes_from_shards_per_step"] for t in r["trainers"]]
        row = [r["label"], f"{r['step_ms_median']:.1f}", f"{r['examples_per_sec']:.0f}",
               f"{r['examples_per_sec'] / one['examples_per_sec']:.2f}x" if one else "-",
               f"{statistics.mean(cpu):.1f}", f"{max(cpu):.1f}",
               f"{statistics.mean(cpu) / statistics.mean([t['cpu_ms_per_step'] for t in one['trainers']]):.2f}" if one else "-",
               fmt_bytes(statistics.mean(to)),
               fmt_bytes(r["coordinator_bytes_per_step"]["to"] + r["coordinator_bytes_per_step"]["from"]),
               f"{r['coordinator_cpu_ms_per_step']:.1f}", len({t["node"] for t in r["trainers"]})]
        table.append(row)
    print(format_table(["system", "step ms", "examples/s", "vs N=1", "trainer CPU ms/step (mean)", "max",
                        "CPU/trainer vs N=1", "bytes/trainer/step", "coordinator bytes/step",
                        "coordinator CPU ms/step", "trainer nodes"], table))
    if local and one:
        print(f"Ray N=1 step / in-process step: {one['step_ms_median'] / local['step_ms_median']:.2f}x")
    payload = {"rows": rows, "examples": examples, "shards": args.shards, "nodes": args.nodes,
               "selection": args.selection, "batch": args.batch, "repeats": args.repeats,
               "dense_reductions": reductions, "partitioned": bool(args.partitioned), "results": results}
    write_results("trainer_scaling", payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


if __name__ == "__main__":
    if not worker_entry(measure):
        main()
