"""How well the forecast before training (trainer/config/forecast.py) tells the runs that could
not learn from those that did, on runs already measured.

Reads benchmarks/user_level.py's result files (default: benchmarks/results/user_level*.json and
forecast_grid_u*.json — the click-log grids at 278 to 18,407 users, and the public logs of
benchmarks/public_logs.py, reported apart: the threshold was not set on them), and for every private run
computes the forecast from its public values only (σ, the expected batch in the run's unit, the
steps, the config's embedding width, the number of units) — no training. A run *learned* when
its test log loss beats the test split's base-rate log loss (the constant predictor's) by at
least 0.001: a run that ends at the base rate (the recalibration's intercept on a model with no
signal) learned nothing. Prints the confusion (flagged / not, learned / not) and each
flagged run that learned (a false alarm) and each unflagged run that did not (a miss); writes
benchmarks/results/forecast_check.json.

    python benchmarks/forecast_check.py [FILES...] [--out FILE]
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, RESULTS_DIR, announce_machine, format_table, write_results  # noqa: E402

LEARNED_MARGIN = -0.001  # test log loss − base-rate log loss at most this: learned


def _files() -> list[str]:
    return sorted(glob.glob(str(RESULTS_DIR / "user_level*.json")) + glob.glob(str(RESULTS_DIR / "forecast_grid_u*.json")))


def check(paths) -> dict:
    from widedp.trainer.config import load_config
    from widedp.trainer.config.forecast import WARN_MIN_UNIT_SHARE, forecast

    runs, seen = [], set()
    for path in paths:
        doc = json.loads(Path(path).read_text())
        users = doc["data"]["users"]
        examples = doc["data"]["train_examples"]
        for r in doc["records"]:
            m = r.get("test_metrics") or {}
            if not r.get("noise_multiplier") or "logloss" not in m or "base_rate_logloss" not in m:
                continue
            key = (doc["data"]["tag"], r["name"])
            if key in seen:  # the same run reported by two files of one grid
                continue
            seen.add(key)
            cfg = load_config(str(REPO / r["config"]), [o for o in r["overrides"] if not o.startswith("data.path=")])
            by_users = r.get("batch_unit") == "users"
            f = forecast(noise_multiplier=r["noise_multiplier"], expected_batch_size=float(r["batch_size"]),
                         steps=int(r["steps"]), embedding_dim=cfg.model.embedding_dim,
                         units=users if by_users else examples, unit="user" if by_users else "example")
            excess = m["logloss"] - m["base_rate_logloss"]
            runs.append({"data": doc["data"]["tag"], "public": bool(doc["data"].get("source")), "users": users,
                         "run": r["name"],
                         "target_epsilon": r.get("target_epsilon"), "min_unit_share": f["min_unit_share"],
                         "flagged": f["unlikely_to_learn"], "logloss_excess": excess, "auc": m.get("auc"),
                         "learned": excess <= LEARNED_MARGIN})
    counts = {(a, b): sum(1 for r in runs if r["flagged"] == a and r["learned"] == b)
              for a in (True, False) for b in (True, False)}
    return {"threshold": WARN_MIN_UNIT_SHARE, "learned_margin": LEARNED_MARGIN, "runs": runs,
            "flagged_failed": counts[(True, False)], "flagged_learned": counts[(True, True)],
            "unflagged_failed": counts[(False, False)], "unflagged_learned": counts[(False, True)]}


def results_section(doc: dict) -> tuple[list[str], list]:
    """docs/RESULTS.md's section: the confusion, the misses, and two goal rows."""
    lines = [f"Every private run of benchmarks/user_level.py's grids on record ({len(doc['runs'])} runs, "
             f"{len({r['data'] for r in doc['runs']})} data sets of {min(r['users'] for r in doc['runs']):,}–"
             f"{max(r['users'] for r in doc['runs']):,} users, ε ∈ {{1, 3, 8}}, sparse and DP-SGD, user and example "
             f"level), forecast from public values only (f_min = σ·√D / (b·√T), warned above {doc['threshold']:g}). "
             f"*Learned*: test log loss at least {-doc['learned_margin']:g} below the base rate's (a run at the base "
             "rate — the recalibrated intercept of a model with no signal — learned nothing).", "",
             "| | learned | did not learn |", "|---|---:|---:|",
             f"| flagged (f_min > {doc['threshold']:g}) | {doc['flagged_learned']} | {doc['flagged_failed']} |",
             f"| not flagged | {doc['unflagged_learned']} | {doc['unflagged_failed']} |", ""]
    misses = [r for r in doc["runs"] if not r["flagged"] and not r["learned"]]
    if misses:
        lines += ["Not flagged and did not learn (the forecast is a bound on noise only: these runs fail for other "
                  "reasons — e.g. more epochs than a few hundred users bear at the configs' learning rates; the "
                  "non-private runs of the smallest sets lose to the base rate too):", ""]
        lines += [f"- {r['data']} {r['run']}: f_min {r['min_unit_share']:.4f}, log loss {r['logloss_excess']:+.3f} "
                  f"over the base rate" for r in sorted(misses, key=lambda r: r["min_unit_share"])]
    synthetic = [r for r in doc["runs"] if not r.get("public")]
    public = [r for r in doc["runs"] if r.get("public")]
    if public:  # benchmarks/public_logs.py's sets: the threshold was not set on them
        lines += ["", "Of these, on the public logs with real users and time (benchmarks/public_logs.py; the threshold "
                  "was not set on them):", "", "| set | flagged, learned | flagged, did not | not flagged, learned | "
                  "not flagged, did not |", "|---|---:|---:|---:|---:|"]
        for name in sorted({r["data"] for r in public}):
            part = [r for r in public if r["data"] == name]
            cells = [sum(1 for r in part if r["flagged"] == a and r["learned"] == b)
                     for a, b in ((True, True), (True, False), (False, True), (False, False))]
            lines.append(f"| {name} ({part[0]['users']:,} users) | " + " | ".join(map(str, cells)) + " |")
    false_alarms = [r for r in synthetic if r["flagged"] and r["learned"]]
    few = [r for r in synthetic if r["users"] < 1000 and r["target_epsilon"] == 1.0]
    goals = [("The forecast never flags a run that learned (click-log grids)",
              f"{len(false_alarms)} false alarms in {sum(r['flagged'] for r in synthetic)} flagged runs",
              "**met**" if not false_alarms else "**missed**",
              f"the threshold was set on these same grids ({len(synthetic)} runs): not an independent test"),
             ("The forecast flags the runs of a few hundred users at ε = 1 before they run",
              f"{sum(r['flagged'] for r in few)} of {len(few)} flagged",
              "**met**" if few and all(r["flagged"] for r in few) else "**missed**",
              "278 and 697 users, every mode and unit")]
    if public:
        failed = [r for r in public if not r["learned"]]
        goals.append(("The forecast flags the runs that could not learn on public logs it was not set on",
                      f"{sum(r['flagged'] for r in failed)} of {len(failed)} flagged; "
                      f"{sum(r['flagged'] and r['learned'] for r in public)} false alarms",
                      "**met**" if failed and all(r["flagged"] for r in failed) else "**missed**",
                      f"{len(public)} runs on {', '.join(sorted({r['data'] for r in public}))}"))
    return lines, goals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--out")
    args = parser.parse_args()
    started = time.time()
    machine = announce_machine()
    sys.path.insert(0, str(REPO))
    doc = check(args.files or _files())
    print(format_table(["", "learned", "did not learn"],
                       [["flagged", doc["flagged_learned"], doc["flagged_failed"]],
                        ["not flagged", doc["unflagged_learned"], doc["unflagged_failed"]]]))
    write_results("forecast_check", doc, quick=False, machine=machine, out=args.out, started=started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
