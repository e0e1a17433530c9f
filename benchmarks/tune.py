"""Hyperparameter sweep: train every point of a grid of config overrides, print a table.

How the configs' learning rates and clip norms were chosen (their comments cite the results).
Each point is one `trainer.run.train.train` run on in-process shards, 1 torch thread per run, `--jobs`
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

`--seeds 100,101,102` trains every point once per `train.seed` (the public initialization; the
noise is fresh secret randomness in every run anyway) and chooses on the *median* validation
metric over them: where two settings differ by less than one run's spread (0.002–0.004 AUC on
ctr at ε = 1), a single run picks by the noise draw.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
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
    from widedp.trainer.run.train import train

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


def _parse_seeds(parser, text):
    if text is None:
        return None
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"--seeds {text!r}: expected comma-separated integers >= 0")
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds {text!r}: expected distinct integers >= 0")
    return seeds


def median_over_seeds(runs: list) -> list:
    """One record per grid point from its runs (one per seed, the last override `train.seed=S`):
    every metric the median over the seeds that finished, with their `min`/`max` beside it
    (`{split}_range`); a point where any seed failed carries that seed's error instead, so a
    failure is never hidden by a median of the rest."""
    by_point: dict = {}
    for r in runs:
        by_point.setdefault(tuple(r["overrides"][:-1]), []).append(r)
    out = []
    for overrides, rs in by_point.items():
        record = {"overrides": list(overrides), "seeds": [int(r["overrides"][-1].split("=")[1]) for r in rs],
                  "run_dirs": [r["run_dir"] for r in rs]}
        failed = [r for r in rs if "error" in r]
        if failed:
            out.append({**record, "error": f"{failed[0]['overrides'][-1]}: {failed[0]['error']}"})
            continue
        for split in ("validation_metrics", "test_metrics"):
            names = [k for k in (rs[0].get(split) or {}) if all(k in (r.get(split) or {}) for r in rs)]
            if names:
                record[split] = {k: statistics.median(r[split][k] for r in rs) for k in names}
                record[split.replace("metrics", "range")] = {k: [min(r[split][k] for r in rs), max(r[split][k] for r in rs)]
                                                              for k in names}
        for k in ("mode", "selection", "epsilon", "noise_multiplier", "bayes_auc", "steps"):
            record[k] = rs[0].get(k)
        for k in ("rows_selected_mean", "wall_s"):
            values = [r[k] for r in rs if r.get(k) is not None]
            record[k] = statistics.median(values) if values else None
        record["stopped_by_budget"] = any(r.get("stopped_by_budget") for r in rs)
        out.append(record)
    return out


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
    parser.add_argument("--seeds", default=None, metavar="S1,S2,...",
                        help="train every point once per train.seed and choose on the median (default: one run)")
    args = parser.parse_args(argv)
    if not 0 <= args.validation_fraction < 1:
        parser.error(f"--validation-fraction must be in [0, 1), got {args.validation_fraction}")
    seeds = _parse_seeds(parser, args.seeds)
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
    if seeds is None:
        jobs = [(args.config, [*fixed, *p], str(root / f"p{i:03d}")) for i, p in enumerate(points)]
    else:
        jobs = [(args.config, [*fixed, *p, f"train.seed={seed}"], str(root / f"p{i:03d}_seed{seed}"))
                for i, p in enumerate(points) for seed in seeds]
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
    if seeds is not None:
        records_by_run = records
        records = median_over_seeds(records_by_run)
    ok = [r for r in records if metric in (r.get(key) or {})]
    ok.sort(key=lambda r: r[key][metric], reverse=(better == "max"))
    print()
    if seeds is not None:
        print(f"medians over train.seed {seeds}")
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
    if seeds is not None:
        payload.update(seeds=seeds, runs=records_by_run)
    write_results(f"tuning/{args.name}", payload, quick=False, machine=machine, out=args.out, started=started)
    return payload


if __name__ == "__main__":
    main()
