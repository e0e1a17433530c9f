"""The best-of-K private selection (accounting/tuning.py, Papernot & Steinke 2022): the number of
trials' sampler against its distribution, the RDP bound against a slow obvious reference, and
the mechanism audited on a toy tuning — the real one below its claim, the broken one that picks
on the un-noised score caught."""

import math

import numpy as np
import pytest
from scipy import stats

from privacy_audit import EventCounts, epsilon_lower_bound
from widedp.accounting import events as ev
from widedp.accounting.base import UnsupportedEventError
from widedp.accounting.rdp import DEFAULT_ORDERS, RdpAccountant, rdp_curve, rdp_to_epsilon
from widedp.accounting.tuning import TrialCount, compare_distributions, known_count_rdp, selection_rdp

ORDERS = np.array(DEFAULT_ORDERS)
COUNTS = [TrialCount.with_mean(m, d, eta) for m in (4.0, 10.0)
          for d, eta in (("truncated_negative_binomial", 0.0), ("truncated_negative_binomial", 0.5),
                         ("truncated_negative_binomial", 1.0), ("poisson", 0.0))]


@pytest.mark.parametrize("count", COUNTS, ids=lambda c: f"{c.distribution}-{c.eta}-{c.expected:.0f}")
def test_the_sampler_draws_the_distribution_the_bound_is_for(count):
    assert count.expected == pytest.approx(count.mu if count.distribution == "poisson" else
                                           float(np.sum(np.arange(1, 2000) * count.pmf(np.arange(1, 2000)))), rel=1e-6)
    rng = np.random.default_rng(7)
    draws = np.array([count.sample(rng) for _ in range(20_000)])
    top = int(np.quantile(draws, 0.99))
    ks = np.arange(0, top + 1)
    expected = count.pmf(ks) * draws.size
    observed = np.array([(draws == k).sum() for k in ks], dtype=float)
    expected = np.append(expected, draws.size - expected.sum())  # the tail pooled
    observed = np.append(observed, (draws > top).sum())
    keep = expected > 5
    pooled_e = np.append(expected[keep], expected[~keep].sum())
    pooled_o = np.append(observed[keep], observed[~keep].sum())
    pooled_e, pooled_o = pooled_e[pooled_e > 0], pooled_o[pooled_e > 0]
    assert stats.chisquare(pooled_o, pooled_e * pooled_o.sum() / pooled_e.sum()).pvalue > 1e-4
    assert abs(draws.mean() - count.expected) < 5 * draws.std() / math.sqrt(draws.size)
    if count.distribution != "poisson":
        assert draws.min() >= 1


@pytest.mark.parametrize("kwargs, message", [
    ({"distribution": "uniform"}, "must be one of"),
    ({"distribution": "poisson", "mu": 0.0}, "mu > 0"),
    ({"distribution": "truncated_negative_binomial", "eta": -0.5, "gamma": 0.1}, "eta >= 0"),
    ({"distribution": "truncated_negative_binomial", "eta": 0.0, "gamma": 1.0}, "gamma in \\(0, 1\\)"),
])
def test_bad_parameters_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrialCount(**kwargs)
    with pytest.raises(ValueError, match="must be > 1"):
        TrialCount.with_mean(1.0)


def _slow_bound(count: TrialCount, curve: np.ndarray) -> np.ndarray:
    out = []
    for i, lam in enumerate(ORDERS):
        if count.distribution == "poisson":
            eps_hat = math.log(1 + 1 / (lam - 1))
            delta_hat = 1.0
            for a, r in zip(ORDERS, curve):
                if math.isfinite(r):
                    log_delta = (a - 1) * (r - eps_hat) + (a - 1) * math.log((a - 1) / a) - math.log(a)
                    delta_hat = min(delta_hat, math.exp(min(0.0, log_delta)))
            out.append(curve[i] + count.mu * delta_hat + math.log(count.mu) / (lam - 1))
            continue
        best = math.inf
        for lam_hat, r in zip(ORDERS, curve):
            value = ((1 + count.eta) * (1 - 1 / lam_hat) * r + (1 + count.eta) * math.log(1 / count.gamma) / lam_hat)
            best = min(best, value)
        out.append(curve[i] + best + math.log(count.expected) / (lam - 1))
    return np.array(out)


CURVES = {"gaussian-2": ev.GaussianDpEvent(2.0), "gaussian-5": ev.GaussianDpEvent(5.0),
          "dpsgd-500": ev.SelfComposedDpEvent(ev.PoissonSampledDpEvent(0.02, ev.GaussianDpEvent(1.0)), 500)}


@pytest.mark.parametrize("name", sorted(CURVES))
@pytest.mark.parametrize("count", COUNTS[4:], ids=lambda c: f"{c.distribution}-{c.eta}")
def test_the_bound_equals_its_slow_reference_and_costs_more_than_one_trial(name, count):
    curve = rdp_curve(CURVES[name], ORDERS)
    fast = selection_rdp(count, curve, ORDERS)
    np.testing.assert_allclose(fast, _slow_bound(count, curve), rtol=1e-9, atol=1e-12)
    assert np.all(fast >= curve)
    eps = lambda c: rdp_to_epsilon(ORDERS, c, 1e-6)[0]  # noqa: E731
    assert eps(curve) < eps(fast) < eps(known_count_rdp(10, curve))  # below ten trials composed


def test_the_accountant_composes_the_event_as_the_bound_on_the_worst_candidate():
    count = TrialCount.with_mean(10.0)
    a, b = CURVES["gaussian-2"], CURVES["dpsgd-500"]
    event = ev.RandomTrialsDpEvent([a, b], count.distribution, eta=count.eta, gamma=count.gamma)
    worst = np.maximum(rdp_curve(a, ORDERS), rdp_curve(b, ORDERS))
    want = rdp_to_epsilon(ORDERS, selection_rdp(count, worst, ORDERS), 1e-6)[0]
    assert RdpAccountant().epsilon([(event, 1)], 1e-6) == pytest.approx(want, rel=1e-9)
    assert ev.event_from_dict(ev.event_to_dict(event)) == event
    more = TrialCount.with_mean(20.0)
    assert RdpAccountant().epsilon([(ev.RandomTrialsDpEvent([a], more.distribution, gamma=more.gamma), 1)], 1e-6) > \
        RdpAccountant().epsilon([(ev.RandomTrialsDpEvent([a], count.distribution, gamma=count.gamma), 1)], 1e-6)
    with pytest.raises(UnsupportedEventError, match="gamma"):
        RdpAccountant().epsilon([(ev.RandomTrialsDpEvent([a], "truncated_negative_binomial", gamma=1.5), 1)], 1e-6)
    with pytest.raises(ValueError, match="non-empty list"):
        ev.RandomTrialsDpEvent([], "poisson", mu=3.0)
    table = compare_distributions(rdp_curve(b, ORDERS), ORDERS, 10.0, 1e-6, lambda o, c, d: rdp_to_epsilon(o, c, d)[0])
    assert table["logarithmic (eta 0)"] == min(v for k, v in table.items() if "composed" not in k and k != "one trial")


# ---- the mechanism audited on a toy tuning ---------------------------------------------------------
# Neighbours: D (one example of value 0... none of value 1) and D' (one example of value 1 added).
# Two candidates: candidate 0's score is the count of 1s plus N(0, σ²) (sensitivity 1: a trial is
# a Gaussian mechanism), candidate 1's is 0.5 plus the same noise. The tuning draws K, a uniform
# candidate per trial, and releases (candidate, noised score) of the trial with the best score.

SIGMA, MEAN, REPS, DELTA = 6.0, 20.0, 200_000, 1e-5


def _toy_tuning(ones: int, count: TrialCount, rng: np.random.Generator, noised_choice: bool):
    ks = np.array([count.sample(rng) for _ in range(REPS)])
    best_key, best_score, best_c = np.full(REPS, -np.inf), np.zeros(REPS), np.full(REPS, -1)
    for j in range(int(ks.max())):
        alive = ks > j
        c = rng.integers(0, 2, REPS)
        f = np.where(c == 0, float(ones), 0.5)
        s = f + rng.normal(0.0, SIGMA, REPS)
        key = s if noised_choice else f + 1e-9 * rng.random(REPS)  # broken: the un-noised score decides
        better = alive & (key > best_key)
        best_key, best_score, best_c = (np.where(better, key, best_key), np.where(better, s, best_score),
                                        np.where(better, c, best_c))
    return best_c, best_score


@pytest.mark.parametrize("noised_choice", [True, False], ids=["real", "broken-unnoised-choice"])
def test_the_tuning_is_audited_below_its_claim_and_the_broken_choice_is_caught(noised_choice):
    count = TrialCount.with_mean(MEAN)
    event = ev.RandomTrialsDpEvent([ev.GaussianDpEvent(SIGMA)], count.distribution, eta=count.eta, gamma=count.gamma)
    claim = RdpAccountant().epsilon([(event, 1)], DELTA)
    rng = np.random.default_rng(11)
    c_d, s_d = _toy_tuning(0, count, rng, noised_choice)
    c_p, s_p = _toy_tuning(1, count, rng, noised_choice)
    thresholds = (-np.inf, 4.0, 8.0)  # fixed in advance: {candidate 0 released, its score above t}
    best = -math.inf
    for t in thresholds:
        on_dprime = EventCounts(int(((c_p == 0) & (s_p > t)).sum()), REPS)
        on_d = EventCounts(int(((c_d == 0) & (s_d > t)).sum()), REPS)
        best = max(best, epsilon_lower_bound(on_dprime, on_d, DELTA, 1e-6 / len(thresholds)).eps_lb)
    if noised_choice:
        assert best <= claim, (best, claim)
    else:
        assert best > claim, (best, claim)  # picking on the un-noised score leaks past the claim
