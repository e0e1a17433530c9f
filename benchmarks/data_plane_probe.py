"""The per-step data plane, transport alone: ordinary Ray actor calls, a compiled Ray graph and
torch.distributed (gloo) inside Ray actors, between one caller and S echo shards (issue 31).

What runs. One fresh worker process per transport (`run_worker`), an embedded Ray with the
project's settings (`ray_runtime.ensure_ray`: objects up to 8 MB inline) and, per S ∈ {1, 2, 4},
S shard actors (`ACTOR_OPTIONS`, 0.5 CPU each) that do no compute: each answers a request with
a response of the round's size (a buffer kept per size, its first bytes a copy of the request's:
`echo_answer`), so the numbers are the transport's. The caller is the worker's driver process
(the coordinator's place in `widedp train`); for gloo it is rank 0 of the process group.
  calls     `actor.echo.remote(request, nbytes)` per shard, then `ray.get` of all (arguments and
            answers numpy arrays, as `RayShardGroup._call` sends them);
  compiled  InputNode → every actor's `dispatch(request_s)` → MultiOutputNode, compiled once per
            S (as `RayShardGroup._compile_graph`) with a channel buffer of
            max(COMPILED_BUFFER_BYTES, the run's largest round input or answer + 1 MB); each
            answer copied out of its channel (`owned`), as `_compiled_call` does; the caller
            and the actors wait on the channels with Ray's own spinning read;
  compiled-backoff  the same, every process waiting with sleeps between looks
            (`cluster.compiled_wait = "backoff"`, trainer/cluster/compiled_wait.py: the default);
  gloo      `init_process_group("gloo")` with a TCP store on 127.0.0.1 at a free port, rank 0
            the caller and ranks 1..S the shard actors (each running `gloo_shard_loop` in one
            long actor call). Per round the caller posts, to every shard at once, `isend` of a
            control tensor (2 × int64: request and answer bytes) and of the request (one uint8
            tensor), and `irecv` of the answer into a fresh tensor; then waits for all. Point to
            point isend/irecv, not scatter/gather: the shards' parts differ in size.
            torch.distributed has no fault tolerance of its own: a rank that dies breaks the
            whole group (every rank must re-init), whereas the ordinary actor calls are what
            docs/DESIGN.md §1.8's recovery replaces a lost shard through, the others untouched.
Payloads (`round_payloads`): one sparse step's three rounds, their bytes per round taken from
the project's own byte accounting of the real CTR step (configs/ctr.toml: 26 features, D = 16;
benchmarks/results/ray_batch_{b}.json, system `widedp-sparse-ray`: payload bytes per shard
method per step, measured with 4 shards at expected batch b):
  lookup    ids in (`lookup`'s ShardInput, plus the previous step's released rows, `apply_rows`,
            which folded write-back sends in this round) / partial pooled rows out;
  norms     pooled-output gradients in / per-example squared norms out (`example_sq_norms`);
  row_sums  clip factors in / the selected rows' clipped sums out (`clipped_row_sums` with the
            selection on the shards).
Arrays over the batch's ids, bags or selected rows are split evenly over S; arrays with one
value per example of the shard (the norms out, the clip factors in) are whole on every shard,
since nearly every example has ids on every shard (26 ids each: P(none on a shard) =
(1 − 1/S)^26 ≤ 6·10⁻⁴ at S = 4) — their per-shard size is the record's total / its 4 shards.
Each request and answer travels as one array (a real round's several arrays in one buffer).

Measured per (transport, b, S), in --passes workers per transport run alternately (calls,
compiled, gloo, calls, ...: load from other work on this 2-core machine falls on all three) and
pooled (`summarize`): every round's wall time (median over all timed steps, after warm-up steps:
a compiled graph's first executions take seconds), machine CPU per round (/proc/stat, every
process: other work's load is in it, see the load average) and this probe's own processes' CPU
per round (the driver and its descendants: Ray's GCS, raylet, workers and the shard actors, from
/proc/PID/stat), the step's transport time (the median over steps of the three rounds' sum);
and per (transport, S) the CPU its processes use while no round is in flight (`idle` cores:
between a real step's rounds the caller computes). The choice (`choose`): at each b, the
transport with the smallest step transport time summed over the S measured, its ratio to
ordinary calls; and, where that transport's processes use ≥ IDLE_LIMIT_CORES more than ordinary
calls' while idle (CPU that a real step's compute on the caller and the shards needs; Ray's own
daemons idle alike under every transport), the fastest one that does not.

    python benchmarks/data_plane_probe.py [--quick] [--batches 1024,4096,16384] [--shards 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (REPO, RESULTS_DIR, announce_machine, fmt_bytes, format_table, run_worker,  # noqa: E402
                     worker_entry, write_results)
from trainer_scaling import machine_busy_seconds  # noqa: E402

TRANSPORTS = ("calls", "compiled", "compiled-backoff", "gloo")
TRANSPORT_LABELS = {"calls": "ordinary Ray actor calls", "compiled": "compiled Ray graph (Ray's spinning reads)",
                    "compiled-backoff": "compiled Ray graph, sleeping reads",
                    "gloo": "torch.distributed (gloo)"}
#: the compiled transports' channel waits (trainer/cluster/compiled_wait.py, cluster.compiled_wait)
COMPILED_WAIT = {"compiled": "spin", "compiled-backoff": "backoff"}
ROUNDS = ("lookup", "norms", "row_sums")
#: Each round's request and answer: (shard method, direction, split over the shards?) from the
#: byte accounting's `bytes_per_step`; unsplit parts are per shard (the record's total / its S).
ROUND_PARTS = {
    "lookup": {"request": [("lookup", "to", True), ("apply_rows", "to", True)],
               "answer": [("lookup", "from", True)]},
    "norms": {"request": [("example_sq_norms", "to", True)], "answer": [("example_sq_norms", "from", False)]},
    "row_sums": {"request": [("clipped_row_sums", "to", False)], "answer": [("clipped_row_sums", "from", True)]},
}
#: The step whose payloads the probe replays: the one with the shards' norms round (three rounds;
#: the default step computes the norms on the trainer and sends the pooled-output gradients with
#: the row sums' factors, two rounds with the same bytes: docs/DESIGN.md §2.2, "Norms on the trainer").
RECORD_SYSTEM = "widedp-sparse-ray-norms-round"
#: the recorded real steps (shards computing) the section shows beside the probe: calls, compiled
RECORDED_STEPS = ("widedp-sparse-ray", "widedp-sparse-ray-compiled")
HEAD_BYTES = 64  # the part of an answer copied from its request (`echo_answer`)
SHARD_CPUS = 0.5  # configs/ctr.toml's cluster.cpus_per_shard


# ---- payloads ---------------------------------------------------------------------------------------

def record_for(batch: int, results_dir: Path = RESULTS_DIR) -> dict:
    """The recorded Ray step's (`RECORD_SYSTEM`) record at expected batch `batch` (its bytes per method)."""
    path = Path(results_dir) / f"ray_batch_{batch}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python benchmarks/make_results.py`'s ray_batch_{batch} "
                                "variant (benchmarks/dlrm_compare.py) first, or pick --batches from the recorded ones")
    doc = json.loads(path.read_text())
    rec = next((r for r in doc["results"] if r.get("system") == RECORD_SYSTEM and "bytes_per_step" in r), None)
    if rec is None:
        raise ValueError(f"{path} has no {RECORD_SYSTEM!r} result with bytes_per_step")
    path = path.resolve()
    return {"source": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
            "batch": batch, "batch_mean": rec["batch_mean"], "num_shards": rec["num_shards"],
            "dim": doc.get("dim"), "tables": doc.get("tables"), "bytes_per_step": rec["bytes_per_step"],
            "recorded_step_ms": {r["system"]: r["step_ms_median"] for r in doc["results"]
                                 if r.get("system") in RECORDED_STEPS and "step_ms_median" in r}}


def round_payloads(record: dict, shards: int) -> dict:
    """Per round, the bytes of each shard's request and answer with `shards` shards:
    {round: {"request": n, "answer": m, "parts": [...]}} (see ROUND_PARTS: a split part is the
    record's total / `shards`, a per-shard part the record's total / the record's shards)."""
    if int(shards) < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    per_method, recorded = record["bytes_per_step"], int(record["num_shards"])
    out = {}
    for name, sides in ROUND_PARTS.items():
        entry: dict = {"parts": []}
        for side, parts in sides.items():
            total = 0.0
            for method, direction, split in parts:
                if method not in per_method:
                    raise ValueError(f"the byte record has no {method!r} (round {name!r})")
                recorded_bytes = float(per_method[method][direction])
                total += recorded_bytes / (shards if split else recorded)
                entry["parts"].append({"side": side, "method": method, "direction": direction, "split": split,
                                       "recorded_bytes": recorded_bytes})
            entry[side] = max(1, int(round(total)))
        out[name] = entry
    return out


def pooled_check(record: dict, features: int = 26) -> dict:
    """The record's pooled rows out of `lookup` against the model's b·F·D float32 (a check that
    the record is the CTR step's)."""
    model = record["batch_mean"] * features * int(record["dim"]) * 4
    return {"recorded": record["bytes_per_step"]["lookup"]["from"], "model": model}


# ---- the shard side ---------------------------------------------------------------------------------

def echo_answer(request, nbytes: int, cache: Optional[dict] = None):
    """The answer to `request` (uint8 array): `nbytes` bytes, a buffer kept per size in `cache`,
    whose first min(HEAD_BYTES, sizes) bytes are the request's (the rest zeros)."""
    import numpy as np

    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    buf = cache.get(nbytes) if cache is not None else None
    if buf is None:
        buf = np.zeros(nbytes, dtype=np.uint8)
        if cache is not None:
            cache[nbytes] = buf
    head = min(HEAD_BYTES, int(request.size), nbytes)
    buf[:head] = request[:head]
    return buf


class EchoShard:
    """A shard that computes nothing: answers of the round's size (`echo_answer`)."""

    def __init__(self):
        self._cache: dict = {}

    def pid(self) -> int:
        return os.getpid()

    def echo(self, request, nbytes: int):
        return echo_answer(request, nbytes, self._cache)

    def dispatch(self, request: tuple):
        return echo_answer(request[0], request[1], self._cache)

    def serve_gloo(self, port: int, rank: int, world_size: int) -> int:
        return gloo_shard_loop(port, rank, world_size, self._cache)


STOP = -1


def _init_gloo(port: int, rank: int, world_size: int) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port)}", rank=int(rank),
                            world_size=int(world_size), timeout=datetime.timedelta(seconds=120))


def gloo_shard_loop(port: int, rank: int, world_size: int, cache: Optional[dict] = None) -> int:
    """Rank `rank` of the gloo group (caller rank 0): until a stop message, receive a control
    tensor (request bytes, answer bytes), the request, and send back `echo_answer`. Returns the
    rounds served."""
    import torch
    import torch.distributed as dist

    _init_gloo(port, rank, world_size)
    cache = {} if cache is None else cache
    served = 0
    try:
        ctrl = torch.empty(2, dtype=torch.int64)
        while True:
            dist.recv(ctrl, src=0)
            req_bytes, ans_bytes = int(ctrl[0]), int(ctrl[1])
            if req_bytes == STOP:
                break
            request = torch.empty(req_bytes, dtype=torch.uint8)
            if req_bytes:
                dist.recv(request, src=0)
            answer = echo_answer(request.numpy(), ans_bytes, cache)
            if ans_bytes:
                dist.send(torch.from_numpy(answer), dst=0)
            served += 1
    finally:
        dist.destroy_process_group()
    return served


class GlooCaller:
    """Rank 0 of a gloo group of 1 + shards: `round(requests, answer_bytes)` sends request s to
    rank s + 1 and returns the answers in shard order."""

    def __init__(self, port: int, world_size: int):
        _init_gloo(port, 0, world_size)
        self.world_size = int(world_size)

    def round(self, requests: Sequence, answer_bytes: Sequence[int]) -> list:
        import torch
        import torch.distributed as dist

        if len(requests) != self.world_size - 1 or len(answer_bytes) != len(requests):
            raise ValueError(f"{len(requests)} requests / {len(answer_bytes)} answer sizes for "
                             f"{self.world_size - 1} shards")
        works, answers = [], []
        for s, (req, n) in enumerate(zip(requests, answer_bytes)):
            ctrl = torch.tensor([int(req.size), int(n)], dtype=torch.int64)
            works.append(dist.isend(ctrl, dst=s + 1))
            if req.size:
                works.append(dist.isend(torch.from_numpy(req), dst=s + 1))
            ans = torch.empty(int(n), dtype=torch.uint8)
            if n:
                works.append(dist.irecv(ans, src=s + 1))
            answers.append(ans)
        for w in works:
            w.wait()
        return [a.numpy() for a in answers]

    def close(self) -> None:
        import torch
        import torch.distributed as dist

        works = [dist.isend(torch.tensor([STOP, STOP], dtype=torch.int64), dst=s) for s in range(1, self.world_size)]
        for w in works:
            w.wait()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- the caller side (inside the worker) ------------------------------------------------------------

def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def processes_cpu_seconds(pids: Sequence[int]) -> float:
    """utime + stime of the processes `pids` (all their threads; gone processes count 0)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


class CallsPlane:
    def __init__(self, actors, ray):
        self.actors, self.ray = actors, ray

    def round(self, requests, answer_bytes):
        refs = [a.echo.remote(req, n) for a, req, n in zip(self.actors, requests, answer_bytes)]
        return self.ray.get(refs)

    def close(self):
        pass


class CompiledPlane:
    def __init__(self, actors, ray, buffer_bytes: int):
        from ray.dag import InputNode, MultiOutputNode

        from widedp.trainer.cluster.ray_shards import COMPILED_GET_TIMEOUT_S

        with InputNode() as inp:
            graph = MultiOutputNode([a.dispatch.bind(inp[s]) for s, a in enumerate(actors)])
        self.graph = graph.experimental_compile(_submit_timeout=COMPILED_GET_TIMEOUT_S,
                                                _buffer_size_bytes=int(buffer_bytes))
        self.ray, self.timeout = ray, COMPILED_GET_TIMEOUT_S

    def round(self, requests, answer_bytes):
        from widedp.trainer.engine.shard import owned

        refs = self.graph.execute(*[(req, int(n)) for req, n in zip(requests, answer_bytes)])
        return [owned(self.ray.get(ref, timeout=self.timeout)) for ref in refs]

    def close(self):
        self.graph.teardown()


class GlooPlane:
    def __init__(self, actors, ray):
        port = free_port()
        self.serving = [a.serve_gloo.remote(port, s + 1, len(actors) + 1) for s, a in enumerate(actors)]
        self.caller = GlooCaller(port, len(actors) + 1)
        self.ray = ray

    def round(self, requests, answer_bytes):
        return self.caller.round(requests, answer_bytes)

    def close(self):
        self.caller.close()
        self.served = self.ray.get(self.serving)


def settle(max_seconds: float = 15.0, quiet: float = 0.25) -> float:
    """Wait until this process and its descendants (Ray's daemons and workers, just started)
    use less than `quiet` CPU seconds per second, at most `max_seconds`; returns the wait."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_seconds:
        pids = _descendants(os.getpid())
        before = processes_cpu_seconds(pids)
        time.sleep(1.0)
        if processes_cpu_seconds(pids) - before < quiet:
            break
    return time.perf_counter() - start


def _check(answers, requests, answer_bytes) -> None:
    for s, (ans, req, n) in enumerate(zip(answers, requests, answer_bytes)):
        head = min(HEAD_BYTES, req.size, n)
        if ans.size != n or bytes(ans[:head]) != bytes(req[:head]):
            raise AssertionError(f"shard {s}: wrong answer ({ans.size} bytes, expected {n})")


def measure(spec: dict) -> dict:
    """One transport in this (worker) process, every S and b of `spec`: raw round times and CPU
    sums per (b, S) (`summarize` pools them over passes), and the CPU used while idle per S."""
    import numpy as np
    import ray

    from widedp.trainer.cluster.ray_runtime import ACTOR_OPTIONS, ensure_ray
    from widedp.trainer.cluster.ray_shards import COMPILED_BUFFER_BYTES

    transport = spec["transport"]
    shards_list = [int(s) for s in spec["shards"]]
    ensure_ray(needed_cpus=SHARD_CPUS * max(shards_list))
    actor_cls = ray.remote(EchoShard)
    rng = np.random.default_rng(0)
    raw: list = []
    idle: list = []
    for shards in shards_list:
        t_setup = time.perf_counter()
        actors = [actor_cls.options(**ACTOR_OPTIONS, num_cpus=SHARD_CPUS).remote() for _ in range(shards)]
        ray.get([a.pid.remote() for a in actors])
        settled_s = settle()  # Ray's start-up work (its agents, the new workers) is not the transport's
        payloads = {b: spec["payloads"][str(b)][str(shards)] for b in spec["batches"]}
        buffer_bytes = None
        plane: "CallsPlane | CompiledPlane | GlooPlane"
        if transport == "calls":
            plane = CallsPlane(actors, ray)
        elif transport in COMPILED_WAIT:
            from widedp.trainer.cluster.compiled_wait import set_compiled_wait_here_and_on

            set_compiled_wait_here_and_on(actors, COMPILED_WAIT[transport], ray)
            largest = max(max(shards * p["request"], p["answer"]) for per in payloads.values() for p in per.values())
            buffer_bytes = max(COMPILED_BUFFER_BYTES, largest + (1 << 20))
            plane = CompiledPlane(actors, ray, buffer_bytes)
        elif transport == "gloo":
            plane = GlooPlane(actors, ray)
        else:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        setup_s = time.perf_counter() - t_setup - settled_s
        pids = _descendants(os.getpid())
        for b in spec["batches"]:
            per = payloads[b]
            requests = {r: [rng.integers(0, 256, per[r]["request"], dtype=np.uint8) for _ in range(shards)]
                        for r in ROUNDS}
            sizes = {r: [per[r]["answer"]] * shards for r in ROUNDS}
            times: dict = {r: [] for r in ROUNDS}
            machine_cpu = {r: 0.0 for r in ROUNDS}
            own_cpu = {r: 0.0 for r in ROUNDS}
            for _ in range(int(spec["warmup"])):  # the first executions of a compiled graph take seconds
                for r in ROUNDS:
                    _check(plane.round(requests[r], sizes[r]), requests[r], sizes[r])
            started = time.perf_counter()
            for i in range(int(spec["steps"])):
                for r in ROUNDS:
                    m0, p0 = machine_busy_seconds(), processes_cpu_seconds(pids)
                    t0 = time.perf_counter()
                    answers = plane.round(requests[r], sizes[r])
                    dt = time.perf_counter() - t0
                    m1, p1 = machine_busy_seconds(), processes_cpu_seconds(pids)
                    _check(answers, requests[r], sizes[r])
                    times[r].append(dt)
                    machine_cpu[r] += m1 - m0
                    own_cpu[r] += p1 - p0
                if i + 1 >= int(spec["min_steps"]) and time.perf_counter() - started >= float(spec["max_seconds"]):
                    break
            raw.append({"transport": transport, "batch": b, "shards": shards, "setup_s": setup_s,
                        "settled_s": settled_s, "buffer_bytes": buffer_bytes,
                        "request_bytes": {r: per[r]["request"] for r in ROUNDS},
                        "answer_bytes": {r: per[r]["answer"] for r in ROUNDS},
                        "round_s": times, "machine_cpu_s": machine_cpu, "own_cpu_s": own_cpu,
                        "processes": len(pids), "load_average": list(os.getloadavg())})
            step = [sum(v) for v in zip(*times.values())]
            print(f"{transport} S={shards} b={b}: step {1e3 * statistics.median(step):.2f} ms ({len(step)} steps)",
                  file=sys.stderr, flush=True)
        # CPU while no round is in flight (between a real step's rounds the caller computes)
        m0, p0, t0 = machine_busy_seconds(), processes_cpu_seconds(pids), time.perf_counter()
        time.sleep(float(spec["idle_seconds"]))
        idle.append({"transport": transport, "shards": shards, "seconds": time.perf_counter() - t0,
                     "own_cpu_s": processes_cpu_seconds(pids) - p0, "machine_cpu_s": machine_busy_seconds() - m0})
        plane.close()
        if isinstance(plane, GlooPlane) and sum(plane.served) < shards * len(ROUNDS):
            raise AssertionError(f"the gloo shards served {sum(plane.served)} rounds")
        for a in actors:
            ray.kill(a)
    return {"transport": transport, "raw": raw, "idle": idle}


def summarize(raw: Sequence[dict], idle: Sequence[dict]) -> list[dict]:
    """One row per (transport, b, S): the raw measurements of every pass pooled (medians over
    all timed steps, CPU per round = CPU sums / steps), with the idle CPU of (transport, S) in
    cores (CPU seconds per second, this probe's processes and the whole machine)."""
    groups: dict = {}
    for r in raw:
        groups.setdefault((r["transport"], int(r["batch"]), int(r["shards"])), []).append(r)
    idle_by: dict = {}
    for i in idle:
        idle_by.setdefault((i["transport"], int(i["shards"])), []).append(i)
    rows = []
    for (transport, b, shards), parts in groups.items():
        times = {k: [t for p in parts for t in p["round_s"][k]] for k in ROUNDS}
        steps = [sum(v) for p in parts for v in zip(*(p["round_s"][k] for k in ROUNDS))]
        n = len(steps)
        machine = {k: sum(p["machine_cpu_s"][k] for p in parts) for k in ROUNDS}
        own = {k: sum(p["own_cpu_s"][k] for p in parts) for k in ROUNDS}
        quiet = idle_by.get((transport, shards), [])
        seconds = sum(i["seconds"] for i in quiet)
        rows.append({
            "transport": transport, "batch": b, "shards": shards, "steps_timed": n, "passes": len(parts),
            "buffer_bytes": parts[0]["buffer_bytes"],
            "rounds": {k: {"request_bytes": parts[0]["request_bytes"][k], "answer_bytes": parts[0]["answer_bytes"][k],
                           "ms_median": 1e3 * statistics.median(times[k]), "ms_min": 1e3 * min(times[k]),
                           "machine_cpu_ms": 1e3 * machine[k] / n, "own_cpu_ms": 1e3 * own[k] / n} for k in ROUNDS},
            "step_ms_median": 1e3 * statistics.median(steps),
            "step_ms_per_pass": [1e3 * statistics.median([sum(v) for v in zip(*(p["round_s"][k] for k in ROUNDS))])
                                 for p in parts],
            "step_machine_cpu_ms": 1e3 * sum(machine.values()) / n, "step_own_cpu_ms": 1e3 * sum(own.values()) / n,
            "idle_own_cores": sum(i["own_cpu_s"] for i in quiet) / seconds if seconds else None,
            "idle_machine_cores": sum(i["machine_cpu_s"] for i in quiet) / seconds if seconds else None,
            "setup_s": [p["setup_s"] for p in parts], "load_average": [p["load_average"] for p in parts]})
    order = {t: i for i, t in enumerate(TRANSPORTS)}
    return sorted(rows, key=lambda r: (order.get(r["transport"], 9), r["shards"], r["batch"]))


# ---- the choice -------------------------------------------------------------------------------------

#: A transport whose processes use at least this many cores more than ordinary calls' while no
#: round is in flight, at some S (the compiled graph's spinning reads), takes that CPU from the
#: compute between and during a real step's rounds; `choose` names the fastest transport below it
#: beside the fastest overall. Relative to ordinary calls: Ray's daemons idle under every transport.
IDLE_LIMIT_CORES = 0.1


def choose(rows: Sequence[dict]) -> dict:
    """Per b: each transport's step transport time summed over the S measured for every
    transport (ms), the fastest (`best`), each one's ratio to ordinary calls, the fastest at
    each S, each transport's largest idle CPU over S (cores), its largest excess over ordinary
    calls' idle CPU at the same S (`idle_extra`) and the fastest of those whose excess is below
    IDLE_LIMIT_CORES (`best_quiet`, None if none is)."""
    by_b: dict = {}
    idle_at: dict = {}
    for r in rows:
        per_s = by_b.setdefault(int(r["batch"]), {}).setdefault(r["transport"], {})
        per_s[int(r["shards"])] = float(r["step_ms_median"])
        if r.get("idle_own_cores") is not None:
            idle_at.setdefault(r["transport"], {})[int(r["shards"])] = float(r["idle_own_cores"])
    idle = {t: max(v.values()) for t, v in idle_at.items()}
    base = idle_at.get("calls", {})
    extra = {t: max(c - base.get(s, 0.0) for s, c in v.items()) for t, v in idle_at.items()}
    out = {}
    for b, per in sorted(by_b.items()):
        common = set.intersection(*(set(v) for v in per.values())) if per else set()
        if not common:
            continue
        total = {t: sum(v[s] for s in common) for t, v in per.items()}
        best = min(total, key=lambda t: total[t])
        quiet = [t for t in total if extra.get(t, 0.0) < IDLE_LIMIT_CORES]
        out[b] = {"shards": sorted(common), "step_ms_sum": total, "best": best,
                  "best_quiet": min(quiet, key=lambda t: total[t]) if quiet else None,
                  "idle_cores": {t: idle[t] for t in total if t in idle},
                  "idle_extra": {t: extra[t] for t in total if t in extra},
                  "vs_calls": ({t: v / total["calls"] for t, v in total.items()} if total.get("calls") else {}),
                  "fastest_at": {s: min(per, key=lambda t: per[t][s]) for s in sorted(common)}}
    return out


def choice_text(choice: dict) -> str:
    """Which transport the step transport times favour at each b; and, where it burns CPU while
    idle, the fastest one that does not."""
    if not choice:
        return "nothing measured"

    def ratio(c: dict, t: str) -> str:
        return f"{c['vs_calls'][t]:.2f}× ordinary calls' time" if c["vs_calls"] else "no ordinary calls measured"

    def which(key: str) -> str:
        picks = {c[key] for c in choice.values()}
        if len(picks) == 1 and None not in picks:
            t = picks.pop()
            return (f"{TRANSPORT_LABELS[t]} at every b ("
                    + "; ".join(f"b = {b:,}: {ratio(c, t)}" for b, c in choice.items()) + ")")
        return "by b: " + "; ".join(f"b = {b:,}: " + (f"{TRANSPORT_LABELS[c[key]]} ({ratio(c, c[key])})" if c[key]
                                                      else "none") for b, c in choice.items())

    text = "transport alone, " + which("best")
    burning = sorted({t for c in choice.values() for t, v in c["idle_extra"].items() if v >= IDLE_LIMIT_CORES})
    if any(c["best"] in burning for c in choice.values()):
        first = next(iter(choice.values()))
        text += ("; but " + ", ".join(f"with the {TRANSPORT_LABELS[t]} the processes use {first['idle_cores'][t]:.2f} "
                                      f"cores while no round is in flight ({first['idle_extra'][t]:.2f} more than with "
                                      "ordinary calls)"
                                      for t in burning)
                 + f" (≥ {IDLE_LIMIT_CORES:g} more), CPU a real step's compute needs; without it: " + which("best_quiet"))
    final = {c["best_quiet"] if c["best"] in burning else c["best"] for c in choice.values()}
    if final == {"calls"}:
        text += "; keep ordinary calls (they also carry the shard recovery)"
    elif "gloo" in final:
        text += ("; torch.distributed has no fault tolerance of its own (a lost rank breaks the group), so adopting "
                 "it needs recovery built around it")
    return text


# ---- RESULTS ----------------------------------------------------------------------------------------

def results_section(doc: dict) -> tuple[list[str], list]:
    """docs/RESULTS.md's section (benchmarks/make_results.py)."""
    rows = doc["rows"]
    choice = choose(rows)
    sources = ", ".join(f"`{r['source']}`" for r in doc["records"].values())
    lines = [f"One caller (the driver process; for gloo rank 0) and S echo shard actors that compute nothing, on this "
             f"{doc['machine'].get('logical_cores')}-core machine; one sparse step's three rounds of "
             "configs/ctr.toml's "
             f"CTR model with the payload bytes of the recorded step ({sources}, system `{RECORD_SYSTEM}`, 4 shards): "
             "per-id and per-row arrays split over S, per-example arrays whole on every shard "
             "(`benchmarks/data_plane_probe.py`'s docstring). "
             f"{doc.get('passes', 1)} pass(es) per transport, alternating; median round ms over all timed steps. CPU "
             "ms per step: the machine's (/proc/stat, other work included) / this probe's own processes' (the "
             "driver, Ray's daemons, the actors); idle cores: this probe's processes' CPU per second while no round "
             "is in flight. gloo: isend/irecv pairs with a 2 × int64 control message per shard; torch.distributed "
             "has no fault tolerance of its own (a lost rank breaks the group), unlike the actor calls DESIGN "
             "§1.8's recovery relies on.", "",
             "| b | S | transport | request / answer per shard (lookup; norms; row sums) | lookup ms | norms ms | "
             "row sums ms | step ms | × calls | CPU ms per step, machine / own | idle cores |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {(r["batch"], r["shards"]): r["step_ms_median"] for r in rows if r["transport"] == "calls"}
    order = {t: i for i, t in enumerate(TRANSPORTS)}
    for r in sorted(rows, key=lambda r: (r["batch"], r["shards"], order.get(r["transport"], 9))):
        rd = r["rounds"]
        sizes = "; ".join(f"{fmt_bytes(rd[k]['request_bytes'])} / {fmt_bytes(rd[k]['answer_bytes'])}" for k in ROUNDS)
        ref = base.get((r["batch"], r["shards"]))
        ratio = f"{r['step_ms_median'] / ref:.2f}" if ref else "-"
        idle = f"{r['idle_own_cores']:.2f}" if r.get("idle_own_cores") is not None else "-"
        lines.append(f"| {r['batch']:,} | {r['shards']} | {TRANSPORT_LABELS[r['transport']]} | {sizes} | "
                     + " | ".join(f"{rd[k]['ms_median']:.2f}" for k in ROUNDS)
                     + f" | {r['step_ms_median']:.2f} | {ratio} | {r['step_machine_cpu_ms']:.1f} / "
                       f"{r['step_own_cpu_ms']:.1f} | {idle} |")
    recorded = [(b, rec["recorded_step_ms"]) for b, rec in doc["records"].items() if rec.get("recorded_step_ms")]
    if recorded:
        lines += ["", "For comparison, the real step as recorded when this probe ran (shards computing, 4 shards; §2d shows the latest run): "
                  + "; ".join(f"b = {int(b):,}: " + ", ".join(f"{s} {v:.1f} ms" for s, v in steps.items())
                              for b, steps in recorded) + "."]
    text = choice_text(choice)
    lines += ["", f"Choice (step transport time summed over S, per b): {text}."]
    measured = "; ".join(f"b = {b:,}: " + ", ".join(f"{t} {v:.1f}" for t, v in c["step_ms_sum"].items()) + " ms"
                         for b, c in choice.items())
    goals = [("torch.distributed (gloo) measured against the compiled graph and ordinary calls on one step's rounds",
              f"step transport time summed over S ∈ {{{', '.join(str(s) for s in doc['shards'])}}}: {measured}",
              "reported", f"choice: {text}")]
    for b, c in choice.items():
        per_s = ", ".join(f"S = {s}: {TRANSPORT_LABELS[t]}" for s, t in c["fastest_at"].items())
        quiet = ""
        if c["best_quiet"] != c["best"]:
            quiet = (f"; fastest below {IDLE_LIMIT_CORES:g} idle cores beyond ordinary calls': "
                     + (TRANSPORT_LABELS[c["best_quiet"]] if c["best_quiet"] else "none"))
        goals.append((f"b = {b:,}: the fastest transport for one step's rounds",
                      f"{TRANSPORT_LABELS[c['best']]} (" + ", ".join(f"{t} {v:.2f}×" for t, v in c["vs_calls"].items())
                      + " ordinary calls)", "reported", f"fastest per S: {per_s}{quiet}"))
    return lines, goals


# ---- main -------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="b ∈ {1024, 4096}, S ∈ {1, 2}, few steps, one pass")
    parser.add_argument("--batches", default=None, help="expected batches (default 1024,4096,16384)")
    parser.add_argument("--shards", default=None, help="shard counts (default 1,2,4)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--passes", type=int, default=None, help="workers per transport, alternating (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per (transport, b, S) and pass, at most")
    parser.add_argument("--max-seconds", type=float, default=None, help="per (transport, b, S) and pass")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    started = time.time()
    machine = announce_machine()
    batches = [int(x) for x in (args.batches or ("1024,4096" if args.quick else "1024,4096,16384")).split(",") if x]
    shards = [int(x) for x in (args.shards or ("1,2" if args.quick else "1,2,4")).split(",") if x]
    transports = [t for t in args.transports.split(",") if t]
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad:
        raise SystemExit(f"--transports: unknown {bad}; choose from {TRANSPORTS}")
    if any(s < 1 for s in shards):
        raise SystemExit("--shards must be >= 1")
    passes = args.passes or (1 if args.quick else 2)
    if passes < 1:
        raise SystemExit("--passes must be >= 1")
    records = {b: record_for(b) for b in batches}
    payloads = {str(b): {str(s): round_payloads(records[b], s) for s in shards} for b in batches}
    for b in batches:
        chk = pooled_check(records[b])
        print(f"b={b}: pooled rows out recorded {fmt_bytes(chk['recorded'])}, "
              f"model b·26·D·4 {fmt_bytes(chk['model'])}; "
              + "; ".join(f"S={s}: " + ", ".join(f"{r} {fmt_bytes(p['request'])}/{fmt_bytes(p['answer'])}"
                                                for r, p in payloads[str(b)][str(s)].items())
                          for s in shards), flush=True)
    spec = {"batches": batches, "shards": shards, "payloads": payloads,
            "steps": args.steps or (10 if args.quick else 200), "min_steps": 5 if args.quick else 15,
            "warmup": 3 if args.quick else 8, "max_seconds": args.max_seconds or (1.0 if args.quick else 2.0),
            "idle_seconds": 1.0 if args.quick else 2.0}
    raw: list = []
    idle: list = []
    workers: list = []
    for k in range(passes):
        for t in transports:
            print(f"--- pass {k + 1}: {TRANSPORT_LABELS[t]}", flush=True)
            res = run_worker(__file__, {**spec, "transport": t}, timeout=1200)
            workers.append({"transport": t, "pass": k + 1, **{key: res.get(key) for key in
                                                              ("wall_s", "peak_tree_rss_bytes", "error")}})
            if "error" in res:
                print(f"    failed: {res['error']}", flush=True)
                continue
            raw += res["raw"]
            idle += res["idle"]
    rows = summarize(raw, idle)
    table = []
    for r in rows:
        table.append([r["transport"], r["batch"], r["shards"], *[r["rounds"][k]["ms_median"] for k in ROUNDS],
                      r["step_ms_median"], " / ".join(f"{v:.1f}" for v in r["step_ms_per_pass"]),
                      r["step_machine_cpu_ms"], r["step_own_cpu_ms"], r["idle_own_cores"], r["steps_timed"]])
    print(format_table(["transport", "b", "S", "lookup ms", "norms ms", "row sums ms", "step ms", "per pass",
                        "machine CPU ms/step", "own CPU ms/step", "idle cores", "steps"], table))
    choice = choose(rows)
    print("choice:", choice_text(choice))
    payload = {"batches": batches, "shards": shards, "transports": transports, "passes": passes, "caller": "driver",
               "gloo_exchange": "isend/irecv pairs per shard: a 2 x int64 control tensor and the request out, "
                                "the answer in",
               "records": {str(b): {k: v for k, v in rec.items() if k != "bytes_per_step"}
                           | {"pooled_check": pooled_check(rec)} for b, rec in records.items()},
               "payloads": payloads, "spec": {k: v for k, v in spec.items() if k != "payloads"},
               "idle_limit_cores": IDLE_LIMIT_CORES, "workers": workers, "rows": rows, "idle": idle,
               "choice": {str(b): c for b, c in choice.items()}, "choice_text": choice_text(choice)}
    write_results("data_plane_probe", payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


if __name__ == "__main__":
    if not worker_entry(measure):
        main()
