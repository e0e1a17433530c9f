"""The threshold audit over independent trials (auditing/threshold_audit.py; Jagielski et al.
2020, Nasr et al. 2023): each fast function against a slow obvious reference, the rate
inequalities exact on the extremal mechanisms (randomized response for ε, a Gaussian shift for
μ), the false-alarm rate measured on the extremal μ-GDP mechanism beside a broken variant the same
check catches, and its power beside the one-run Gaussian-DP bound on the same scores."""

import math

import numpy as np
import pytest
from scipy import stats

import sys

import widedp.auditing.threshold_audit  # noqa: F401 (the module; the package's name is the function)
from widedp.auditing.fdp_one_run import epsilon_lower_bound_gdp, gdp_epsilon, gdp_mu_of_epsilon
from widedp.auditing.threshold_audit import (best_threshold, clopper_pearson_upper, epsilon_from_rates,
                                             gdp_mu_from_rates, threshold_audit)

REPS = 300
DELTA = 1e-5


def _exceedance_limit(reps: int, rate: float) -> int:
    """Most exceedances a valid level-`rate` procedure shows in `reps` runs, but for a 1e-3 chance."""
    return int(stats.binom.ppf(0.999, reps, rate))


def _shift_trials(rng, m: int, mu: float):
    """m independent trials of the extremal μ-GDP mechanism: a member scores N(μ, 1), a non-member N(0, 1);
    the coins and an independent half to choose the threshold on."""
    included = rng.random(m) < 0.5
    return rng.normal(size=m) + mu * included, included, rng.random(m) < 0.5


def _reference_upper(k: int, n: int, confidence: float) -> float:
    """The largest p with P[Binomial(n, p) ≤ k] ≥ 1 − confidence, by bisection on the binomial cdf."""
    if k == n:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if stats.binom.cdf(k, n, mid) >= 1.0 - confidence:
            lo = mid
        else:
            hi = mid
    return lo


@pytest.mark.parametrize("k,n", [(0, 1), (0, 50), (3, 50), (25, 50), (49, 50), (50, 50), (7, 2000)])
def test_the_clopper_pearson_bound_is_the_binomial_tails_inversion(k, n):
    for confidence in (0.9, 0.975):
        assert clopper_pearson_upper(k, n, confidence) == pytest.approx(_reference_upper(k, n, confidence), abs=1e-9)


def test_the_clopper_pearson_bound_covers_the_rate_at_its_confidence():
    rng = np.random.default_rng(0)
    p, n = 0.07, 300
    misses = sum(clopper_pearson_upper(int(rng.binomial(n, p)), n, 0.95) < p for _ in range(2000))
    assert misses <= _exceedance_limit(2000, 0.05)


def test_the_rate_bounds_are_exact_on_the_extremal_mechanisms():
    for eps in (0.5, 2.0, 6.0):  # ε-DP randomized response: FPR = FNR = 1/(1 + e^ε)
        rate = 1.0 / (1.0 + math.exp(eps))
        assert epsilon_from_rates(rate, rate, 0.0) == pytest.approx(eps, rel=1e-12)
    for mu in (0.3, 1.0, 3.0):  # a Gaussian shift at threshold t: FPR = 1 − Φ(t), FNR = Φ(t − μ)
        for t in (-1.0, 0.4, 2.5):
            fpr, fnr = stats.norm.sf(t), stats.norm.cdf(t - mu)
            assert gdp_mu_from_rates(fpr, fnr) == pytest.approx(mu, rel=1e-9)
    assert epsilon_from_rates(0.0, 0.5, DELTA) == math.inf and epsilon_from_rates(0.6, 0.6, 0.0) == 0.0
    assert gdp_mu_from_rates(0.7, 0.7) == 0.0


def _reference_best_threshold(members, others, objective, delta, confidence):
    """Every distinct score tried in a loop, the rates counted by comparisons."""
    best, best_t = -math.inf, None
    for t in sorted(set(members.tolist()) | set(others.tolist())):
        fnr = _reference_upper(int(sum(s < t for s in members)), members.size, confidence)
        fpr = _reference_upper(int(sum(s >= t for s in others)), others.size, confidence)
        if objective == "gdp":
            value = stats.norm.ppf(1 - fpr) - stats.norm.ppf(fnr)
        else:
            value = max(math.log(max(1 - delta - fnr, 1e-300) / fpr), math.log(max(1 - delta - fpr, 1e-300) / fnr))
        if value > best + 1e-9:
            best, best_t = value, t
    return best_t


@pytest.mark.parametrize("objective", ["gdp", "epsilon"])
def test_the_best_threshold_is_the_slow_loops(objective):
    rng = np.random.default_rng(1)
    for trial in range(6):
        members = np.round(rng.normal(1.5, 1, size=40 + trial), 1)  # rounded: ties across the two sets
        others = np.round(rng.normal(0, 1, size=35), 1)
        fast = best_threshold(members, others, objective, DELTA, 0.975)
        assert fast == _reference_best_threshold(members, others, objective, DELTA, 0.975)


@pytest.mark.parametrize("mu", [0.5, 1.5, 3.0])
def test_the_bounds_exceed_a_gaussian_shifts_true_mu_and_epsilon_no_more_often_than_their_confidence_allows(mu):
    rng = np.random.default_rng(int(10 * mu))
    true_eps = gdp_epsilon(mu, DELTA)
    over_mu = over_eps = 0
    for _ in range(REPS):
        scores, included, choose = _shift_trials(rng, 2000, mu)
        g = threshold_audit(scores, included, choose, DELTA, 0.95, "gdp")
        e = threshold_audit(scores, included, choose, DELTA, 0.95, "epsilon")
        over_mu += g.mu_lower_bound > mu
        over_eps += e.epsilon_lower_bound > true_eps
    assert over_mu <= _exceedance_limit(REPS, 0.05) and over_eps <= _exceedance_limit(REPS, 0.05), (over_mu, over_eps)


def test_rates_taken_without_their_confidence_are_caught_by_the_same_check(monkeypatch):
    monkeypatch.setattr(sys.modules["widedp.auditing.threshold_audit"], "clopper_pearson_upper", lambda k, n, confidence: k / n)  # broken: point estimates
    rng = np.random.default_rng(7)
    over = sum(threshold_audit(*_shift_trials(rng, 2000, 1.5), DELTA, 0.95, "gdp").mu_lower_bound > 1.5
               for _ in range(REPS))
    assert over > 3 * _exceedance_limit(REPS, 0.05), over


def test_at_a_claimed_epsilon_8_the_threshold_bound_comes_within_a_third_and_beats_the_one_run_bound():
    rng = np.random.default_rng(9)
    mu = gdp_mu_of_epsilon(8.0, DELTA)
    ours, one_run = [], []
    for _ in range(20):
        scores, included, choose = _shift_trials(rng, 10_000, mu)
        ours.append(threshold_audit(scores, included, choose, DELTA, 0.95, "gdp").epsilon_lower_bound_gdp)
        top = np.argsort(-scores)[:500]
        one_run.append(epsilon_lower_bound_gdp(500, int(included[top].sum()), 10_000, DELTA, 0.95))
    assert max(ours) <= 8.0 and np.median(ours) >= 0.67 * 8.0, ours
    assert np.median(ours) > np.median(one_run) + 0.5, (ours, one_run)


def test_threshold_functions_refuse_bad_inputs_naming_the_parameter():
    scores, included, choose = _shift_trials(np.random.default_rng(2), 100, 1.0)
    with pytest.raises(ValueError, match="objective"):
        threshold_audit(scores, included, choose, DELTA, 0.95, "auc")
    with pytest.raises(ValueError, match="confidence"):
        threshold_audit(scores, included, choose, DELTA, 1.0, "gdp")
    with pytest.raises(ValueError, match="delta"):
        threshold_audit(scores, included, choose, 1.5, 0.95, "gdp")
    with pytest.raises(ValueError, match="one entry per trial"):
        threshold_audit(scores[:-1], included, choose, DELTA, 0.95, "gdp")
    with pytest.raises(ValueError, match="finite"):
        threshold_audit(np.where(included, np.nan, scores), included, choose, DELTA, 0.95, "gdp")
    with pytest.raises(ValueError, match="counting trials need members"):
        threshold_audit(scores, included, np.ones_like(choose), DELTA, 0.95, "gdp")
    with pytest.raises(ValueError, match="successes"):
        clopper_pearson_upper(5, 3, 0.95)
