"""Seed D's bias-reduced estimator and DP-SGD (sparse_learners.bias_reduced_sgd): unbiasedness
(Gaussian: for the clipped mean gradient; projection: for the full-batch projection mechanism's
mean, which the single-level estimate misses), level law, calibration, privacy audits with a broken
variant for both mean estimators, clear errors."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from scipy import stats

from widedp.accounting import events as ev
from widedp.accounting.base import make_accountant
from widedp.sparse_learners import bias_reduced_sgd as br
from widedp.sparse_learners import linear_models as lm
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


@pytest.mark.parametrize("estimator", ["gaussian", "projection"])
def test_level_correction_is_exactly_zero_without_noise(estimator):
    # Without noise the projection is the identity (the clipped mean is in the ℓ1 ball of radius
    # L√s), so both estimators reduce to the linear one and B = O ∪ E cancels the correction.
    rng = np.random.default_rng(1)
    data = _data(rng)
    w = rng.normal(size=6)
    rng_a, rng_b = np.random.default_rng(7), np.random.default_rng(7)
    est = br.bias_reduced_gradient(data, w, clip=1.0, noise_multiplier=0.0, rng=rng_a, mean_estimator=estimator,
                                   sparsity=3 if estimator == "projection" else None)
    # Replay the same draws: N, the batch, then i; 𝒢 must equal the single-example gradient G_i.
    p = br.level_probabilities(br.num_levels(64))
    rng_b.random()
    rng_b.choice(64, size=2 ** (est.level + 1), replace=False)
    i = rng_b.integers(64, size=1)
    g_i = _clipped_mean_gradient_dense(lm.Dataset(data.X[i], data.y[i], data.loss), w, 1.0)
    np.testing.assert_allclose(est.gradient, g_i, atol=1e-12)
    np.testing.assert_allclose(est.correction, 0.0, atol=1e-12)
    assert est.p_level == pytest.approx(p[est.level])


def test_levels_follow_p_k_proportional_to_two_to_minus_k():
    rng = np.random.default_rng(2)
    data = _data(rng, n=256)  # K = 7
    K = br.num_levels(256)  # levels N = 0..7, batches 2..256
    assert K == 7 and 2 ** (K + 1) <= 256
    draws = np.array([br.bias_reduced_gradient(data, np.zeros(6), clip=1.0, noise_multiplier=0.0, rng=rng).level
                      for _ in range(3000)])
    p = br.level_probabilities(K)
    assert p.size == K + 1
    freq = np.bincount(draws, minlength=K + 1) / draws.size
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
    (dict(X=sp.csr_matrix(np.eye(1)), y=np.ones(1)), "needs n >= 2"),
    (dict(clip=0.0), "clip must be"),
    (dict(radius=-1.0), "radius must be"),
    (dict(steps=0), "steps must be an integer"),
    (dict(delta=0.0), "delta must be in"),
    (dict(y=np.array([1.0, 0.5, 1.0, 1.0])), r"y\[1\] = 0.5"),
    (dict(noise_multiplier=-2.0), "noise_multiplier must be"),
    (dict(mean_estimator="laplace"), "mean_estimator must be one of"),
    (dict(mean_estimator="projection"), "needs sparsity = s"),
    (dict(mean_estimator="projection", sparsity=0), "needs sparsity = s"),
    (dict(sparsity=2), "only used by mean_estimator='projection'"),
    (dict(X=sp.csr_matrix(np.array([[1.0, 0, 0], [0, 1, 0], [0.5, 0, 0.5], [0, 0, 1]])), mean_estimator="projection",
          sparsity=1), "row 2 of X has 2 nonzeros > s = 1"),
])
def test_invalid_input_raises_value_error_naming_it(change, match):
    kwargs = dict(X=sp.csr_matrix(np.eye(4)), y=np.array([1.0, -1.0, 1.0, -1.0]), epsilon=1.0, delta=1e-5, steps=2,
                  learning_rate=0.1, clip=1.0, radius=1.0, rng=np.random.default_rng(0))
    kwargs.update(change)
    X, y = kwargs.pop("X"), kwargs.pop("y")
    with pytest.raises(ValueError, match=match):
        br.bias_reduced_dp_sgd(X, y, **kwargs)


# ---- projection estimator: what 𝒢 is unbiased for ------------------------------------------------
# Module docstring: E𝒢 = μ_M, M = 2^{K+1}, μ_m = E[Π(mean of a uniform m-subset + N(0, (2zL/m)² I))],
# Π onto the ℓ1 ball of radius L√s. With n = M (a power of two) the subset is the data set, so
# μ_M = E_ξ Π(ḡ + ξ), computed here by Monte Carlo with an independent, vectorized projection.
# The single-level projection estimate G_i (= `Estimate.base`) has mean μ_1 ≠ μ_M.
# Bands: per coordinate, q standard errors of the difference of two independent means, q the
# two-sided normal quantile at family-wise level ALPHA split over the d coordinates (Bonferroni).

ALPHA = 1e-4


def _project_rows_l1(V, r):
    """Euclidean projection of every row of V onto the ℓ1 ball of radius r (Duchi et al. 2008)."""
    A = np.abs(V)
    mu = -np.sort(-A, axis=1)
    cs = np.cumsum(mu, axis=1)
    rho = (mu * np.arange(1, V.shape[1] + 1) > cs - r).sum(axis=1)
    theta = np.maximum((cs[np.arange(V.shape[0]), rho - 1] - r) / rho, 0.0)
    return np.where(A.sum(axis=1, keepdims=True) <= r, V, np.sign(V) * np.maximum(A - theta[:, None], 0.0))


def _one_sparse_data(rng, n, d, flip):
    """Squared loss at w = 0 with 1-sparse rows e_j and labels ±2: clipped gradients ∓L·e_j (L = 1)."""
    cols = rng.choice(d, size=n, p=np.linspace(2.0, 1.0, d) / np.linspace(2.0, 1.0, d).sum())
    X = sp.csr_matrix((np.ones(n), (np.arange(n), cols)), shape=(n, d))
    y = np.where(rng.random(n) < flip, 2.0, -2.0)
    return lm.check_data(X, y, "squared")


@pytest.mark.parametrize("n, z, full_batch_bias_detectable", [(16, 1.0, False), (4, 2.0, True)])
def test_projection_estimator_is_unbiased_for_the_full_batch_projection_mechanism(n, z, full_batch_bias_detectable):
    rng = np.random.default_rng(11)
    d, L, s, draws = 3, 1.0, 1, 8000
    data = _one_sparse_data(rng, n, d, flip=0.1)
    w = np.zeros(d)
    gbar = _clipped_mean_gradient_dense(data, w, L)
    M = 2 ** (br.num_levels(n) + 1)
    assert M == n
    mc = _project_rows_l1(gbar + rng.normal(0.0, z * 2 * L / M, size=(400_000, d)), L * math.sqrt(s))
    target, se_target = mc.mean(axis=0), mc.std(axis=0, ddof=1) / math.sqrt(mc.shape[0])
    norms = lm.row_norms(data.X, "2")
    ests = [br.bias_reduced_gradient(data, w, clip=L, noise_multiplier=z, rng=rng, l2_norms=norms,
                                     mean_estimator="projection", sparsity=s) for _ in range(draws)]
    G = np.array([e.gradient for e in ests])
    base = np.array([e.base for e in ests])  # the single-level (one-example) projection estimate
    corr = np.array([e.correction for e in ests])
    q = stats.norm.ppf(1 - ALPHA / (2 * d))

    def se(a):
        return a.std(axis=0, ddof=1) / math.sqrt(a.shape[0])

    band = q * np.hypot(se(G), se_target)
    assert np.all(np.abs(G.mean(axis=0) - target) <= band), (G.mean(axis=0), target, band)
    # The single-level estimate is biased against the same target: its deviation exceeds its band.
    base_band = q * np.hypot(se(base), se_target)
    assert np.any(np.abs(base.mean(axis=0) - target) > base_band), (base.mean(axis=0), target, base_band)
    # Hence the level correction is not zero-mean (unlike the Gaussian estimator's): it carries μ_M − μ_1.
    assert np.any(np.abs(corr.mean(axis=0)) > q * se(corr)), (corr.mean(axis=0), se(corr))
    # Unbiased for μ_M, not for ḡ: where the full-batch projection bias is large, 𝒢 misses ḡ.
    gbar_miss = np.abs(G.mean(axis=0) - gbar) > q * se(G)
    assert gbar_miss.any() == full_batch_bias_detectable, (G.mean(axis=0), gbar, q * se(G))


def test_projection_estimator_names_a_drawn_row_that_breaks_the_sparsity_bound():
    X = sp.csr_matrix(np.array([[1.0, 1.0, 0.0]] * 4))  # every row has 2 nonzeros
    data = lm.check_data(X, np.ones(4), "squared")
    with pytest.raises(ValueError, match=r"row \d of X has 2 nonzeros > s = 1"):
        br.bias_reduced_gradient(data, np.zeros(3), clip=1.0, noise_multiplier=1.0, rng=np.random.default_rng(0),
                                 mean_estimator="projection", sparsity=1)


# ---- statistical privacy audit ------------------------------------------------------------------
# One estimator call (T = 1), claimed ε = 2 at δ = 1e-5 (z calibrated by RDP). Worst-case
# neighbours: D = 4 examples whose clipped gradient is -L·e₀ (squared loss, feature 1 on
# coordinate 0, label 5: φ' = -5 clipped to -L), D' = D + x with gradient +L·e₀. With n = 4 and 5,
# K = 1: levels N ∈ {0, 1}, p = (2/3, 1/3).
# Both audits look at the single-example release G_i (`Estimate.base`; a component of the step's
# release, which the claimed event covers): x moves it by 2L when i = x (probability 1/5). An event
# on 𝒢₀ = correction₀ + G_i,₀ has less power now that N = 0 is a level: given N = k the Gaussian
# correction's std is (1/p_k)·zL·√(4^{-k} + ½·4·4^{-k}) = √3·c·zL, c = Σ_{k≤K} 2^{-k} = 3/2, which
# swamps G_i's 2zL (at noise z/10, 10000 trials give only eps_lb ≈ 0.9 with the 𝒢₀ > -L + 3σ event).
# Gaussian estimator: under D, G_i,₀ = -L + N(0, (2zL)²). Event (fixed in advance):
# G_i,₀ > -L + 3.5·2zL; complement reversed. At z/10: ≈ 2.3e-4 on D vs ≈ 0.2·0.21 on D'.
# Projection estimator (s = 1, ℓ1 radius L): "G_i is the vertex +L·e₀",
# i.e. G_i,₀ ≥ L(1 − 1e-9). Π(v) is that vertex iff v₀ − |v₁| ≥ L; under D, v = -L·e₀ + ξ (std 2zL per
# coordinate), which needs ξ₀ − |ξ₁| ≥ 2L; under D' with i = x (probability 1/5) it needs only
# ξ₀ − |ξ₁| ≥ 0 (probability 1/4). At noise z/10 that is ≈ 1e-3 vs ≈ 5e-2: ε ≈ 3.9 > 2, caught.

AUDIT_EPS, AUDIT_DELTA = 2.0, 1e-5
AUDIT_TRIALS = {"gaussian": 10000, "projection": 20000}


def _audit(monkeypatch, noise_factor: float, estimator: str = "gaussian"):
    z = br.calibrate_noise_multiplier(AUDIT_EPS, AUDIT_DELTA, 1)
    if noise_factor != 1.0:  # the one noise path, shared by both estimators
        real = br._gaussian_mean
        monkeypatch.setattr(br, "_gaussian_mean",
                            lambda data, rows, scalars, clip, zz, rng: real(data, rows, scalars, clip, zz * noise_factor, rng))
    d = 2
    X_d = sp.csr_matrix((np.ones(4), (np.arange(4), np.zeros(4, dtype=int))), shape=(4, d))
    X_dp = sp.vstack([X_d, sp.csr_matrix(([1.0], ([0], [0])), shape=(1, d))], format="csr")
    D = lm.check_data(X_d, np.full(4, 5.0), "squared")
    Dp = lm.check_data(X_dp, np.append(np.full(4, 5.0), -5.0), "squared")
    assert br.num_levels(4) == br.num_levels(5) == 1
    cut = -1.0 + 3.5 * noise_factor * z * 2.0
    rng = np.random.default_rng(2024)
    w = np.zeros(d)
    trials = AUDIT_TRIALS[estimator]
    sparsity = 1 if estimator == "projection" else None

    def event(est):
        return est.base[0] >= 1.0 - 1e-9 if estimator == "projection" else est.base[0] > cut

    def hits(data, norms):
        return sum(event(br.bias_reduced_gradient(data, w, clip=1.0, noise_multiplier=z, rng=rng, l2_norms=norms,
                                                  mean_estimator=estimator, sparsity=sparsity))
                   for _ in range(trials))

    h_dp, h_d = int(hits(Dp, np.ones(5))), int(hits(D, np.ones(4)))
    bound = epsilon_lower_bound_both_directions(
        EventCounts(h_dp, trials), EventCounts(h_d, trials), AUDIT_DELTA,
        reverse_event_on_d=EventCounts(trials - h_dp, trials),
        reverse_event_on_dprime=EventCounts(trials - h_d, trials))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        claimed = make_accountant("rdp").epsilon(br.run_history(z, 1), AUDIT_DELTA)
    return bound, claimed


@pytest.mark.parametrize("estimator", ["gaussian", "projection"])
def test_bias_reduced_step_privacy_audit_lower_bound_is_within_the_claimed_epsilon(monkeypatch, estimator):
    bound, claimed = _audit(monkeypatch, 1.0, estimator)
    assert claimed <= AUDIT_EPS
    assert bound.eps_lb <= claimed, str(bound)


@pytest.mark.parametrize("estimator", ["gaussian", "projection"])
def test_bias_reduced_step_privacy_audit_catches_noise_divided_by_10(monkeypatch, estimator):
    bound, claimed = _audit(monkeypatch, 0.1, estimator)
    assert bound.eps_lb > claimed, str(bound)
