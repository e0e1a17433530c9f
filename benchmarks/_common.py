"""Shared pieces of the widedp benchmarks: machine description, results files, isolated
worker processes with peak-memory measurement, and the engine step timer.

Every benchmark script writes one JSON file (`benchmarks/results/NAME.json`, or
`benchmarks/results/quick/NAME.json` with `--quick`) that `benchmarks/make_results.py` turns
into docs/RESULTS.md and docs/plots/. Figures are medians over repeated steps after warm-up;
every file carries the machine description and the load average seen while it ran (a loaded
machine makes timings noisy — the files say so rather than hide it).

Workers: each timed configuration runs in a fresh Python process (`script --worker SPEC`),
so tables of one configuration never share memory with the next, and peak memory is
measured per configuration: the worker's own peak RSS (getrusage) and the peak of the summed
RSS of its whole process tree (Ray's raylet, GCS and shard actors are descendants of an
embedded-Ray driver), polled from /proc every 0.2 s.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
#: Synthetic data sets are cached here (WIDEDP_BENCH_DATA overrides, e.g. for tests).
DATA_DIR = Path(os.environ.get("WIDEDP_BENCH_DATA", str(REPO / "runs" / "bench_data")))
WORKER_TAG = "WORKER_RESULT "

# ---- machine --------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _physical_cores() -> Optional[int]:
    try:
        cores, phys = set(), None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("physical id"):
                phys = line.split(":", 1)[1].strip()
            elif line.startswith("core id"):
                cores.add((phys, line.split(":", 1)[1].strip()))
        return len(cores) or None
    except OSError:
        return None


def mem_info() -> dict:
    """MemTotal / MemAvailable in bytes (Linux; empty elsewhere)."""
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _version(module: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def machine_info() -> dict:
    """What the figures were measured on (cores, threads, memory, versions, load)."""
    import torch

    mem = mem_info()
    return {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": _physical_cores(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "memory_gib": round(mem.get("MemTotal", 0) / 2**30, 1),
        "gpu": bool(torch.cuda.is_available()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in ("torch", "fbgemm-gpu-cpu", "fbgemm-gpu", "ray", "opacus", "numpy")
                     if _version(m)},
        "load_average_start": list(os.getloadavg()),
    }


def machine_line(m: dict, load: bool = True) -> str:
    cores = f"{m['logical_cores']} logical cores" + (f" ({m['physical_cores']} physical)" if m.get("physical_cores") else "")
    line = (f"{m['cpu']}, {cores}, torch threads {m['torch_threads']} (interop {m['torch_interop_threads']}), "
            f"{m['memory_gib']} GiB, {'GPU' if m.get('gpu') else 'no GPU'}, {m.get('platform', '')}, "
            f"Python {m.get('python', '')}, " + ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items()))
    return line + (f"; load average at start {m['load_average_start'][0]:.2f}" if load else "")


# ---- results files ----------------------------------------------------------------------------


def announce_machine() -> dict:
    """Print the machine line (and a CPU note if any) that heads every benchmark; return it."""
    machine = machine_info()
    print(f"machine: {machine_line(machine)}")
    if cpu_note(machine):
        print(cpu_note(machine))
    return machine


def results_path(name: str, quick: bool, out: Optional[str] = None) -> Path:
    if out:
        return Path(out)
    return (RESULTS_DIR / "quick" if quick else RESULTS_DIR) / f"{name}.json"


def write_results(name: str, payload: dict, *, quick: bool, machine: dict, out: Optional[str] = None,
                  started: Optional[float] = None) -> Path:
    path = results_path(name, quick, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    machine = dict(machine, load_average_end=list(os.getloadavg()))
    doc = {"benchmark": name, "quick": quick, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": " ".join([_script_name(), *sys.argv[1:]]),
           "wall_seconds": round(time.time() - started, 1) if started else None,
           "machine": machine, **payload}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    os.replace(tmp, path)
    print(f"\nwrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return path


def _script_name() -> str:
    p = Path(sys.argv[0]).resolve()
    return ("python " + p.relative_to(REPO).as_posix()) if p.is_relative_to(REPO) else p.as_posix()


def _json_default(o):
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def format_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    cells = [[_cell(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def _cell(c) -> str:
    if c is None:
        return "-"
    if isinstance(c, float):
        if c != c:
            return "nan"
        if abs(c) >= 1e5 or (0 < abs(c) < 1e-3):
            return f"{c:.3g}"
        return f"{c:,.2f}" if abs(c) < 100 else f"{c:,.0f}"
    if isinstance(c, int):
        return f"{c:,}"
    return str(c)


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000.0
    return str(n)


def exps(lo: int, hi: int) -> list[int]:
    return [10**e for e in range(lo, hi + 1)]


# ---- worker processes ---------------------------------------------------------------------------


def _tree_rss(root: int) -> int:
    """Summed RSS (bytes) of `root` and all its descendants, read from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/statm") as f:
                rss[int(name)] = int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    total, stack, seen = 0, [root], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


class PeakTreeRSS:
    """Polls the summed RSS of a process tree in a thread; `.peak` is the largest seen."""

    def __init__(self, pid: int, interval: float = 0.2):
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = Path("/proc").is_dir()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, _tree_rss(self.pid))
            except OSError:
                pass
            self._stop.wait(self.interval)

    def __enter__(self):
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.available:
            self._thread.join()


def run_worker(script: str | Path, spec: dict, timeout: float = 3600.0, echo: bool = False) -> dict:
    """Run `python SCRIPT --worker JSON(spec)` in a fresh process; its result dict plus
    `peak_tree_rss_bytes` and `wall_s`, or {"error": ...} if it failed (never raises)."""
    cmd = [sys.executable, str(script), "--worker", json.dumps(spec)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", TQDM_DISABLE="1")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    with PeakTreeRSS(proc.pid) as mon:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - start}
    wall = time.perf_counter() - start
    result = None
    for line in out.splitlines():
        if line.startswith(WORKER_TAG):
            result = json.loads(line[len(WORKER_TAG):])
    if echo and err.strip():
        print(err, file=sys.stderr)
    if result is None:
        noise = re.compile(r"^[WI]\d{4} |warnings\.warn|Warning:")  # glog lines and Python warnings
        tail = [ln for ln in err.strip().splitlines() if ln.strip() and not noise.search(ln)][-3:]
        reason = " | ".join(tail) or f"exit code {proc.returncode}"
        if proc.returncode in (-9, 137):
            reason = f"killed (exit {proc.returncode}; out of memory?) {reason}"
        return {"error": reason[-600:], "returncode": proc.returncode, "wall_s": wall,
                "peak_tree_rss_bytes": mon.peak or None}
    result["peak_tree_rss_bytes"] = mon.peak or None
    result["wall_s"] = wall
    return result


def worker_entry(fn: Callable[[dict], dict]) -> bool:
    """If argv is `--worker SPEC`, run fn(spec), print its result for run_worker and exit."""
    if len(sys.argv) >= 3 and sys.argv[1] == "--worker":
        import warnings

        warnings.filterwarnings("ignore")
        spec = json.loads(sys.argv[2])
        result = fn(spec)
        result["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        sys.stdout.write(WORKER_TAG + json.dumps(result, default=_json_default) + "\n")
        sys.stdout.flush()
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()  # stop the embedded cluster this worker started
        os._exit(0)  # skip interpreter teardown (Ray / torch atexit work is not measured)
    return False


# ---- data sets ----------------------------------------------------------------------------------


def bible_verses(extracted: Path) -> list[str]:
    """The King James Bible's 31,102 verses, one string each without its "Ge1:1" reference, read
    with the `bible` program of the Debian packages bible-kjv-text + bible-kjv extracted under
    `extracted` (usr/bin/bible, usr/lib)."""
    reader, data = extracted / "usr/bin/bible", extracted / "usr/lib"
    verses = subprocess.run([str(reader), "-f", "-p", str(data), "gen1:1-rev22:21"], check=True,
                            capture_output=True, text=True).stdout.splitlines()
    verses = [v.split(" ", 1)[1] for v in verses if " " in v]
    if len(verses) < 31000:
        raise RuntimeError(f"the bible reader printed {len(verses)} verses, expected 31,102")
    return verses


def extract_debs(packages: Sequence[str], into: Path) -> None:
    """`apt-get download` each Debian package into `into` and extract them all under into/root."""
    for package in packages:
        subprocess.run(["apt-get", "download", package], cwd=into, check=True, capture_output=True)
    for deb in into.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(into / "root")], check=True)


def kjv_corpus(root: Path = DATA_DIR / "kjv") -> Path:
    """root/kjv.txt: the King James Bible (public domain), one verse per line; fetched once
    (apt-get download bible-kjv-text bible-kjv), written atomically."""
    import tempfile

    corpus = root / "kjv.txt"
    if corpus.exists():
        return corpus
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        extract_debs(("bible-kjv-text", "bible-kjv"), Path(tmp))
        verses = bible_verses(Path(tmp) / "root")
    partial = corpus.with_suffix(".txt.tmp")
    partial.write_text("\n".join(verses) + "\n")
    partial.replace(corpus)
    return corpus


def table_sizes(total_rows: int, tables: int = 26) -> list[int]:
    """`total_rows` split into `tables` near-equal tables (the first ones one row larger)."""
    base, extra = divmod(int(total_rows), tables)
    return [base + (1 if i < extra else 0) for i in range(tables)]


def ctr_dataset(total_rows: int, examples: int, seed: int = 0) -> Path:
    """A planted-truth CTR data set (26 tables summing to `total_rows` rows), cached on disk."""
    from widedp.trainer.data import synth_ctr

    path = DATA_DIR / f"ctr_rows{total_rows}_n{examples}_s{seed}"
    if not (path / "dataset.json").exists():
        synth_ctr(path, num_examples=examples, table_sizes=table_sizes(total_rows), seed=seed)
    return path


def text_dataset(vocab: int, examples: int, seed: int = 0) -> Path:
    """A synthetic Zipf corpus as CBOW examples (window 4, 8 negatives), cached on disk."""
    from widedp.trainer.data import synth_text

    path = DATA_DIR / f"text_vocab{vocab}_n{examples}_s{seed}"
    if not (path / "dataset.json").exists():
        synth_text(path, num_examples=examples, vocab=vocab, seed=seed)
    return path


# ---- the engine step timer (runs inside a worker) -------------------------------------------------

#: Explicit privacy parameters for timing runs: timings do not depend on their values, and an
#: explicit σ avoids a calibration per configuration. The target ε is never reached. That
#: includes the one-time Gaussians' σ — DP-FEST's count (fest, fest-threshold) and
#: train.recalibrate's histogram (after training, never timed): their "auto" rules calibrate a
#: Gaussian to a share of the 1e12 target, i.e. at the PLD grid's ceiling
#: (accounting.calibration.RHO_CEILING_GRID), ~10 s each of a worker's start-up (twice for
#: FEST with a threshold: `default_selection_threshold` plans the run too).
TIMING_PRIVACY = ["privacy.noise_multiplier=1.0", "privacy.selection_epsilon=0.1", "privacy.selection_sigma=2.0",
                  "privacy.fest_noise_multiplier=1.0", "privacy.recalibration_noise_multiplier=1.0",
                  "privacy.target_epsilon=1e12",
                  # the selection's shape the timings were taken at (τ = auto lets about k noise-only
                  # rows pass): ctr.toml's k and split moved to 20,000 / 0.05 with its DP batch of 8,192
                  "privacy.k=1000", "privacy.selection_fraction=0.1"]


class MethodBytes:
    """Payload bytes, calls and wall time per shard method, through the shard group's public
    observer hook (`ShardGroup.add_observer`)."""

    def __init__(self, group):
        self.per: dict[str, list] = {}
        self.remove = group.add_observer(self._observe)

    def _observe(self, call) -> None:
        entry = self.per.setdefault(call.method, [0, 0, 0, 0.0])
        entry[0] += call.bytes_to
        entry[1] += call.bytes_from
        entry[2] += 1
        entry[3] += call.seconds

    def reset(self):
        self.per = {}

    def per_step(self, steps: int) -> dict:
        return {m: {"to": v[0] / steps, "from": v[1] / steps, "calls": v[2] / steps, "seconds": v[3] / steps}
                for m, v in sorted(self.per.items())}


class StepTimer:
    """Run callback recording each step's wall time, phases and sizes; stops the loop after
    `steps` timed steps, or after `min_steps` once `max_seconds` have passed."""

    def __init__(self, steps: int, min_steps: int, max_seconds: float):
        self.steps, self.min_steps, self.max_seconds = steps, min_steps, max_seconds
        self.times, self.phases, self.batch, self.touched, self.selected = [], {}, [], [], []
        self.start = time.perf_counter()

    def on_step(self, engine, stats, seconds) -> bool:
        self.times.append(seconds)
        for name, sec in getattr(stats, "phases", {}).items():
            self.phases.setdefault(name, []).append(sec)
        self.batch.append(stats.batch_size)
        self.touched.append(stats.rows_touched)
        self.selected.append(stats.rows_selected)
        n = len(self.times)
        return n >= self.steps or (n >= self.min_steps and time.perf_counter() - self.start >= self.max_seconds)


def summarize_call_timings(recorded: dict) -> dict:
    """Per shard method, from `RayShardGroup.record_call_timings`' records (one machine's clock):
    medians over the rounds of when each shard began its part after the round was sent (the
    first, the median and the last shard), how long a shard's part ran (wall and CPU of its
    thread), the CPU of all shards' parts summed, the time from the last shard's end to the
    answers in hand, and the whole round as the sender saw it; all in ms. A round with a
    shard missing (replaced actor) is left out."""
    by_call: dict = {}
    for records in recorded["shards"]:
        for call_id, _, start, end, cpu in records:  # the method is the sent record's
            by_call.setdefault(call_id, []).append((start, end, cpu))
    n_shards = len(recorded["shards"])
    per: dict = {}
    for call_id, method, plane, sent, answered in recorded["sent"]:
        parts = by_call.get(call_id, [])
        if len(parts) != n_shards:
            continue
        starts = sorted(1e3 * (start - sent) for start, _, _ in parts)
        entry = per.setdefault(method, {"plane": plane, "first": [], "median": [], "last": [], "wall": [], "cpu": [],
                                        "cpu_sum": [], "return": [], "round": []})
        entry["first"].append(starts[0])
        entry["median"].append(statistics.median(starts))
        entry["last"].append(starts[-1])
        entry["wall"] += [1e3 * (end - start) for start, end, _ in parts]
        entry["cpu"] += [1e3 * cpu for _, _, cpu in parts]
        entry["cpu_sum"].append(1e3 * sum(cpu for _, _, cpu in parts))
        entry["return"].append(1e3 * (answered - max(end for _, end, _ in parts)))
        entry["round"].append(1e3 * (answered - sent))
    out = {}
    for method, e in per.items():
        out[method] = {"plane": e["plane"], "rounds": len(e["round"]), "shards": n_shards,
                       "start_first_ms": statistics.median(e["first"]), "start_median_ms": statistics.median(e["median"]),
                       "start_last_ms": statistics.median(e["last"]), "shard_wall_ms": statistics.median(e["wall"]),
                       "shard_cpu_ms": statistics.median(e["cpu"]), "shards_cpu_sum_ms": statistics.median(e["cpu_sum"]),
                       "return_ms": statistics.median(e["return"]), "round_ms": statistics.median(e["round"])}
    return out


def time_engine(spec: dict) -> dict:
    """Build an engine from a config (+ overrides) with trainer.run.train.build_run and time its
    steps: `warmup` untimed steps, then up to `steps` timed ones (at least `min_steps`, fewer
    if `max_seconds` runs out). Returns medians, per-phase medians, bytes per shard method."""
    import numpy as np

    from widedp.trainer.config import load_config
    from widedp.trainer.run.train import build_run

    cfg = load_config(spec["config"], list(spec.get("overrides", [])))
    cfg.validate()
    rule = default_selection_threshold(cfg)  # svt/threshold with privacy.threshold = "auto"
    if rule:
        cfg.privacy.threshold = rule["threshold"]
    t0 = time.perf_counter()
    run = build_run(cfg)
    engine, train_set, info = run.engine, run.train_set, run.privacy
    build_s = time.perf_counter() - t0
    try:
        counter = MethodBytes(engine.shards)
        warmup = int(spec.get("warmup", 2))
        if run.run(engine.step_count + warmup).stopped_by_budget:
            raise RuntimeError("budget exhausted during warm-up")
        counter.reset()
        steps, min_steps = int(spec.get("steps", 10)), int(spec.get("min_steps", 2))
        timer = StepTimer(steps, min_steps, float(spec.get("max_seconds", 1e9)))
        call_timings = bool(spec.get("call_timings")) and hasattr(engine.shards, "record_call_timings")
        if call_timings:
            engine.shards.record_call_timings(True)
        if run.run(engine.step_count + steps, [timer]).stopped_by_budget:
            raise RuntimeError("budget exhausted while timing")
        rounds = summarize_call_timings(engine.shards.record_call_timings(False)) if call_timings else None
        times, phases, batch, touched, selected = timer.times, timer.phases, timer.batch, timer.touched, timer.selected
        n = len(times)
        phase_sum = [sum(p[i] for p in phases.values()) for i in range(n)] if phases else [0.0] * n
        med = statistics.median(times)
        bytes_per = counter.per_step(n)
        return {
            "mode": cfg.train.mode,
            "selection": cfg.train.selection if cfg.train.mode == "sparse" else None,
            "backend": cfg.cluster.backend,
            "num_shards": cfg.cluster.num_shards,
            "optimizer": cfg.train.optimizer,
            "vocabulary_size": engine.layout.vocabulary_size,
            "tables": len(engine.layout.tables),
            "dim": engine.layout.dim,
            "train_examples": len(train_set),
            "expected_batch": info.sample_rate * len(train_set),
            "k": info.k,
            "build_s": build_s,
            "warmup": int(spec.get("warmup", 2)),
            "steps_timed": n,
            "step_ms": [1e3 * t for t in times],
            "step_ms_median": 1e3 * med,
            "step_ms_min": 1e3 * min(times),
            "phase_ms_median": {k: 1e3 * statistics.median(v) for k, v in phases.items()},
            # step time outside every phase: budget check before, ε report and freeing the step's tensors after
            "unphased_ms_median": 1e3 * statistics.median([t - p for t, p in zip(times, phase_sum)]),
            "examples_per_sec": float(np.mean(batch)) / med if med > 0 else None,
            "batch_mean": float(np.mean(batch)),
            "rows_touched_mean": float(np.mean(touched)),
            "rows_selected_mean": float(np.mean(selected)),
            "bytes_per_step": bytes_per,
            "bytes_to_shards_per_step": sum(v["to"] for v in bytes_per.values()),
            "bytes_from_shards_per_step": sum(v["from"] for v in bytes_per.values()),
            **({"call_timings": rounds} if rounds is not None else {}),
        }
    finally:
        run.close()


def timing_overrides(mode: str, selection: str = "em", backend: Optional[str] = None, extra: Sequence[str] = ()) -> list:
    out = [f"train.mode={mode}", f"train.selection={selection}", *TIMING_PRIVACY]
    if backend:
        out.append(f"cluster.backend={backend}")
    return out + list(extra)


def widedp_timing_spec(config: str, mode: str, selection: str, backend: Optional[str], extra: Sequence[str],
                       sigma: float) -> dict:
    """The worker spec entries of a widedp system in a speed comparison: the timing overrides of
    `mode` with σ forced to the peer's (so both systems noise alike)."""
    over = [o for o in timing_overrides(mode, selection, backend, extra) if not o.startswith("privacy.noise_multiplier")]
    return {"config": config, "overrides": [*over, f"privacy.noise_multiplier={sigma}"], "min_steps": 1}


def run_timed_system(script: str | Path, row: dict, spec: dict, need_bytes: float, label: str) -> dict:
    """One (system, size) of a speed comparison: skipped when its estimated memory `need_bytes`
    exceeds 85% of what is available, else timed in a fresh worker (`run_worker`); prints one
    line (`label`: the size) and returns `row` with the result merged in."""
    system, avail = row["system"], mem_info().get("MemAvailable")
    if avail and need_bytes > 0.85 * avail:
        row["skipped"] = f"needs ~{need_bytes / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"
        print(f"{label} {system}: skipped ({row['skipped']})")
        return row
    row.update(run_worker(script, spec, timeout=3 * 3600))
    if "error" in row:
        print(f"{label} {system}: FAILED: {row['error']}")
    else:
        print(f"{label} {system:>24}: {row['step_ms_median']:10.1f} ms/step  {row['examples_per_sec']:9.1f} ex/s  "
              f"peak {fmt_bytes(row.get('ru_maxrss_bytes'))} (tree {fmt_bytes(row.get('peak_tree_rss_bytes'))})"
              f"{'  [1 step]' if row.get('single_step_only') or row.get('steps_timed') == 1 else ''}")
    return row


def cpu_note(machine: dict) -> str:
    la = machine.get("load_average_start", [0])[0]
    cores = machine.get("logical_cores") or 1
    if la > 0.5 * cores:
        return (f"NOTE: load average {la:.2f} on {cores} cores at start: the machine was busy, timings are noisy "
                "(medians over repeated steps still move by tens of percent).")
    return ""


def ensure_config_dataset(config: str, overrides: Sequence[str] = ()) -> str:
    """Generate the config's synthetic data set now (in the parent), so workers only read it.

    A data.path without a data set gets the config's `data.synth` set here exactly as
    trainer/run/train.py:_ensure_dataset generates it first (`SYNTHETIC_DATASETS[...].generate`),
    without importing the trainer (torch, torchrec, the engine: ~5-10 s of CPU that a parent
    which only launches workers does not otherwise spend); the workers open it through
    `_ensure_dataset` in `build_run`. An existing data set (or a config without data.synth)
    goes through `_ensure_dataset` here, which checks that a cached synthetic set is the one
    the config asks for, so a stale cache is refused before any worker starts."""
    from widedp.trainer.config import load_config
    from widedp.trainer.data.synthetic.generators import SYNTHETIC_DATASETS

    cfg = load_config(config, list(overrides))
    synthetic = SYNTHETIC_DATASETS.get(cfg.data.synth) if cfg.data.synth else None
    if synthetic is not None and not (Path(cfg.data.path) / "dataset.json").exists():
        synthetic.generate(Path(cfg.data.path), cfg.data)
        return cfg.data.path
    from widedp.trainer.run.train import _ensure_dataset

    _ensure_dataset(cfg)
    return cfg.data.path


#: --quick replaces the configs' data sets by small ones (own paths, so nothing is overwritten).
QUICK_DATA = {
    "ctr": ["data.synth_examples=20000", "data.synth_table_size=10000"],
    "cbow": ["data.synth_examples=20000"],
    "quickstart": ["data.synth_examples=20000"],
}


def quick_data_overrides(config: str) -> list[str]:
    stem = Path(config).stem.split("_")[0]
    extra = QUICK_DATA.get(stem, ["data.synth_examples=20000"])
    return [*extra, f"data.path={DATA_DIR / ('quick_' + stem)}"]



# ---- training runs (privacy-utility, Fig 1) -------------------------------------------------------

def default_selection_threshold(cfg) -> Optional[dict]:
    """The trainer's own rule for privacy.threshold = "auto" (`Selector.auto_threshold`, applied
    by `trainer.config.planning.plan_privacy`), made explicit so that a benchmark record carries the
    value and the rule. Returns {"threshold": value, "rule": text}, or None when the config's
    own value is used (or the selector has no threshold)."""
    from widedp.selection.registry import get_selector
    from widedp.trainer.config import is_auto
    from widedp.trainer.run.train import _ensure_dataset, plan_run

    t, p = cfg.train, cfg.privacy
    if t.mode != "sparse" or "threshold" not in get_selector(t.selection).config_fields().values() or not is_auto(p.threshold):
        return None
    train_set, _ = _ensure_dataset(cfg)
    meta = train_set.meta
    plan, info, _ = plan_run(cfg, len(train_set), meta.table_sizes, [e for _, e in meta.privacy_events],
                             meta.feature_tables, feature_max_ids=meta.max_ids_per_example())
    if plan is None or plan.selection_params is None:  # every table dense: no selection
        return None
    return {"threshold": plan.selection_params.threshold, "rule": info.threshold_rule}


def set_aside_stale_run(run_dir: Path) -> Optional[Path]:
    """A benchmark's run directory whose saved config no longer matches is moved aside (renamed
    `<dir>.replaced-<date-time>`, ledger and all), never trained over: a run directory is written
    by one run only (trainer/run/train.py refuses otherwise). Returns the new name, or None."""
    run_dir = Path(run_dir)
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return None
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.rename(aside)
    print(f"  {run_dir}: its config changed; the old run is kept as {aside.name}")
    return aside


def one_torch_thread() -> None:
    """In a spawned worker of a parallel grid (`--jobs`): one torch (and OpenMP) thread, so two
    jobs on 2 cores do not oversubscribe them."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def train_point(cfg, run_dir: Path, fresh: bool, record: dict, label: str, keys: Sequence[str]) -> bool:
    """One grid point (`train_or_reuse`) into `record`: its summary's `keys`, `reused` when the
    saved run was taken, `wall_s`; on a training error `record["error"]` instead, printed under
    `label`, so that one failed point does not lose the grid. Returns whether it trained."""
    t0 = time.perf_counter()
    try:
        summary, reused = train_or_reuse(cfg, run_dir, fresh)
    except Exception as exc:  # one failed point must not lose the grid
        record["error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(f"  {label}: FAILED: {record['error']}")
        return False
    if reused:
        record["reused"] = True
    record["wall_s"] = time.perf_counter() - t0
    record.update({key: summary.get(key) for key in keys})
    return True


def train_or_reuse(cfg, run_dir: Path, fresh: bool) -> tuple[dict, bool]:
    """(summary.json, reused): the run in `run_dir` when its saved config computes the same run
    as `cfg` (keys of placement, logging and recovery may differ:
    trainer/run/train.py:changed_computation_keys) and not `fresh`; else a new run there, the old
    one set aside (`set_aside_stale_run`). Training errors propagate (the caller records them)."""
    from widedp.trainer.run.train import changed_computation_keys, train

    summary_path, saved = Path(run_dir) / "summary.json", Path(run_dir) / "config.json"
    if (not fresh and summary_path.exists() and saved.exists()
            and not changed_computation_keys(json.loads(saved.read_text()), json.loads(json.dumps(cfg.to_dict())))):
        return json.loads(summary_path.read_text()), True
    set_aside_stale_run(run_dir)
    return train(cfg, run_dir, progress=False), False
