"""Privacy overhead: widedp sparse throughput over widedp nonprivate throughput (goal >= 0.5).

The product configs as they are (configs/ctr.toml and configs/cbow.toml: their data, batch,
k, optimizer, shards and backend), timed in `sparse` (the config's selection), `nonprivate`
and — for context — `dpsgd` mode, each in a fresh process: warm-up, then the median step.
Throughput = mean realized batch / median step time. Privacy parameters are explicit
(σ = 1, fixed selection budget): step cost does not depend on their values.

    python benchmarks/privacy_overhead.py [--quick] [--configs configs/ctr.toml,configs/cbow.toml]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (announce_machine, ensure_config_dataset, format_table, quick_data_overrides, run_worker, time_engine, timing_overrides, worker_entry, write_results)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small data, few steps, no dpsgd")
    parser.add_argument("--configs", default="configs/ctr.toml,configs/cbow.toml")
    parser.add_argument("--modes", default=None, help="default sparse,nonprivate,dpsgd (quick: sparse,nonprivate)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20, quick 5)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--backend", default=None, choices=("ray", "local"))
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    started = time.time()
    steps = args.steps or (5 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    modes = (args.modes or ("sparse,nonprivate" if args.quick else "sparse,nonprivate,dpsgd")).split(",")
    machine = announce_machine()
    from widedp.trainer.config import load_config

    results, ratios = [], {}
    for config in [c for c in args.configs.split(",") if c]:
        overrides = [*(quick_data_overrides(config) if args.quick else []), *args.set]
        ensure_config_dataset(config, overrides)
        cfg = load_config(config, overrides)
        for mode in modes:
            spec = {"config": config, "overrides": timing_overrides(mode, cfg.train.selection, args.backend, overrides),
                    "steps": steps, "warmup": warmup, "max_seconds": 300}
            r = run_worker(__file__, spec, timeout=3600)
            r.update(config=config, mode=mode)
            results.append(r)
            if "error" in r:
                print(f"{config} {mode}: FAILED: {r['error']}")
            else:
                print(f"{config} {mode:>10}: {r['step_ms_median']:8.1f} ms/step, {r['examples_per_sec']:8.0f} examples/s")
        by = {r["mode"]: r for r in results if r["config"] == config and "error" not in r}
        if "sparse" in by and "nonprivate" in by:
            ratio = by["sparse"]["examples_per_sec"] / by["nonprivate"]["examples_per_sec"]
            ratios[config] = {"sparse_over_nonprivate": ratio, "goal": 0.5, "met": ratio >= 0.5}
            if "dpsgd" in by:
                ratios[config]["dpsgd_over_nonprivate"] = by["dpsgd"]["examples_per_sec"] / by["nonprivate"]["examples_per_sec"]
    ok = [r for r in results if "error" not in r]
    print("\n" + format_table(["config", "mode", "backend", "rows", "batch", "step ms", "examples/s"],
                              [[r["config"], r["mode"] + (f"/{r['selection']}" if r["selection"] else ""), r["backend"],
                                r["vocabulary_size"], r["batch_mean"], r["step_ms_median"], r["examples_per_sec"]]
                               for r in ok]))
    print("\nratios (measured in this run):")
    for config, r in ratios.items():
        extra = f", dpsgd / nonprivate = {r['dpsgd_over_nonprivate']:.2f}" if "dpsgd_over_nonprivate" in r else ""
        print(f"  {config}: sparse / nonprivate throughput = {r['sparse_over_nonprivate']:.2f} "
              f"(goal >= 0.5: {'met' if r['met'] else 'missed'}){extra}")
    payload = {"configs": args.configs.split(","), "steps": steps, "warmup": warmup, "results": results, "ratios": ratios}
    write_results("privacy_overhead", payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


if __name__ == "__main__":
    worker_entry(time_engine)
    main()
