"""Hyperparameter sweep: train every point of a grid of config overrides, print a table.

How the configs' learning rates and clip norms were chosen (their comments cite the results).
Each point is one `trainer.train.train` run on in-process shards, 1 torch thread per run, `--jobs`
runs at a time (each in its own process). The runs are kept under
runs/bench/tune/NAME/ and reused when their config is unchanged. Results go to
benchmarks/results/tuning/NAME.json, which `make results` lists in docs/RESULTS.md.

    python benchmarks/tune.py --config configs/ctr.toml --name ctr_dpsgd --set train.mode=dpsgd \\
        --grid train.lr=3,10 --grid train.dense_lr=0.2,1 --grid privacy.clip_norm=1,3 [--jobs 2]

A grid axis is `section.key=v1,v2,...`; points are the cartesian product.

Tuning protocol (issue 10): every point trains with `data.validation_fraction`
(`--validation-fraction`, default 0.1) of the training split held out, never trained on; the
best point is the one with the best *validation* metric, and the table shows its test metric
beside it (reported, not used to choose). The privacy-utility grid then trains the chosen
settings on the whole training split over fresh seeds. Tuning is not charged to ε — as in the
DP literature (and Opacus's examples) the hyperparameter search is outside the guarantee:
a user who needs it covered must tune on public data or charge the search themselves.
`--validation-fraction 0` falls back to choosing on the test split (optimistic; labelled).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, announce_machine, format_table, one_torch_thread, set_aside_stale_run, write_results  # noqa: E402

PRIMARY = {"dlrm": ("auc", "max"), "cbow": ("loss", "min")}


def _run_point(job: tuple) -> dict:
    config, overrides, run_dir = job
    one_torch_thread()
    sys.path.insert(0, str(REPO))
    from widedp.trainer.config import load_config
    from widedp.trainer.train import train

    cfg = load_config(config, [*overrides, "cluster.backend=local"])
    cfg.validate()
    run_dir = Path(run_dir)
    saved = run_dir / "config.json"
    t0 = time.perf_counter()
    record = {"overrides": overrides,
              "run_dir": str(run_dir.relative_to(REPO) if run_dir.is_relative_to(REPO) else run_dir)}
    if saved.exists() and (run_dir / "summary.json").exists() and \
            json.loads(saved.read_text()) == json.loads(json.dumps(cfg.to_dict())):
        summary = json.loads((run_dir / "summary.json").read_text())
        record["reused"] = True
    else:
        set_aside_stale_run(run_dir)
        try:
            summary = train(cfg, run_dir, progress=False)
        except Exception as exc:  # one failed point must not lose the sweep
            return {**record, "error": f"{type(exc).__name__}: {exc}"[:300]}
    record["wall_s"] = time.perf_counter() - t0
    for key in ("mode", "selection", "epsilon", "test_metrics", "validation_metrics", "noise_multiplier", "rows_selected_mean",
                "rows_touched_mean", "bayes_auc", "steps", "stopped_by_budget"):
        record[key] = summary.get(key)
    return record


def _four(x) -> str:
    return "–" if x is None else f"{x:.4f}"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--name", required=True, help="results name (benchmarks/results/tuning/NAME.json)")
    parser.add_argument("--grid", action="append", default=[], metavar="SECTION.KEY=V1,V2,...")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="for every point")
    parser.add_argument("--validation-fraction", type=float, default=0.1,
                        help="training data held out to choose on (0: choose on the test split, optimistic)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--runs-dir", default=None, help="default runs/bench/tune/NAME")
    parser.add_argument("--out", help="results file (default benchmarks/results/tuning/NAME.json)")
    args = parser.parse_args(argv)
    if not 0 <= args.validation_fraction < 1:
        parser.error(f"--validation-fraction must be in [0, 1), got {args.validation_fraction}")
    started = time.time()
    axes = []
    for item in args.grid:
        key, sep, values = item.partition("=")
        if not sep or not values:
            parser.error(f"--grid {item!r}: expected section.key=v1,v2,...")
        axes.append([f"{key}={v}" for v in values.split(",")])
    points = [list(p) for p in itertools.product(*axes)] if axes else [[]]
    machine = announce_machine()
    root = Path(args.runs_dir) if args.runs_dir else REPO / "runs" / "bench" / "tune" / args.name
    fixed = [*args.set, f"data.validation_fraction={args.validation_fraction}"]
    chosen_on = "validation" if args.validation_fraction > 0 else "test"
    jobs = [(args.config, [*fixed, *p], str(root / f"p{i:03d}")) for i, p in enumerate(points)]
    with get_context("spawn").Pool(max(1, args.jobs)) as pool:
        records = []
        for r in pool.imap(_run_point, jobs):
            records.append(r)
            metrics = r.get(f"{chosen_on}_metrics") or {}
            print(" ".join(r["overrides"][len(fixed):]) + ": "
                  + (r["error"] if "error" in r else f"{chosen_on} " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())),
                  flush=True)
    from widedp.trainer.config import load_config

    model = load_config(args.config, args.set).model.name
    metric, better = PRIMARY.get(model, ("loss", "min"))
    key = f"{chosen_on}_metrics"
    ok = [r for r in records if metric in (r.get(key) or {})]
    ok.sort(key=lambda r: r[key][metric], reverse=(better == "max"))
    print()
    print(format_table(["point", f"{chosen_on} {metric} (chosen on)", f"test {metric}", "ε", "σ", "rows selected"],
                       [[" ".join(r["overrides"][len(fixed):])
                         + (f" [stopped by the budget after {r.get('steps')} steps]" if r.get("stopped_by_budget") else ""),
                         f"{r[key][metric]:.4f}",
                         _four((r.get("test_metrics") or {}).get(metric)), r.get("epsilon"), r.get("noise_multiplier"),
                         r.get("rows_selected_mean")] for r in ok]))
    best = ok[0] if ok else None
    if best:
        print(f"\nbest ({'highest' if better == 'max' else 'lowest'} {chosen_on} {metric}): {' '.join(best['overrides'])}")
    payload = {"config": args.config, "name": args.name, "set": fixed, "grid": args.grid, "metric": metric,
               "better": better, "chosen_on": chosen_on, "validation_fraction": args.validation_fraction,
               "records": records, "best": best}
    write_results(f"tuning/{args.name}", payload, quick=False, machine=machine, out=args.out, started=started)
    return payload


if __name__ == "__main__":
    main()
