"""Where the time of a sparse step goes: per-phase medians, in-process shards versus Ray actors.

The engine times each phase of a step (trainer/engine/engine.py `StepStats.phases`): sample + batch
read, lookup (route ids, shards' partial pooled embeddings), dense forward/backward with
per-example gradients (torch.func), per-example norms (embedding norms from the ids on the
trainer, or the shards' with cluster.norms_on_trainer = false, + dense norms, clip factors),
clipped row sums (shards; the pooled-output gradients travel with the factors) and dense sums, selection (over the whole
vocabulary), S2 clip + Gaussian noise, ledger record, write-back (selected rows to the
shards, optimizer there), dense optimizer update. Time outside every phase is the budget
check before the step and the ε report after it.

Ray overhead: the same config and data run once with in-process shards and once with Ray
actors (each in a fresh process); the per-phase difference of the medians is what Ray's
task submission, serialization and scheduling cost in that phase. The Ray run also records,
per round of calls to the shards, when it was sent, when each shard began and ended its part
(and its CPU time) and when the answers were in hand (`RayShardGroup.record_call_timings`; one
machine's clock): where a round's time goes between transport, shards waiting for a core, and
the shards' own work.

    python benchmarks/phase_breakdown.py [--quick] [--config configs/ctr.toml]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (announce_machine, ensure_config_dataset, format_table, quick_data_overrides, run_worker, time_engine, timing_overrides, worker_entry, write_results)

PHASE_LABELS = {
    "sample": "sample + read batch",
    "lookup": "lookup (shards)",
    "dense_forward_backward": "dense fwd/bwd + dense norms (pass 1)",
    "norms": "per-example norms (on the trainer; cluster.norms_on_trainer = false: the shards) + clip factors",
    "row_sums": "clipped row sums",
    "dense_clipped_sum": "dense clipped sum (pass 2)",
    "selection": "selection",
    "clip_and_noise": "S2 clip + noise",
    "ledger": "ledger record",
    "write_back": "write-back + row update",
    "dense_update": "dense update",
    "unphased": "outside phases (budget check, ε report, freeing the step's tensors)",
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small data, few steps")
    parser.add_argument("--config", default="configs/ctr.toml")
    parser.add_argument("--selection", default=None, help="default: the config's train.selection")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 30, quick 6)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    started = time.time()
    steps = args.steps or (6 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    machine = announce_machine()
    from widedp.trainer.config import load_config

    data_over = quick_data_overrides(args.config) if args.quick else []
    overrides = [*data_over, *args.set]
    ensure_config_dataset(args.config, overrides)
    cfg = load_config(args.config, overrides)
    selection = args.selection or cfg.train.selection
    print(f"config {args.config}: sparse/{selection}, expected batch {cfg.train.batch_size}, k {cfg.privacy.k}, "
          f"{cfg.cluster.num_shards} shards; median of {steps} steps after {warmup} warm-up\n")
    runs = {}
    for backend in ("local", "ray"):
        spec = {"config": args.config, "overrides": timing_overrides("sparse", selection, backend, overrides),
                "steps": steps, "warmup": warmup, "max_seconds": 600, "call_timings": backend == "ray"}
        r = run_worker(__file__, spec, timeout=3600)
        runs[backend] = r
        if "error" in r:
            print(f"{backend}: FAILED: {r['error']}")
    summary = summarize(runs)
    if summary:
        print(format_table(["phase", "in-process ms", "Ray ms", "Ray overhead ms", "share of Ray step"],
                           [[PHASE_LABELS.get(p, p), v["local"], v["ray"], v["ray_overhead"], f"{100 * v['share']:.0f}%"]
                            for p, v in summary["phases"].items()]))
        rounds = runs["ray"].get("call_timings") or {}
        if rounds:
            print(f"\nRay rounds (medians; ms after the round was sent, on this machine's clock; {len(rounds)} methods):")
            print(format_table(["method", "plane", "rounds", "first shard starts", "median shard", "last shard",
                                "a shard's part (wall / CPU)", "shards' CPU summed", "last end → answers", "round"],
                               [[m, r["plane"], r["rounds"], r["start_first_ms"], r["start_median_ms"], r["start_last_ms"],
                                 f"{r['shard_wall_ms']:.2f} / {r['shard_cpu_ms']:.2f}", r["shards_cpu_sum_ms"],
                                 r["return_ms"], r["round_ms"]] for m, r in rounds.items()]))
        print(f"\nstep (median): in-process {summary['step_ms']['local']:.1f} ms, Ray {summary['step_ms']['ray']:.1f} ms; "
              f"Ray overhead {summary['ray_overhead_ms']:.1f} ms/step ({100 * summary['ray_overhead_share']:.0f}% of the Ray step)")
    payload = {"config": args.config, "overrides": list(args.set), "batch": cfg.train.batch_size,
               "selection": selection, "steps": steps, "warmup": warmup, "runs": runs,
               "summary": summary, "phase_labels": PHASE_LABELS,
               # on Ray the write-back then travels with the next step's lookup: its time is in "lookup"
               "fold_write_back": cfg.cluster.fold_write_back}
    write_results("phase_breakdown", payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


def summarize(runs: dict) -> dict:
    if any("error" in r for r in runs.values()) or len(runs) < 2:
        return {}
    phases = {}
    for p in list(PHASE_LABELS):
        get = (lambda r: r["unphased_ms_median"]) if p == "unphased" else (lambda r, p=p: r["phase_ms_median"].get(p))
        loc, ray = get(runs["local"]), get(runs["ray"])
        if loc is None or ray is None:
            continue
        phases[p] = {"local": loc, "ray": ray, "ray_overhead": ray - loc,
                     "share": ray / runs["ray"]["step_ms_median"] if runs["ray"]["step_ms_median"] else 0.0}
    step = {b: runs[b]["step_ms_median"] for b in runs}
    return {"phases": phases, "step_ms": step, "ray_overhead_ms": step["ray"] - step["local"],
            "ray_overhead_share": (step["ray"] - step["local"]) / step["ray"] if step["ray"] else 0.0}


if __name__ == "__main__":
    worker_entry(time_engine)
    main()
