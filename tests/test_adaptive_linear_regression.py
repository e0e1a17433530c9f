"""Seed C's one-pass private linear regression: DP-AMBSSGD, fixed-clip DP-SSGD, non-private SGD."""

from __future__ import annotations

import math

import numpy as np
import pytest

from widedp.accounting.base import make_accountant
from widedp.accounting.events import GaussianDpEvent, NonPrivateDpEvent, SelfComposedDpEvent
from widedp.adaptive_clipping import dp_stat as ds
from widedp.adaptive_clipping import linear_regression as lr
from tests import privacy_audit as pa


def _problem(n=20_000, d=10, noise=0.1, seed=0):
    rng = np.random.default_rng(seed)
    w_star = rng.normal(size=d)
    w_star /= np.linalg.norm(w_star)
    X = rng.normal(size=(n, d))
    return X, X @ w_star + noise * rng.normal(size=n), w_star


def test_zcdp_conversion_is_the_stated_formula_and_its_inverse_is_exact():
    assert lr.zcdp_epsilon(0.5, 1e-5) == pytest.approx(0.5 + 2 * math.sqrt(0.5 * math.log(1e5)))
    for eps in (0.1, 1.0, 8.0):
        assert lr.zcdp_epsilon(lr.zcdp_rho_for_epsilon(eps, 1e-6), 1e-6) == pytest.approx(eps)


def test_update_noise_multiplier_makes_one_replace_one_update_rho_zcdp():
    sigma = lr.update_noise_multiplier(0.08)
    # sensitivity 2γ/b, noise σγ/b: ρ = (2/σ)²/2
    assert (2 / sigma) ** 2 / 2 == pytest.approx(0.08)
    assert lr.update_event(sigma) == GaussianDpEvent(sigma / 2)


def test_replacing_one_example_moves_the_clipped_mean_by_at_most_two_clip_norms_over_b():
    rng = np.random.default_rng(1)
    for _ in range(100):
        g = rng.normal(scale=rng.uniform(0.1, 10), size=(16, 5))
        g2 = g.copy()
        g2[3] = rng.normal(scale=50, size=5)
        gamma = rng.uniform(0.1, 5)
        diff = lr.clip_rows(g, gamma).mean(axis=0) - lr.clip_rows(g2, gamma).mean(axis=0)
        assert np.linalg.norm(diff) <= 2 * gamma / 16 + 1e-12


def test_dp_ambssgd_run_is_max_of_update_and_stat_rho_by_parallel_composition():
    X, y, _ = _problem(n=3000)
    out = lr.dp_ambssgd(X, y, rho=0.3, batch_size=100, stat_size=50, lr=0.5, theta=1e-3, num_doublings=15,
                        rng=np.random.default_rng(0))
    assert out.steps == 3000 // 150 and out.unused == 0
    sigma_u = lr.update_noise_multiplier(0.3)
    sigma_c = ds.count_noise_std(0.3, 15)
    assert out.events["update"] == GaussianDpEvent(sigma_u / 2)
    assert out.events["dp_stat"] == SelfComposedDpEvent(GaussianDpEvent(sigma_c), 16)
    rdp = make_accountant("rdp")
    # both parts are 0.3-zCDP; the run's event is one of them, not their sum
    assert rdp.epsilon([(out.event, 1)], 1e-5) == pytest.approx(rdp.epsilon([(out.events["update"], 1)], 1e-5))
    assert out.rho == 0.3
    assert rdp.epsilon([(out.event, 1)], 1e-5) <= out.epsilon(1e-5)  # RDP's conversion is tighter


def test_dp_ambssgd_recovers_the_model_at_a_large_budget_and_its_clip_norm_tracks_the_residual():
    X, y, w_star = _problem(n=40_000, noise=0.01)
    out = lr.dp_ambssgd(X, y, rho=5.0, batch_size=400, stat_size=200, lr=0.9, theta=1e-4, num_doublings=20,
                        rng=np.random.default_rng(2))
    assert np.sum((out.w - w_star) ** 2) < 1e-4
    # early steps clip at the scale of ‖x‖·|y| ~ √d, late steps at ~√d·σ_obs
    assert out.clip_norms[0] > 1.0 and out.clip_norms[-1] < 0.2


def test_dp_ambssgd_error_shrinks_with_the_observation_noise_but_fixed_clipping_keeps_a_privacy_floor():
    results = {}
    for noise in (1.0, 0.01):
        X, y, w_star = _problem(n=40_000, noise=noise, seed=3)
        kw = dict(lr=0.9, rng=np.random.default_rng(4))
        amb = lr.dp_ambssgd(X, y, rho=0.5, batch_size=400, stat_size=200, theta=1e-4, num_doublings=20, **kw)
        fixed = lr.dp_ssgd(X, y, rho=0.5, batch_size=400, clip_norm=1.0, **kw)
        plain = lr.sgd(X, y, batch_size=400, **kw)
        results[noise] = [float(np.sum((r.w - w_star) ** 2)) for r in (amb, fixed, plain)]
    amb_err, fixed_err, sgd_err = results[0.01]
    assert amb_err < 1e-2 * results[1.0][0]  # adaptive: shrinks with σ_obs² (10⁴ here)
    assert fixed_err > 10 * sgd_err  # fixed clip: its noise σC/b does not shrink, privacy error dominates
    assert amb_err < fixed_err / 5


def test_non_private_sgd_converges_and_says_it_is_not_private():
    X, y, w_star = _problem(n=20_000, noise=0.1)
    out = lr.sgd(X, y, batch_size=200, lr=0.9, rng=np.random.default_rng(0))
    assert np.sum((out.w - w_star) ** 2) < 1e-3
    assert out.event == NonPrivateDpEvent() and math.isinf(out.epsilon(1e-5))


def test_each_example_is_read_by_exactly_one_block(monkeypatch):
    seen: list[np.ndarray] = []
    real = lr.per_example_gradients

    def spy(X, y, w):
        seen.append(X[:, 0].copy())
        return real(X, y, w)

    monkeypatch.setattr(lr, "per_example_gradients", spy)
    X = np.arange(1.0, 1.0 + 3 * 23).reshape(-1, 1)  # distinct ids in column 0
    lr.dp_ambssgd(np.hstack([X, X]), np.zeros(69), rho=1.0, batch_size=15, stat_size=8, lr=0.01, theta=1.0,
                  num_doublings=3, rng=np.random.default_rng(0))
    ids = np.concatenate(seen)
    assert ids.size == 69 and np.unique(ids).size == 69


def test_tail_average_is_the_mean_of_the_last_half_of_the_iterates():
    assert np.allclose(lr._tail_average([np.array([float(i)]) for i in range(10)], 0.5), [7.0])


@pytest.mark.parametrize("kwargs, name", [
    (dict(rho=0.0), "rho"), (dict(batch_size=0), "batch_size"), (dict(stat_size=1.5), "stat_size"),
    (dict(lr=-1.0), "lr"), (dict(theta=0.0), "theta"), (dict(num_doublings=-2), "num_doublings"),
    (dict(beta=2.0), "beta"), (dict(tail_fraction=0.0), "tail_fraction"), (dict(rng=None), "rng"),
    (dict(batch_size=5000), "batch_size"), (dict(w0=np.zeros(3)), "w0"), (dict(y=np.zeros(5)), "y"),
])
def test_bad_input_raises_value_error_naming_the_parameter(kwargs, name):
    X, y, _ = _problem(n=500)
    args = dict(X=X, y=y, rho=1.0, batch_size=50, stat_size=20, lr=0.5, theta=1e-3, num_doublings=10,
                rng=np.random.default_rng(0))
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        lr.dp_ambssgd(args.pop("X"), args.pop("y"), **args)


def test_dp_ssgd_reports_unamplified_accounting_and_refuses_shuffling_amplification_saying_why():
    X, y, _ = _problem(n=400)
    kw = dict(rho=0.5, lr=0.5, clip_norm=1.0)
    out = lr.dp_ssgd(X, y, batch_size=1, rng=np.random.default_rng(0), **kw)
    assert out.events["amplification"] == "none" and (out.noise, out.accounting, out.eps0) == ("gaussian", "zcdp", None)
    assert out.epsilon(1e-6) == pytest.approx(lr.zcdp_epsilon(0.5, 1e-6))  # the plain parallel-composition ε
    with pytest.raises(ValueError, match="batch_size = 1.*not a local randomizer of one record"):
        lr.dp_ssgd(X, y, batch_size=4, amplification="shuffling", rng=np.random.default_rng(0), **kw)
    with pytest.raises(ValueError, match="could not be verified"):
        lr.dp_ssgd(X, y, batch_size=1, amplification="shuffling", rng=np.random.default_rng(0), **kw)
    with pytest.raises(ValueError, match="^amplification "):
        lr.dp_ssgd(X, y, batch_size=1, amplification="subsampling", rng=np.random.default_rng(0), **kw)


# ---- statistical privacy audits ----------------------------------------------------------------
#
# Worst-case replace-one neighbours for one step, d = 1, w0 = 0: every example but one has
# x = 0, y = 0 (gradient 0, also in DP-STAT's fresh points, which therefore returns γ = θ but
# with probability ≤ β); the differing example has x = 1 and y = +Y (D) or y = -Y (D'), Y ≫ γ,
# so its gradient -y is clipped to ∓γ: the two outputs are (η/b)(γ - σγξ) and (η/b)(-γ - σγξ),
# means 2ηγ/b apart, the full sensitivity. Pre-specified event: w·b/(ηθ) > 0.5.

AUDIT_RHO, AUDIT_DELTA, AUDIT_TRIALS, AUDIT_B, AUDIT_THETA = 0.5, 1e-5, 20_000, 4, 1.0


def _neighbours(n: int):
    X = np.zeros((n, 1))
    X[0, 0] = 1.0
    y_d, y_dprime = np.zeros(n), np.zeros(n)
    y_d[0], y_dprime[0] = 100.0, -100.0
    return X, y_d, y_dprime


def _run_amb(X, y, rng):
    return lr.dp_ambssgd(X, y, rho=AUDIT_RHO, batch_size=AUDIT_B, stat_size=1, lr=1.0, theta=AUDIT_THETA,
                         num_doublings=2, beta=1e-3, rng=rng).w[0]


def _run_fixed(X, y, rng):
    return lr.dp_ssgd(X, y, rho=AUDIT_RHO, batch_size=AUDIT_B, lr=1.0, clip_norm=AUDIT_THETA, rng=rng).w[0]


def _audit(run, n: int, monkeypatch, noise_divisor: float) -> pa.EpsilonLowerBound:
    if noise_divisor != 1.0:
        real = lr.update_noise_std
        monkeypatch.setattr(lr, "update_noise_std", lambda c, s, b: real(c, s, b) / noise_divisor)
    X, y_d, y_dprime = _neighbours(n)
    rng = np.random.default_rng(99)

    def event(w: float) -> bool:
        return w * AUDIT_B / AUDIT_THETA > 0.5

    on_d = pa.run_trials(lambda: run(X, y_d, rng), event, AUDIT_TRIALS)
    on_dprime = pa.run_trials(lambda: run(X, y_dprime, rng), event, AUDIT_TRIALS)
    return pa.epsilon_lower_bound(on_d, on_dprime, delta=AUDIT_DELTA)


def _claimed() -> float:
    event = lr.update_event(lr.update_noise_multiplier(AUDIT_RHO))
    return make_accountant("rdp").epsilon([(event, 1)], AUDIT_DELTA)


@pytest.mark.parametrize("run, n", [(_run_amb, AUDIT_B + 1), (_run_fixed, AUDIT_B)], ids=["dp_ambssgd", "dp_ssgd"])
def test_one_pass_regression_passes_a_worst_case_privacy_audit(run, n, monkeypatch):
    bound = _audit(run, n, monkeypatch, noise_divisor=1.0)
    assert bound.eps_lb <= _claimed() <= lr.zcdp_epsilon(AUDIT_RHO, AUDIT_DELTA), str(bound)


@pytest.mark.parametrize("run, n", [(_run_amb, AUDIT_B + 1), (_run_fixed, AUDIT_B)], ids=["dp_ambssgd", "dp_ssgd"])
def test_the_audit_catches_the_update_noise_divided_by_ten(run, n, monkeypatch):
    bound = _audit(run, n, monkeypatch, noise_divisor=10.0)
    assert bound.eps_lb > _claimed(), str(bound)


# ---- DP-SSGD with Laplace noise: pure ε₀-DP steps, amplification by shuffling at b = 1 -----------

def test_l1_clipped_rows_move_by_at_most_two_clip_norms_in_l1_while_l2_clipping_needs_sqrt_d():
    rng = np.random.default_rng(5)
    d, C = 7, 1.3
    for _ in range(200):
        u, v = rng.normal(scale=rng.uniform(0.01, 10), size=(2, 1, d))
        assert np.abs(lr.clip_rows_l1(u, C) - lr.clip_rows_l1(v, C)).sum() <= 2 * C + 1e-12
    # the bounds are attained: v = -u for the ℓ1 clip; u = C(1..1)/√d = -v for the ℓ2 clip (2C√d)
    u = np.full((1, d), 10.0)
    assert np.abs(lr.clip_rows_l1(u, C) - lr.clip_rows_l1(-u, C)).sum() == pytest.approx(2 * C)
    assert np.abs(lr.clip_rows(u, C) - lr.clip_rows(-u, C)).sum() == pytest.approx(2 * C * math.sqrt(d))
    assert lr.laplace_noise_scale(C, 0.5, 4) == pytest.approx(2 * C / (4 * 0.5))


def test_dp_ssgd_laplace_step_is_the_audited_randomizer():
    # one record, lr = 1, w0 = 0: the released iterate is minus the randomizer's output, drawn
    # from the same random stream (dp_ssgd draws the permutation first)
    X, y = np.array([[0.3, -2.0, 1.0]]), np.array([4.0])
    out = lr.dp_ssgd(X, y, batch_size=1, lr=1.0, clip_norm=0.7, noise="laplace", eps0=0.9,
                     rng=np.random.default_rng(8))
    rng = np.random.default_rng(8)
    rng.permutation(1)
    step = lr.noisy_clipped_mean_laplace(lr.per_example_gradients(X, y, np.zeros(3)), 0.7, 0.9, rng)
    assert np.array_equal(out.w, -step)


def test_dp_ssgd_with_laplace_noise_converges_at_a_large_budget():
    X, y, w_star = _problem(n=20_000, noise=0.1)
    out = lr.dp_ssgd(X, y, batch_size=1, lr=0.05, clip_norm=20.0, noise="laplace", eps0=50.0,
                     rng=np.random.default_rng(0))
    assert np.sum((out.w - w_star) ** 2) < 2e-3
    assert out.noise == "laplace" and out.accounting == "pure" and out.epsilon(1e-9) == 50.0


# Worst case for one Laplace step, d = 2, w0 = 0: the record x = (1, 1), y = +Y (D) or -Y (D'),
# Y ≫ C, has gradient -y(1, 1), ℓ1-clipped to ∓(C/2)(1, 1): the releases are those means plus
# i.i.d. Lap(2C/ε₀) noise, ℓ1 distance 2C apart, the full sensitivity. Pre-specified event
# E = {z₁ > C/2, z₂ > C/2}: probability 1/4 on D' and e^{-ε₀}/4 on D, likelihood ratio e^{ε₀}
# exactly (the audit is tight). A step with ℓ2 clipping but the ℓ1 scale 2C/ε₀ (the √d factor
# forgotten) is √2·ε₀-DP here, one with the add/remove sensitivity C (scale C/ε₀) 2ε₀-DP.

LAP_EPS0, LAP_C, LAP_TRIALS = 1.0, 1.0, 200_000


def _audit_laplace_step(monkeypatch, broken: str) -> pa.EpsilonLowerBound:
    if broken == "l2_clip_without_sqrt_d":
        monkeypatch.setattr(lr, "clip_rows_l1", lambda g, c: g * np.minimum(
            1.0, c / np.linalg.norm(g, axis=-1, keepdims=True)))
    elif broken == "add_remove_sensitivity":
        monkeypatch.setattr(lr, "laplace_noise_scale", lambda c, e, b: c / (b * e))
    rng = np.random.default_rng(12)
    x = np.array([[1.0, 1.0]])

    def releases(label: float) -> np.ndarray:
        g = lr.per_example_gradients(x, np.array([label]), np.zeros(2))  # (1, 2): one record
        return lr.noisy_clipped_mean_laplace(np.broadcast_to(g, (LAP_TRIALS, 1, 2)), LAP_C, LAP_EPS0, rng)

    def event(z: np.ndarray) -> np.ndarray:
        return (z[:, 0] > LAP_C / 2) & (z[:, 1] > LAP_C / 2)

    on_d = pa.EventCounts.from_bools(event(releases(100.0)))
    on_dp = pa.EventCounts.from_bools(event(releases(-100.0)))
    return pa.epsilon_lower_bound_both_directions(
        on_dp, on_d, delta=0.0, reverse_event_on_d=pa.EventCounts(LAP_TRIALS - on_dp.hits, LAP_TRIALS),
        reverse_event_on_dprime=pa.EventCounts(LAP_TRIALS - on_d.hits, LAP_TRIALS))


def test_laplace_step_passes_a_worst_case_audit_at_its_eps0(monkeypatch):
    bound = _audit_laplace_step(monkeypatch, "none")
    assert 0.8 * LAP_EPS0 < bound.eps_lb <= LAP_EPS0, str(bound)  # tight event: the lower bound comes close


@pytest.mark.parametrize("broken", ["l2_clip_without_sqrt_d", "add_remove_sensitivity"])
def test_the_laplace_audit_catches_a_wrong_sensitivity(broken, monkeypatch):
    bound = _audit_laplace_step(monkeypatch, broken)
    assert bound.eps_lb > LAP_EPS0, str(bound)


def test_amplified_laplace_dp_ssgd_reports_the_shuffled_epsilon_and_no_gaussian_event():
    from widedp.accounting.events import LaplaceDpEvent, walk
    from widedp.adaptive_clipping import shuffling as sh

    X, y, _ = _problem(n=10_000, d=3)
    out = lr.dp_ssgd(X, y, batch_size=1, lr=0.05, clip_norm=1.0, noise="laplace", eps0=2.0,
                     amplification="shuffling", delta=1e-6, rng=np.random.default_rng(0))
    eps = sh.shuffled_epsilon(2.0, 10_000, 1e-6)
    assert eps < 2.0 / 4  # amplified: n = 10⁴ shuffled ε₀ = 2 randomizers
    assert out.epsilon(1e-6) == eps and out.epsilon(1e-3) < eps
    assert (out.noise, out.accounting, out.eps0, out.steps, out.unused) == ("laplace", "shuffling", 2.0, 10_000, 0)
    amp = out.events["amplification"]
    assert (amp["eps0"], amp["n"], amp["delta"], amp["epsilon"]) == (2.0, 10_000, 1e-6, eps)
    assert "shuffled_epsilon" in amp["bound"]
    assert out.event == out.events["update"] == LaplaceDpEvent(0.5)
    assert all(not isinstance(e, GaussianDpEvent) for e in walk(out.event))
    assert math.isnan(out.rho)  # not zCDP-accounted
    plain = lr.dp_ssgd(X, y, batch_size=1, lr=0.05, clip_norm=1.0, noise="laplace", eps0=2.0,
                       rng=np.random.default_rng(0))
    assert plain.accounting == "pure" and plain.events["amplification"] == "none" and plain.epsilon(1e-6) == 2.0
    assert np.array_equal(plain.w, out.w)  # the accounting is the only difference


def test_calibrated_eps0_meets_the_target_after_amplification():
    from widedp.adaptive_clipping import shuffling as sh

    X, y, _ = _problem(n=20_000, d=3)
    eps0 = sh.eps0_for_epsilon(1.0, 20_000, 1e-5)
    assert eps0 > 3.0  # amplification: far more per-step budget than the target
    out = lr.dp_ssgd(X, y, batch_size=1, lr=0.05, clip_norm=1.0, noise="laplace", eps0=eps0,
                     amplification="shuffling", delta=1e-5, rng=np.random.default_rng(1))
    assert out.epsilon(1e-5) <= 1.0 and out.events["amplification"]["epsilon"] <= 1.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(noise="laplace", eps0=1.0, batch_size=4, amplification="shuffling", delta=1e-6),
     "batch_size = 1.*not a local randomizer of one record"),
    (dict(rho=0.5, batch_size=1, amplification="shuffling", delta=1e-6), "needs noise='laplace'.*could not be verified"),
    (dict(noise="laplace", eps0=1.0, batch_size=1, amplification="shuffling"), "needs delta"),
    (dict(noise="laplace", eps0=1.0, batch_size=1, delta=1e-6), "delta is only used"),
    (dict(noise="laplace", batch_size=1), "eps0"),
    (dict(noise="laplace", rho=0.5, eps0=1.0, batch_size=1), "rho is the Gaussian"),
    (dict(rho=0.5, eps0=1.0, batch_size=1), "eps0 is the Laplace"),
    (dict(batch_size=1), "rho"),
    (dict(rho=0.5, noise="uniform", batch_size=1), "noise must be"),
])
def test_dp_ssgd_refuses_amplification_and_budgets_it_cannot_honour(kwargs, match):
    X, y, _ = _problem(n=100, d=2)
    with pytest.raises(ValueError, match=match):
        lr.dp_ssgd(X, y, lr=0.1, clip_norm=1.0, rng=np.random.default_rng(0), **kwargs)
