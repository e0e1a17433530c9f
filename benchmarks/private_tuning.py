"""`widedp tune` against the shipped defaults and the non-private model tuned on validation.

Data: click logs with users (`widedp synth logs`, --users users over --days days, the last day
as the test split, converted by its own schema); made once under the work directory. Config:
configs/logs.toml (user level, sparse fest-threshold) or --config, `cluster.backend = local`.

Per target ε (--eps): "default" trains the config as shipped (--repeats runs, fresh secret
noise each); "tuned" runs `widedp tune` --repeats times over the grid (--grid, default
train.lr × train.dense_lr) with E[K] = --expected-trials, each a whole tuning at that ε (its
ε covers the search); "nonprivate (validation)" trains every grid point non-privately with
data.validation_fraction = 0.2 held out and keeps the point with the lowest validation log
loss — the reference a private tuning is measured against (tuned on validation, not on the
test split). Reported per row: the test split's AUC, log loss, ECE (median and min–max over
the repeats) beside its base-rate log loss, and for "tuned" the chosen candidates, the
tuning's ε and the per-trial ε. Nothing asserts on the numbers; they go to
benchmarks/results/private_tuning.json.

    python benchmarks/private_tuning.py [--users 2000] [--days 4] [--eps 1,8] [--repeats 3]
        [--expected-trials 10] [--grid train.lr=0.5,1.75,5 --grid train.dense_lr=0.05,0.175,0.5]
        [--config configs/logs.toml] [--work-dir DIR] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, announce_machine, format_table, one_torch_thread, write_results  # noqa: E402

DEFAULT_GRID = ["train.lr=0.5,1.75,5", "train.dense_lr=0.05,0.175,0.5"]


def _dataset(work: Path, users: int, days: int, seed: int) -> Path:
    from widedp.trainer.data.convert.table import convert_table
    from widedp.trainer.data.synthetic.synth_logs import synth_logs

    root = work / f"logs_u{users}_d{days}_s{seed}"
    if not (root / "data" / "dataset.json").exists():
        truth = synth_logs(root / "logs", users=users, days=days, seed=seed)
        with contextlib.redirect_stdout(io.StringIO()):
            convert_table([str(root / "logs" / "day=*" / "*.parquet")], root / "data", schema=root / "logs" / "schema.toml",
                          test_after=truth["evaluation_day"]["date"])
    return root / "data"


def _metrics(summary: dict) -> dict:
    m = summary["test_metrics"]
    return {k: m.get(k) for k in ("auc", "logloss", "ece", "base_rate_logloss")}


def _f(x) -> str:
    return "-" if x is None else f"{x:.4f}" if isinstance(x, float) else str(x)


def _spread(records: list[dict], key: str) -> tuple:
    values = [r[key] for r in records if r.get(key) is not None]
    return (statistics.median(values), min(values), max(values)) if values else (None, None, None)


def results_section(doc: dict) -> tuple[list[str], list]:
    """docs/RESULTS.md's section (benchmarks/make_results.py): the table and the goal rows."""
    grid = " × ".join(doc["grid"])
    if doc.get("data"):
        where = (f"Public logs `{doc['set']}` ({doc['data_source']}; benchmarks/public_logs.py, "
                 f"{doc['train_users'] or '?'} training users; its newest period is the test split)")
        data_name = f"{doc['set']}, real users and time"
    else:
        where = (f"Click logs with users (`widedp synth logs`, {doc['users']:,} users, {doc['days']} days, seed "
                 f"{doc['seed']}; the last day is the test split)")
        data_name = f"synth logs, {doc['users']:,} users"
    sets = "".join(f", `{s}`" for s in doc.get("sets", []))
    lines = [f"{where}, `{Path(doc['config']).name}`{sets} with "
             f"`cluster.backend = local`. *default*: the config as shipped at the target ε, {doc['repeats']} runs. "
             f"*tuned*: `widedp tune` over {grid} with E[K] = {doc['expected_trials']:g} (logarithmic), "
             f"validation fraction {doc.get('validation_fraction', 0.2):g}, score share {doc.get('score_share', 0.05):g}, "
             f"{doc['repeats']} tunings, each charged its whole target ε; the chosen trial's test metrics. "
             "*nonprivate (validation)*: every grid point trained non-privately with 20% of the training split held "
             "out, the lowest validation log loss kept — the reference (tuned on validation, never on the test "
             "split). Medians over the repeats, AUC's min–max beside them.", "",
             "| " + " | ".join(doc["headers"]) + " |", "|" + "---|" * len(doc["headers"])]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in doc["rows"]]
    goals = []
    reference = doc["records"]["nonprivate_validation"]["chosen"]
    for key, rec in doc["records"].items():
        if not key.startswith("eps"):
            continue
        tuned = [r for r in rec["tuned"] if "auc" in r]
        if not tuned:
            continue
        auc = statistics.median(r["auc"] for r in tuned)
        worst_ll = max(r["logloss"] - r["base_rate_logloss"] for r in tuned)
        eps = key[3:]
        if eps == "8":
            goals.append((f"widedp tune at ε = 8 within 0.01 AUC of the non-private model tuned on validation "
                          f"({data_name})",
                          f"{auc:.4f} vs {reference['auc']:.4f}",
                          "**met**" if auc >= reference["auc"] - 0.01 else "**missed**",
                          f"median of {len(tuned)} tunings" + ("" if doc.get("data") else
                                                                 "; the data generator is ours")))
        goals.append((f"widedp tune at ε = {eps}: log loss never worse than the base rate + 0.005 ({data_name})",
                      f"worst excess {worst_ll:+.4f}", "**met**" if worst_ll <= 0.005 else "**missed**",
                      f"over {len(tuned)} tunings (test split's base-rate log loss)"))
    return lines, goals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=None,
                        help="a converted data set with a unit column (e.g. benchmarks/public_logs.py's) instead of "
                             "synth logs; its stats.json beside it, if any, describes it in the report")
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--days", type=int, default=4)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--eps", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--expected-trials", type=float, default=10.0)
    parser.add_argument("--score-share", type=float, default=0.05)
    parser.add_argument("--validation-fraction", type=float, default=0.2)
    parser.add_argument("--grid", action="append", default=None)
    parser.add_argument("--config", default=str(REPO / "configs" / "logs.toml"))
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--work-dir", default=str(REPO / "runs" / "bench" / "private_tuning"))
    parser.add_argument("--quick", action="store_true", help="300 users, 2 days, 20 steps, one repeat, ε 8")
    parser.add_argument("--out")
    parser.add_argument("--name", default="private_tuning", help="results/NAME.json")
    args = parser.parse_args()
    started = time.time()
    machine = announce_machine()
    one_torch_thread()
    sys.path.insert(0, str(REPO))
    from widedp.trainer.config import load_config
    from widedp.trainer.run.train import train
    from widedp.trainer.run.tune import TuneSpec, parse_grid, tune

    if args.quick:
        args.users, args.days, args.repeats, args.eps = 300, 2, 1, "8"
        args.set = [*args.set, "train.steps=20"]
    grid = parse_grid(args.grid or DEFAULT_GRID)
    work = Path(args.work_dir) / time.strftime("%Y%m%d-%H%M%S")
    if args.data:
        data = Path(args.data)
        if not (data / "dataset.json").is_file():
            parser.error(f"--data {data}: no dataset.json (not a converted data set)")
        from public_logs import source_of

        source = source_of(data) or {}
        described = {"data": str(data), "data_source": source.get("source", str(data)),
                     "train_users": source.get("train", {}).get("users"), "set": source.get("set", data.name)}
    else:
        data = _dataset(Path(args.work_dir), args.users, args.days, args.seed)
        described = {}
    base_sets = [f"data.path={data}", "cluster.backend=local", "train.log_every=1000", *args.set]
    rows, records = [], {}

    def run(name: str, sets: list) -> dict:
        cfg = load_config(args.config, [*base_sets, *sets])
        return train(cfg, work / name, progress=False)

    # the non-private reference, tuned on a validation split of the training data
    spec = TuneSpec(args.config, tuple(base_sets), grid)
    points = []
    for i, candidate in enumerate(spec.candidates()):
        s = run(f"nonprivate-{i}", [*candidate, "train.mode=nonprivate", "data.validation_fraction=0.2"])
        points.append({"candidate": candidate, "validation_logloss": s["validation_metrics"]["logloss"], **_metrics(s)})
    best = min(points, key=lambda p: p["validation_logloss"])
    records["nonprivate_validation"] = {"points": points, "chosen": best}
    rows.append(["nonprivate (validation)", "-", " ".join(best["candidate"]), _f(best["auc"]), "", _f(best["logloss"]),
                 _f(best["base_rate_logloss"]), _f(best["ece"]), "-", "-", "-"])
    for eps in [float(e) for e in args.eps.split(",")]:
        default = [_metrics(run(f"default-eps{eps:g}-r{r}", [f"privacy.target_epsilon={eps}"]))
                   for r in range(args.repeats)]
        tuned = []
        for r in range(args.repeats):
            spec = TuneSpec(args.config, tuple(base_sets), grid, target_epsilon=eps,
                            expected_trials=args.expected_trials, score_share=args.score_share,
                            validation_fraction=args.validation_fraction)
            try:
                result = tune(spec, work / f"tune-eps{eps:g}-r{r}")
            except ValueError as exc:  # e.g. no per-trial target reachable: recorded, the grid goes on
                print(f"tune at ε = {eps:g}: {exc}")
                tuned.append({"error": str(exc)})
                continue
            if result["chosen"] is None:
                tuned.append({"error": "K = 0: nothing released"})
                continue
            chosen = json.loads((Path(result["chosen"]["run_dir"]) / "summary.json").read_text())
            tuned.append({**_metrics(chosen), "candidate": result["chosen"]["candidate"], "epsilon": result["epsilon"],
                          "trial_epsilon": result["trial_epsilon"], "score_noise_std": result["score"]["noise_std"]})
        records[f"eps{eps:g}"] = {"default": default, "tuned": tuned}
        for label, recs in (("default", default), ("tuned (widedp tune)", tuned)):
            auc, auc_lo, auc_hi = _spread(recs, "auc")
            ll, ll_lo, ll_hi = _spread(recs, "logloss")
            ece = _spread(recs, "ece")[0]
            base = _spread(recs, "base_rate_logloss")[0]
            chosen = "; ".join(" ".join(r["candidate"]) for r in recs if "candidate" in r) or "config"
            rows.append([label, eps, chosen, _f(auc), f"{_f(auc_lo)}–{_f(auc_hi)}", _f(ll), _f(base), _f(ece),
                         _f(_spread(recs, "epsilon")[0]) if label != "default" else eps,
                         _f(_spread(recs, "trial_epsilon")[0]) if label != "default" else "-",
                         _f(_spread(recs, "score_noise_std")[0]) if label != "default" else "-"])
    headers = ["row", "target ε", "chosen", "AUC (median)", "AUC min–max", "logloss", "base-rate logloss", "ECE",
               "ε spent", "ε per trial", "score noise std"]
    print(format_table(headers, rows))
    write_results(args.name, {**described, "sets": args.set, "users": args.users, "days": args.days, "seed": args.seed,
                                     "config": str(args.config), "grid": [f"{k}={','.join(v)}" for k, v in grid],
                                     "expected_trials": args.expected_trials, "repeats": args.repeats,
                                     "score_share": args.score_share, "validation_fraction": args.validation_fraction,
                                     "headers": headers, "rows": rows, "records": records},
                  quick=args.quick, machine=machine, out=args.out, started=started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
