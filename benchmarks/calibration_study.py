"""Why private CTR models were miscalibrated, and what train.recalibrate buys (RESULTS §6b).

For each (data set, mode) at target ε (default 1), one run with `train.recalibrate = false` and
one with it (the default), same config otherwise. From the run without it, measured on the
**training** split (a diagnostic of this benchmark, not something a run releases):
- mean predicted probability against the base rate: per-example clipping pulls the intercept
  toward the majority class when most examples are clipped (each pushes about equally whatever
  |p − y|), so the mean prediction falls below the base rate on the very data it was fitted to;
- Platt's (a, b) fitted to the training logits: a < 1 means the logits are spread beyond what
  they predict (the noise left in the embeddings adds label-free variance);
and on the test split: AUC, logloss, logloss after applying the training-fitted (a, b) (what a
perfect recalibration could reach), the base-rate predictor's logloss. From the run with it: the
private recalibration's test AUC and logloss, σ and the fitted (a, b).

    python benchmarks/calibration_study.py [--quick] [--datasets ctr] [--modes sparse,dpsgd] [--eps 1]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, announce_machine, write_results  # noqa: E402
from privacy_utility import DATASETS, QUICK, variant  # noqa: E402


def _logloss(z: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.logaddexp(0.0, z) - y * z))


def _platt(z: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Non-private Platt fit on exact logits (the same Newton fit the mechanism runs on its noisy
    histogram, here on one bin per example)."""
    from widedp.trainer.engine.recalibration import fit_platt

    return fit_platt(z, np.ones_like(z), y)


def _outputs(run_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    from widedp.trainer.config import saved_config
    from widedp.trainer.run.train import build_run, load_checkpoint

    state = load_checkpoint(run_dir / "checkpoint.pt")
    cfg = saved_config(state["config"], str(run_dir / "checkpoint.pt"))
    cfg.cluster.backend = "local"
    with build_run(cfg) as run:
        run.engine.load_state_dict(state["engine"])
        out = run.engine.outputs(run.train_set if split == "train" else run.test_set, 8192)
    assert out is not None
    return out[0].double().numpy(), out[1].double().numpy()


def study(dataset: str, mode: str, eps: float, over: list, root: Path, selection: str) -> dict:
    from widedp.trainer.api import train
    from widedp.trainer.config import load_config

    config = variant(DATASETS[dataset], mode)
    extra = [*over, f"privacy.target_epsilon={eps}", "cluster.backend=local"]
    if mode == "sparse":
        extra.append(f"train.selection={selection}")
    out: dict = {"dataset": dataset, "mode": mode, "selection": selection if mode == "sparse" else None,
                 "target_epsilon": eps, "config": config}
    for recal in (False, True):
        run_dir = root / dataset / f"{mode}-eps{eps:g}-recal{int(recal)}"
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        t0 = time.perf_counter()
        cfg = load_config(config, [*extra, f"train.recalibrate={'true' if recal else 'false'}"])
        summary = train(cfg, run_dir).summary
        key = "recalibrated" if recal else "raw"
        out[key] = {"test_metrics": summary["test_metrics"], "epsilon": summary["epsilon"],
                    "accountant": summary["accountant"], "noise_multiplier": summary["noise_multiplier"],
                    "recalibration": summary.get("recalibration"), "tuned_for_epsilon": summary.get("tuned_for_epsilon"),
                    "wall_s": time.perf_counter() - t0}
        if not recal:
            z_train, y_train = _outputs(run_dir, "train")
            z_test, y_test = _outputs(run_dir, "test")
            a, b = _platt(z_train, y_train)
            base = float(y_test.mean())
            out["diagnosis"] = {
                "train_mean_prediction": float(np.mean(1 / (1 + np.exp(-z_train)))),
                "train_base_rate": float(y_train.mean()),
                "train_platt_a": a, "train_platt_b": b,
                "test_mean_prediction": float(np.mean(1 / (1 + np.exp(-z_test)))), "test_base_rate": base,
                "test_logloss": _logloss(z_test, y_test),
                "test_logloss_with_train_platt": _logloss(a * z_test + b, y_test),
                "test_base_rate_logloss": -(base * math.log(base) + (1 - base) * math.log(1 - base)),
            }
        print(f"  {dataset} {mode} ε={eps:g} recalibrate={recal}: {summary['test_metrics']}", flush=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small data, few steps")
    parser.add_argument("--datasets", default="ctr")
    parser.add_argument("--modes", default="sparse,dpsgd")
    parser.add_argument("--selection", default="fest-threshold")
    parser.add_argument("--eps", default="1")
    parser.add_argument("--runs-dir", default=None)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    machine = announce_machine()
    started = time.time()
    root = Path(args.runs_dir) if args.runs_dir else REPO / "runs" / "bench" / (
        "calibration_study_quick" if args.quick else "calibration_study")
    rows = []
    for dataset in args.datasets.split(","):
        over = list(QUICK.get(dataset, [])) if args.quick else []
        if args.quick:
            over += ["train.steps=20", "data.synth_examples=6000", f"data.path=runs/bench_data/cs_{dataset}_quick"]
        for mode in args.modes.split(","):
            for eps in (float(e) for e in args.eps.split(",")):
                rows.append(study(dataset, mode, eps, over, root, args.selection))
    payload = {"rows": rows}
    write_results("calibration_study", payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


if __name__ == "__main__":
    main()
