"""`widedp convert table` throughput and peak memory on multi-file click logs.

The input is `widedp synth logs` output (day-partitioned Parquet with a string user id, a
timestamp, dense columns that need log1p / standardize / fill, hashed string and int ids, a
public vocabulary and a list-valued history of up to 20 ids on a table shared with the ad id),
converted by its own schema with the last day as the test split (`--test-after`), exactly as
README's user-level walkthrough does. Each size is converted in a fresh worker process
(benchmarks/_common.py `run_worker`): rows/s over all rows read (train + test), input MB/s
(Parquet bytes on disk), and the worker's peak RSS beside the size of its input and output, so
the streaming claim (memory bounded by the chunk, not the input) can be read off: the peak
should stay flat while the input grows.

    python benchmarks/convert_throughput.py                  # 20k and 200k users (~0.25M, ~2.5M rows)
    python benchmarks/convert_throughput.py --quick          # 2k users only
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DATA_DIR, announce_machine, fmt_bytes, format_table, run_worker, worker_entry, write_results  # noqa: E402

SIZES = {"quick": [(2_000, 3)], "full": [(20_000, 5), (200_000, 10)]}


def _logs(users: int, days: int) -> tuple[Path, dict]:
    """The synthetic logs of this size (cached under DATA_DIR) and their truth.json."""
    from widedp.trainer.data.synthetic.synth_logs import synth_logs

    root = DATA_DIR / f"logs_u{users}_d{days}"
    if not (root / "truth.json").exists():
        synth_logs(root, users=users, days=days, seed=0)
    return root, json.loads((root / "truth.json").read_text())


def _convert(spec: dict) -> dict:
    """Worker: convert the logs at spec["logs"] once; what it read and wrote."""
    from widedp.trainer.data.convert.table import convert_table

    logs, out = Path(spec["logs"]), Path(spec["out"])
    inputs = sorted(logs.glob("day=*/*.parquet"))
    started = time.perf_counter()
    meta = convert_table([str(logs / "day=*" / "*.parquet")], out, schema=logs / "schema.toml",
                         test_after=spec["test_after"])
    seconds = time.perf_counter() - started
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {"seconds": seconds, "files": len(inputs), "input_bytes": sum(p.stat().st_size for p in inputs),
            "output_bytes": written, "train_rows": int(meta.num_examples),
            "test_rows": int(meta.extra.get("test_examples", 0))}


def results_section(doc: dict) -> tuple[list[str], list]:
    """docs/RESULTS.md's section (benchmarks/make_results.py)."""
    lines = ["`widedp convert table` on `widedp synth logs` output (day-partitioned Parquet, list-valued history "
             "of ≤ 20 ids, string user ids, a timestamp split on the last day), one fresh process per size; "
             "peak RSS is the converting process's own.", "",
             "| users | days | files | rows | seconds | rows/s | input MB/s | input | output | peak RSS |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        lines.append(f"| {r['users']:,} | {r['days']} | {r['files']} | {r['rows']:,} | {r['seconds']:.1f} | "
                     f"{r['rows_per_s']:,.0f} | {r['input_mb_per_s']:.1f} | {fmt_bytes(r['input_bytes'])} | "
                     f"{fmt_bytes(r['output_bytes'])} | {fmt_bytes(r['peak_rss_bytes'])} |")
    return lines, []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smallest size only")
    parser.add_argument("--out", help="results file (default benchmarks/results/convert_throughput.json)")
    args = parser.parse_args(argv)
    started = time.time()
    machine = announce_machine()
    rows = []
    for users, days in SIZES["quick" if args.quick else "full"]:
        logs, truth = _logs(users, days)
        work = Path(tempfile.mkdtemp(prefix="convert-bench-"))
        try:
            result = run_worker(__file__, {"logs": str(logs), "out": str(work / "data"),
                                           "test_after": truth["evaluation_day"]["date"]})
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if "error" in result:
            print(f"users={users}: {result['error']}", file=sys.stderr)
            return 1
        total = result["train_rows"] + result["test_rows"]
        rows.append({"users": users, "days": days, "files": result["files"], "rows": total,
                     "train_rows": result["train_rows"], "test_rows": result["test_rows"],
                     "input_bytes": result["input_bytes"], "output_bytes": result["output_bytes"],
                     "seconds": result["seconds"], "rows_per_s": total / result["seconds"],
                     "input_mb_per_s": result["input_bytes"] / 1e6 / result["seconds"],
                     "peak_rss_bytes": result["ru_maxrss_bytes"], "peak_tree_rss_bytes": result["peak_tree_rss_bytes"]})
    print(format_table(["users", "days", "files", "rows", "s", "rows/s", "input MB/s", "input", "output", "peak RSS"],
                       [[r["users"], r["days"], r["files"], r["rows"], round(r["seconds"], 1), round(r["rows_per_s"]),
                         round(r["input_mb_per_s"], 1), fmt_bytes(r["input_bytes"]), fmt_bytes(r["output_bytes"]),
                         fmt_bytes(r["peak_rss_bytes"])] for r in rows]))
    write_results("convert_throughput", {"rows": rows}, quick=args.quick, machine=machine, out=args.out,
                  started=started)
    return 0


if __name__ == "__main__":
    if not worker_entry(_convert):
        raise SystemExit(main())
