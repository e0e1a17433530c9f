"""`widedp wide-linear`: a wide linear (logistic) model on a widedp data set, trained privately
by seed A's Algorithm 2 (`sparse_learners.dp_erm`), with its held-out metrics and privacy report.

Why a command of its own rather than a model option of `widedp train`: `train` runs Algorithm 3
(Poisson-sampled steps, per-example ℓ2 clipping over embedding rows and dense layers, a private
row selection, Gaussian noise, the ledger, shard actors, checkpoints). Algorithm 2 shares none
of it: its model is one d-vector, its per-step mechanism is NumericSparse (Laplace answers on an
ℓ∞-clipped group gradient), and its accounting is its own (`DpErmResult.accounting`). Putting it
behind `train` would mean branching on the model kind through the run loop, which is what the
selector and accountant registries exist to avoid.

Features (data-independent given the public table sizes): every categorical feature f of an
example sets column offset_f + id to 1/√F (F features), so each row has ℓ2 norm 1 and ℓ∞ norm
1/√F — the gradient bound c₂ of Alg 2 is that ℓ∞ norm (the logistic loss has |φ'| ≤ 1), so no
gradient is ever clipped. Numeric features are not used (their public range is not known).

Privacy: add/remove-one training example. The data set's own events (e.g. a private vocabulary,
`dataset.json` privacy_events) are composed with the run's by the RDP accountant; the summary's
`epsilon` is that composition. Randomness (the per-step groups and NumericSparse's noise) comes
from fresh OS entropy unless `--seed` is given (reproducible mode: then ε holds only while the
seed stays secret, and the summary says so). Written: `summary.json` (the command's JSON) and
`model.npz` (w, the released model). Test metrics are computed on the held-out split.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

import numpy as np
import scipy.sparse as sp

from widedp.selection.keyed_random import NoiseKey

ALGORITHMS = ("alg2", "nonprivate")


def wide_features(split) -> tuple[sp.csr_matrix, np.ndarray]:
    """(X, y) of a data split: one-hot columns offset_f + id per categorical feature, scaled by
    1/√F; y the 0/1 labels. Column offsets follow the tables (features sharing a table share
    its columns)."""
    meta = split.meta
    tables = list(meta.tables)
    table_offsets = np.concatenate([[0], np.cumsum([meta.table_sizes[t] for t in tables])]).astype(np.int64)
    n, features = len(split), list(meta.features)
    if not features:
        raise ValueError("wide-linear: the data set has no categorical features")
    scale = 1.0 / math.sqrt(len(features))
    rows, cols = [], []
    for feature in features:
        offsets, ids = split.feature_rows(feature)
        counts = np.diff(offsets)
        rows.append(np.repeat(np.arange(n, dtype=np.int64), counts))
        cols.append(ids.astype(np.int64) + table_offsets[tables.index(meta.feature_tables[feature])])
    r, c = np.concatenate(rows), np.concatenate(cols)
    X = sp.csr_matrix((np.full(r.size, scale), (r, c)), shape=(n, int(table_offsets[-1])))
    X.sum_duplicates()
    labels = split.take(np.arange(n, dtype=np.int64)).labels.numpy().astype(np.float64)
    return X, labels


def _metrics(X: sp.csr_matrix, y: np.ndarray, w: np.ndarray) -> dict:
    """AUC, logloss and calibration (ECE over 15 bins, the base-rate predictor's logloss) on the
    held-out split: the DLRM model's metrics (trainer/models/calibration_metrics.py)."""
    from widedp.trainer.data._util import auc
    from widedp.trainer.models.calibration_metrics import calibration_metrics, logloss_from_logits

    z = X @ w
    return {"auc": float(auc(z, y)), "logloss": logloss_from_logits(z, y), **calibration_metrics(z, y),
            "examples": int(y.size)}


def _nonprivate(X: sp.csr_matrix, y: np.ndarray, l2: float) -> np.ndarray:
    """The λ-regularized logistic minimizer (the floor the private runs are compared with)."""
    from scipy import optimize

    n = X.shape[0]

    def f(w):
        z = X @ w
        p = 0.5 * (1.0 + np.tanh(0.5 * z))  # σ(z), overflow-free
        return (float(np.mean(np.logaddexp(0.0, z) - y * z) + 0.5 * l2 * w @ w),
                X.T @ (p - y) / n + l2 * w)

    res = optimize.minimize(f, np.zeros(X.shape[1]), jac=True, method="L-BFGS-B", options={"maxiter": 500})
    return res.x


def run_wide_linear(data: str, *, algorithm: str = "alg2", epsilon: float = 8.0, delta: float = 1e-5,
                    steps: int = 100, num_groups: Optional[int] = None, max_answers: int = 100,
                    learning_rate: float = 1.0, l2: float = 1e-4, threshold: Optional[float] = None,
                    calibration: str = "rdp",
                    test_fraction: float = 0.1, split_seed: int = 0, seed: Optional[int] = None,
                    run_dir: Optional[str] = None) -> dict:
    """Train, evaluate on the held-out split and (with `run_dir`) write summary.json and model.npz.
    `num_groups` m defaults to ⌈10√T⌉ (Theorem 1's condition)."""
    from widedp.accounting.base import make_accountant
    from widedp.trainer.data.format.dataset import open_dataset

    if algorithm not in ALGORITHMS:
        raise ValueError(f"--algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    started = time.time()
    train, test = open_dataset(data, test_fraction=test_fraction, seed=split_seed)
    X, y = wide_features(train)
    X_test, y_test = wide_features(test)
    reproducible = seed is not None
    # secret: Philox keyed with 128 fresh bits (selection/keyed_random.py); --seed: tests only
    rng = np.random.default_rng(seed) if reproducible else NoiseKey.fresh().generator()
    out: dict = {"command": "wide-linear", "algorithm": algorithm, "data": str(data), "features": int(X.shape[1]),
                 "feature_nonzeros_per_example": len(train.meta.features), "steps": steps,
                 "randomness": ("reproducible: groups and noise come from --seed; ε holds only while it stays secret"
                                if reproducible else "secret: groups and noise come from fresh OS entropy")}
    data_events = [e for _, e in train.meta.privacy_events]
    if algorithm == "nonprivate":
        w = _nonprivate(X, y, l2)
        out.update(private=False, epsilon=math.inf, delta=0.0, accountant=None)  # JSON: "epsilon": null
    else:
        from widedp.sparse_learners.dp_erm import dp_erm_sparse

        m = num_groups or int(math.ceil(10 * math.sqrt(steps)))
        result = dp_erm_sparse(X, y, epsilon=epsilon, delta=delta, num_groups=m, steps=steps,
                               max_answers=min(max_answers, X.shape[1]), learning_rate=learning_rate,
                               gradient_bound=1.0 / math.sqrt(len(train.meta.features)), rng=rng,
                               calibration=calibration, l2=l2, threshold=threshold)
        w = result.w
        history = list(result.history) + [(e, 1) for e in data_events]
        total = make_accountant("rdp").epsilon(history, delta) if data_events else result.epsilon
        out.update(private=True, epsilon=float(total), delta=delta, accountant="rdp" if data_events else "best valid",
                   target_epsilon=epsilon, calibration=calibration, num_groups=m, max_answers=max_answers,
                   epsilon_prime=result.epsilon_prime, delta_prime=result.delta_prime,
                   threshold=result.threshold, sensitivity=result.sensitivity,
                   theorem1_condition_met=result.theorem1_condition_met,
                   answered_mean=float(np.mean(result.answered)),
                   accounting={k: (v if isinstance(v, (int, float, str)) else str(v))
                               for k, v in result.accounting.items()},
                   data_events=len(data_events))
    out["test_metrics"] = _metrics(X_test, y_test, w)
    out["seconds"] = round(time.time() - started, 3)
    if run_dir is not None:
        from widedp.accounting.atomic import atomic_write_bytes

        directory = Path(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(directory / "model.npz", w=w)
        from widedp.trainer import strict_json

        atomic_write_bytes(directory / "summary.json", strict_json.dumps(out, indent=2).encode())
        out["run_dir"] = str(directory)
    return out
