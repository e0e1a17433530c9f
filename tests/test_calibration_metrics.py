"""Held-out calibration metrics (trainer/models/calibration_metrics.py): ECE and the base-rate
predictor's logloss, against slow obvious references, and in the models' metric dicts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from widedp.trainer.models.calibration_metrics import (ECE_BINS, base_rate_logloss, calibration_metrics,
                                                       expected_calibration_error, logloss_from_logits, sigmoid)


def _ece_reference(p, y, bins=ECE_BINS):
    """The definition, one bin at a time: Σ_b (n_b/n)·|mean(y)_b − mean(p)_b| over the bins
    [b/bins, (b+1)/bins) (the last one closed)."""
    p, y = [float(v) for v in p], [float(v) for v in y]
    edges = [b / bins for b in range(bins + 1)]
    total = 0.0
    for b in range(bins):
        lo, hi = edges[b], edges[b + 1]
        members = [i for i, v in enumerate(p) if lo <= v < hi or (b == bins - 1 and v == hi)]
        if members:
            mean_y = sum(y[i] for i in members) / len(members)
            mean_p = sum(p[i] for i in members) / len(members)
            total += len(members) / len(p) * abs(mean_y - mean_p)
    return total


def _base_rate_reference(y):
    """Logloss of predicting the mean label r for every example, summed example by example."""
    r = sum(y) / len(y)
    return sum(-(math.log(r) if v == 1 else math.log(1 - r)) for v in y) / len(y)


def _calibrated(n, seed=0):
    """p from a CTR-like spread (mean ≈ 0.25), y ~ Bernoulli(p): a perfectly calibrated predictor."""
    rng = np.random.default_rng(seed)
    z = rng.normal(-1.2, 1.0, size=n)
    p = sigmoid(z)
    return z, p, (rng.uniform(size=n) < p).astype(np.float64)


def test_ece_agrees_with_the_bin_loop_reference():
    rng = np.random.default_rng(1)
    for n, bins in ((1, ECE_BINS), (7, ECE_BINS), (500, ECE_BINS), (300, 4)):
        p = rng.uniform(size=n)
        y = (rng.uniform(size=n) < rng.uniform()).astype(np.float64)
        assert expected_calibration_error(p, y, bins) == pytest.approx(_ece_reference(p, y, bins), abs=1e-12)
    # probabilities exactly on the edges, 0 and 1 (the last bin is closed)
    edges = np.linspace(0, 1, ECE_BINS + 1)
    p = np.concatenate([edges, edges, [0.0, 1.0, 1.0]])
    y = (np.arange(p.size) % 3 == 0).astype(np.float64)
    assert expected_calibration_error(p, y) == pytest.approx(_ece_reference(p, y), abs=1e-12)
    # tensors are accepted (the DLRM model passes its outputs)
    assert expected_calibration_error(torch.tensor(p, dtype=torch.float32), torch.tensor(y)) == pytest.approx(
        _ece_reference(np.float32(p), y), abs=1e-6)


def test_ece_of_a_constant_predictor_is_its_distance_to_the_base_rate():
    y = np.array([1.0, 0, 0, 0, 1, 0, 0, 0])
    assert expected_calibration_error(np.full(8, 0.25), y) == pytest.approx(0.0, abs=1e-15)
    assert expected_calibration_error(np.full(8, 0.9), y) == pytest.approx(0.65)
    assert math.isnan(expected_calibration_error([], []))
    with pytest.raises(ValueError, match="differ in size"):
        expected_calibration_error([0.5, 0.5], [1.0])


def test_base_rate_logloss_is_the_logloss_of_the_mean_label():
    y = np.array([1.0, 0, 0, 1, 0, 0, 0, 0, 0, 1])
    assert base_rate_logloss(y) == pytest.approx(_base_rate_reference(list(y)), rel=1e-12)
    r = y.mean()  # the constant logit log(r/(1-r)) scores exactly the base rate
    assert logloss_from_logits(np.full(y.size, math.log(r / (1 - r))), y) == pytest.approx(base_rate_logloss(y), rel=1e-12)
    assert base_rate_logloss(np.ones(5)) == 0.0 and base_rate_logloss(np.zeros(5)) == 0.0
    assert calibration_metrics(np.zeros(0), np.zeros(0)) == {}


def test_a_calibrated_predictor_has_ece_near_zero_and_beats_the_base_rate():
    z, p, y = _calibrated(200_000)
    m = calibration_metrics(z, y)
    assert m["ece"] < 0.01  # sampling noise of order √(bins/n)·(1/√bins) ≈ 0.003
    assert logloss_from_logits(z, y) < m["base_rate_logloss"] - 0.05


def test_a_predictor_shifted_by_two_logits_is_miscalibrated_and_worse_than_the_base_rate():
    z, p, y = _calibrated(200_000)
    shifted = calibration_metrics(z + 2.0, y)
    assert shifted["ece"] > 0.25 > 20 * calibration_metrics(z, y)["ece"]
    # its ranking (AUC) is unchanged, but its probabilities are worse than a constant's
    assert logloss_from_logits(z + 2.0, y) > shifted["base_rate_logloss"] + 0.2
    assert shifted["base_rate_logloss"] == calibration_metrics(z, y)["base_rate_logloss"]  # labels only


def test_dlrm_metrics_carry_logloss_auc_ece_and_the_base_rate():
    from widedp.trainer.models import DLRM

    model = DLRM(features=["a", "b"], embedding_dim=4, num_dense=3, bottom_mlp=[4], top_mlp=[4])
    z, p, y = _calibrated(5000, seed=2)
    outputs, labels = torch.tensor(z + 2.0, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    m = model.metrics(outputs, labels)
    assert set(m) == {"logloss", "auc", "ece", "base_rate_logloss"}
    probs = torch.sigmoid(outputs).double().numpy()
    assert m["ece"] == pytest.approx(_ece_reference(probs, y), abs=1e-9)
    assert m["base_rate_logloss"] == pytest.approx(_base_rate_reference(list(y)), rel=1e-9)
    assert m["logloss"] == pytest.approx(logloss_from_logits(z + 2.0, y), rel=1e-5)
    assert m["logloss"] > m["base_rate_logloss"] and m["ece"] > 0.25
    one_class = model.metrics(outputs, torch.ones_like(labels))
    assert "auc" not in one_class and one_class["base_rate_logloss"] == 0.0


def test_wide_linear_metrics_carry_the_calibration_metrics():
    import scipy.sparse as sp

    from widedp.trainer.run.wide_linear import _metrics

    z, p, y = _calibrated(3000, seed=3)
    m = _metrics(sp.csr_matrix(z.reshape(-1, 1)), y, np.array([1.0]))  # X·w = z
    assert set(m) == {"auc", "logloss", "ece", "base_rate_logloss", "examples"}
    assert m["ece"] == pytest.approx(_ece_reference(p, y), abs=1e-9)
    assert m["base_rate_logloss"] == pytest.approx(_base_rate_reference(list(y)), rel=1e-9)
    assert m["logloss"] == pytest.approx(logloss_from_logits(z, y)) and m["logloss"] < m["base_rate_logloss"]
