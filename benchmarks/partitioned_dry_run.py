"""A production-size dry run of partitioned training (issue 52): a synthetic CTR data set written
as K parts, larger than the memory the coordinator is allowed, trained on a loopback multi-node
Ray cluster by N trainer actors that each read only their own parts.

What runs:
  1. `synth_ctr` writes the source data set (streamed, one row group at a time), then
     `write_partitioned` writes it as K parts (streamed) with a 0.1% test split (cached in
     --work-dir: a second run reuses both).
  2. This process starts a loopback Ray cluster (`ray.cluster_utils.Cluster`: a head and worker
     nodes, each its own raylet, on this machine) and then runs the coordinator — `widedp train`
     with `cluster.address` — as a child process whose memory is capped from its first
     instruction: a cgroup-v1 memory cgroup with `memory.limit_in_bytes` (the cap; its
     `memory.max_usage_in_bytes` is the peak) where the machine has one, else RLIMIT_AS. Only
     the coordinator is in it: the raylets and the actors were forked by the cluster before.
  3. While it trains, every process's peak RSS (VmHWM) and storage reads (/proc/PID/io
     read_bytes) are polled once a second and grouped by role (coordinator, trainer actors,
     shard actors, the rest of Ray).
Printed and written (benchmarks/results/partitioned_dry_run.json): the data set's size on disk
and decoded (what a process holding it would hold) against the coordinator's cap, the
coordinator's peak, every role's peak RSS, examples per second, and per trainer per step the
bytes of its sampled rows (decoded) and its storage reads during the timed steps.

    python benchmarks/partitioned_dry_run.py [--examples 75000000] [--parts 4] [--trainers 2] [--steps 300]
        [--coordinator-memory-gib 1.0] [--checkpoint-every 50]

Each trainer's parts are read through their memory-mapped decoded cache advised for random access
(trainer/data/format/store.py `advise_random_access`); about 30 GB of disk at the default size
(the source is removed once partitioned, unless --keep-source).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import announce_machine, table_sizes, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
#: decoded bytes of one CTR example: 26 int64 ids, 13 float32 dense values, a float32 label
DECODED_BYTES_PER_EXAMPLE = 26 * 8 + 13 * 4 + 4


def directory_bytes(path: Path, skip_cache: bool = True) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        if skip_cache:
            dirs[:] = [d for d in dirs if d != ".widedp-cache"]
        total += sum((Path(root) / f).stat().st_size for f in files)
    return total


def ensure_data(work: Path, examples: int, parts: int, rows: int, keep_source: bool = False) -> tuple[Path, dict]:
    from widedp.trainer.data import synth_ctr
    from widedp.trainer.data.format.partitioned import is_partitioned, write_partitioned

    source, out = work / f"source_n{examples}_r{rows}", work / f"parts{parts}_n{examples}_r{rows}"
    timings = {}
    if not (source / "dataset.json").exists() and not is_partitioned(out):
        t0 = time.perf_counter()
        synth_ctr(source, num_examples=examples, table_sizes=table_sizes(rows), seed=0)
        timings["synth_s"] = time.perf_counter() - t0
    if not is_partitioned(out):
        t0 = time.perf_counter()
        write_partitioned(source, out, parts, test_fraction=0.001, seed=0)
        timings["partition_s"] = time.perf_counter() - t0
        if not keep_source:
            shutil.rmtree(source)  # the parts are what trains; the source only doubles the disk used
    return out, timings


class CoordinatorCap:
    """The coordinator's memory cap: a cgroup-v1 memory cgroup if writable, else RLIMIT_AS."""

    def __init__(self, limit_bytes: int):
        self.limit = int(limit_bytes)
        self.cgroup = None
        group = CGROUP_ROOT / f"widedp-dry-run-{os.getpid()}"
        try:
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(str(self.limit))
            swap = group / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(self.limit))
            self.cgroup = group
        except OSError:
            self.cgroup = None
        self.kind = "cgroup-v1 memory.limit_in_bytes" if self.cgroup else "RLIMIT_AS"

    def preexec(self) -> None:  # runs in the child, before exec: everything it allocates is capped
        if self.cgroup is not None:
            (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))
        else:
            resource.setrlimit(resource.RLIMIT_AS, (self.limit, self.limit))

    def peak(self):
        if self.cgroup is None:
            return None
        return int((self.cgroup / "memory.max_usage_in_bytes").read_text())

    def failcnt(self):
        return None if self.cgroup is None else int((self.cgroup / "memory.failcnt").read_text())

    def close(self) -> None:
        if self.cgroup is not None:
            try:
                self.cgroup.rmdir()
            except OSError:
                pass


def _role(cmdline: str, coordinator_pid: int, pid: int) -> str:
    if pid == coordinator_pid:
        return "coordinator"
    if "_TrainerActor" in cmdline:
        return "trainer"
    if "EmbeddingShard" in cmdline or "ShardActor" in cmdline:
        return "shard"
    if "raylet" in cmdline or "gcs_server" in cmdline or "ray" in cmdline:
        return "ray"
    return ""


class ProcessWatch(threading.Thread):
    """Polls every process once a second: peak RSS (VmHWM) and read_bytes per pid, with its role."""

    def __init__(self):
        super().__init__(daemon=True)
        self.coordinator_pid = -1
        self.seen: dict[int, dict] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.poll()
            self.stop.wait(1.0)

    def poll(self) -> None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                status = (entry / "status").read_text()
                io = (entry / "io").read_text()
            except OSError:
                continue
            role = _role(cmdline, self.coordinator_pid, pid)
            if not role:
                continue
            hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)
            anon = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:")), 0)
            read = next((int(line.split()[1]) for line in io.splitlines() if line.startswith("read_bytes:")), 0)
            rec = self.seen.setdefault(pid, {"role": role, "peak_rss": 0, "peak_anon": 0, "read_bytes": []})
            rec["role"] = role
            rec["peak_rss"] = max(rec["peak_rss"], hwm)
            rec["peak_anon"] = max(rec["peak_anon"], anon)
            rec["read_bytes"].append((time.time(), read))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=75_000_000)
    p.add_argument("--rows", type=int, default=520_000, help="total rows of the 26 tables")
    p.add_argument("--parts", type=int, default=4)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--checkpoint-every", type=int, default=50,
                   help="train.checkpoint_every: the coordinator keeps every release since the last checkpoint "
                        "(to restore a lost shard), about 1.5 MB a step here")
    p.add_argument("--coordinator-memory-gib", type=float, default=1.0)
    p.add_argument("--work-dir", default="runs/bench/partitioned_dry_run")
    p.add_argument("--keep-source", action="store_true", help="keep the unpartitioned source data set")
    p.add_argument("--config", default="configs/ctr.toml")
    p.add_argument("--out")
    args = p.parse_args(argv)
    started = time.time()
    machine = announce_machine()
    work = (ROOT / args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data, timings = ensure_data(work, args.examples, args.parts, args.rows, args.keep_source)
    from widedp.trainer.data.format.partitioned import read_manifest

    manifest = read_manifest(data)
    disk = directory_bytes(data)
    decoded = manifest.num_examples * DECODED_BYTES_PER_EXAMPLE
    cap = CoordinatorCap(int(args.coordinator_memory_gib * 2 ** 30))
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=max(2, -(-(args.trainers + args.shards) // (args.nodes - 1))))
    cluster.wait_for_nodes()
    run_dir = work / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    sets = [f"data.path={data}", "data.synth=", "train.selection=threshold", f"train.batch_size={args.batch}", f"train.steps={args.steps}",
            "train.recalibrate=false", "data.validation_fraction=0", "train.eval_every=0", f"train.checkpoint_every={args.checkpoint_every}",
            f"cluster.address={cluster.address}", "cluster.backend=ray", f"cluster.num_trainers={args.trainers}",
            "cluster.trainer_placement=actors", "cluster.cpus_per_trainer=1", "cluster.cpus_per_shard=0.5",
            f"cluster.num_shards={args.shards}", "cluster.dense_reduction=trainers", "train.log_every=50"]
    command = [sys.executable, "-m", "widedp.trainer.cli", "train", "--config", str(ROOT / args.config),
               "--run-dir", str(run_dir), "--no-progress", *[a for s in sets for a in ("--set", s)]]
    watch = ProcessWatch()
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(command, cwd=ROOT, preexec_fn=cap.preexec, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        watch.coordinator_pid = proc.pid
        watch.start()
        out, err = proc.communicate(timeout=3 * 3600)
        wall = time.perf_counter() - t0
        watch.stop.set()
        watch.join()
        watch.poll()
        coordinator_peak_cgroup, failcnt = cap.peak(), cap.failcnt()
    finally:
        cluster.shutdown()
        cap.close()
    if proc.returncode != 0:
        print(err[-4000:], file=sys.stderr)
        raise SystemExit(f"the coordinator failed (rc {proc.returncode}) under a {cap.kind} cap of "
                         f"{args.coordinator_memory_gib} GiB")
    summary = json.loads(out.strip().splitlines()[-1])
    roles: dict = {}
    for pid, rec in watch.seen.items():
        roles.setdefault(rec["role"], []).append(rec)
    # trainers' storage reads during training: from their first poll to their last
    steps = int(summary["steps"])
    trainer_reads = [(rec["read_bytes"][-1][1] - rec["read_bytes"][0][1]) for rec in roles.get("trainer", [])
                     if len(rec["read_bytes"]) > 1]
    per_trainer_examples = float(summary["expected_batch_size"]) / args.trainers
    result = {
        "examples": manifest.num_examples, "parts": manifest.num_parts, "trainers": args.trainers, "steps_planned": args.steps,
        "checkpoint_every": args.checkpoint_every,
        "shards": args.shards, "nodes": args.nodes, "rows": args.rows, "batch": args.batch, "steps": steps,
        "data_bytes_on_disk": disk, "data_bytes_decoded": decoded,
        "coordinator_cap_bytes": cap.limit, "cap_kind": cap.kind,
        "coordinator_peak_bytes_cgroup": coordinator_peak_cgroup, "cap_failcnt": failcnt,
        "peak_rss_bytes": {role: max(r["peak_rss"] for r in recs) for role, recs in roles.items()},
        # RssAnon polled once a second (the process's own memory; VmHWM also counts the file pages it mapped,
        # e.g. a trainer's memory-mapped parts, which the page cache holds and can drop)
        "peak_anon_bytes": {role: max(r["peak_anon"] for r in recs) for role, recs in roles.items()},
        "processes": {role: len(recs) for role, recs in roles.items()},
        "examples_per_sec": summary.get("examples_per_sec"), "step_time_ms_median": summary.get("step_time_ms_median"),
        "wall_s": wall, "test_metrics": summary.get("test_metrics"), "epsilon": summary.get("epsilon"),
        "sampled_bytes_per_trainer_per_step": per_trainer_examples * DECODED_BYTES_PER_EXAMPLE,
        "storage_read_bytes_per_trainer_per_step": [b / max(steps, 1) for b in trainer_reads],
        "trainer_parts": summary.get("partitions", {}).get("trainer_parts"), **timings,
    }
    gib = 2 ** 30
    print(f"data set: {manifest.num_examples:,} examples in {manifest.num_parts} parts, {disk / gib:.2f} GiB on disk, "
          f"{decoded / gib:.2f} GiB decoded; coordinator cap {cap.limit / gib:.2f} GiB ({cap.kind}): "
          f"{decoded / cap.limit:.1f}x decoded, {disk / cap.limit:.1f}x on disk")
    print("peak RSS: " + ", ".join(f"{role} {v / gib:.2f} GiB" for role, v in result["peak_rss_bytes"].items())
          + (f"; coordinator cgroup peak {coordinator_peak_cgroup / gib:.2f} GiB" if coordinator_peak_cgroup else "")
          + "; peak anonymous: " + ", ".join(f"{role} {v / gib:.2f} GiB" for role, v in result["peak_anon_bytes"].items()))
    print(f"{steps} steps, {result['examples_per_sec']:.0f} examples/s, median step {result['step_time_ms_median']:.0f} ms; "
          f"per trainer per step: {result['sampled_bytes_per_trainer_per_step'] / 1e6:.2f} MB of sampled rows, storage reads "
          + ", ".join(f"{b / 1e6:.2f} MB" for b in result["storage_read_bytes_per_trainer_per_step"]))
    payload = {"command": " ".join(["python", "benchmarks/partitioned_dry_run.py", *(argv or sys.argv[1:])]), **result}
    write_results("partitioned_dry_run", payload, quick=False, machine=machine, out=args.out, started=started)
    return payload


if __name__ == "__main__":
    main()
