"""Privacy-utility curves: test AUC / loss versus ε for nonprivate, dpsgd and sparse training.

Data sets: the realistic Criteo-format planted-truth set (configs/ctr_criteo_like.toml: Criteo's
26 published cardinalities, per-feature Zipf, hashed to 262,144; the main CTR benchmark), the
planted-truth synthetic CTR set (configs/ctr.toml; its Bayes AUC is known) and CBOW over the
synthetic Zipf corpus (configs/cbow.toml). Each point trains one run with
`trainer.run.train.train` from the configs — `{config}_dpsgd.toml` / `{config}_nonprivate.toml`
for those modes when they exist, so hyperparameters tuned there are used — at target
ε ∈ {1, 3, 8} (δ = 1/n, σ and the selection budget calibrated by the config's accountant for
the run's steps), for dpsgd and for sparse with em, em-count, svt, threshold, fest-threshold and random selection;
nonprivate once per seed. Each point is the median over seeds (default 3). Metrics: CTR test
AUC, log loss, expected calibration error (ECE, 15 bins) and the base-rate predictor's log loss
(always predicting the test split's mean label: trainer/models/calibration_metrics.py); CBOW
test loss (and pairwise accuracy). A reused CTR run whose summary.json predates ECE is
re-evaluated from its checkpoint for the missing keys only (the record lists them in
`metrics_from_checkpoint`). Each private run's ledger is also re-accounted by the seed paper's
Theorem 3 bound and the other accountants.

Goals (issue 10): on both CTR sets the best sparse selector >= dpsgd - 0.003 AUC at every ε, and
at ε = 8 within 0.01 AUC of nonprivate; CBOW: best sparse test loss <= dpsgd's at every ε; em-count
(EM on example counts) beats random at every ε (em, on min(‖G_r‖, S0), is reported beside it).
Calibration, on both CTR sets: the best sparse test log loss <= dpsgd's + 0.005 at every ε, and
every private model's (dpsgd's and each sparse selector's) test log loss below the base-rate
predictor's at every ε. Beside each sparse point: rows noised per step and the ratio
dpsgd / sparse (dpsgd noises every row; sparse noises the selected rows plus its dense tables').

Tuning protocol: the shipped configs carry their values per target ε ([by_epsilon] rows,
chosen by benchmarks/tune.py sweeps on a validation split carved from the training data), so by
default the grid runs the configs as they are (`privacy.target_epsilon` picks the row; each
record says which row: `tuned_for_epsilon`). `--tuning-dir DIR` instead applies
DIR/{dataset}_{mode}_eps{ε}.json's best point (a sweep's output) on top, for every sparse
selector alike (`tuned_from`). The runs train on the whole training split and report on the test
split. Tuning is not charged to ε (docs/THREAT_MODEL.md).

Runs are kept under runs/bench/privacy_utility[/quick]/ and reused when their config is
unchanged up to keys of placement, logging and recovery (an interrupted grid resumes; --fresh
retrains). SVT and threshold selections use the config's privacy.threshold, or when that is
"auto" the noise-only rule of
_common.default_selection_threshold (pure-noise rows pass with probability k/p).

    python benchmarks/privacy_utility.py [--quick] [--datasets criteo_like,ctr,cbow] [--eps 1,3,8] [--seeds 0,1,2]
        [--steps N] [--examples N] [--jobs 2] [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (announce_machine, DATA_DIR, REPO, default_selection_threshold, ensure_config_dataset, format_table, results_path,
                     train_point, write_results)

DATASETS = {"criteo_like": "configs/ctr_criteo_like.toml", "heavytail": "configs/ctr_heavytail.toml",
            "ctr": "configs/ctr.toml", "cbow": "configs/cbow.toml"}
PRIMARY = {"criteo_like": ("auc", "max"), "heavytail": ("auc", "max"), "ctr": ("auc", "max"), "cbow": ("loss", "min")}
CTR_DATASETS = tuple(d for d, (metric, _) in PRIMARY.items() if metric == "auc")
# held-out metrics of the CTR model added after runs of the grid were trained: a reused run's
# summary.json without them is re-evaluated from its checkpoint (run_one)
CALIBRATION_METRICS = ("ece", "base_rate_logloss")
LOGLOSS_TOLERANCE = 0.005  # best sparse log loss <= dpsgd's + this, at every ε
QUICK = {  # a tiny grid: small data, few steps, in-process shards
    "criteo_like": ["data.synth_table_size=4096", "privacy.k=2000", "train.batch_size=256"],
    "heavytail": ["data.synth_table_size=4096", "privacy.k=2000", "train.batch_size=256"],
    "ctr": ["data.synth_table_size=2000", "privacy.k=2000", "train.batch_size=256"],
    "cbow": ["train.batch_size=128"],
}


def variant(config: str, mode: str) -> str:
    path = REPO / config
    v = path.with_name(f"{path.stem}_{mode}.toml")
    return str(v.relative_to(REPO)) if mode != "sparse" and v.exists() else config


def tuned_overrides(dataset: str, mode: str, eps, tuning_dir: Path) -> tuple[list, Optional[str]]:
    """The grid values of the best point (chosen on the validation split) of the sweep
    `tuning_dir/{dataset}_{mode}_eps{ε}.json` (benchmarks/tune.py), and that file; none: ([], None).
    A sparse sweep tunes the config's selector; its values are used for every selector."""
    if eps is None:
        return [], None
    path = tuning_dir / f"{dataset}_{mode}_eps{eps:g}.json"
    if not path.is_file():
        return [], None
    doc = json.loads(path.read_text())
    if doc.get("chosen_on") != "validation" or not doc.get("best"):
        return [], None  # only sweeps that chose on held-out training data, never on the test split
    return list(doc["best"]["overrides"][len(doc["set"]):]), str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def run_one(dataset: str, config: str, mode: str, selection, eps, seed: int, overrides: list, root: Path,
            fresh: bool, accountants: bool, tuning_dir: Optional[Path] = None) -> dict:
    from widedp.trainer.config import load_config
    from widedp.trainer.release.report import ledger_accounting

    name = mode + (f"-{selection}" if selection else "") + (f"-eps{eps:g}" if eps is not None else "") + f"-seed{seed}"
    run_dir = root / dataset / name
    tuned, tuned_from = tuned_overrides(dataset, mode, eps, tuning_dir) if tuning_dir else ([], None)
    over = [*tuned, *overrides, f"train.mode={mode}", f"train.seed={seed}"]  # --set wins over tuned values
    if selection:
        over.append(f"train.selection={selection}")
    if eps is not None:
        over.append(f"privacy.target_epsilon={eps}")
    cfg = load_config(variant(config, mode), over)
    cfg.validate()
    rule = default_selection_threshold(cfg)
    if rule:
        cfg.privacy.threshold = rule["threshold"]
    record = {"dataset": dataset, "mode": mode, "selection": selection, "target_epsilon": eps, "seed": seed,
              "run_dir": str(run_dir.relative_to(REPO) if run_dir.is_relative_to(REPO) else run_dir),
              "config": variant(config, mode), "threshold_rule": rule, "tuned": tuned, "tuned_from": tuned_from,
              "tuned_for_epsilon": cfg.tuned_for_epsilon}
    if not train_point(cfg, run_dir, fresh, record, f"{dataset} {name}", (
            "epsilon", "delta", "steps", "stopped_by_budget", "test_metrics", "bayes_auc", "noise_multiplier",
            "selection_epsilon", "k", "examples_per_sec", "step_time_ms_median", "rows_selected_mean",
            "rows_touched_mean", "vocabulary_size", "accountant", "recalibration", "selection_params")):
        return record
    if record.get("reused") and dataset in CTR_DATASETS:
        _add_missing_metrics(record, run_dir)
    if accountants and mode != "nonprivate":
        acc = ledger_accounting(run_dir, curve_points=0)
        record["accountants"] = acc.get("final", {})
    metrics = record.get("test_metrics") or {}
    print(f"  {dataset} {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
          + (f", ε {record['epsilon']:.3g}" if record.get("epsilon") not in (None, math.inf) else "")
          + (" (reused)" if record.get("reused") else f" ({record['wall_s']:.0f} s)"))
    return record


def _add_missing_metrics(record: dict, run_dir: Path) -> None:
    """Fill the CALIBRATION_METRICS a reused run's summary.json lacks (it predates them) by
    evaluating its checkpoint on the test split (trainer/run/train.py:evaluate, as `widedp evaluate`).
    Only the missing keys are added, and only when the re-evaluation reproduces the summary's
    log loss (the same checkpoint and split); otherwise the record says why in
    `metrics_from_checkpoint_error` and the keys stay missing ("—" in RESULTS)."""
    metrics = dict(record.get("test_metrics") or {})
    missing = [k for k in CALIBRATION_METRICS if k not in metrics]
    if not missing or not (run_dir / "checkpoint.pt").exists():
        return
    try:
        from widedp.trainer.run.train import evaluate

        fresh = evaluate(run_dir)["test_metrics"]
    except Exception as exc:  # a stale or unreadable checkpoint: the point is kept without the new keys
        record["metrics_from_checkpoint_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return
    old, new = metrics.get("logloss"), fresh.get("logloss")
    if old is not None and (new is None or not math.isclose(old, new, rel_tol=1e-4, abs_tol=1e-6)):
        record["metrics_from_checkpoint_error"] = (f"the checkpoint's test log loss {new} is not the summary's {old}: "
                                                   "not the run's final model")
        return
    added = [k for k in missing if k in fresh]
    record["test_metrics"] = {**metrics, **{k: fresh[k] for k in added}}
    record["metrics_from_checkpoint"] = added


def _run_job(job: tuple) -> dict:
    """run_one in a spawned worker process: one torch thread."""
    from _common import one_torch_thread

    one_torch_thread()
    return run_one(*job)


def _prepare_data(config: str, overrides: list) -> None:
    """Generate (or check) the data set of `config` before parallel runs read it."""
    ensure_config_dataset(config, overrides)


def aggregate(records: list) -> list:
    groups: dict = {}
    for r in records:
        if "error" in r:
            continue
        key = (r["dataset"], r["mode"], r["selection"], r["target_epsilon"])
        groups.setdefault(key, []).append(r)
    out = []
    for (dataset, mode, selection, eps), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]),
                                                                                       kv[0][3] or 0)):
        metrics = {}
        names = list(dict.fromkeys(m for r in rs for m in (r["test_metrics"] or {})))  # every seed's, in order
        for m in names:
            vals = [r["test_metrics"][m] for r in rs if (r["test_metrics"] or {}).get(m) is not None]
            if not vals:
                continue
            metrics[m] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
        spent = [r["epsilon"] for r in rs if r.get("epsilon") is not None and math.isfinite(r["epsilon"])]
        paper = [r["accountants"]["paper"]["epsilon"] for r in rs
                 if r.get("accountants", {}).get("paper", {}).get("epsilon") is not None]
        noised = [r["rows_selected_mean"] for r in rs if r.get("rows_selected_mean")]
        out.append({"dataset": dataset, "mode": mode, "selection": selection, "target_epsilon": eps, "seeds": len(rs),
                    "rows_noised_median": statistics.median(noised) if noised else None,
                    "rows_noised_ratio": (rs[0]["vocabulary_size"] / statistics.median(noised)
                                          if noised and rs[0].get("vocabulary_size") else None),
                    "metrics": metrics, "epsilon_spent_median": statistics.median(spent) if spent else None,
                    "paper_epsilon_median": statistics.median(paper) if paper else None,
                    "bayes_auc": rs[0].get("bayes_auc"), "steps_median": statistics.median(r["steps"] for r in rs)})
    return out


def goals(points: list) -> dict:
    out = {}
    for dataset, (metric, better) in PRIMARY.items():
        pts = [p for p in points if p["dataset"] == dataset and metric in p["metrics"]]
        if not pts:
            continue
        val = {(p["mode"], p["selection"], p["target_epsilon"]): p["metrics"][metric]["median"] for p in pts}
        eps_list = sorted({p["target_epsilon"] for p in pts if p["target_epsilon"] is not None})
        sels = sorted({p["selection"] for p in pts if p["mode"] == "sparse"})
        cmp = {}
        for sel in sels:
            per_eps = {}
            for e in eps_list:
                s, d = val.get(("sparse", sel, e)), val.get(("dpsgd", None, e))
                if s is not None and d is not None:
                    per_eps[str(e)] = {"sparse": s, "dpsgd": d, "ok": (s >= d) if better == "max" else (s <= d)}
            cmp[sel] = {"per_epsilon": per_eps, "all": bool(per_eps) and all(v["ok"] for v in per_eps.values())}
        out[dataset] = {"metric": metric, "better": better, "sparse_vs_dpsgd": cmp}
        # The best sparse selector at each ε against dpsgd (tolerance 0.003 AUC on CTR, 0 on CBOW).
        tolerance = 0.003 if better == "max" else 0.0
        best = {}
        for e in eps_list:
            cands = [(val[("sparse", sel, e)], sel) for sel in sels if ("sparse", sel, e) in val]
            d = val.get(("dpsgd", None, e))
            if cands and d is not None:
                v, sel = max(cands) if better == "max" else min(cands)
                ok = v >= d - tolerance if better == "max" else v <= d + tolerance
                best[str(e)] = {"selection": sel, "sparse": v, "dpsgd": d, "ok": ok}
        out[dataset]["best_sparse_vs_dpsgd"] = {"tolerance": tolerance, "per_epsilon": best,
                                                "all": bool(best) and all(v["ok"] for v in best.values())}
        # EM against random selection: the count utility (the goal) and the norm utility.
        for em in ("em-count", "em"):
            em_random = {str(e): {"em": val[("sparse", em, e)], "random": val[("sparse", "random", e)],
                                  "ok": (val[("sparse", em, e)] > val[("sparse", "random", e)]) if better == "max"
                                  else (val[("sparse", em, e)] < val[("sparse", "random", e)])}
                         for e in eps_list if ("sparse", em, e) in val and ("sparse", "random", e) in val}
            if em_random:
                out[dataset].setdefault("em_beats_random", {})[em] = {
                    "per_epsilon": em_random, "all": all(v["ok"] for v in em_random.values())}
        nonp = val.get(("nonprivate", None, None))
        if better == "max" and nonp is not None and 8 in eps_list:
            gaps = {sel: nonp - val[("sparse", sel, 8)] for sel in sels if ("sparse", sel, 8) in val}
            out[dataset]["gap_to_nonprivate_at_eps8"] = {
                sel: {"gap": g, "met": g <= 0.01} for sel, g in gaps.items()}
            out[dataset]["nonprivate"] = nonp
        if dataset in CTR_DATASETS:
            out[dataset]["calibration"] = calibration_goals(points, dataset)
    return out


def _median(point: dict, metric: str) -> Optional[float]:
    m = point["metrics"].get(metric)
    return None if m is None or m.get("median") is None else m["median"]


def calibration_goals(points: list, dataset: str) -> dict:
    """The CTR calibration goals of `dataset` from the points (medians over seeds):

    `best_sparse_logloss`: at each ε the sparse selector of least test log loss against dpsgd's,
    ok when <= dpsgd's + LOGLOSS_TOLERANCE; `all` None when no ε has both (not measured).
    `below_base_rate`: at each ε every private model's (dpsgd and each sparse selector) test log
    loss against its own base-rate log loss (the test split's mean-label predictor), ok when every
    one is below; an ε where a private point lacks either key is not measured (`measured` False,
    results written before the metric). `all`: False when a measured ε is missed, None when none
    is missed but some ε (or all) is not measured, else True.
    """
    pts = [p for p in points if p["dataset"] == dataset and p["mode"] in ("dpsgd", "sparse")
           and p["target_epsilon"] is not None]
    eps_list = sorted({p["target_epsilon"] for p in pts})
    best: dict = {}
    below: dict = {}
    for e in eps_list:
        at = [p for p in pts if p["target_epsilon"] == e]
        sparse = [(_median(p, "logloss"), p["selection"]) for p in at if p["mode"] == "sparse"]
        sparse = [(v, sel) for v, sel in sparse if v is not None]
        d = next((_median(p, "logloss") for p in at if p["mode"] == "dpsgd"), None)
        if sparse and d is not None:
            v, sel = min(sparse)
            best[str(e)] = {"selection": sel, "sparse": v, "dpsgd": d, "ok": v <= d + LOGLOSS_TOLERANCE}
        models = {p["mode"] + (f"/{p['selection']}" if p["selection"] else ""):
                  (_median(p, "logloss"), _median(p, "base_rate_logloss")) for p in at}
        if any(ll is None or base is None for ll, base in models.values()):
            below[str(e)] = {"measured": False, "ok": None,
                             "missing": sorted(k for k, (ll, base) in models.items() if ll is None or base is None)}
            continue
        base = max(b for _, b in models.values())  # one test split: the same value in every run
        above = {k: ll for k, (ll, b) in models.items() if ll >= b}
        worst = max(models, key=lambda k: models[k][0] - models[k][1])
        below[str(e)] = {"measured": True, "ok": not above, "base_rate": base, "models": len(models),
                         "worst": worst, "worst_logloss": models[worst][0], "above": above}
    flags = [v["ok"] for v in below.values()]
    return {"best_sparse_logloss": {"tolerance": LOGLOSS_TOLERANCE, "per_epsilon": best,
                                    "all": all(v["ok"] for v in best.values()) if best else None},
            "below_base_rate": {"per_epsilon": below,
                                "all": False if False in flags else (True if flags and None not in flags else None)}}


def _per_dataset(parser, option: str, items: list, kind: type) -> dict:
    """{data set: [values]} from `option DATASET=V1,V2` items (--dataset-seeds, --dataset-eps)."""
    out = {}
    for item in items:
        name, _, values = item.partition("=")
        if name not in DATASETS or not values:
            parser.error(f"{option} expects DATASET=V1,V2 with DATASET in {sorted(DATASETS)}, got {item!r}")
        out[name] = [kind(v) for v in values.split(",")]
    return out


def merge_previous(path: Path, records: list, settings: dict) -> tuple[list, dict, Optional[dict]]:
    """This run's records and settings, plus the previous results' (at `path`) for every data set
    this run did not train; and what was merged (None: nothing to merge)."""
    if not path.exists():
        return records, settings, None
    old = json.loads(path.read_text())
    ran = set(settings)
    kept = [r for r in old.get("records", []) if r.get("dataset") not in ran]
    if not kept:
        return records, settings, None
    others = {d: v for d, v in old.get("settings", {}).items() if d not in ran}
    return records + kept, {**others, **settings}, {"rerun": sorted(ran), "other_rows_created": old.get("created", "?"),
                                                    "other_datasets": sorted(others)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny grid: ε 1 and 8, one seed, small data, 15 steps")
    parser.add_argument("--datasets", default="criteo_like,ctr,cbow", help=f"comma list of {sorted(DATASETS)}")
    parser.add_argument("--ctr-config", default=DATASETS["ctr"])
    parser.add_argument("--cbow-config", default=DATASETS["cbow"])
    parser.add_argument("--eps", default=None, help="target ε list (default 1,3,8; quick 1,8)")
    parser.add_argument("--seeds", default=None, help="default 0,1,2 (quick 0)")
    parser.add_argument("--dataset-seeds", action="append", default=[], metavar="DATASET=SEEDS",
                        help="seeds for one data set instead of --seeds (e.g. criteo_like=0 where a run takes minutes)")
    parser.add_argument("--dataset-eps", action="append", default=[], metavar="DATASET=EPS",
                        help="target ε list for one data set instead of --eps")
    parser.add_argument("--modes", default="nonprivate,dpsgd,sparse")
    parser.add_argument("--selections", default="em,em-count,svt,threshold,fest-threshold,random")
    parser.add_argument("--steps", type=int, default=None, help="train.steps for every run (default: the configs')")
    parser.add_argument("--examples", type=int, default=None, help="data set size (a separate data dir per size)")
    parser.add_argument("--backend", choices=("ray", "local"), default=None, help="default: config's (quick: local)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="for every run")
    parser.add_argument("--fresh", action="store_true", help="retrain runs that already exist")
    parser.add_argument("--no-accountants", action="store_true", help="skip re-accounting ledgers")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the coordinator (default: torch's)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time, each in its own process with one torch thread (on 2 cores, 2 jobs "
                             "finish the grid sooner than 1 job with 2 threads: much of a step is single-threaded)")
    parser.add_argument("--tuning-dir", default="",
                        help="apply each (data set, mode, ε)'s tuned values from DIR/{dataset}_{mode}_eps{ε}.json "
                             "(benchmarks/tune.py, chosen on validation) on top of the configs' [by_epsilon] rows; "
                             "default '': the configs as they are")
    parser.add_argument("--merge", action="store_true",
                        help="keep the existing results' rows of the data sets not run now (their records, settings)")
    parser.add_argument("--runs-dir", default=None)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    started = time.time()
    quick = args.quick
    eps_list = [float(e) for e in (args.eps or ("1,8" if quick else "1,3,8")).split(",")]
    seeds = [int(s) for s in (args.seeds or ("0" if quick else "0,1,2")).split(",")]
    seeds_for = _per_dataset(parser, "--dataset-seeds", args.dataset_seeds, int)
    eps_for = _per_dataset(parser, "--dataset-eps", args.dataset_eps, float)
    modes = args.modes.split(",")
    selections = args.selections.split(",")
    root = Path(args.runs_dir) if args.runs_dir else REPO / "runs" / "bench" / ("privacy_utility_quick" if quick else "privacy_utility")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    # Tuned values (chosen on validation splits) per (data set, mode, ε); never for --quick smoke grids.
    tuning_dir = Path(args.tuning_dir) if args.tuning_dir and not quick else None
    machine = announce_machine()
    configs = {**DATASETS, "ctr": args.ctr_config, "cbow": args.cbow_config}
    jobs: list = []
    settings: dict = {}
    for dataset in [d for d in args.datasets.split(",") if d]:
        config = configs[dataset]
        over = list(QUICK[dataset]) if quick else []
        if args.steps or quick:
            over.append(f"train.steps={args.steps or 15}")
        if quick or args.examples:
            n = args.examples or 6000
            path = DATA_DIR / f"pu_{dataset}_n{n}"
            path = path.relative_to(REPO) if path.is_relative_to(REPO) else path  # runs from the repo root
            over += [f"data.synth_examples={n}", f"data.path={path}"]
        backend = args.backend or ("local" if quick else None)
        if backend:
            over.append(f"cluster.backend={backend}")
        over += args.set
        settings[dataset] = {"config": config, "overrides": over}
        print(f"\n{dataset}: {config} {' '.join(over)}")
        if args.jobs > 1:
            _prepare_data(config, over)  # parallel runs must not generate the same data set twice
        for seed in seeds_for.get(dataset, seeds):
            if "nonprivate" in modes:
                jobs.append((dataset, config, "nonprivate", None, None, seed, over, root, args.fresh, False, tuning_dir))
            for eps in eps_for.get(dataset, eps_list):
                if "dpsgd" in modes:
                    jobs.append((dataset, config, "dpsgd", None, eps, seed, over, root, args.fresh,
                                 not args.no_accountants, tuning_dir))
                if "sparse" in modes:
                    for sel in selections:
                        jobs.append((dataset, config, "sparse", sel, eps, seed, over, root, args.fresh,
                                     not args.no_accountants, tuning_dir))
    if args.jobs > 1:
        from multiprocessing import get_context

        with get_context("spawn").Pool(args.jobs) as pool:
            records = pool.map(_run_job, jobs, chunksize=1)
    else:
        records = [run_one(*job) for job in jobs]
    merged = None
    if args.merge:
        records, settings, merged = merge_previous(results_path("privacy_utility", quick, args.out), records, settings)
    points = aggregate(records)
    g = goals(points)
    print()
    for dataset, (metric, _) in PRIMARY.items():
        pts = [p for p in points if p["dataset"] == dataset]
        if not pts:
            continue
        extra = ["logloss", "ece", "base_rate_logloss"] if dataset in CTR_DATASETS else []
        print(format_table(
            ["dataset", "mode", "target ε", "seeds", f"test {metric} (median)", "min", "max",
             *[f"{m} (median)" for m in extra], "rows noised/step", "dpsgd/sparse rows", "ε spent (rdp)", "ε paper Thm 3"],
            [[dataset, p["mode"] + (f"/{p['selection']}" if p["selection"] else ""), p["target_epsilon"], p["seeds"],
              p["metrics"].get(metric, {}).get("median"), p["metrics"].get(metric, {}).get("min"),
              p["metrics"].get(metric, {}).get("max"), *[_median(p, m) for m in extra],
              p["rows_noised_median"] if p["mode"] != "nonprivate" else None,
              p["rows_noised_ratio"] if p["mode"] == "sparse" else None, p["epsilon_spent_median"],
              p["paper_epsilon_median"]]
             for p in pts]))
        if pts[0].get("bayes_auc"):
            print(f"Bayes AUC of the planted model: {pts[0]['bayes_auc']:.4f}")
        print()
    for line in goal_lines(g):
        print(line)
    payload = {"eps": eps_list, "seeds": seeds, "modes": modes, "selections": selections, "settings": settings,
               "records": records, "points": points, "goals": g, **({"merged": merged} if merged else {})}
    write_results("privacy_utility", payload, quick=quick, machine=machine, out=args.out, started=started)
    return payload


def goal_lines(g: dict) -> list[str]:
    lines = []
    for dataset, d in g.items():
        for sel, c in d["sparse_vs_dpsgd"].items():
            if c["per_epsilon"]:
                detail = ", ".join(f"ε={e}: {v['sparse']:.4f} vs {v['dpsgd']:.4f}" for e, v in c["per_epsilon"].items())
                lines.append(f"{dataset}: sparse/{sel} {'>=' if d['better'] == 'max' else '<='} dpsgd ({d['metric']}) at every ε: "
                             f"{'met' if c['all'] else 'missed'} ({detail})")
        best = d.get("best_sparse_vs_dpsgd", {})
        if best.get("per_epsilon"):
            detail = ", ".join(f"ε={e}: {v['selection']} {v['sparse']:.4f} vs {v['dpsgd']:.4f}"
                               for e, v in best["per_epsilon"].items())
            lines.append(f"{dataset}: best sparse within {best['tolerance']:g} of dpsgd ({d['metric']}) at every ε: "
                         f"{'met' if best['all'] else 'missed'} ({detail})")
        for em, er in d.get("em_beats_random", {}).items():
            detail = ", ".join(f"ε={e}: {v['em']:.4f} vs {v['random']:.4f}" for e, v in er["per_epsilon"].items())
            lines.append(f"{dataset}: {em} beats random at every ε: {'met' if er['all'] else 'missed'} ({detail})")
        for sel, v in d.get("gap_to_nonprivate_at_eps8", {}).items():
            lines.append(f"{dataset}: sparse/{sel} at ε=8 within 0.01 AUC of nonprivate ({d['nonprivate']:.4f}): "
                         f"{'met' if v['met'] else 'missed'} (gap {v['gap']:+.4f})")
        lines += calibration_goal_lines(dataset, d.get("calibration"))
    return lines


def goal_status(flag: Optional[bool]) -> str:
    return "not measured" if flag is None else "met" if flag else "missed"


def calibration_goal_lines(dataset: str, cal: Optional[dict]) -> list[str]:
    if not cal:
        return []
    best, below = cal["best_sparse_logloss"], cal["below_base_rate"]
    detail = ", ".join(f"ε={e}: {v['selection']} {v['sparse']:.4f} vs {v['dpsgd']:.4f}"
                       for e, v in best["per_epsilon"].items())
    lines = [f"{dataset}: best sparse logloss <= dpsgd + {best['tolerance']:g} at every ε: "
             f"{goal_status(best['all'])}" + (f" ({detail})" if detail else "")]
    detail = ", ".join(f"ε={e}: worst {v['worst']} {v['worst_logloss']:.4f} vs base rate {v['base_rate']:.4f}"
                       if v["measured"] else f"ε={e}: not measured" for e, v in below["per_epsilon"].items())
    lines.append(f"{dataset}: every private model's logloss below the base-rate predictor's at every ε: "
                 f"{goal_status(below['all'])}" + (f" ({detail})" if detail else ""))
    return lines


if __name__ == "__main__":
    main()
