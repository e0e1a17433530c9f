"""Amplification by shuffling for pure ε₀-DP local randomizers (FMT21 clones), `adaptive_clipping.shuffling`."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from widedp.adaptive_clipping import shuffling as sh


def _slack(eps0: float) -> float:
    """The absolute safety term the module adds to every δ (see its docstring)."""
    return sh._ABS_SLACK * (1.0 + math.exp(eps0))


# ---- the reduction, enumerated directly -----------------------------------------------------
#
# With e^{ε₀} and e^{ε} rational, every probability of the pair (P, Q) is rational: enumerate
# (C, A, Δ) exactly, collect the law of the output pair (x, y), and take the hockey-stick
# divergence in exact arithmetic. Independent of the module's tail formula, its k*, its
# truncation and its floating point.

def _pair(e0: Fraction, n: int) -> tuple[dict, dict]:
    p = 1 / e0
    alpha = e0 / (e0 + 1)
    P: dict = {}
    Q: dict = {}
    for c in range(n):
        wc = math.comb(n - 1, c) * p ** c * (1 - p) ** (n - 1 - c)
        for a in range(c + 1):
            wa = wc * Fraction(math.comb(c, a), 2 ** c)
            for d, wd in ((1, alpha), (0, 1 - alpha)):
                op = (a + d, c - a + 1 - d)
                oq = (a + 1 - d, c - a + d)
                P[op] = P.get(op, 0) + wa * wd
                Q[oq] = Q.get(oq, 0) + wa * wd
    return P, Q


def _hockey_stick(P: dict, Q: dict, r: Fraction) -> Fraction:
    return sum((max(Fraction(0), P[o] - r * Q.get(o, 0)) for o in P), Fraction(0))


@pytest.mark.parametrize("e0, n", [(Fraction(2), 1), (Fraction(2), 2), (Fraction(3), 7), (Fraction(7), 12),
                                   (Fraction(20), 9), (Fraction(3, 2), 15)])
def test_clone_delta_is_the_exact_divergence_of_the_pair_both_directions(e0, n):
    P, Q = _pair(e0, n)
    assert sum(P.values()) == 1 and sum(Q.values()) == 1
    eps0 = math.log(e0)
    # a spread of ratios e^ε in (1, e^{ε₀}), plus the exact likelihood ratios of the pair:
    # the ties, where the positive part's boundary sits exactly on an outcome
    ratios = {1 + (e0 - 1) * Fraction(k, 7) for k in range(7)}
    ratios |= {P[o] / Q[o] for o in P if o in Q and Q[o] > 0 and 1 <= P[o] / Q[o] < e0}
    for r in sorted(ratios)[:40]:
        forward, backward = _hockey_stick(P, Q, r), _hockey_stick(Q, P, r)
        assert forward == backward  # the symmetry the module relies on
        got = sh.clone_delta(eps0, n, math.log(r))
        exact = float(forward)
        # an upper bound, and tight up to its stated safety term (+ float rounding of the input ε)
        assert exact - 1e-14 <= got - _slack(eps0) + 1e-15, (r, exact, got)
        assert got <= exact + 2 * _slack(eps0) + 1e-13, (r, exact, got)
    # at and beyond ε₀ nothing is left but the safety term; below it the bound is not vacuous
    assert sh.clone_delta(eps0, n, eps0) <= 2 * _slack(eps0)
    assert sh.clone_delta(eps0, n, 0.0) > 0.05


def test_clone_delta_matches_the_enumeration_at_a_moderate_n_where_truncation_starts():
    e0, n = Fraction(3), 60  # weights P[C = c] of c near n - 1 are below 1e-30 and dropped
    P, Q = _pair(e0, n)
    for r in (Fraction(11, 10), Fraction(3, 2), Fraction(2)):
        exact = float(_hockey_stick(P, Q, r))
        got = sh.clone_delta(math.log(3), n, math.log(r))
        assert exact - 1e-14 <= got <= exact + 2 * _slack(math.log(3)), (r, exact, got)


# ---- the authors' published numbers -------------------------------------------------------------
#
# README of github.com/apple/ml-shuffling-amplification (commit 993d285), example.py with
# n = 10⁵, ε₀ = 4, δ = 1e-6: "for eps between 0.1675385583317841 and 0.172790550755978" (their
# numerical bounds on the same reduction, bisection of 10 steps on [0, closed form], step 100)
# and closed form "at most 0.5378040242374512".

def test_numerical_bound_lies_in_the_authors_published_interval():
    eps = sh.numerical_epsilon(4.0, 10 ** 5, 1e-6)
    resolution = 0.5378040242374512 / 2 ** 10  # their bisection's resolution (their lower end may sit this much high)
    assert 0.1675385583317841 - resolution <= eps <= 0.172790550755978
    assert sh.shuffled_epsilon(4.0, 10 ** 5, 1e-6) == eps


def test_closed_form_reproduces_the_authors_published_value():
    assert sh.closed_form_epsilon(4.0, 10 ** 5, 1e-6) == pytest.approx(0.5378040242374512, rel=1e-12)


@pytest.mark.parametrize("eps0, n, delta", [
    (0.1, 10 ** 4, 1e-5), (1.0, 10 ** 4, 1e-5), (3.0, 10 ** 4, 1e-5),  # 3.0: outside the regime
    (2.0, 10 ** 5, 1e-6), (5.0, 10 ** 5, 1e-6), (8.0, 10 ** 6, 1e-8),
])
def test_numerical_bound_is_never_above_the_closed_form_or_eps0(eps0, n, delta):
    closed = sh.closed_form_epsilon(eps0, n, delta)
    num = sh.numerical_epsilon(eps0, n, delta)
    assert 0 < num <= eps0
    if closed is not None:
        assert num <= closed
        assert num < eps0  # amplification actually happens in the closed form's regime


def test_closed_form_is_none_outside_its_regime():
    # ε₀ ≤ log(n / (16 log(4/δ))): at n = 1000, δ = 1e-6 that is log(1000/243.3) ≈ 1.41
    assert sh.closed_form_epsilon(1.4, 1000, 1e-6) is not None
    assert sh.closed_form_epsilon(1.5, 1000, 1e-6) is None
    assert 0 < sh.shuffled_epsilon(1.5, 1000, 1e-6) < 1.5


# ---- monotonicity and limits ----------------------------------------------------------------

@pytest.mark.parametrize("eps0", [0.5, 3.0, 6.0])
def test_more_users_never_cost_more(eps0):
    # exact for the reduction: the pair for n + 1 is the pair for n plus the same independent clone
    ns = [1, 2, 3, 5, 10, 30, 100, 300, 1000, 3000, 10 ** 4] + ([10 ** 5] if eps0 > 5 else [])
    eps = [sh.numerical_epsilon(eps0, n, 1e-6) for n in ns]
    assert all(b <= a + 1e-9 for a, b in zip(eps, eps[1:])), eps
    assert eps[-1] < eps[0] / 5


def test_larger_delta_never_costs_more_and_delta_of_eps_is_nonincreasing():
    deltas = [1e-10, 1e-8, 1e-6, 1e-4, 1e-2, 0.2]
    eps = [sh.numerical_epsilon(3.0, 2000, d) for d in deltas]
    assert all(b <= a + 1e-12 for a, b in zip(eps, eps[1:])), eps
    grid = np.linspace(0.0, 3.0, 61)
    ds = [sh.clone_delta(3.0, 2000, float(e)) for e in grid]
    assert all(b <= a + 1e-15 for a, b in zip(ds, ds[1:]))


@pytest.mark.parametrize("eps0", [0.3, 1.0, 4.0])
def test_one_user_gets_no_amplification(eps0):
    # n = 1: the pair is randomized response, δ(ε) = (e^{ε₀} - e^ε)/(e^{ε₀} + 1) exactly, so the
    # smallest ε at δ is log(e^{ε₀} - (δ - slack)(e^{ε₀} + 1)), i.e. ε₀ to within ~δ
    delta = 1e-6
    expected = math.log(math.exp(eps0) - (delta - _slack(eps0)) * (math.exp(eps0) + 1))
    got = sh.numerical_epsilon(eps0, 1, delta)
    assert got == pytest.approx(expected, abs=1e-12)
    assert eps0 - 3 * delta <= got <= eps0


def test_result_is_a_certified_point_whatever_the_bisection_resolution():
    for iterations in (1, 3, 10, 40):
        eps = sh.numerical_epsilon(2.0, 2000, 1e-6, iterations=iterations)
        assert sh.clone_delta(2.0, 2000, eps) <= 1e-6
    coarse = sh.numerical_epsilon(2.0, 2000, 1e-6, iterations=3)
    fine = sh.numerical_epsilon(2.0, 2000, 1e-6)
    assert fine <= coarse and sh.clone_delta(2.0, 2000, fine - 1e-9) > 1e-6  # fine is the threshold


# ---- a concrete shuffled protocol: binary randomized response --------------------------------
#
# Each of n users reports its bit through randomized response (keep w.p. e^{ε₀}/(1+e^{ε₀})): a
# pure ε₀-DP local randomizer. The shuffled reports are exactly the count of ones, whose law is
# a convolution of binomials. Neighbours: user 1 holds 0 vs 1, the others' bits fixed (k ones).
# The exact divergence of the count must stay below the clone bound for every ε and every k.

def _rr_counts(eps0: float, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    keep = 1.0 / (1.0 + math.exp(-eps0))
    zeros = stats.binom.pmf(np.arange(n - k), n - 1 - k, 1.0 - keep)  # others holding 0 report 1 w.p. 1 - keep
    ones = stats.binom.pmf(np.arange(k + 1), k, keep)
    others = np.convolve(zeros, ones)
    return np.convolve(others, [keep, 1.0 - keep]), np.convolve(others, [1.0 - keep, keep])


def _rr_delta(eps0: float, n: int, eps: float) -> float:
    worst = 0.0
    for k in range(0, n, max(1, n // 8)):
        p0, p1 = _rr_counts(eps0, n, k)
        worst = max(worst, np.maximum(0, p0 - math.exp(eps) * p1).sum(), np.maximum(0, p1 - math.exp(eps) * p0).sum())
    return float(worst)


@pytest.mark.parametrize("eps0, n", [(1.0, 20), (2.0, 50), (4.0, 1000)])
def test_shuffled_randomized_response_is_within_the_clone_bound(eps0, n):
    for eps in np.linspace(0.05, eps0, 8):
        assert _rr_delta(eps0, n, float(eps)) <= sh.clone_delta(eps0, n, float(eps))
    # and the ε the module certifies at δ holds for the protocol
    for delta in (1e-2, 1e-4, 1e-6):
        assert _rr_delta(eps0, n, sh.numerical_epsilon(eps0, n, delta)) <= delta


@pytest.mark.parametrize("eps0, n", [(1.0, 20), (2.0, 50), (4.0, 1000)])
def test_the_protocol_catches_a_bound_that_claims_ten_times_the_users(eps0, n):
    # claiming amplification among 10n users when there are n: violated by the real protocol
    violated = [eps for eps in np.linspace(0.05, eps0, 8)
                if _rr_delta(eps0, n, float(eps)) > sh.clone_delta(eps0, 10 * n, float(eps))]
    assert violated
    assert _rr_delta(eps0, n, sh.numerical_epsilon(eps0, 10 * n, 1e-4)) > 1e-4


# ---- inputs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, name", [
    (lambda: sh.numerical_epsilon(0.0, 10, 1e-6), "eps0"),
    (lambda: sh.numerical_epsilon(-1.0, 10, 1e-6), "eps0"),
    (lambda: sh.numerical_epsilon(math.inf, 10, 1e-6), "eps0"),
    (lambda: sh.numerical_epsilon(math.nan, 10, 1e-6), "eps0"),
    (lambda: sh.numerical_epsilon(True, 10, 1e-6), "eps0"),
    (lambda: sh.numerical_epsilon("1", 10, 1e-6), "eps0"),  # type: ignore[arg-type]
    (lambda: sh.numerical_epsilon(1.0, 0, 1e-6), "n"),
    (lambda: sh.numerical_epsilon(1.0, 2.5, 1e-6), "n"),  # type: ignore[arg-type]
    (lambda: sh.numerical_epsilon(1.0, True, 1e-6), "n"),
    (lambda: sh.numerical_epsilon(1.0, 10, 0.0), "delta"),
    (lambda: sh.numerical_epsilon(1.0, 10, 1.0), "delta"),
    (lambda: sh.numerical_epsilon(1.0, 10, math.nan), "delta"),
    (lambda: sh.numerical_epsilon(1.0, 10, 1e-6, iterations=0), "iterations"),
    (lambda: sh.shuffled_epsilon(1.0, -3, 1e-6), "n"),
    (lambda: sh.closed_form_epsilon(1.0, 10, 2.0), "delta"),
    (lambda: sh.clone_delta(1.0, 10, -0.1), "eps"),
    (lambda: sh.clone_delta(1.0, 10, math.inf), "eps"),
    (lambda: sh.clone_delta(1.0, 10, True), "eps"),
    (lambda: sh.clone_delta(0.0, 10, 0.5), "eps0"),
    (lambda: sh.eps0_for_epsilon(1.0, 10, 1e-6, iterations=0), "iterations"),
    (lambda: sh.eps0_for_epsilon(1.0, 0, 1e-6), "n"),
])
def test_bad_input_raises_value_error_naming_the_parameter(call, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        call()


# ---- calibration ---------------------------------------------------------------------------

@pytest.mark.parametrize("eps, n, delta", [(1.0, 10_000, 1e-5), (1.0, 100_000, 1e-6), (0.3, 50_000, 1e-5),
                                           (8.0, 100_000, 1e-5)])
def test_calibrated_eps0_is_certified_and_nearly_the_largest(eps, n, delta):
    eps0 = sh.eps0_for_epsilon(eps, n, delta)
    assert sh.shuffled_epsilon(eps0, n, delta) <= eps  # certified at the returned point
    assert sh.shuffled_epsilon(eps0 * 1.001, n, delta) > eps  # and not far below the largest
    assert eps0 > eps  # amplification happened at these n


def test_calibration_gains_more_with_more_users_and_almost_nothing_with_one():
    e0 = [sh.eps0_for_epsilon(1.0, n, 1e-5) for n in (1_000, 10_000, 100_000)]
    assert e0[0] < e0[1] < e0[2]
    assert sh.eps0_for_epsilon(1.0, 1, 1e-5) < 1.001  # one user: no amplification to speak of
