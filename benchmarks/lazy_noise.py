"""Lazy against eager DP-SGD noise on a whole run: held-out AUC, log loss and ECE of
`configs/ctr_dpsgd.toml` (or --config) with train.dpsgd_noise = "lazy" and "eager", several
seeds each (train.seed: the initialization; the noise and the sampling are secret and fresh in
every run), at the target ε of each --eps; and the median step time of each run.

Lazy noise gives every value a run reads and releases the eager run's distribution
(docs/DESIGN.md §1.3, tests/test_lazy_noise.py): the held-out metrics differ only by the runs'
own randomness. The goal row: at every ε, the median test AUC of the lazy runs is within the
seed spread (min–max over the runs of either mode) of the eager runs' median. Nothing here is
tuned: both modes run the config's values.

    python benchmarks/lazy_noise.py [--config configs/ctr_dpsgd.toml] [--eps 8] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import announce_machine, ensure_config_dataset, train_point, write_results  # noqa: E402

MODES = ("lazy", "eager")
KEYS = ("test_metrics", "step_time_ms_median", "epsilon", "steps", "dpsgd_noise")


def run_grid(config: str, eps: list[float], seeds: list[int], work: Path, extra: list[str], fresh: bool) -> list[dict]:
    from widedp.trainer.config import lazy_dpsgd_noise, load_config

    records = []
    for e in eps:
        for seed in seeds:
            for mode in MODES:  # interleaved: load that drifts falls on both modes
                sets = [f"privacy.target_epsilon={e}", f"train.dpsgd_noise={mode}", f"train.seed={seed}",
                        "cluster.backend=local", *extra]
                cfg = load_config(config, sets)
                if mode == "lazy" and not lazy_dpsgd_noise(cfg):
                    raise SystemExit(f"{config}: lazy noise is not exact for this config (train.optimizer "
                                     f"{cfg.train.optimizer!r}, ema_decay {cfg.train.ema_decay}): nothing to compare")
                record = {"target_epsilon": e, "seed": seed, "mode": mode, "overrides": sets}
                label = f"eps{e:g}-seed{seed}-{mode}"
                train_point(cfg, work / label, fresh, record, label, KEYS)
                m = record.get("test_metrics") or {}
                print(f"  {label}: AUC {m.get('auc', float('nan')):.4f}, logloss {m.get('logloss', float('nan')):.4f}, "
                      f"ECE {m.get('ece', float('nan')):.4f}, step {record.get('step_time_ms_median') or float('nan'):.1f} ms")
                records.append(record)
    return records


def summarize(records: list[dict]) -> dict:
    """Per ε and mode: the median, min and max over the runs of AUC, log loss, ECE, step ms."""
    out: dict = {}
    for e in sorted({r["target_epsilon"] for r in records}):
        for mode in MODES:
            runs = [r for r in records if r["target_epsilon"] == e and r["mode"] == mode and "error" not in r]
            if not runs:
                continue
            cell = {}
            for key in ("auc", "logloss", "ece"):
                values = [r["test_metrics"][key] for r in runs]
                cell[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
            steps = [r["step_time_ms_median"] for r in runs if r.get("step_time_ms_median")]
            cell["step_ms"] = statistics.median(steps) if steps else None
            cell["runs"] = len(runs)
            out.setdefault(f"{e:g}", {})[mode] = cell
    return out


def auc_goal(summary: dict) -> list[dict]:
    """Per ε: |median lazy AUC − median eager AUC| ≤ the larger of the two modes' min–max spreads."""
    rows = []
    for e, cells in summary.items():
        if not all(m in cells for m in MODES):
            rows.append({"eps": e, "difference": None, "spread": None, "met": None})
            continue
        lazy, eager = cells["lazy"]["auc"], cells["eager"]["auc"]
        spread = max(lazy["max"] - lazy["min"], eager["max"] - eager["min"])
        diff = lazy["median"] - eager["median"]
        rows.append({"eps": e, "difference": diff, "spread": spread, "met": abs(diff) <= spread})
    return rows


def results_section(doc: dict) -> tuple[list[str], list]:
    lines = [f"`{doc['config']}`, only train.dpsgd_noise changed, {len(doc['seeds'])} seeds per mode and ε "
             "(train.seed: the initialization; noise and sampling secret and fresh in every run), cluster.backend = "
             "local. Median [min, max] over the runs; step: the median over the runs of each run's median step.", "",
             "| ε | noise | runs | test AUC | log loss | ECE | step ms |", "|---:|---|---:|---:|---:|---:|---:|"]

    def cell(c):
        return f"{c['median']:.4f} [{c['min']:.4f}, {c['max']:.4f}]"

    for e, cells in doc["summary"].items():
        for mode in MODES:
            if mode in cells:
                c = cells[mode]
                step = f"{c['step_ms']:.1f}" if c.get("step_ms") else "–"
                lines.append(f"| {e} | {mode} | {c['runs']} | {cell(c['auc'])} | {cell(c['logloss'])} | "
                             f"{cell(c['ece'])} | {step} |")
    goals = []
    for row in doc["goal"]:
        if row["met"] is None:
            goals.append((f"Lazy DP-SGD noise: median test AUC within the seed spread of eager at ε = {row['eps']}",
                          "not measured", "**not measured**", ""))
            continue
        goals.append((f"Lazy DP-SGD noise: median test AUC within the seed spread of eager at ε = {row['eps']}",
                      f"lazy − eager {row['difference']:+.4f}, spread {row['spread']:.4f}",
                      "**met**" if row["met"] else "**missed**", f"{len(doc['seeds'])} seeds per mode"))
    return lines, goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/ctr_dpsgd.toml")
    parser.add_argument("--eps", default="8", help="target ε list")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="for every run")
    parser.add_argument("--work-dir", default="runs/bench/lazy_noise")
    parser.add_argument("--fresh", action="store_true", help="retrain runs that already exist")
    parser.add_argument("--out")
    args = parser.parse_args()
    started = time.time()
    machine = announce_machine()
    eps = [float(x) for x in args.eps.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    ensure_config_dataset(args.config, args.set)
    records = run_grid(args.config, eps, seeds, Path(args.work_dir), list(args.set), args.fresh)
    summary = summarize(records)
    goal = auc_goal(summary)
    for row in goal:
        print(f"ε {row['eps']}: lazy − eager median AUC {row['difference']}, spread {row['spread']}: met {row['met']}")
    write_results("lazy_noise", {"config": args.config, "eps": eps, "seeds": seeds, "records": records,
                                 "summary": summary, "goal": goal}, quick=False, machine=machine, out=args.out,
                  started=started)


if __name__ == "__main__":
    main()
