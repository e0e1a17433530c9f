"""Seed D's bias-reduced estimator and DP-SGD (sparse_learners.bias_reduced_sgd): unbiasedness,
level law, calibration, privacy audit with a broken variant, clear errors."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import scipy.sparse as sp

from accounting import events as ev
from accounting.base import make_accountant
from sparse_learners import bias_reduced_sgd as br
from sparse_learners import linear_models as lm
from tests.privacy_audit import EventCounts, epsilon_lower_bound_both_directions


def _data(rng, n=64, d=6, s=3, loss="logistic"):
    cols = np.stack([rng.choice(d, size=s, replace=False) for _ in range(n)])
    X = sp.csr_matrix((rng.uniform(-1, 1, size=n * s), cols.ravel(), np.arange(0, n * s + 1, s)), shape=(n, d))
    y = rng.choice([-1.0, 1.0], size=n) if loss == "logistic" else rng.normal(size=n)
    return lm.check_data(X, y, loss)


def _clipped_mean_gradient_dense(data, w, clip):
    Xd = data.X.toarray()
    scal = lm.loss_derivative(data.loss, Xd @ w, data.y)
    g = Xd * scal[:, None]
    norms = np.linalg.norm(g, axis=1)
    g *= np.minimum(1.0, clip / np.where(norms > 0, norms, 1.0))[:, None]
    return g.mean(axis=0)


@pytest.mark.parametrize("noise_multiplier", [0.0, 0.3])
def test_estimator_is_unbiased_for_the_clipped_mean_gradient(noise_multiplier):
    rng = np.random.default_rng(0)
    data = _data(rng, loss="squared")
    w = rng.normal(size=6)
    clip = 0.8  # active for some examples: the target is the mean of *clipped* gradients
    ref = _clipped_mean_gradient_dense(data, w, clip)
    draws = np.array([br.bias_reduced_gradient(data, w, clip=clip, noise_multiplier=noise_multiplier, rng=rng).gradient
                      for _ in range(4000)])
    band = 5.0 * draws.std(axis=0, ddof=1) / math.sqrt(draws.shape[0])  # 5 standard errors per coordinate
    assert np.all(np.abs(draws.mean(axis=0) - ref) <= band), (draws.mean(axis=0) - ref, band)


def test_level_correction_is_exactly_zero_without_noise_for_the_linear_mean_estimator():
    rng = np.random.default_rng(1)
    data = _data(rng)
    w = rng.normal(size=6)
    rng_a, rng_b = np.random.default_rng(7), np.random.default_rng(7)
    est = br.bias_reduced_gradient(data, w, clip=1.0, noise_multiplier=0.0, rng=rng_a)
    # Replay the same draws: N, the batch, then i; 𝒢 must equal the single-example gradient G_i.
    p = br.level_probabilities(br.num_levels(64))
    rng_b.random()
    rng_b.choice(64, size=2 ** (est.level + 1), replace=False)
    i = rng_b.integers(64, size=1)
    g_i = _clipped_mean_gradient_dense(lm.Dataset(data.X[i], data.y[i], data.loss), w, 1.0)
    np.testing.assert_allclose(est.gradient, g_i, atol=1e-12)
    assert est.p_level == pytest.approx(p[est.level - 1])


def test_levels_follow_p_k_proportional_to_two_to_minus_k():
    rng = np.random.default_rng(2)
    data = _data(rng, n=256)  # K = 7
    K = br.num_levels(256)
    assert K == 7 and 2 ** (K + 1) <= 256
    draws = np.array([br.bias_reduced_gradient(data, np.zeros(6), clip=1.0, noise_multiplier=0.0, rng=rng).level
                      for _ in range(3000)])
    p = br.level_probabilities(K)
    freq = np.bincount(draws, minlength=K + 1)[1:] / draws.size
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / draws.size) + 1e-3)


def test_calibrated_noise_multiplier_spends_the_target_and_not_more():
    z = br.calibrate_noise_multiplier(3.0, 1e-5, 50)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spent = make_accountant("rdp").epsilon(br.run_history(z, 50), 1e-5)
    assert spent <= 3.0 and spent == pytest.approx(3.0, rel=1e-4)
    # Three Gaussians of multiplier z per step are one Gaussian of multiplier z/√3 (zCDP adds).
    assert ev.gaussian_noise_multiplier(br.step_event(z)) == pytest.approx(z / math.sqrt(3))


def test_low_noise_dp_sgd_decreases_loss_and_stays_in_the_ball():
    rng = np.random.default_rng(3)
    n, d = 512, 40
    X = sp.random(n, d, density=0.1, format="csr", random_state=3)
    w_star = 4.0 * rng.normal(size=d)
    y = np.where(rng.random(n) < 1 / (1 + np.exp(-(X @ w_star))), 1.0, -1.0)
    data = lm.check_data(X, y, "logistic")
    res = br.bias_reduced_dp_sgd(X, y, epsilon=1.0, delta=1e-5, steps=300, learning_rate=0.5, clip=5.0, radius=3.0,
                                 rng=rng, noise_multiplier=1e-3)  # explicit tiny noise: checks the optimizer
    assert np.linalg.norm(res.w) <= 3.0 + 1e-9 and np.linalg.norm(res.w_average) <= 3.0 + 1e-9
    assert lm.empirical_loss(data, res.w_average) < lm.empirical_loss(data, np.zeros(d)) - 0.01
    assert res.epsilon > 1e3 and res.history == [(br.step_event(res.noise_multiplier), 300)]


@pytest.mark.parametrize("change, match", [
    (dict(X=sp.csr_matrix(np.eye(3)), y=np.ones(3)), "needs n >= 4"),
    (dict(clip=0.0), "clip must be"),
    (dict(radius=-1.0), "radius must be"),
    (dict(steps=0), "steps must be an integer"),
    (dict(delta=0.0), "delta must be in"),
    (dict(y=np.array([1.0, 0.5, 1.0, 1.0])), r"y\[1\] = 0.5"),
    (dict(noise_multiplier=-2.0), "noise_multiplier must be"),
])
def test_invalid_input_raises_value_error_naming_it(change, match):
    kwargs = dict(X=sp.csr_matrix(np.eye(4)), y=np.array([1.0, -1.0, 1.0, -1.0]), epsilon=1.0, delta=1e-5, steps=2,
                  learning_rate=0.1, clip=1.0, radius=1.0, rng=np.random.default_rng(0))
    kwargs.update(change)
    X, y = kwargs.pop("X"), kwargs.pop("y")
    with pytest.raises(ValueError, match=match):
        br.bias_reduced_dp_sgd(X, y, **kwargs)


# ---- statistical privacy audit ------------------------------------------------------------------
# One estimator call (T = 1), claimed ε = 2 at δ = 1e-5 (z calibrated by RDP). Worst-case
# neighbours: D = 4 examples whose clipped gradient is -L·e₀ (squared loss, feature 1 on
# coordinate 0, label 5: φ' = -5 clipped to -L), D' = D + x with gradient +L·e₀. With n = 4 and 5
# the only level is N = 1 (p₁ = 1) and B = O ∪ E, so the level term has mean 0 on both and x moves
# 𝒢₀ only through G_i (by 2L, when i = x). Under D, 𝒢₀ = -L + noise of std σ = z·L·√(1/4 + 1/2 + 4)
# (G_B, ½(G_O + G_E), G_i). Event (fixed in advance from that): 𝒢₀ > -L + 3σ; complement reversed.

AUDIT_EPS, AUDIT_DELTA, AUDIT_TRIALS = 2.0, 1e-5, 10000


def _audit(monkeypatch, noise_factor: float):
    z = br.calibrate_noise_multiplier(AUDIT_EPS, AUDIT_DELTA, 1)
    if noise_factor != 1.0:
        real = br._gaussian_mean
        monkeypatch.setattr(br, "_gaussian_mean",
                            lambda data, rows, scalars, clip, zz, rng: real(data, rows, scalars, clip, zz * noise_factor, rng))
    d = 2
    X_d = sp.csr_matrix((np.ones(4), (np.arange(4), np.zeros(4, dtype=int))), shape=(4, d))
    X_dp = sp.vstack([X_d, sp.csr_matrix(([1.0], ([0], [0])), shape=(1, d))], format="csr")
    D = lm.check_data(X_d, np.full(4, 5.0), "squared")
    Dp = lm.check_data(X_dp, np.append(np.full(4, 5.0), -5.0), "squared")
    sigma = noise_factor * z * math.sqrt(0.25 + 0.5 + 4.0)
    cut = -1.0 + 3.0 * sigma
    rng = np.random.default_rng(2024)
    w = np.zeros(d)

    def hits(data, norms):
        return sum(br.bias_reduced_gradient(data, w, clip=1.0, noise_multiplier=z, rng=rng, l2_norms=norms).gradient[0] > cut
                   for _ in range(AUDIT_TRIALS))

    h_dp, h_d = int(hits(Dp, np.ones(5))), int(hits(D, np.ones(4)))
    bound = epsilon_lower_bound_both_directions(
        EventCounts(h_dp, AUDIT_TRIALS), EventCounts(h_d, AUDIT_TRIALS), AUDIT_DELTA,
        reverse_event_on_d=EventCounts(AUDIT_TRIALS - h_dp, AUDIT_TRIALS),
        reverse_event_on_dprime=EventCounts(AUDIT_TRIALS - h_d, AUDIT_TRIALS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        claimed = make_accountant("rdp").epsilon(br.run_history(z, 1), AUDIT_DELTA)
    return bound, claimed


def test_bias_reduced_step_privacy_audit_lower_bound_is_within_the_claimed_epsilon(monkeypatch):
    bound, claimed = _audit(monkeypatch, 1.0)
    assert claimed <= AUDIT_EPS
    assert bound.eps_lb <= claimed, str(bound)


def test_bias_reduced_step_privacy_audit_catches_noise_divided_by_10(monkeypatch):
    bound, claimed = _audit(monkeypatch, 0.1)
    assert bound.eps_lb > claimed, str(bound)
