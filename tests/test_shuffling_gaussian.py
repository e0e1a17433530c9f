"""Amplification by shuffling for (ε₀, δ₀)-DP local randomizers and the Gaussian (Lemma S of
`adaptive_clipping.shuffling`): its construction on random finite randomizers, its end result on an
exactly enumerated shuffled protocol (with a mutant that drops the δ₀ term caught), the Gaussian
profile against numerical integration, and the calibration."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from widedp.adaptive_clipping import shuffling as sh

# ---- Lemma S's construction, step by step, on random finite randomizers ---------------------


def _hs(p: np.ndarray, q: np.ndarray, eps: float) -> float:
    return float(np.maximum(0.0, p - math.exp(eps) * q).sum())


def _surrogate(R0, R1, Rj, eps0):
    """The construction of the module docstring's proof: (R'_0, R'_1) ε₀-close, R'_j ≥ c."""
    e = math.exp(eps0)
    low0, low1 = np.minimum(R0, e * R1), np.minimum(R1, e * R0)
    m0, m1 = 1.0 - low0.sum(), 1.0 - low1.sum()
    slack0, slack1 = e * low1 - low0, e * low0 - low1
    g0 = m0 * slack0 / slack0.sum() if m0 > 0 else 0.0 * slack0
    g1 = m1 * slack1 / slack1.sum() if m1 > 0 else 0.0 * slack1
    P0, P1 = low0 + g0, low1 + g1
    c = 0.5 / e * (P0 + P1)
    deficit = np.maximum(0.0, c - Rj).sum()
    over = np.maximum(0.0, Rj - c)
    Pj = np.maximum(Rj, c) - (deficit / over.sum()) * over
    return P0, P1, Pj


def _random_randomizer(rng, k: int, eps0: float):
    """Three output laws that are ε₀-close except for some mass moved to spoil purity."""
    base = rng.dirichlet(np.ones(k))
    laws = []
    for _ in range(3):
        tilt = np.exp(rng.uniform(-0.6 * eps0, 0.6 * eps0, size=k))
        law = base * tilt
        law /= law.sum()
        spoil = rng.uniform(0, 0.1)
        j = rng.integers(k)
        law = (1 - spoil) * law
        law[j] += spoil
        laws.append(law)
    return laws


@pytest.mark.parametrize("eps0", [0.3, 1.0, 2.5])
def test_the_proofs_surrogate_has_the_clone_structure_within_the_stated_total_variation(eps0):
    rng = np.random.default_rng(7)
    p = math.exp(-eps0)
    needed_fix = checked = 0
    for _ in range(300):
        R0, R1, Rj = _random_randomizer(rng, 6, eps0)
        delta0 = max(_hs(a, b, eps0) for a in (R0, R1, Rj) for b in (R0, R1, Rj))
        if delta0 > 1 - p:
            continue
        P0, P1, Pj = _surrogate(R0, R1, Rj, eps0)
        for law in (P0, P1, Pj):
            assert law.min() >= -1e-15 and law.sum() == pytest.approx(1.0, abs=1e-12)
        # (1) the pair is pure ε₀-close, each within δ₀ in TV
        assert np.all(P0 <= math.exp(eps0) * P1 + 1e-15) and np.all(P1 <= math.exp(eps0) * P0 + 1e-15)
        assert 0.5 * np.abs(P0 - R0).sum() <= delta0 + 1e-12
        assert 0.5 * np.abs(P1 - R1).sum() <= delta0 + 1e-12
        # (2) the other value dominates its clone part, within 2e^{-ε₀}δ₀ in TV
        assert np.all(Pj >= 0.5 * p * (P0 + P1) - 1e-15)
        assert 0.5 * np.abs(Pj - Rj).sum() <= 2 * p * delta0 + 1e-12
        needed_fix += bool(np.any(Rj < 0.5 * p * (R0 + R1) - 1e-12))
        checked += 1
    assert checked >= 100 and needed_fix >= 20, (checked, needed_fix)  # the raw laws break the clone inequality: step (2) is not vacuous here


# ---- a shuffled protocol enumerated exactly: randomized response with failure -----------------
#
# Each user holds a bit v; with probability f it reports ⊥_v (its bit in the clear), otherwise
# randomized response (v kept w.p. e^{ε₀}/(1+e^{ε₀})). One report is (ε₀, f)-DP exactly. The
# shuffled reports are the counts (#1, #⊥0, #⊥1) (the order is uniform given them), whose law is a
# convolution; neighbours: user 1 holds 0 vs 1, the others k ones and n-1-k zeros.

def _counts_law(n: int, ones: int, eps0: float, f: float) -> dict:
    keep = 1.0 / (1.0 + math.exp(-eps0))
    law = {(0, 0, 0): 1.0}
    for bit in [1] * ones + [0] * (n - ones):
        p_one = (1 - f) * (keep if bit else 1 - keep)
        moves = [((1, 0, 0), p_one), ((0, 0, 0), (1 - f) - p_one), ((0, 0, 1) if bit else (0, 1, 0), f)]
        nxt: dict = {}
        for s, w in law.items():
            for (da, d0, d1), pw in moves:
                key = (s[0] + da, s[1] + d0, s[2] + d1)
                nxt[key] = nxt.get(key, 0.0) + w * pw
        law = nxt
    return law


def _true_delta(n: int, eps0: float, f: float, eps: float) -> float:
    worst = 0.0
    for k in range(n):
        a, b = _counts_law(n, k, eps0, f), _counts_law(n, k + 1, eps0, f)  # user 1: 0 vs 1
        for P, Q in ((a, b), (b, a)):
            worst = max(worst, sum(max(0.0, w - math.exp(eps) * Q.get(o, 0.0)) for o, w in P.items()))
    return worst


@pytest.mark.parametrize("eps0, n, f", [(1.0, 12, 1e-6), (2.0, 16, 1e-7), (3.0, 14, 1e-8)])
def test_the_certified_epsilon_holds_for_the_protocol(eps0, n, f):
    for delta in (3e-2, 1e-3):
        eps = sh.approx_shuffled_epsilon(eps0, f, n, delta)
        assert eps < eps0  # amplified
        assert _true_delta(n, eps0, f, eps) <= delta
        # and the inequality it certifies, recomputed
        assert sh.clone_delta(eps0, n, eps) + sh.approx_delta_term(eps, eps0, f, n) <= delta


@pytest.mark.parametrize("eps0, n", [(1.0, 12), (2.0, 16)])
def test_the_protocol_catches_a_bound_that_drops_the_delta0_term(eps0, n):
    delta = 1e-3
    f = delta  # each user fails w.p. δ: the pure bound at ε₀ alone (the mutant) claims too much
    mutant = sh.shuffled_epsilon(eps0, n, delta)
    assert mutant < eps0 and _true_delta(n, eps0, f, mutant) > delta
    sound = sh.approx_shuffled_epsilon(eps0, f, n, delta)
    assert sound == eps0  # no room left for amplification; ε₀ holds, the truth there is f = δ
    assert _true_delta(n, eps0, f, sound) <= delta * (1 + 1e-12)  # (float rounding of the enumeration)


# ---- the (ε₀, δ₀) bound itself -------------------------------------------------------------

@pytest.mark.parametrize("eps0, n, delta", [(0.5, 1000, 1e-6), (3.0, 10 ** 4, 1e-5), (6.0, 10 ** 5, 1e-8),
                                            (2.0, 1, 1e-3)])
def test_delta0_zero_is_exactly_the_pure_bound(eps0, n, delta):
    assert sh.approx_shuffled_epsilon(eps0, 0.0, n, delta) == sh.shuffled_epsilon(eps0, n, delta)


def test_more_delta0_or_less_delta_never_costs_less():
    eps0, n = 3.0, 10 ** 4
    by_d0 = [sh.approx_shuffled_epsilon(eps0, d0, n, 1e-5) for d0 in (0.0, 1e-13, 1e-11, 1e-10, 3e-10, 1e-9)]
    assert all(b >= a - 1e-9 for a, b in zip(by_d0, by_d0[1:])), by_d0
    assert by_d0[-1] > by_d0[0]
    by_delta = [sh.approx_shuffled_epsilon(eps0, 1e-11, n, d) for d in (1e-6, 1e-5, 1e-4, 1e-2)]
    assert all(b <= a + 1e-9 for a, b in zip(by_delta, by_delta[1:])), by_delta


def test_without_room_for_the_delta0_term_it_falls_back_to_eps0_or_nothing():
    # n·δ₀ above δ: no amplified bound; ε₀ holds when δ₀ ≤ δ (one randomizer per record), else nothing
    assert sh.approx_shuffled_epsilon(2.0, 1e-6, 10 ** 4, 1e-5) == 2.0
    assert sh.approx_shuffled_epsilon(2.0, 1e-4, 10 ** 4, 1e-5) == math.inf


# ---- the Gaussian ----------------------------------------------------------------------------

def _profile_by_integration(eps: float, mu: float) -> float:
    """∫ (φ(x - μ) - e^ε φ(x))_+ dx: the hockey-stick divergence of N(μ, 1) from N(0, 1)."""
    cut = eps / mu + mu / 2  # the integrand is positive exactly for x > cut
    val, _ = integrate.quad(lambda x: stats.norm.pdf(x - mu) - math.exp(eps) * stats.norm.pdf(x), cut, np.inf,
                            epsabs=1e-15, epsrel=1e-10)
    return val


@pytest.mark.parametrize("eps, sens, std", [(0.0, 1.0, 1.0), (0.5, 2.0, 1.0), (1.0, 2.0, 3.0), (3.0, 1.0, 0.5),
                                            (5.0, 2.0, 0.8), (0.2, 0.01, 0.02)])
def test_gaussian_profile_matches_numerical_integration(eps, sens, std):
    got = sh.gaussian_delta(eps, sens, std)
    want = _profile_by_integration(eps, sens / std)
    assert got == pytest.approx(want, rel=1e-7, abs=1e-15)
    assert got >= want * (1 - 1e-12)  # rounded up, not down
    # a mutant that swaps Δ and s (the noise multiplier for its inverse) is far off
    assert abs(_profile_by_integration(eps, std / sens) - got) > 1e-3 * got or sens == std


def test_gaussian_epsilon_is_the_certified_inverse_of_the_profile():
    for sens, std, delta in ((2.0, 1.0, 1e-5), (2.0, 5.0, 1e-6), (1.0, 0.2, 1e-3)):
        eps = sh.gaussian_epsilon(delta, sens, std)
        assert sh.gaussian_delta(eps, sens, std) <= delta < sh.gaussian_delta(eps * (1 - 1e-6), sens, std)


@pytest.mark.parametrize("eps, n", [(1.0, 10 ** 4), (0.5, 5000)])
def test_gaussian_calibration_is_certified_and_amplifies(eps, n):
    delta = 1e-5
    out = sh.gaussian_noise_for_epsilon(eps, 2.0, n, delta)
    assert out["amplified"] and out["noise_std"] < out["unamplified_noise_std"] / 2
    # the certified triple, recomputed from its parts
    d0 = sh.gaussian_delta(out["eps0"], 2.0, out["noise_std"])
    assert d0 == out["delta0"]
    assert sh.clone_delta(out["eps0"], n, eps) + sh.approx_delta_term(eps, out["eps0"], d0, n) <= delta
    # the forward bound at that noise agrees (to its grid's resolution), and a little less noise fails it
    fwd = sh.gaussian_shuffled_epsilon(2.0, out["noise_std"], n, delta)
    assert fwd["epsilon"] <= eps * 1.02
    assert sh.gaussian_shuffled_epsilon(2.0, out["noise_std"] * 0.97, n, delta)["epsilon"] > eps
    # unamplified: the profile's own inverse
    assert sh.gaussian_epsilon(delta, 2.0, out["unamplified_noise_std"]) <= eps


def test_gaussian_calibration_scales_with_the_sensitivity_and_gains_nothing_for_few_records():
    a = sh.gaussian_noise_for_epsilon(1.0, 2.0, 10 ** 4, 1e-5, grid=64)
    b = sh.gaussian_noise_for_epsilon(1.0, 0.02, 10 ** 4, 1e-5, grid=64)
    assert b["noise_std"] == pytest.approx(a["noise_std"] / 100, rel=1e-6)
    few = sh.gaussian_noise_for_epsilon(1.0, 2.0, 10, 1e-5, grid=64)
    assert not few["amplified"] and few["noise_std"] == few["unamplified_noise_std"]


@pytest.mark.parametrize("call, name", [
    (lambda: sh.approx_shuffled_epsilon(1.0, -1e-9, 10, 1e-6), "delta0"),
    (lambda: sh.approx_shuffled_epsilon(1.0, 0.7, 10, 1e-6), "delta0"),  # > 1 - e^{-1}
    (lambda: sh.approx_shuffled_epsilon(1.0, 1e-9, 0, 1e-6), "n"),
    (lambda: sh.gaussian_delta(-1.0, 1.0, 1.0), "eps"),
    (lambda: sh.gaussian_delta(1.0, 0.0, 1.0), "sensitivity"),
    (lambda: sh.gaussian_delta(1.0, 1.0, math.inf), "noise_std"),
    (lambda: sh.gaussian_noise_for_epsilon(0.0, 2.0, 10, 1e-5), "epsilon"),
    (lambda: sh.gaussian_noise_for_epsilon(1.0, 2.0, 10, 1e-5, grid=0), "grid"),
    (lambda: sh.gaussian_shuffled_epsilon(2.0, 1.0, 10, 1.5), "delta"),
])
def test_bad_input_raises_value_error_naming_the_parameter(call, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        call()
