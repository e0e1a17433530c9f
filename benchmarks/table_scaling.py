"""Step time versus table size: is the sparse step flat in the number of rows?

The same DLRM-style CTR model (configs/ctr.toml: 26 tables, its dim and MLPs) with the
tables' total row count p = 10^4 ... 10^7 (10^8 with --max-exp 8 when it fits in memory),
fixed expected batch and fixed k, in `sparse` (EM selection), `dpsgd` and `nonprivate` modes.
Each (p, mode) runs in a fresh process on the config's backend (embedded Ray by default):
warm-up steps, then the median of the timed steps. Data: planted-truth synthetic CTR with
`--examples` examples (Zipf ids spread over each table), cached under runs/bench_data/.

Goals: sparse step time at 10^7 rows <= 1.3x its time at 10^4; the same for dpsgd with lazy noise
(the default for SGD: a step draws the pending noise of the rows it reads, not of every row).
The embedding optimizer defaults to SGD (FBGEMM fused, no optimizer state) so 10^8 rows fit;
`--optimizer adam` uses the config's lazy Adam instead.

    python benchmarks/table_scaling.py [--quick] [--max-exp 8] [--modes sparse,dpsgd,nonprivate]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (announce_machine, ctr_dataset, exps, fmt_bytes, format_table, mem_info, run_worker, time_engine, timing_overrides, worker_entry, write_results)

MODES = ("sparse", "dpsgd", "nonprivate")


def memory_estimate(rows: int, dim: int, optimizer: str) -> float:
    """Bytes the tables need (weights + optimizer state), plus ~2 GB for everything else."""
    state = {"sgd": 0, "adagrad": 0.1, "adam": 2.0}[optimizer]
    return rows * dim * 4 * (1 + state) * 1.3 + 2e9


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10^4..10^6 rows, few steps (a few minutes)")
    parser.add_argument("--config", default="configs/ctr.toml")
    parser.add_argument("--min-exp", type=int, default=4)
    parser.add_argument("--max-exp", type=int, default=None, help="largest 10^e rows (default 8, quick 6)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batch", type=int, default=None, help="expected batch (default: the config's)")
    parser.add_argument("--k", type=int, default=1000, help="rows selected per sparse step (fixed)")
    parser.add_argument("--examples", type=int, default=20000)
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adagrad", "adam"))
    parser.add_argument("--backend", default=None, choices=("ray", "local"), help="default: the config's")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 10, quick 4)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3, quick 2)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="time budget per configuration after warm-up (at least 2 timed steps)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out", help="results file (default benchmarks/results[/quick]/table_scaling.json)")
    args = parser.parse_args(argv)
    started = time.time()
    quick = args.quick
    max_exp = args.max_exp if args.max_exp is not None else (6 if quick else 8)
    steps = args.steps or (4 if quick else 10)
    warmup = args.warmup if args.warmup is not None else (2 if quick else 3)
    max_seconds = args.max_seconds or (30.0 if quick else 120.0)
    modes = [m for m in args.modes.split(",") if m]
    machine = announce_machine()

    from widedp.trainer.config import load_config

    base = load_config(args.config, args.set)
    batch = args.batch or base.train.batch_size
    dim = base.model.embedding_dim
    print(f"model: {args.config} (26 tables, dim {dim}), expected batch {batch}, k = {args.k}, "
          f"embedding optimizer {args.optimizer}, backend {args.backend or base.cluster.backend}, "
          f"{base.cluster.num_shards} shards; median of up to {steps} steps after {warmup} warm-up\n")

    results, skipped = [], []
    for rows in exps(args.min_exp, max_exp):
        need = memory_estimate(rows, dim, args.optimizer)
        avail = mem_info().get("MemAvailable")
        if avail and need > 0.85 * avail:
            skipped.append({"rows": rows, "reason": f"needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"})
            print(f"rows {rows:.0e}: skipped ({skipped[-1]['reason']})")
            continue
        data = ctr_dataset(rows, args.examples)
        for mode in modes:
            extra = [f"data.path={data}", "data.synth=", f"train.batch_size={batch}", f"privacy.k={min(args.k, rows)}",
                     f"train.optimizer={args.optimizer}", *args.set]
            spec = {"config": args.config, "overrides": timing_overrides(mode, "em", args.backend, extra),
                    "steps": steps, "warmup": 1 if (mode == "dpsgd" and rows >= 10**7) else warmup,
                    "max_seconds": max_seconds}
            r = run_worker(__file__, spec, timeout=3600)
            r.update(rows=rows, mode=mode)
            results.append(r)
            if "error" in r:
                print(f"rows {rows:.0e} {mode}: FAILED: {r['error']}")
            else:
                print(f"rows {rows:.0e} {mode:>10}: {r['step_ms_median']:9.1f} ms/step  "
                      f"({r['steps_timed']} steps, touched {r['rows_touched_mean']:.0f}, "
                      f"selected {r['rows_selected_mean']:.0f})")

    ok = [r for r in results if "error" not in r]
    print("\n" + format_table(
        ["rows", "mode", "step ms", "min ms", "examples/s", "touched", "selected", "to shards", "from shards", "peak mem"],
        [[f"{r['rows']:.0e}", r["mode"], r["step_ms_median"], r["step_ms_min"], r["examples_per_sec"],
          r["rows_touched_mean"], r["rows_selected_mean"], fmt_bytes(r["bytes_to_shards_per_step"]),
          fmt_bytes(r["bytes_from_shards_per_step"]), fmt_bytes(r.get("peak_tree_rss_bytes"))] for r in ok]))

    ratios = scaling_ratios(ok)
    print("\nratios (measured in this run):")
    for line in ratio_lines(ratios):
        print("  " + line)
    payload = {"config": args.config, "batch": batch, "k": args.k, "dim": dim, "optimizer": args.optimizer,
               "examples": args.examples, "steps": steps, "warmup": warmup, "results": results,
               "skipped": skipped, "ratios": ratios}
    write_results("table_scaling", payload, quick=quick, machine=machine, out=args.out, started=started)
    return payload


def _by(results, mode):
    return {r["rows"]: r for r in results if r["mode"] == mode}


def scaling_ratios(results) -> dict:
    out = {}
    for mode in MODES:
        by = _by(results, mode)
        if len(by) >= 2:
            lo, hi = min(by), max(by)
            out[f"{mode}_largest_over_smallest"] = {"rows": [lo, hi],
                                                     "ratio": by[hi]["step_ms_median"] / by[lo]["step_ms_median"],
                                                     # fastest step: less sensitive to a busy machine
                                                     "ratio_min": by[hi]["step_ms_min"] / by[lo]["step_ms_min"]}
    sp = _by(results, "sparse")
    if 10**4 in sp and 10**7 in sp:
        r = sp[10**7]["step_ms_median"] / sp[10**4]["step_ms_median"]
        out["sparse_1e7_over_1e4"] = {"ratio": r, "goal": 1.3, "met": r <= 1.3,
                                      "ratio_min": sp[10**7]["step_ms_min"] / sp[10**4]["step_ms_min"]}
    dp = _by(results, "dpsgd")
    if 10**4 in dp and 10**7 in dp:
        r = dp[10**7]["step_ms_median"] / dp[10**4]["step_ms_median"]
        out["dpsgd_1e7_over_1e4"] = {"ratio": r, "goal": 1.3, "met": r <= 1.3,
                                     "ratio_min": dp[10**7]["step_ms_min"] / dp[10**4]["step_ms_min"]}
    np_ = _by(results, "nonprivate")
    out["sparse_over_nonprivate_throughput"] = {
        str(rows): sp[rows]["examples_per_sec"] / np_[rows]["examples_per_sec"] for rows in sp if rows in np_}
    return out


def ratio_lines(ratios: dict) -> list[str]:
    lines = []
    for mode in MODES:
        r = ratios.get(f"{mode}_largest_over_smallest")
        if r:
            lines.append(f"{mode}: step time at {r['rows'][1]:.0e} rows / at {r['rows'][0]:.0e} rows = {r['ratio']:.2f}x "
                         f"(fastest steps: {r['ratio_min']:.2f}x)")
    g = ratios.get("sparse_1e7_over_1e4")
    if g:
        lines.append(f"sparse 10^7 / 10^4 = {g['ratio']:.2f}x (goal <= 1.3: {'met' if g['met'] else 'missed'})")
    g = ratios.get("dpsgd_1e7_over_1e4")
    if g:
        lines.append(f"dpsgd (lazy noise) 10^7 / 10^4 = {g['ratio']:.2f}x (goal <= 1.3: {'met' if g['met'] else 'missed'})")
    for rows, v in ratios.get("sparse_over_nonprivate_throughput", {}).items():
        lines.append(f"sparse / nonprivate throughput at {int(rows):.0e} rows = {v:.2f}")
    return lines


if __name__ == "__main__":
    worker_entry(time_engine)
    main()
