"""The Gaussian-DP (f-DP) one-run bound (auditing/fdp_one_run.py, Mahloujifar, Melis & Chaudhuri
2025) and the intermediate-release scores (auditing/scores.py): each fast function against a
slow obvious reference, the bound's false-alarm rate measured on the extremal μ-GDP mechanism
(a Gaussian shift) beside a broken variant that the same check catches, and its power beside the
(ε, δ) one-run bound on the same guesses."""

import math

import numpy as np
import pytest
from scipy import stats

import widedp.auditing.fdp_one_run as fdp
from widedp.auditing.fdp_one_run import (epsilon_lower_bound_gdp, gdp_epsilon, gdp_mu_lower_bound,
                                         gdp_mu_of_epsilon)
from widedp.auditing.one_run_audit import epsilon_lower_bound
from widedp.auditing.scores import (robust_step_scales, step_projections, subsampled_gaussian_log_likelihood_ratios,
                                    white_box_scores)

REPS = 300


def _exceedance_limit(reps: int, rate: float) -> int:
    """Most exceedances a valid level-`rate` procedure shows in `reps` runs, but for a 1e-3 chance."""
    return int(stats.binom.ppf(0.999, reps, rate))


def _reference_rejects(m: int, r: int, v: int, mu: float, beta: float) -> bool:
    """The paper's one-sided recursion written out without the early exit, scipy.stats throughout."""
    right, wrong = beta * v / m, beta * (r - v) / m
    for i in range(v - 1, -1, -1):
        needed = 1.0 if right >= 1.0 else float(stats.norm.cdf(stats.norm.ppf(right) - mu))
        grown = max(wrong, needed)
        right = min(right + (i / (r - i)) * (grown - wrong), 1.0)
        wrong = grown
    return right + wrong > r / m


def _member_guesses(rng, m: int, mu: float, k: int) -> tuple[int, int]:
    """One audit of the extremal μ-GDP mechanism: a member's score N(μ, 1), a non-member's N(0, 1),
    "member" guessed for the k highest. Returns (k, correct)."""
    included = rng.random(m) < 0.5
    scores = rng.standard_normal(m) + mu * included
    return k, int(included[np.argsort(-scores)[:k]].sum())


@pytest.mark.parametrize("m,r", [(100, 10), (1000, 50), (1000, 200), (5000, 500)])
def test_the_recursion_rejects_exactly_when_the_slow_reference_does(m, r):
    rng = np.random.default_rng(m + r)
    for _ in range(40):
        v = int(rng.integers(0, r + 1))
        mu = float(rng.uniform(0.0, 4.0))
        assert fdp._rejects_gdp(m, r, v, mu, 0.05) == _reference_rejects(m, r, v, mu, 0.05), (m, r, v, mu)


def test_the_mu_bound_is_the_boundary_of_the_rejected_mus_and_grows_with_correct_guesses():
    m, r = 2000, 100
    bounds = [gdp_mu_lower_bound(r, v, m, 0.95) for v in range(0, r + 1, 5)]
    assert all(a <= b for a, b in zip(bounds, bounds[1:])) and bounds[0] == 0.0 and bounds[-1] > 1.0
    for v in (70, 85, 100):
        mu = gdp_mu_lower_bound(r, v, m, 0.95)
        assert _reference_rejects(m, r, v, mu, 0.05) and not _reference_rejects(m, r, v, mu + 1e-6, 0.05)
    # Half right is what μ = 0 gives: nothing rejected.
    assert gdp_mu_lower_bound(r, 50, m, 0.95) == 0.0
    # Higher confidence, lower bound.
    assert gdp_mu_lower_bound(r, 90, m, 0.99) < gdp_mu_lower_bound(r, 90, m, 0.95)


@pytest.mark.parametrize("mu", [0.5, 1.5, 3.0])
def test_the_gdp_bound_exceeds_the_true_mu_of_a_gaussian_shift_no_more_often_than_its_confidence_allows(mu):
    """The extremal μ-GDP mechanism (a Gaussian shift of the member's score), 300 audits of 1,000
    canaries with 50 member guesses: the bound exceeds μ in at most 5% of them (binomial margin)."""
    rng = np.random.default_rng(int(mu * 10))
    exceed = sum(gdp_mu_lower_bound(*_member_guesses(rng, 1000, mu, 50), 1000, 0.95) > mu for _ in range(REPS))
    assert exceed <= _exceedance_limit(REPS, 0.05), exceed


def test_a_blow_up_with_half_the_mu_is_caught_by_the_same_check(monkeypatch):
    """Broken variant: the recursion's tradeoff taken for μ/2 (a sensitivity without its factor 2)
    — the bound then exceeds the true μ in most audits."""
    real = fdp._gdp_blow_up_inverse
    monkeypatch.setattr(fdp, "_gdp_blow_up_inverse", lambda x, mu: real(x, mu / 2))
    rng = np.random.default_rng(15)
    exceed = sum(gdp_mu_lower_bound(*_member_guesses(rng, 1000, 1.5, 50), 1000, 0.95) > 1.5 for _ in range(REPS))
    assert exceed > 3 * _exceedance_limit(REPS, 0.05), exceed


def test_a_bound_without_its_confidence_is_caught_by_the_same_check():
    """Broken variant: β = 1 (no confidence at all) — exceedances far above 5%."""
    rng = np.random.default_rng(16)
    exceed = 0
    for _ in range(REPS):
        r, v = _member_guesses(rng, 1000, 1.5, 50)
        exceed += gdp_mu_lower_bound(r, v, 1000, 1e-9) > 1.5
    assert exceed > 2 * _exceedance_limit(REPS, 0.05), exceed


def test_on_a_gaussian_mechanism_the_gdp_bound_is_tighter_than_the_eps_delta_bound_on_the_same_guesses():
    """What the refinement buys (the reason the audit reports it): 20 audits of 4,000 canaries of a
    mechanism that is exactly (ε = 4, δ = 1e-5) as a Gaussian; median bounds over the same guesses."""
    delta, eps = 1e-5, 4.0
    mu = gdp_mu_of_epsilon(eps, delta)
    rng = np.random.default_rng(17)
    gdp, eps_delta = [], []
    for _ in range(20):
        r, v = _member_guesses(rng, 4000, mu, 200)
        gdp.append(epsilon_lower_bound_gdp(r, v, 4000, delta, 0.95))
        eps_delta.append(epsilon_lower_bound(r, v, delta, 0.95, 4000))
    assert np.median(gdp) > 1.15 * np.median(eps_delta) and max(gdp) <= eps, (gdp, eps_delta)
    assert np.median(gdp) > 0.45 * eps


@pytest.mark.parametrize("mu", [0.1, 0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_gdp_epsilon_is_the_gaussian_mechanisms_epsilon_by_the_pld_accountant(mu, delta):
    """μ-GDP is the Gaussian mechanism with σ = 1/μ at sensitivity 1: dp_accounting's PLD of that
    one event gives the same ε (to its discretization)."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.GaussianDpEvent(1.0 / mu))
    assert gdp_epsilon(mu, delta) == pytest.approx(accountant.get_epsilon(delta), abs=2e-3)
    assert gdp_mu_of_epsilon(gdp_epsilon(mu, delta), delta) == pytest.approx(mu, rel=1e-6)


def test_gdp_functions_refuse_bad_inputs_naming_the_parameter():
    with pytest.raises(ValueError, match="correct"):
        gdp_mu_lower_bound(10, 11, 100, 0.95)
    with pytest.raises(ValueError, match="canaries"):
        gdp_mu_lower_bound(10, 5, 5, 0.95)
    with pytest.raises(ValueError, match="confidence"):
        gdp_mu_lower_bound(10, 5, 100, 1.0)
    with pytest.raises(ValueError, match="mu"):
        gdp_epsilon(-1.0, 1e-5)
    with pytest.raises(ValueError, match="delta"):
        gdp_epsilon(1.0, 0.0)
    with pytest.raises(ValueError, match="epsilon"):
        gdp_mu_of_epsilon(0.0, 1e-5)


# ---- intermediate-release scores ------------------------------------------------------------------


def test_step_projections_are_each_steps_descent_along_the_canarys_direction():
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((6, 7, 8))  # T + 1 = 6 releases, m = 7 canaries, width 8
    u = rng.standard_normal((7, 2, 4))
    p = step_projections(rows, u)
    for i in range(7):
        for t in range(5):
            assert p[i, t] == pytest.approx(float(np.dot(rows[t, i] - rows[t + 1, i], u[i].reshape(-1))))
    # Their sum is the final-model score.
    assert p.sum(1) == pytest.approx(white_box_scores(rows[0], rows[-1], u))
    with pytest.raises(ValueError, match="rows_by_step"):
        step_projections(rows[:1], u)


def test_the_likelihood_ratio_is_the_mixture_density_ratio_summed_over_steps():
    rng = np.random.default_rng(4)
    y = rng.standard_normal((9, 5)) * 2
    for q, sigma in ((0.3, 0.8), (1.0, 2.0), (0.01, 5.0)):
        fast = subsampled_gaussian_log_likelihood_ratios(y, q, sigma)
        slow = [sum(math.log(((1 - q) * stats.norm.pdf(v) + q * stats.norm.pdf(v - 1 / sigma)) / stats.norm.pdf(v))
                    for v in row) for row in y]
        assert fast == pytest.approx(slow, rel=1e-9, abs=1e-12)
    with pytest.raises(ValueError, match="sample_rate"):
        subsampled_gaussian_log_likelihood_ratios(y, 0.0, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        subsampled_gaussian_log_likelihood_ratios(y, 0.5, 0.0)


def test_at_a_small_sample_rate_the_likelihood_ratio_separates_members_better_than_the_summed_update():
    """q = 0.02, 200 steps, σ = 0.7: a member's signal arrives in a few steps; the sum of the steps
    (all the final model shows) drowns it in 200 steps of noise, the likelihood ratio does not."""
    rng = np.random.default_rng(5)
    m, steps, q, sigma = 4000, 200, 0.02, 0.7
    member = rng.random(m) < 0.5
    sampled = (rng.random((m, steps)) < q) & member[:, None]
    y = sampled / sigma + rng.standard_normal((m, steps))

    def auc(score):
        return stats.mannwhitneyu(score[member], score[~member]).statistic / (member.sum() * (~member).sum())

    lr, summed = auc(subsampled_gaussian_log_likelihood_ratios(y, q, sigma)), auc(y.sum(1))
    assert lr > summed + 0.03, (lr, summed)


def test_the_robust_step_scale_ignores_the_members_shift_and_needs_no_coins():
    rng = np.random.default_rng(6)
    scale = np.array([0.5, 2.0, 3.0])
    p = rng.standard_normal((20000, 3)) * scale
    p[:5000] += 0.5 * scale  # a quarter of the canaries (members sampled at q = ½) shifted by 1/σ, σ = 2
    assert robust_step_scales(p) == pytest.approx(scale, rel=0.05)
    assert robust_step_scales(np.zeros((5, 2))).tolist() == [0.0, 0.0]


def test_selected_step_scores_count_the_steps_a_row_moved_and_break_ties_by_its_values_like_the_slow_loop():
    from widedp.auditing.scores import selected_step_scores

    rng = np.random.default_rng(3)
    m, steps, width = 40, 6, 4
    rows = np.zeros((steps + 1, m, width))
    for t in range(1, steps + 1):
        rows[t] = rows[t - 1]
        picked = rng.random(m) < 0.3
        rows[t, picked] += rng.normal(size=(int(picked.sum()), width))
    u = rng.normal(size=(m, width))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    p = step_projections(rows, u)
    got = selected_step_scores(rows, p)
    moved_values = [p[i, t] for i in range(m) for t in range(steps) if not np.array_equal(rows[t + 1, i], rows[t, i])]
    centre = np.median(moved_values)
    scale = 1.4826 * np.median([abs(v - centre) for v in moved_values])
    for i in range(m):
        count, total = 0, 0.0
        for t in range(steps):
            if not np.array_equal(rows[t + 1, i], rows[t, i]):
                count += 1
                total += p[i, t]
        assert got[i] == pytest.approx(count + math.atan(total / scale) / math.pi, abs=1e-12)
    # the count ranks first: the values move a score by less than half a step either way
    counts = np.any(rows[1:] != rows[:-1], axis=2).sum(axis=0)
    assert np.array_equal(np.round(got), counts) and np.all(np.abs(got - counts) < 0.5)
    with pytest.raises(ValueError, match="rows_by_step must be"):
        selected_step_scores(rows[:1], p)
