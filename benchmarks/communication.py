"""Bytes to and from the shards per step, per mode and per shard call.

Same model and data as table_scaling.py (configs/ctr.toml, 26 tables summing to p rows,
fixed batch and k) at one table size (default p = 10^7; --quick 10^5). Counts are the
payload arrays the shard group ships (trainer/engine/shard_group.py counts them the same way for
in-process and Ray shards), attributed to each shard method, averaged over the timed steps.

Write-back = the call that releases the update to the shards: `apply_rows` (sparse: the k
selected rows; nonprivate: the touched rows) or `apply_dense_noise_update` (dpsgd). widedp's
dpsgd does not ship noise: it ships the touched rows' clipped sums plus a seed and each shard
draws the (partition-independent) noise for all of its rows itself — O(p) work per step on
the shards instead of O(p) bytes. A DP-SGD whose noise is added where the gradient is
aggregated (a parameter server, or Opacus on one machine writing into the table) moves the
whole noisy table gradient, p·D·4 bytes per step: that is the "dense write-back" of the goal
ratio dense / sparse write-back (goal >= 10^4 at 10^7 rows), reported next to the measured
widedp dpsgd bytes.

    python benchmarks/communication.py [--quick] [--rows 10000000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (announce_machine, ctr_dataset, fmt_bytes, format_table, run_worker, time_engine, timing_overrides, worker_entry, write_results)

MODES = ("sparse", "dpsgd", "nonprivate")
WRITE_BACK = ("apply_rows", "apply_dense_noise_update")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10^5 rows, 2 steps")
    parser.add_argument("--config", default="configs/ctr.toml")
    parser.add_argument("--rows", type=int, default=None, help="total rows of the 26 tables (default 10^7, quick 10^5)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--k", type=int, default=1000)
    parser.add_argument("--examples", type=int, default=20000)
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adagrad", "adam"))
    parser.add_argument("--backend", default=None, choices=("ray", "local"))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    started = time.time()
    rows = args.rows or (10**5 if args.quick else 10**7)
    steps = args.steps or (2 if args.quick else 4)
    machine = announce_machine()
    from widedp.trainer.config import load_config

    base = load_config(args.config, args.set)
    batch = args.batch or base.train.batch_size
    dim = base.model.embedding_dim
    data = ctr_dataset(rows, args.examples)
    print(f"model: {args.config}, p = {rows:,} rows in 26 tables, dim {dim}, expected batch {batch}, k = {args.k}\n")
    results = []
    for mode in [m for m in args.modes.split(",") if m]:
        extra = [f"data.path={data}", "data.synth=", f"train.batch_size={batch}", f"privacy.k={min(args.k, rows)}",
                 f"train.optimizer={args.optimizer}", *args.set]
        spec = {"config": args.config, "overrides": timing_overrides(mode, "em", args.backend, extra),
                "steps": steps, "warmup": 1, "max_seconds": 60}
        r = run_worker(__file__, spec, timeout=3600)
        r["mode"] = mode
        results.append(r)
        if "error" in r:
            print(f"{mode}: FAILED: {r['error']}")

    ok = [r for r in results if "error" not in r]
    table = []
    for r in ok:
        for method, b in r["bytes_per_step"].items():
            table.append([r["mode"], method, fmt_bytes(b["to"]), fmt_bytes(b["from"]), b["calls"]])
        table.append([r["mode"], "TOTAL", fmt_bytes(r["bytes_to_shards_per_step"]),
                      fmt_bytes(r["bytes_from_shards_per_step"]), None])
    print(format_table(["mode", "shard call", "to shards/step", "from shards/step", "calls/step"], table))
    summary = summarize(ok, rows, dim)
    print("\nratios (measured in this run):")
    for line in summary["lines"]:
        print("  " + line)
    payload = {"config": args.config, "rows": rows, "dim": dim, "batch": batch, "k": args.k,
               "optimizer": args.optimizer, "examples": args.examples, "results": results, "summary": summary}
    write_results("communication", payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


def write_back_bytes(r: dict) -> float:
    return sum(b["to"] for m, b in r["bytes_per_step"].items() if m in WRITE_BACK)


def summarize(results, rows: int, dim: int) -> dict:
    by = {r["mode"]: r for r in results}
    out = {"write_back_bytes": {m: write_back_bytes(r) for m, r in by.items()},
           "dense_write_back_bytes": rows * dim * 4, "lines": []}
    lines = out["lines"]
    for m, b in out["write_back_bytes"].items():
        lines.append(f"{m} write-back: {fmt_bytes(b)}/step ({by[m]['rows_selected_mean']:.0f} rows"
                     f"{' noised on the shards from a seed' if m == 'dpsgd' else ''})")
    lines.append(f"dense write-back (noisy gradient of all p = {rows:,} rows x dim {dim} x 4 B): "
                 f"{fmt_bytes(out['dense_write_back_bytes'])}/step")
    if "sparse" in by:
        sparse_wb = out["write_back_bytes"]["sparse"]
        ratio = out["dense_write_back_bytes"] / sparse_wb if sparse_wb else None
        k = by["sparse"]["rows_selected_mean"]
        per_row = sparse_wb / k if k else None
        out.update(dense_over_sparse_write_back=ratio, sparse_bytes_per_row=per_row,
                   goal=1e4, met=bool(ratio and ratio >= 1e4))
        if ratio:
            lines.append(f"dense / sparse write-back = {ratio:,.0f}x (goal >= 10^4: {'met' if ratio >= 1e4 else 'missed'}; "
                         f"= p·D·4 / (k·{per_row:.0f} B per selected row: D·4 B of values + 16 B of int64 table and row ids)")
        if "dpsgd" in by and out["write_back_bytes"]["dpsgd"]:
            lines.append(f"widedp dpsgd write-back / sparse write-back = "
                         f"{out['write_back_bytes']['dpsgd'] / sparse_wb:.1f}x (dpsgd ships touched rows + seed)")
        tot = {m: by[m]["bytes_to_shards_per_step"] + by[m]["bytes_from_shards_per_step"] for m in by}
        out["total_bytes_per_step"] = tot
    return out


if __name__ == "__main__":
    worker_entry(time_engine)
    main()
