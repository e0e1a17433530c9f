"""Private hyper-parameter selection with a random number of trials (accounting/tuning.py).

1. The sampler of K agrees with the slow pmf (chi-square on ~20k draws, the tail pooled) and the
   pmf with an independent closed form; `with_mean` hits the mean; bad parameters are refused.
2. `selection_rdp` equals a slow, obvious transcription of Papernot & Steinke 2022, Thm 2 / Thm 6
   (loops over λ̂ and over α), on the curves of Gaussians and of a Poisson-subsampled DP-SGD run;
   its sanity properties; and the RDP accountant composes `RandomTrialsDpEvent` through it.
3. A statistical audit (tests/privacy_audit.py) of the tuning on a toy problem, paired with a
   broken variant that chooses on the un-noised score: the real one stays below its claimed ε,
   the broken one is caught above it by the same audit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from privacy_audit import EventCounts, epsilon_lower_bound_both_directions
from widedp.accounting import events as ev
from widedp.accounting.base import UnsupportedEventError
from widedp.accounting.rdp import DEFAULT_ORDERS, RdpAccountant, rdp_curve, rdp_to_epsilon
from widedp.accounting.tuning import TrialCount, known_count_rdp, selection_rdp

TNB = "truncated_negative_binomial"
ORDERS = np.asarray(DEFAULT_ORDERS, dtype=np.float64)
DELTA = 1e-5


def _counts(mean: float) -> dict[str, TrialCount]:
    return {"logarithmic": TrialCount.with_mean(mean, eta=0.0),
            "eta 0.5": TrialCount.with_mean(mean, eta=0.5),
            "geometric": TrialCount.with_mean(mean, eta=1.0),
            "poisson": TrialCount.with_mean(mean, "poisson")}


PMF_SUPPORT = 1200
COUNT_CASES = [(name, mean) for mean in (4.0, 10.0) for name in ("logarithmic", "eta 0.5", "geometric", "poisson")]


# ============================================================================================
# 1. The distribution of K
# ============================================================================================


def _pmf_closed_form(count: TrialCount, k: np.ndarray) -> np.ndarray:
    """P[K = k] by an independent route (log-gamma), for comparison with the looped `pmf`."""
    k = np.asarray(k, dtype=np.float64)
    k_safe = np.maximum(k, 1.0)
    if count.distribution == "poisson":
        return np.exp(k * math.log(count.mu) - count.mu - special.gammaln(k + 1))
    g, eta = count.gamma, count.eta
    if eta == 0:
        out = (1 - g) ** k_safe / k_safe / -math.log(g)
    else:  # C(k+η-1, k) (1-γ)^k / (γ^-η - 1)
        log_c = special.gammaln(k_safe + eta) - special.gammaln(eta) - special.gammaln(k_safe + 1)
        out = np.exp(log_c + k_safe * math.log1p(-g)) / (g ** (-eta) - 1)
    return np.where(k >= 1, out, 0.0)


@pytest.mark.parametrize("name,mean", COUNT_CASES)
def test_pmf_matches_closed_form_and_mean(name, mean):
    count = _counts(mean)[name]
    assert count.expected == pytest.approx(mean, rel=1e-6)
    k = np.arange(0, PMF_SUPPORT)  # the tail beyond it is < 1e-13 for E[K] <= 10
    pmf = count.pmf(k)
    np.testing.assert_allclose(pmf, _pmf_closed_form(count, k), rtol=1e-9, atol=1e-300)
    if count.distribution != "poisson":
        assert pmf[0] == 0.0
    assert pmf.sum() == pytest.approx(1.0, abs=1e-9)
    assert float((k * pmf).sum()) == pytest.approx(count.expected, rel=1e-7)


@pytest.mark.parametrize("name,mean", COUNT_CASES)
def test_sampler_matches_pmf(name, mean):
    count = _counts(mean)[name]
    n = 20_000
    rng = np.random.default_rng(1000 + int(mean) + COUNT_CASES.index((name, mean)))
    draws = np.array([count.sample(rng) for _ in range(n)])
    assert draws.dtype.kind == "i"
    lo = 0 if count.distribution == "poisson" else 1
    assert draws.min() >= lo
    # Bins lo..kmax with an expected count >= 5 each, then one pooled tail bin (k > kmax).
    k = np.arange(lo, PMF_SUPPORT)
    pk = count.pmf(k)
    expected = n * pk
    kmax = int(k[np.nonzero(expected >= 5)[0][-1]])
    ks = np.arange(lo, kmax + 1)
    exp_bins = n * count.pmf(ks)
    exp_tail = n - exp_bins.sum()
    assert exp_tail >= 5
    obs_bins = np.array([np.count_nonzero(draws == kk) for kk in ks])
    obs_tail = np.count_nonzero(draws > kmax)
    obs = np.append(obs_bins, obs_tail)
    exp = np.append(exp_bins, exp_tail)
    p = stats.chisquare(obs, exp).pvalue
    assert p > 1e-4, f"{count.describe()}: chi-square p = {p:.3g} over {obs.size} bins"
    # The sample mean within 5 standard errors of E[K] (the pmf gives the variance).
    var = float((k**2 * pk).sum() - (k * pk).sum() ** 2)
    assert abs(draws.mean() - count.expected) < 5 * math.sqrt(var / n), (draws.mean(), count.expected)


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 2.5])
@pytest.mark.parametrize("mean", [1.01, 2.0, 4.0, 10.0, 1000.0])
def test_with_mean_hits_the_mean(eta, mean):
    count = TrialCount.with_mean(mean, eta=eta)
    assert count.distribution == TNB and count.eta == eta and 0 < count.gamma < 1
    assert count.expected == pytest.approx(mean, rel=1e-6)
    assert TrialCount.with_mean(mean, "poisson").expected == pytest.approx(mean, rel=1e-12)


@pytest.mark.parametrize("build,match", [
    (lambda: TrialCount(TNB, eta=-0.1, gamma=0.5), "eta >= 0"),
    (lambda: TrialCount(TNB, eta=math.nan, gamma=0.5), "eta >= 0"),
    (lambda: TrialCount.with_mean(5.0, eta=-1.0), "eta >= 0"),
    (lambda: TrialCount(TNB, eta=0.0, gamma=0.0), "gamma in"),
    (lambda: TrialCount(TNB, eta=0.0, gamma=1.0), "gamma in"),
    (lambda: TrialCount(TNB, eta=1.0, gamma=-0.2), "gamma in"),
    (lambda: TrialCount(TNB, eta=1.0, gamma=1.5), "gamma in"),
    (lambda: TrialCount(TNB, eta=1.0, gamma=math.nan), "gamma in"),
    (lambda: TrialCount("poisson", mu=0.0), "mu > 0"),
    (lambda: TrialCount("poisson", mu=-3.0), "mu > 0"),
    (lambda: TrialCount("poisson", mu=math.inf), "mu > 0"),
    (lambda: TrialCount.with_mean(0.0, "poisson"), "mu > 0"),
    (lambda: TrialCount.with_mean(1.0), "expected number of trials must be > 1"),
    (lambda: TrialCount.with_mean(0.5, eta=1.0), "expected number of trials must be > 1"),
    (lambda: TrialCount.with_mean(math.inf), "expected number of trials must be > 1"),
    (lambda: TrialCount("uniform", gamma=0.5), "distribution must be one of"),
    (lambda: TrialCount.with_mean(5.0, "uniform"), "distribution must be one of"),
])
def test_bad_parameters_are_refused(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# ============================================================================================
# 2. The RDP bound of the best of K trials
# ============================================================================================


def _reference_selection_rdp(count: TrialCount, curve, orders) -> np.ndarray:
    """Papernot & Steinke 2022, Thm 2 (truncated negative binomial) / Thm 6 (Poisson), written
    out with loops: λ̂ (Thm 2) and α (the (ε̂, δ̂) conversion of Thm 6) range over `orders`."""
    orders = [float(a) for a in orders]
    eps = [float(e) for e in curve]
    out = []
    for i, lam in enumerate(orders):
        if count.distribution == "poisson":
            eps_hat = math.log(1 + 1 / (lam - 1))
            log_deltas = []
            for j, a in enumerate(orders):
                if not math.isfinite(eps[j]):
                    continue
                # log of exp((a-1)(eps(a)-eps_hat)) * ((a-1)/a)^(a-1) / a
                log_deltas.append((a - 1) * (eps[j] - eps_hat) + (a - 1) * math.log((a - 1) / a) - math.log(a))
            delta_hat = min(1.0, math.exp(min(0.0, min(log_deltas)))) if log_deltas else 1.0
            out.append(eps[i] + count.mu * delta_hat + math.log(count.mu) / (lam - 1))
            continue
        eta, gamma = count.eta, count.gamma
        best = math.inf
        for j, lam_hat in enumerate(orders):
            value = (eps[i] + (1 + eta) * (1 - 1 / lam_hat) * eps[j] + (1 + eta) * math.log(1 / gamma) / lam_hat
                     + math.log(count.expected) / (lam - 1))
            best = min(best, value)
        out.append(best)
    return np.array(out)


def _subsampled_event():
    return ev.SelfComposedDpEvent(ev.PoissonSampledDpEvent(0.02, ev.GaussianDpEvent(1.0)), 500)


TRIAL_EVENTS = {"gaussian sigma 2": ev.GaussianDpEvent(2.0),
                "gaussian sigma 5": ev.GaussianDpEvent(5.0),
                "dp-sgd 500 steps": _subsampled_event()}


@pytest.fixture(scope="module")
def trial_curves():
    return {name: rdp_curve(event, ORDERS) for name, event in TRIAL_EVENTS.items()}


@pytest.mark.parametrize("curve_name", list(TRIAL_EVENTS))
@pytest.mark.parametrize("mean", [2.0, 10.0, 100.0])
def test_selection_rdp_equals_reference(trial_curves, curve_name, mean):
    curve = trial_curves[curve_name]
    assert np.all(np.isfinite(curve))
    for name, count in _counts(mean).items():
        got = selection_rdp(count, curve, ORDERS)
        want = _reference_selection_rdp(count, curve, ORDERS)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"{name}, E[K] = {mean}")


def test_selection_rdp_reference_with_infinite_orders():
    # +inf where the curve is unknown (e.g. Zhu-Wang at non-integer orders): the same reference.
    curve = rdp_curve(ev.GaussianDpEvent(3.0), ORDERS)
    curve = np.where(ORDERS == np.round(ORDERS), curve, np.inf)
    for name, count in _counts(10.0).items():
        got = selection_rdp(count, curve, ORDERS)
        want = _reference_selection_rdp(count, curve, ORDERS)
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(got), finite), name
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-10, err_msg=name)


def test_selection_rdp_rejects_bad_inputs():
    count = TrialCount.with_mean(10.0)
    with pytest.raises(ValueError, match="values for"):
        selection_rdp(count, np.ones(3), ORDERS)
    with pytest.raises(ValueError, match="> 1"):
        selection_rdp(count, np.ones(2), [1.0, 2.0])


@pytest.mark.parametrize("curve_name", list(TRIAL_EVENTS))
def test_selection_rdp_sanity(trial_curves, curve_name):
    curve = trial_curves[curve_name]
    one = rdp_to_epsilon(ORDERS, curve, DELTA)[0]
    composed10 = rdp_to_epsilon(ORDERS, known_count_rdp(10, curve), DELTA)[0]
    assert np.array_equal(known_count_rdp(10, curve), 10 * curve)
    means = (1.5, 2.0, 5.0, 10.0, 30.0, 100.0)
    for name in ("logarithmic", "eta 0.5", "geometric", "poisson"):
        epsilons = []
        for mean in means:
            count = _counts(mean)[name]
            bound = selection_rdp(count, curve, ORDERS)
            assert np.all(bound >= curve), f"{name} E[K]={mean}: below one trial"  # E[K] >= 1 here
            epsilons.append(rdp_to_epsilon(ORDERS, bound, DELTA)[0])
        assert all(e > one for e in epsilons), (name, epsilons, one)
        assert np.all(np.diff(epsilons) > 0), f"{name}: ε does not grow with E[K]: {epsilons}"
        at10 = epsilons[means.index(10.0)]
        assert at10 < composed10, f"{name}: best of K (E[K]=10) {at10} not below 10 composed trials {composed10}"
    # The default (η = 0) is the cheapest truncated negative binomial at the same E[K].
    e = {name: rdp_to_epsilon(ORDERS, selection_rdp(c, curve, ORDERS), DELTA)[0] for name, c in _counts(10.0).items()}
    assert e["logarithmic"] < e["eta 0.5"] < e["geometric"], e


def _random_trials_event(candidates, count: TrialCount):
    return ev.RandomTrialsDpEvent(candidates=list(candidates), distribution=count.distribution,
                                  eta=count.eta, gamma=count.gamma, mu=count.mu)


@pytest.mark.parametrize("name", ["logarithmic", "eta 0.5", "geometric", "poisson"])
def test_accountant_composes_random_trials(name):
    count = _counts(10.0)[name]
    candidates = [ev.GaussianDpEvent(1.5), _subsampled_event()]
    event = _random_trials_event(candidates, count)
    curves = [rdp_curve(c, ORDERS) for c in candidates]
    trial = np.maximum(curves[0], curves[1])
    assert np.any(curves[0] > curves[1]) and np.any(curves[1] > curves[0])  # the max takes from both
    want, order = rdp_to_epsilon(ORDERS, selection_rdp(count, trial, ORDERS), DELTA)
    assert min(ORDERS) < order < max(ORDERS)  # interior: no edge orders searched
    accountant = RdpAccountant()
    got = accountant.epsilon([(event, 1)], DELTA)
    assert got == pytest.approx(want, rel=1e-12)
    # Either candidate alone costs less, and so does the smaller E[K].
    for c in candidates:
        assert RdpAccountant().epsilon([(_random_trials_event([c], count), 1)], DELTA) <= got + 1e-12
    # Serialization round trip (the persisted ledger).
    data = ev.event_to_dict(event)
    assert data["type"] == "RandomTrialsDpEvent" and len(data["candidates"]) == 2
    back = ev.event_from_dict(data)
    assert back == event
    assert RdpAccountant().epsilon([(back, 1)], DELTA) == got


@pytest.mark.parametrize("params,match", [
    ({"distribution": TNB, "eta": 0.0, "gamma": 1.5}, "gamma in"),
    ({"distribution": TNB, "eta": 0.0, "gamma": 0.0}, "gamma in"),
    ({"distribution": TNB, "eta": -1.0, "gamma": 0.1}, "eta >= 0"),
    ({"distribution": "poisson", "mu": 0.0}, "mu > 0"),
    ({"distribution": "uniform", "gamma": 0.1}, "distribution must be one of"),
])
def test_accountant_refuses_invalid_trial_count(params, match):
    event = ev.RandomTrialsDpEvent(candidates=[ev.GaussianDpEvent(2.0)], **params)
    accountant = RdpAccountant()
    assert not accountant.supports(event)
    with pytest.raises(UnsupportedEventError, match=match) as info:
        accountant.epsilon([(event, 1)], DELTA)
    assert "RandomTrialsDpEvent" in str(info.value)


# ============================================================================================
# 3. Statistical audit of the tuning on a toy problem
# ============================================================================================
# D: n examples all 0; D' = D plus one example of value 1. Candidates c ∈ {0, 1}; a trial of c
# outputs (c, s), s = f_c(data) + N(0, σ²) with f_0 = sum(data) (0 on D, 1 on D') and f_1 = 0.5:
# each trial is a Gaussian mechanism of noise multiplier σ (candidate 1: a no-op). The tuning
# draws K (logarithmic, E[K] = m), each trial's candidate uniformly, and releases the (c, s) of
# the largest noised s. Vectorized exactly, without capping K: given K, the trials of candidate 0
# are N0 ~ Binomial(K, 1/2), and the max of N0 iid N(f_0, σ²) is f_0 + σ Φ⁻¹(U^(1/N0)).
# Broken: the choice is made on the un-noised f_c (the released s is still noised): on D, c = 0
# only if every trial drew candidate 0 (P = E[2^-K]), on D' whenever one did (1 - E[2^-K]).
# Pre-specified events E_t = {released c = 0 and s > t}, t ∈ {-∞, 0, σ, 2σ}, each audited in
# both directions at alpha / 4 (Bonferroni: overall false alarm ≤ 1e-6). At σ = 5, m = 100 and
# 2e5 repetitions per side: claimed ε ≈ 1.69; the real tuning's eps_lb ≈ 0.3; the broken ≈ 2.3
# (exact for t = -∞: log((1 - p)/p) = 2.12 with p = E[2^-K] = log(2/(1+γ)) / log(1/γ)).

AUDIT_SIGMA = 5.0
AUDIT_MEAN = 100.0
AUDIT_REPS = 200_000
AUDIT_THRESHOLDS = (-math.inf, 0.0, AUDIT_SIGMA, 2 * AUDIT_SIGMA)
AUDIT_ALPHA = 1e-6


def _max_of_normals(n: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The max of n[i] iid N(0, 1) for each i (-inf where n[i] = 0), by inversion."""
    u = rng.random(n.shape)
    with np.errstate(divide="ignore"):
        tail = -np.expm1(np.log(u) / n)  # 1 - U^(1/n) = P[max > x]
    return np.where(n > 0, -special.ndtri(np.where(n > 0, tail, 0.5)), -np.inf)


def test_max_of_normals_matches_literal_max():
    rng = np.random.default_rng(7)
    for n in (1, 3, 17, 250):
        fast = _max_of_normals(np.full(20_000, n), rng)
        literal = rng.standard_normal((20_000, n)).max(axis=1)
        assert stats.ks_2samp(fast, literal).pvalue > 1e-4, n
    assert np.all(_max_of_normals(np.zeros(5, dtype=np.int64), rng) == -np.inf)


def _tuning(count: TrialCount, f0: float, sigma: float, reps: int, rng: np.random.Generator, broken: bool):
    """(released candidate, released noised score) of `reps` independent tunings."""
    f1 = 0.5
    k = np.array([count.sample(rng) for _ in range(reps)], dtype=np.int64)
    assert k.min() >= 1  # truncated: the tuning always releases a trial here
    n0 = rng.binomial(k, 0.5)
    n1 = k - n0
    if broken:
        # The best tried candidate by its un-noised score; one of its trials' noised score released.
        tried_best = 0 if f0 > f1 else 1
        other = 1 - tried_best
        tried = np.where(tried_best == 0, n0, n1) > 0
        c = np.where(tried, tried_best, other)
        s = np.where(c == 0, f0, f1) + sigma * rng.standard_normal(reps)
        return c, s
    best0 = f0 + sigma * _max_of_normals(n0, rng)
    best1 = f1 + sigma * _max_of_normals(n1, rng)
    c = np.where(best0 > best1, 0, 1)
    return c, np.maximum(best0, best1)


def _claimed_epsilon(count: TrialCount, sigma: float) -> float:
    event = _random_trials_event([ev.GaussianDpEvent(sigma), ev.NoOpDpEvent()], count)
    return RdpAccountant().epsilon([(event, 1)], DELTA)


def _audit_tuning(broken: bool, seed: int):
    count = TrialCount.with_mean(AUDIT_MEAN, eta=0.0)
    rng = np.random.default_rng(seed)
    c_d, s_d = _tuning(count, 0.0, AUDIT_SIGMA, AUDIT_REPS, rng, broken)
    c_dp, s_dp = _tuning(count, 1.0, AUDIT_SIGMA, AUDIT_REPS, rng, broken)
    alpha = AUDIT_ALPHA / len(AUDIT_THRESHOLDS)
    results = []
    for t in AUDIT_THRESHOLDS:
        on_d = EventCounts.from_bools((c_d == 0) & (s_d > t))
        on_dp = EventCounts.from_bools((c_dp == 0) & (s_dp > t))
        # Forward: P[E | D'] ≤ e^ε P[E | D] + δ; backward (E again): P[E | D] ≤ e^ε P[E | D'] + δ.
        results.append(epsilon_lower_bound_both_directions(on_dp, on_d, delta=DELTA, alpha=alpha))
    return max(results, key=lambda r: r.eps_lb), results


def test_audit_claim_is_modest():
    claimed = _claimed_epsilon(TrialCount.with_mean(AUDIT_MEAN), AUDIT_SIGMA)
    assert 1.5 < claimed < 3.0, claimed
    # More than one trial (the claim exceeds a single Gaussian's ε).
    assert claimed > RdpAccountant().epsilon([(ev.GaussianDpEvent(AUDIT_SIGMA), 1)], DELTA)


@pytest.mark.parametrize("variant", ["real", "choose_on_unnoised_score"])
def test_tuning_audit(variant):
    broken = variant != "real"
    claimed = _claimed_epsilon(TrialCount.with_mean(AUDIT_MEAN), AUDIT_SIGMA)
    best, results = _audit_tuning(broken, seed=2022)
    detail = "; ".join(f"t={t:g}: {r}" for t, r in zip(AUDIT_THRESHOLDS, results))
    print(f"\ntuning audit ({variant}): claimed eps={claimed:.4f}, eps_lb={best.eps_lb:.4f}\n  {detail}")
    if broken:
        assert best.eps_lb > claimed, f"broken tuning not caught: claimed {claimed:.4f}; {detail}"
    else:
        assert best.eps_lb <= claimed, f"tuning leaks more than claimed {claimed:.4f}: {detail}"
        assert best.eps_lb > 0.1, f"vacuous audit (the toy's leak is ~0.3): {detail}"


def test_the_default_distribution_costs_least_and_an_event_needs_candidates():
    """The logarithmic distribution (η = 0, `widedp tune`'s default) gives the lowest ε of the
    choices at the same E[K] on a DP-SGD trial's curve (docs/guide/tuning.md's table), below ten
    trials composed; an event without candidates is refused."""
    from widedp.accounting.tuning import compare_distributions

    curve = rdp_curve(ev.SelfComposedDpEvent(ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(1.0)), 2000), ORDERS)
    table = compare_distributions(curve, ORDERS, 10.0, 1e-6, lambda o, c, d: rdp_to_epsilon(o, c, d)[0])
    choices = {k: v for k, v in table.items() if k != "one trial" and "composed" not in k}
    assert min(choices, key=choices.get) == "logarithmic (eta 0)"
    assert table["one trial"] < choices["logarithmic (eta 0)"] < table["10 trials composed"]
    with pytest.raises(ValueError, match="non-empty list"):
        ev.RandomTrialsDpEvent([], "poisson", mu=3.0)
