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
from widedp.auditing.scores import claimed_mechanism_threshold, subsampled_gaussian_log_likelihood_ratios
from widedp.auditing.threshold_audit import (best_threshold, clopper_pearson_upper, epsilon_from_rates,
                                             gdp_mu_from_rates, threshold_audit, threshold_audit_at)

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


# ---- a threshold fixed from the claimed mechanism, every trial counted ------------------------------
def _claimed_trials(rng, m: int, sample_rate: float, sigma: float, steps: int = 10):
    """m independent trials of the claimed every-step mechanism, scored as the audit scores them:
    y_t = c_t/σ + z_t (c_t ~ Bernoulli(q) for a member), the claim's log-likelihood ratio."""
    included = rng.random(m) < 0.5
    present = (rng.random((m, steps)) < sample_rate) & included[:, None]
    y = present / sigma + rng.standard_normal((m, steps))
    return subsampled_gaussian_log_likelihood_ratios(y, sample_rate, sigma), included


def test_a_pre_registered_threshold_counts_every_trial_like_the_slow_loop():
    rng = np.random.default_rng(4)
    scores, included = _claimed_trials(rng, 400, 1.0, 2.0)
    got = threshold_audit_at(scores, included, 0.1, DELTA, 0.95)
    fn = sum(1 for x, inc in zip(scores, included) if inc and x < 0.1)
    fp = sum(1 for x, inc in zip(scores, included) if not inc and x >= 0.1)
    assert (got.false_negatives, got.false_positives, got.chosen_by) == (fn, fp, "claim")
    assert got.members + got.non_members == 400  # every trial counted
    fnr = _reference_upper(fn, int(included.sum()), 0.975)
    fpr = _reference_upper(fp, int((~included).sum()), 0.975)
    assert got.mu_lower_bound == pytest.approx(max(0.0, stats.norm.ppf(1 - fpr) - stats.norm.ppf(fnr)), abs=1e-9)
    assert got.epsilon_lower_bound == pytest.approx(epsilon_from_rates(fpr, fnr, DELTA), abs=1e-9)


@pytest.mark.parametrize("sample_rate, sigma", [(1.0, 2.0), (1.0, 0.8), (0.5, 1.0)])
def test_the_claimed_threshold_bound_exceeds_the_truth_no_more_often_than_its_confidence_allows(sample_rate, sigma):
    """At q = 1 the mechanism is exactly √T/σ-GDP: the μ bound is checked against it; at q = ½ the
    (ε, δ) bound against the subsampled Gaussian's ε (PLD accountant)."""
    import dp_accounting as dpa

    rng, steps = np.random.default_rng(int(100 * sigma + 10 * sample_rate)), 10
    if sample_rate == 1.0:
        truth = math.sqrt(steps) / sigma
    else:
        acc = dpa.pld.PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
        acc.compose(dpa.PoissonSampledDpEvent(sample_rate, dpa.GaussianDpEvent(sigma)), steps)
        truth = acc.get_epsilon(DELTA)
    t = claimed_mechanism_threshold(sample_rate, sigma, steps, 1000, 1000, np.random.default_rng(1), simulated=50_000)
    over = 0
    for _ in range(REPS):
        got = threshold_audit_at(*_claimed_trials(rng, 2000, sample_rate, sigma, steps), t, DELTA, 0.95)
        over += (got.mu_lower_bound if sample_rate == 1.0 else got.epsilon_lower_bound) > truth
    assert over <= _exceedance_limit(REPS, 0.05), over


def test_a_claimed_threshold_bound_without_its_confidence_is_caught(monkeypatch):
    module = sys.modules["widedp.auditing.threshold_audit"]
    monkeypatch.setattr(module, "clopper_pearson_upper", lambda k, n, confidence: k / n)  # broken: point estimates
    rng = np.random.default_rng(8)
    over = sum(threshold_audit_at(*_claimed_trials(rng, 2000, 1.0, 2.0), 0.0, DELTA, 0.95).mu_lower_bound
               > math.sqrt(10) / 2.0 for _ in range(REPS))
    assert over > 3 * _exceedance_limit(REPS, 0.05), over


def test_at_a_claimed_epsilon_8_the_claimed_threshold_bound_comes_within_a_tenth():
    """All 10,000 trials counted at a threshold fixed from the claim, against half of them at a
    threshold chosen on the other half."""
    rng = np.random.default_rng(11)
    sigma = math.sqrt(10) / gdp_mu_of_epsilon(8.0, DELTA)
    t = claimed_mechanism_threshold(1.0, sigma, 10, 5000, 5000, np.random.default_rng(2))
    fixed, half = [], []
    for _ in range(20):
        scores, included = _claimed_trials(rng, 10_000, 1.0, sigma)
        fixed.append(threshold_audit_at(scores, included, t, DELTA, 0.95).epsilon_lower_bound_gdp)
        half.append(threshold_audit(scores, included, rng.random(10_000) < 0.5, DELTA, 0.95, "gdp").epsilon_lower_bound_gdp)
    assert max(fixed) <= 8.0 and np.median(fixed) >= 0.9 * 8.0, fixed
    assert np.median(fixed) > np.median(half), (fixed, half)


def test_the_claimed_threshold_functions_refuse_bad_inputs_naming_the_parameter():
    scores, included = _claimed_trials(np.random.default_rng(2), 100, 1.0, 1.0)
    with pytest.raises(ValueError, match="threshold must be a finite"):
        threshold_audit_at(scores, included, float("nan"), DELTA, 0.95)
    with pytest.raises(ValueError, match="members and non-members"):
        threshold_audit_at(scores, np.ones_like(included), 0.0, DELTA, 0.95)
    with pytest.raises(ValueError, match="one entry per trial"):
        threshold_audit_at(scores[:-1], included, 0.0, DELTA, 0.95)
    with pytest.raises(ValueError, match="steps, members and non_members"):
        claimed_mechanism_threshold(1.0, 1.0, 0, 10, 10, np.random.default_rng(0))
    with pytest.raises(ValueError, match="sample_rate"):
        claimed_mechanism_threshold(1.5, 1.0, 10, 10, 10, np.random.default_rng(0))


def test_the_claim_curve_test_is_the_rate_bound_at_every_delta_of_the_curve():
    from widedp.auditing.threshold_audit import claim_curve_test

    curve = [(8.0, 1e-5), (4.0, 1e-2), (2.0, 0.1)]
    got = claim_curve_test(0.05, 0.2, curve)
    for (delta, eps, bound), (want_eps, want_delta) in zip(got["points"], curve):
        assert (delta, eps) == (want_delta, want_eps)
        assert bound == pytest.approx(epsilon_from_rates(0.05, 0.2, want_delta), abs=1e-12)
    ratios = [p[2] / p[1] for p in got["points"]]
    assert got["ratio"] == pytest.approx(max(ratios)) and got["refuted"] is (max(ratios) > 1.0)
    # log((1 − 0.1 − 0.2) / 0.05) = 2.64 > 2 claimed at δ = 0.1: that pair is refuted
    assert got["refuted"] and got["delta"] == 0.1 and got["epsilon_bound"] == pytest.approx(math.log(0.7 / 0.05))
    assert not claim_curve_test(0.3, 0.3, curve)["refuted"]
    # an accountant's ε < 0 at a large δ is the claim (0, δ): refuted exactly when FPR + FNR < 1 − δ
    assert claim_curve_test(0.3, 0.3, [(-0.1, 0.3)])["refuted"] and not claim_curve_test(0.4, 0.3, [(-0.1, 0.3)])["refuted"]
    assert claim_curve_test(0.3, 0.3, [(-0.1, 0.3)])["epsilon_claimed"] == 0.0
    with pytest.raises(ValueError, match="curve points"):
        claim_curve_test(0.1, 0.1, [(1.0, 0.0)])
    with pytest.raises(ValueError, match="at least one"):
        claim_curve_test(0.1, 0.1, [])


def test_the_claim_curve_test_refutes_a_subsampled_gaussian_told_twice_its_sigma_and_not_the_true_one():
    """q = ½, 10 steps: the claim's curve from the PLD accountant at σ, the trials at σ (correct)
    or σ/2 (the break); rates at the claimed mechanism's threshold, 4,000 trials."""
    import dp_accounting as dpa

    sigma, q, steps = 1.2, 0.5, 10
    acc = dpa.pld.PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    curve = [(acc.get_epsilon(d), d) for d in (1e-5, 1e-3, 1e-2, 1e-1)]
    t = claimed_mechanism_threshold(q, sigma, steps, 2000, 2000, np.random.default_rng(3), simulated=50_000)
    from widedp.auditing.threshold_audit import claim_curve_test

    rng = np.random.default_rng(5)
    refuted = {"correct": 0, "sigma/2": 0}
    for _ in range(40):
        for name, true_sigma in (("correct", sigma), ("sigma/2", sigma / 2)):
            included = rng.random(4000) < 0.5
            present = (rng.random((4000, steps)) < q) & included[:, None]
            y = present / true_sigma + rng.standard_normal((4000, steps))
            scores = subsampled_gaussian_log_likelihood_ratios(y, q, sigma)  # the claim's score
            a = threshold_audit_at(scores, included, t, 1e-5, 0.95)
            refuted[name] += claim_curve_test(a.fpr_upper, a.fnr_upper, curve)["refuted"]
    assert refuted["correct"] <= _exceedance_limit(40, 0.05) and refuted["sigma/2"] == 40, refuted
