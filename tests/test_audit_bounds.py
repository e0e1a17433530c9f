"""Audit bounds: the one-run ε lower bound (Steinke, Nasr & Jagielski 2023) and the canary
exposure test (Carlini et al. 2019).

Each statistical guarantee is checked where it can fail: exactly (enumerating every outcome of a
mechanism whose true (ε, δ) is known) or by seeded simulation with a binomial margin, and each is
paired with a broken variant (a dropped δ term, a swapped confidence, an unadjusted maximum,
ties broken by array order, ...) that the same check catches.
"""

import dataclasses
import math

import numpy as np
import pytest
from scipy import special, stats

from widedp.auditing.canary_exposure import (
    CanaryExposureReport,
    canary_ranks,
    exposure,
    exposure_report,
    log_perplexity,
    rank_uniformity_test,
)
from widedp.auditing.one_run_audit import (
    OneRunAudit,
    audit_from_scores,
    best_guess_counts,
    epsilon_lower_bound,
    epsilon_lower_bound_pure,
    one_run_p_value,
    randomized_response_accuracy,
)

REPS = 200


def _exceedance_limit(reps: int, rate: float) -> int:
    """Most exceedances a valid level-`rate` procedure shows in `reps` runs, but for a 1e-3 chance."""
    return int(stats.binom.ppf(0.999, reps, rate))


def _bounds_by_count(guesses, counts, **kwargs):
    """The pure bound for each observed count (computed once per distinct count)."""
    cache = {v: epsilon_lower_bound_pure(guesses, int(v), **kwargs) for v in np.unique(counts)}
    return np.array([cache[v] for v in counts])


# --------------------------------------------------------------------------------------------
# The pure bound
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("guesses,confidence", [(10, 0.95), (100, 0.95), (1000, 0.95), (1000, 0.99), (37, 0.8)])
def test_pure_bound_with_every_guess_right_is_the_closed_form_logit_of_beta_to_the_one_over_r(guesses, confidence):
    # P[Binomial(r, q) >= r] = q^r = β  <=>  q = β^(1/r)  <=>  ε = logit(β^(1/r)).
    beta = 1.0 - confidence
    assert epsilon_lower_bound_pure(guesses, guesses, confidence) == pytest.approx(special.logit(beta ** (1.0 / guesses)), abs=1e-9)


def test_pure_bound_is_zero_when_all_right_is_not_surprising_even_at_epsilon_zero():
    # One guess, right: P = 1/2 > β at ε = 0, and logit(β^(1/1)) < 0.
    assert epsilon_lower_bound_pure(1, 1, 0.95) == 0.0
    assert epsilon_lower_bound_pure(4, 4, 0.95) == 0.0  # 1/16 > 0.05
    assert epsilon_lower_bound_pure(5, 5, 0.95) > 0.0  # 1/32 < 0.05


def test_pure_bound_grows_with_correct_guesses_and_shrinks_with_wrong_ones():
    r = 200
    by_correct = [epsilon_lower_bound_pure(r, v, 0.95) for v in range(r + 1)]
    assert all(a <= b for a, b in zip(by_correct, by_correct[1:]))
    assert by_correct[150] < by_correct[170] < by_correct[200]
    # Same correct count, more (wrong) guesses: lower bound.
    by_guesses = [epsilon_lower_bound_pure(r, 150, 0.95) for r in (150, 160, 180, 200, 250)]
    assert all(a > b for a, b in zip(by_guesses, by_guesses[1:]))
    # Same accuracy (80%), more guesses: more evidence, higher bound.
    at_80 = [epsilon_lower_bound_pure(r, 4 * r // 5, 0.95) for r in (10, 20, 50, 100, 500, 1000)]
    assert all(a < b for a, b in zip(at_80, at_80[1:]))
    assert at_80[-1] < math.log(4)  # never above the accuracy's own logit


@pytest.mark.parametrize("guesses", [1, 2, 7, 100, 1001])
def test_pure_bound_is_zero_at_or_below_half_right(guesses):
    for v in range(0, guesses // 2 + 1):
        assert epsilon_lower_bound_pure(guesses, v, 0.95) == 0.0


def test_higher_confidence_gives_a_lower_bound():
    bounds = [epsilon_lower_bound_pure(500, 400, c) for c in (0.5, 0.8, 0.9, 0.95, 0.99, 0.999)]
    assert all(a > b for a, b in zip(bounds, bounds[1:])) and bounds[-1] > 0


def test_pure_bound_is_the_boundary_of_the_rejected_epsilons():
    r, v, conf = 300, 230, 0.95
    eps = epsilon_lower_bound_pure(r, v, conf)
    assert one_run_p_value(r, v, eps) <= 1 - conf < one_run_p_value(r, v, eps + 1e-9)


# --------------------------------------------------------------------------------------------
# The (ε, δ) bound
# --------------------------------------------------------------------------------------------


def test_delta_bound_reproduces_the_values_printed_in_the_paper():
    # (m, r, v, δ, β) -> ε printed in arXiv:2305.08846v1: Appendix D's worked example (0.673) and
    # §7's white-box CIFAR-10 audit (2.675). Pins transcribed from a secondary source, not
    # re-read from the PDF here; printed to 3 decimals.
    pins = [((1000, 100, 75, 1e-4, 0.05), 0.673), ((100_000, 1510, 1439, 1e-5, 0.05), 2.675)]
    for (m, r, v, delta, beta), printed in pins:
        assert epsilon_lower_bound(r, v, delta, 1 - beta, m) == pytest.approx(printed, abs=1e-3)
        # Broken variants miss the pins: the δ term dropped, or scaled by r instead of m.
        assert abs(epsilon_lower_bound_pure(r, v, 1 - beta) - printed) > 0.02
        assert abs(epsilon_lower_bound(r, v, delta, 1 - beta, r) - printed) > 0.02


@pytest.mark.parametrize("r,v,m", [(100, 75, 1000), (1000, 1000, 1000), (50, 40, 50), (10, 3, 20)])
def test_delta_bound_equals_the_pure_one_at_delta_zero_and_decreases_in_delta(r, v, m):
    pure = epsilon_lower_bound_pure(r, v, 0.95)
    assert epsilon_lower_bound(r, v, 0.0, 0.95, m) == pure
    bounds = [epsilon_lower_bound(r, v, d, 0.95, m) for d in (0.0, 1e-9, 1e-7, 1e-5, 1e-4, 1e-3, 1e-2, 0.1)]
    assert all(a >= b for a, b in zip(bounds, bounds[1:]))
    assert all(b <= pure + 1e-12 for b in bounds)
    if pure > 0:
        assert bounds[-1] < pure


def test_p_value_adds_two_m_delta_times_the_worst_slope_of_the_binomial_tail():
    # Direct from the statement: max over i of (f(v - i) - f(v)) / i, f the tail of Binomial(r, q).
    r, v, m, eps, delta = 60, 45, 400, 0.7, 1e-4
    q = randomized_response_accuracy(eps)

    def tail(k):
        return stats.binom.sf(k - 1, r, q)

    slope = max((tail(v - i) - tail(v)) / i for i in range(1, m + 1))
    assert one_run_p_value(r, v, eps, delta, m) == pytest.approx(tail(v) + 2 * m * delta * slope, rel=1e-9)
    assert one_run_p_value(r, v, eps) == pytest.approx(tail(v), rel=1e-12)


# --------------------------------------------------------------------------------------------
# The guarantee: P[bound > true ε] ≤ 1 − confidence
# --------------------------------------------------------------------------------------------


def test_bound_exceeds_the_true_epsilon_of_randomized_response_no_more_often_than_the_stated_confidence_allows():
    # ε-DP randomized response on each canary's bit: every guess right with probability q_ε,
    # independently, so v ~ Binomial(r, q_ε).
    eps, r = 1.0, 500
    v = np.random.default_rng(2024).binomial(r, randomized_response_accuracy(eps), size=REPS)
    limit = _exceedance_limit(REPS, 0.05)
    assert np.count_nonzero(_bounds_by_count(r, v, confidence=0.95) > eps) <= limit
    # Broken variant: confidence and β swapped (confidence=0.05) exceeds almost always.
    assert np.count_nonzero(_bounds_by_count(r, v, confidence=0.05) > eps) > 4 * limit


@pytest.mark.parametrize("delta", [1e-3, 5e-3, 1e-2])
def test_delta_bound_never_exceeds_the_true_epsilon_of_randomized_response_with_a_delta_leak_beyond_the_confidence(delta):
    # Exactly, by enumerating v: with probability δ the mechanism reveals every canary's bit
    # (v = r), otherwise ε-randomized response. It is (ε, δ)-DP per canary; with the δ term
    # dropped (the pure bound) the same check fails.
    eps, m = 1.0, 200
    q = randomized_response_accuracy(eps)
    law = (1 - delta) * stats.binom.pmf(np.arange(m + 1), m, q)
    law[m] += delta
    bounds = np.array([epsilon_lower_bound(m, v, delta, 0.95, m) for v in range(m + 1)])
    assert bounds.max() > 0.5  # the bound is not vacuous here
    assert law[bounds > eps].sum() <= 0.05
    if delta >= 5e-3:
        pure = np.array([epsilon_lower_bound_pure(m, v, 0.95) for v in range(m + 1)])
        assert law[pure > eps].sum() > 0.05


def test_an_always_right_guesser_gives_a_bound_far_above_any_small_epsilon():
    # 1000 canaries, all guessed, all right: logit(0.05^(1/1000)) ≈ 5.81.
    membership = np.random.default_rng(5).random(1000) < 0.5
    audit = audit_from_scores(membership.astype(float), membership, int(membership.sum()), int((~membership).sum()), 0.0, 0.95)
    assert (audit.guesses, audit.correct) == (1000, 1000)
    assert audit.epsilon_lower_bound > 5
    partial = audit_from_scores(membership.astype(float), membership, 400, 400, 1e-6, 0.95)
    assert partial.correct == partial.guesses == 800 and partial.epsilon_lower_bound > 5


def test_scores_from_an_epsilon_dp_laplace_mechanism_give_bounds_above_epsilon_no_more_often_than_allowed():
    # Score = S_i + Laplace(2/ε): ε-DP in each canary's bit (sensitivity 2). For scores beyond ±1
    # the likelihood ratio is exactly e^ε, so top/bottom-k guessing is nearly tight here.
    eps, m, k = 2.0, 1000, 100
    rng = np.random.default_rng(7)
    bounds = []
    for _ in range(REPS):
        member = rng.random(m) < 0.5
        scores = np.where(member, 1.0, -1.0) + rng.laplace(scale=2.0 / eps, size=m)
        bounds.append(audit_from_scores(scores, member, k, k, 0.0, 0.95).epsilon_lower_bound)
    bounds = np.array(bounds)
    assert np.count_nonzero(bounds > eps) <= _exceedance_limit(REPS, 0.05)
    assert np.median(bounds) > 0.7 * eps  # and the audit sees most of ε


# --------------------------------------------------------------------------------------------
# From scores
# --------------------------------------------------------------------------------------------


def test_scores_equal_to_membership_make_every_guess_right_and_random_scores_give_a_bound_near_zero():
    rng = np.random.default_rng(3)
    member = rng.random(1000) < 0.5
    exact = audit_from_scores(member.astype(int), member.astype(int), 100, 150, 1e-5, 0.95)
    assert exact.correct == exact.guesses == 250 and exact.canaries == 1000
    assert (exact.guesses_positive, exact.guesses_negative) == (100, 150)
    assert exact.epsilon_lower_bound == epsilon_lower_bound(250, 250, 1e-5, 0.95, 1000)
    noise = audit_from_scores(rng.normal(size=1000), member, 100, 100, 1e-5, 0.95)
    assert noise.epsilon_lower_bound < 0.3
    assert 60 <= noise.correct <= 140


def test_ties_are_broken_independently_of_the_array_order():
    # A model that learned nothing (every score equal), arrays sorted members-first: breaking
    # ties by array order would guess every canary right. The audit must not.
    member = np.r_[np.ones(500, bool), np.zeros(500, bool)]
    flat = np.zeros(1000)
    audit = audit_from_scores(flat, member, 300, 300, 0.0, 0.95)
    assert audit.epsilon_lower_bound < 0.5
    # Broken variant: stable argsort of the scores (array order breaks ties).
    order = np.argsort(-flat, kind="stable")
    v = int(member[order[:300]].sum() + (~member[order[-300:]]).sum())
    assert epsilon_lower_bound(600, v, 0.0, 0.95, 1000) > 5


def test_audit_refuses_bad_inputs_naming_the_parameter():
    s, member = np.arange(10.0), np.arange(10) % 2
    with pytest.raises(ValueError, match="same length"):
        audit_from_scores(s, member[:9], 1, 1, 0.0, 0.95)
    with pytest.raises(ValueError, match="same length"):
        audit_from_scores(s.reshape(2, 5), member.reshape(2, 5), 1, 1, 0.0, 0.95)
    with pytest.raises(ValueError, match="included must be binary"):
        audit_from_scores(s, member * 2, 1, 1, 0.0, 0.95)
    with pytest.raises(ValueError, match="guesses_positive \\+ guesses_negative"):
        audit_from_scores(s, member, 6, 5, 0.0, 0.95)
    with pytest.raises(ValueError, match="guesses_negative"):
        audit_from_scores(s, member, 1, -1, 0.0, 0.95)
    for bad in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="confidence"):
            audit_from_scores(s, member, 1, 1, 0.0, bad)
    for bad in (1.0, -1e-9, 2.0):
        with pytest.raises(ValueError, match="delta"):
            audit_from_scores(s, member, 1, 1, bad, 0.95)
    with pytest.raises(ValueError, match="NaN"):
        audit_from_scores(np.r_[np.nan, s[1:]], member, 1, 1, 0.0, 0.95)
    with pytest.raises(ValueError, match="correct must be <= guesses"):
        epsilon_lower_bound_pure(10, 11, 0.95)
    with pytest.raises(ValueError, match="canaries"):
        epsilon_lower_bound(10, 5, 1e-5, 0.95, 9)
    with pytest.raises(ValueError, match="guesses must be an integer"):
        epsilon_lower_bound_pure(10.5, 5, 0.95)
    with pytest.raises(ValueError, match="canaries .* needed when delta > 0"):
        one_run_p_value(10, 5, 1.0, 1e-5)


def test_one_run_audit_is_a_frozen_record_that_checks_its_counts():
    audit = OneRunAudit(100, 20, 15, 1e-5, 0.95, 0.4, 10, 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        audit.epsilon_lower_bound = 9.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="correct"):
        OneRunAudit(100, 20, 21, 1e-5, 0.95, 0.4)
    with pytest.raises(ValueError, match="guesses_positive \\+ guesses_negative"):
        OneRunAudit(100, 20, 15, 1e-5, 0.95, 0.4, 10, 5)


# --------------------------------------------------------------------------------------------
# Several guess counts: Bonferroni
# --------------------------------------------------------------------------------------------

CHOICES = [(k, 0) for k in (5, 10, 20, 50, 100)] + [(0, k) for k in (5, 10, 20, 50, 100)] + [(k, k) for k in (5, 10, 20, 50, 100, 200, 300, 400, 500)]


def test_best_of_several_guess_counts_splits_beta_across_them():
    rng = np.random.default_rng(17)
    member = rng.random(1000) < 0.5
    scores = member + rng.normal(scale=0.7, size=1000)
    best = best_guess_counts(scores, member, CHOICES, 1e-5, 0.95)
    assert best.comparisons == len(CHOICES) and best.confidence == 0.95
    per_choice = 1 - 0.05 / len(CHOICES)
    assert best.epsilon_lower_bound == epsilon_lower_bound(best.guesses, best.correct, 1e-5, per_choice, 1000)
    others = [audit_from_scores(scores, member, kp, kn, 1e-5, per_choice).epsilon_lower_bound for kp, kn in CHOICES]
    assert best.epsilon_lower_bound == max(others) > 0
    single = best_guess_counts(scores, member, [(100, 100)], 1e-5, 0.95)
    assert single == audit_from_scores(scores, member, 100, 100, 1e-5, 0.95)
    with pytest.raises(ValueError, match="choices"):
        best_guess_counts(scores, member, [], 1e-5, 0.95)


def test_best_of_several_guess_counts_keeps_the_false_alarm_rate_and_the_unadjusted_maximum_does_not():
    # ε = 0: scores independent of membership. Any positive bound is a false alarm.
    rng = np.random.default_rng(11)
    adjusted = unadjusted = 0
    for _ in range(REPS):
        member, scores = rng.random(1000) < 0.5, rng.normal(size=1000)
        adjusted += best_guess_counts(scores, member, CHOICES, 0.0, 0.95).epsilon_lower_bound > 0
        unadjusted += max(audit_from_scores(scores, member, kp, kn, 0.0, 0.95).epsilon_lower_bound for kp, kn in CHOICES) > 0
    limit = _exceedance_limit(REPS, 0.05)
    assert adjusted <= limit < unadjusted


# --------------------------------------------------------------------------------------------
# Canary exposure
# --------------------------------------------------------------------------------------------


def test_ranks_count_ties_against_the_canary():
    rng = np.random.default_rng(0)
    refs, canaries = rng.integers(0, 20, size=300).astype(float), rng.integers(0, 20, size=50).astype(float)
    expected = [1 + int(np.sum(refs <= c)) for c in canaries]
    assert canary_ranks(canaries, refs).tolist() == expected
    # A model that scores everything alike: last place, exposure 0 (ties in the canary's favour
    # would claim the full log2 N bits).
    flat = canary_ranks(np.zeros(5), np.zeros(99))
    assert flat.tolist() == [100] * 5
    assert exposure(flat, 100).tolist() == [0.0] * 5


def test_canaries_below_every_reference_rank_first_with_full_exposure_and_are_flagged():
    refs = np.random.default_rng(1).normal(10.0, 1.0, size=999)
    canaries = np.full(100, 1.0)
    ranks = canary_ranks(canaries, refs)
    assert ranks.tolist() == [1] * 100
    assert exposure(ranks, 1000) == pytest.approx(np.full(100, math.log2(1000)))
    report = exposure_report(canaries, refs, insertions=4, bins=10)
    assert report.flagged and report.p_value < 0.01 and report.insertions == 4 and report.num_candidates == 1000
    assert report.mean_exposure == report.median_exposure == pytest.approx(math.log2(1000))


def test_canaries_from_the_reference_distribution_are_not_flagged_more_often_than_one_percent():
    rng = np.random.default_rng(2)
    reports = [exposure_report(rng.normal(size=200), rng.normal(size=999), insertions=1, bins=10) for _ in range(REPS)]
    assert reports[0].p_value > 0.01 and not reports[0].flagged
    assert sum(r.flagged for r in reports) <= _exceedance_limit(REPS, 0.01)
    assert np.mean([r.mean_exposure for r in reports]) == pytest.approx(1 / math.log(2), abs=0.05)
    # Partly memorized canaries (log-perplexity one reference s.d. lower) are flagged every time.
    memorized = [exposure_report(rng.normal(-1.0, size=200), rng.normal(size=999), 1, 10) for _ in range(20)]
    assert all(r.flagged and r.mean_exposure > 2.5 for r in memorized)


def test_exposure_of_every_rank_once_averages_log2_n_minus_log2_n_factorial_over_n():
    n = 1000
    ranks = np.arange(1, n + 1)
    assert exposure(ranks, n).mean() == pytest.approx(math.log2(n) - math.lgamma(n + 1) / math.log(2) / n, rel=1e-12)


def test_uniformity_chi2_matches_a_hand_computation_with_unequal_bins():
    # N = 10 candidates in 3 equal-width bins: ranks 1-4 | 5-7 | 8-10 (⌊(k-1)·3/10⌋).
    ranks = np.array([1] * 10 + [4] * 6 + [5] * 3 + [7] * 2 + [10] * 9)
    n = ranks.size
    observed = np.array([16, 5, 9])
    expected = n * np.array([4, 3, 3]) / 10
    by_hand = float(np.sum((observed - expected) ** 2 / expected))
    chi2, p = rank_uniformity_test(ranks, 10, 3)
    assert chi2 == pytest.approx(by_hand, rel=1e-12)
    assert p == pytest.approx(stats.chi2.sf(by_hand, df=2), rel=1e-12)
    # Broken variant: equal expected counts (n / bins) would give another statistic.
    assert abs(stats.chisquare(observed).statistic - by_hand) > 0.5


def test_exposure_functions_refuse_bad_inputs_naming_the_parameter():
    with pytest.raises(ValueError, match="bins=10 expects"):
        rank_uniformity_test(np.arange(1, 40), 100, 10)  # 3.9 per bin < 5
    with pytest.raises(ValueError, match="bins"):
        rank_uniformity_test(np.arange(1, 40), 100, 1)
    with pytest.raises(ValueError, match="ranks must lie in 1..num_candidates=100"):
        exposure(np.array([0, 3]), 100)
    with pytest.raises(ValueError, match="ranks must lie"):
        exposure(np.array([101]), 100)
    with pytest.raises(ValueError, match="integer"):
        exposure(np.array([1.5]), 100)
    with pytest.raises(ValueError, match="num_candidates"):
        exposure(np.array([1]), 0)
    with pytest.raises(ValueError, match="reference_scores must not contain NaN"):
        canary_ranks([1.0], [np.nan])
    with pytest.raises(ValueError, match="canary_scores"):
        canary_ranks([], [1.0])
    report = CanaryExposureReport(5, 1, 100, 2, 1.0, 1.0, 3.0, 0.5)
    assert not report.flagged
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.p_value = 0.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="insertions"):
        CanaryExposureReport(5, 0, 100, 2, 1.0, 1.0, 3.0, 0.5)


def _bigram_model(vocab, seed):
    table = np.random.default_rng(seed).random((vocab + 1, vocab))
    log_table = np.log(table / table.sum(axis=1, keepdims=True))

    def log_probs(context):  # row `vocab` is the start-of-phrase distribution
        return log_table[context[-1] if context else vocab]

    return log_table, log_probs


def test_log_perplexity_sums_negative_log_probabilities_of_each_token_given_its_prefix():
    vocab = 7
    log_table, model = _bigram_model(vocab, 0)
    phrase = [3, 1, 4, 1, 5]
    by_hand = -(log_table[vocab, 3] + log_table[3, 1] + log_table[1, 4] + log_table[4, 1] + log_table[1, 5])
    assert log_perplexity(model, phrase) == pytest.approx(by_hand, rel=1e-12)
    assert log_perplexity(lambda ctx: np.full(vocab, -math.log(vocab)), phrase) == pytest.approx(5 * math.log(vocab))
    seen = []
    log_perplexity(lambda ctx: seen.append(ctx) or np.full(vocab, -math.log(vocab)), phrase)
    assert seen == [(), (3,), (3, 1), (3, 1, 4), (3, 1, 4, 1)]


def test_log_perplexity_refuses_logits_and_tokens_outside_the_vocabulary():
    vocab = 7
    _, model = _bigram_model(vocab, 1)
    with pytest.raises(ValueError, match="log_softmax"):
        log_perplexity(lambda ctx: np.zeros(vocab), [1, 2])  # logits, not log-probabilities
    with pytest.raises(ValueError, match="outside the vocabulary"):
        log_perplexity(model, [1, vocab])
    with pytest.raises(ValueError, match="phrase"):
        log_perplexity(model, [])
    with pytest.raises(ValueError, match="phrase"):
        log_perplexity(model, [1.0, 2.0])
