"""Calibration of a binary (CTR) model's probabilities on a held-out set, beside AUC and logloss.

AUC only ranks; users of a CTR model use its probabilities, so every evaluation also reports

- ``ece``: expected calibration error over ``ECE_BINS`` = 15 equal-width probability bins,
      ECE = Σ_b (n_b / n) · |mean(y)_b − mean(p)_b|  =  (1/n) Σ_b |Σ_{i∈b} (y_i − p_i)|,
  p_i = σ(z_i) the predicted probability, bin b = [b/15, (b+1)/15) (the last bin also holds
  p = 1), empty bins contributing 0. 0 for a calibrated predictor (up to sampling noise of order
  √(bins/n)); at most 1.
- ``base_rate_logloss``: the logloss of always predicting the evaluated set's own mean label
  ȳ, i.e. the binary entropy H(ȳ) = −ȳ log ȳ − (1 − ȳ) log(1 − ȳ) (0 when every label is the
  same). It is the reference a model's logloss must beat: a model above it does worse than a
  constant. Computed on the evaluated (held-out) set only — it uses that set's labels, like AUC,
  and is a held-out metric like the others (docs/THREAT_MODEL.md: not covered by ε).

Everything is float64 numpy, vectorized (one bincount); torch tensors are accepted and copied
to the CPU. Both the DLRM model (trainer/models/dlrm.py) and `widedp wide-linear`
(trainer/run/wide_linear.py) use `calibration_metrics`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ECE_BINS = 15


def _array(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (no torch import here: wide-linear runs without it)
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def sigmoid(logits: Any) -> np.ndarray:
    """σ(z) in float64, overflow-free."""
    z = _array(logits)
    return np.exp(-np.logaddexp(0.0, -z))


def bin_index(probs: Any, bins: int = ECE_BINS) -> np.ndarray:
    """The bin of each probability: b with edges[b] ≤ p < edges[b+1] over the edges
    np.linspace(0, 1, bins + 1), the last bin closed (p = 1 falls in it)."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    return np.clip(np.searchsorted(edges, _array(probs), side="right") - 1, 0, bins - 1)


def expected_calibration_error(probs: Any, labels: Any, bins: int = ECE_BINS) -> float:
    """Σ_b (n_b/n)·|mean(y)_b − mean(p)_b| over `bins` equal-width bins of [0, 1] (module
    docstring); nan for an empty set."""
    p, y = _array(probs), _array(labels)
    if p.shape != y.shape:
        raise ValueError(f"probabilities and labels differ in size: {p.size} vs {y.size}")
    if p.size == 0:
        return float("nan")
    residual = np.bincount(bin_index(p, bins), weights=y - p, minlength=bins)  # Σ_{i∈b} (y_i − p_i)
    return float(np.abs(residual).sum() / p.size)


def binary_entropy(rate: float) -> float:
    """H(r) in nats; 0 at r ∈ {0, 1}."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"a rate must be in [0, 1], got {rate}")
    return float(-sum(v * np.log(v) for v in (rate, 1.0 - rate) if v > 0))


def base_rate_logloss(labels: Any) -> float:
    """Logloss of predicting the set's own mean label for every example: H(mean(y)); nan for an
    empty set."""
    y = _array(labels)
    return binary_entropy(float(y.mean())) if y.size else float("nan")


def logloss_from_logits(logits: Any, labels: Any) -> float:
    """Mean binary cross-entropy of σ(z) against y, float64: mean(log(1 + e^z) − y·z)."""
    z, y = _array(logits), _array(labels)
    return float(np.mean(np.logaddexp(0.0, z) - y * z)) if z.size else float("nan")


def calibration_metrics(logits: Any, labels: Any, bins: int = ECE_BINS) -> dict[str, float]:
    """{"ece", "base_rate_logloss"} of the logits' probabilities on this (held-out) set; {} for
    an empty set."""
    y = _array(labels)
    if y.size == 0:
        return {}
    return {"ece": expected_calibration_error(sigmoid(logits), y, bins), "base_rate_logloss": base_rate_logloss(y)}
