"""Privacy amplification by shuffling for *pure* ε₀-DP local randomizers (Feldman, McMillan &
Talwar, "Hiding Among the Clones", FOCS 2021 — FMT21 below; arXiv 2012.12803; the authors' code is
github.com/apple/ml-shuffling-amplification, read at commit 993d285, never copied).

Sources, and what each one settles. (a) The authors' code `computeamplification.py`: its docstrings
state the binomial-mixture pair below (`deltacomp`, `onestep`) and its `closedformanalysis` is the
closed form used here; its README publishes two outputs we test against. (b) The seed
(/work/shared/seeds/dp-ambssgd-adaptive-clipping.txt, Theorem A.3 "From Feldman et al. (2021)"):
its words, formulas lost in extraction, confirm the *adaptive* form of the hypothesis below.
(c) FMT21's text itself could not be read here (the stored copy of
ar5iv.labs.arxiv.org/html/2012.12803 gives the abstract only): the theorem numbers, the
replace-one relation and the regime of the closed form are our reading of FMT21, recalled, and
agree with (a) and (b) as far as those go.

What is bounded. n records x_1..x_n, a secret uniformly random permutation π, and local
randomizers applied in order, z_i = R^(i)(z_1..z_{i-1}, x_π(i)); the output is z_1..z_n (or any
post-processing of it). The hypothesis (FMT21 Thms 3.1/3.2; the seed's Thm A.3 restates an FMT21
theorem in this adaptive form) is that
R^(i)(z_<i, ·) is an **ε₀-DP local randomizer for every prefix** z_<i: for all records x, x' and
output sets S, P[R(x) ∈ S] ≤ e^{ε₀}·P[R(x') ∈ S], with δ₀ = 0. Neighbours: replace one record
(x_1^0 vs x_1^1). Each record is read by exactly one randomizer. (The SODA 2023 follow-up by the
same authors, "Stronger privacy amplification by shuffling", carries an erratum restricting *its*
general adaptive bounds to a class of randomizers; nothing from that paper is used here.)

The reduction (FMT21 Thm 3.2; the pair as the authors' `deltacomp` docstring states it, up to the
names P ↔ Q, immaterial as both directions are bounded). With
p = e^{-ε₀}, α = e^{ε₀}/(e^{ε₀}+1),
    C ~ Bin(n-1, p),  A ~ Bin(C, 1/2),  Δ ~ Bern(α),
    P = law of (A + Δ, C - A + 1 - Δ),   Q = law of (A + 1 - Δ, C - A + Δ),
the shuffled output on X_0 is a post-processing of P and on X_1 the same post-processing of Q.
So the shuffled algorithm is (ε, δ)-DP whenever δ ≥ max(D_{e^ε}(P‖Q), D_{e^ε}(Q‖P)), where
D_{e^ε}(P‖Q) = Σ_o max(0, P(o) - e^ε Q(o)) is the hockey-stick divergence. (C is readable from
the output — the two coordinates sum to C + 1 — and has the same law under P and Q, so the
divergence is the P[C = c]-weighted sum of the conditional ones.)

Exact evaluation (`clone_delta`). Given C = c the pair is determined by its first coordinate
a ∈ {0..c+1}: P_c(a) = α·B_c(a-1) + (1-α)·B_c(a), Q_c(a) = (1-α)·B_c(a-1) + α·B_c(a), with
B_c = the Bin(c, 1/2) pmf. The ratio P_c/Q_c = (α·r + 1 - α)/((1-α)·r + α) is increasing in
r = B_c(a-1)/B_c(a) = a/(c+1-a) (as α > 1/2), hence in a, so the positive part of P_c - e^ε Q_c
is a tail {a ≥ k*}, with
    Σ_{a≥k} (P_c - e^ε Q_c) = A1·S_c(k-1) - A2·S_c(k),  S_c(j) = P[Bin(c,1/2) ≥ j],
    A1 = α - e^ε(1-α),  A2 = e^ε·α - (1-α),  k* = ⌊(c+1)·A2/(A1+A2)⌋ + 1
(P_c(a) > e^ε Q_c(a) ⇔ a·(A1+A2) > (c+1)·A2 when A1 > 0; for A1 ≤ 0, i.e. ε ≥ ε₀, the ratio
never exceeds e^ε and the divergence is 0). Every tail gives a *lower* bound on the divergence
(it is a max over sets), so a k* misplaced by rounding would under-estimate δ; we therefore
evaluate the tails k*-2..k*+2 and keep the largest (k* is off by at most one even at an exact
tie, where the term at the boundary is 0). The two directions are equal (a ↦ c+1-a swaps P_c
and Q_c, B_c being symmetric); the tests check both against a direct enumeration of the pair
over (C, A, Δ) in exact rational arithmetic. Summing over c costs O(#c) per ε (binomial tails
from scipy's incomplete beta, `bdtrc`).

Over-estimation, by construction:
- c is summed over C's mean ± (40 sd + 16) only, and weights P[C = c] below 1e-30 are dropped;
  the total mass left out is *added* to δ (each conditional divergence is ≤ 1);
- an absolute slack 1e-12·(1 + e^{ε₀}) is added to δ(ε): the conditional divergences are
  differences A1·S - A2·S' with A1 + A2 ≤ 1 + e^ε, so the floating error of the sum is ~1e-14
  times that; the slack is 100x it. (For δ targets below ~1e-10 the slack dominates and the
  returned ε is looser, never smaller.)
- bisection on [0, ε₀] keeps as `hi` only points where the computed δ(hi) ≤ δ and returns `hi`,
  so the result is a certified point whatever the bisection's resolution, and does not rely on
  δ(ε) being exactly monotone. ε₀ itself is always valid (each record is read by one ε₀-DP
  randomizer, for every permutation), so the result is ≤ ε₀.
Cross-check (tests): at n = 10⁵, ε₀ = 4, δ = 1e-6 the numerical ε is 0.169770, inside the
interval [0.16754, 0.17279] the authors' README publishes for the same reduction. (Their code run
once here, outside the repository, with step 1 and 40 bisection steps gives [0.1697697, 0.1769731];
our exact δ at their lower end is 1.0000022e-6 > δ, so the exact threshold lies just above it, and
ours sits 6e-7 higher because of the slack above.)

Closed form (`closed_form_epsilon`), exactly as the authors' `closedformanalysis` computes it: for
ε₀ ≤ log(n / (16·log(4/δ))), with ε' = log(1 + a), a = 8·√(e^{ε₀}·log(4/δ)/n) + 8·e^{ε₀}/n,
    ε ≤ log(1 + (1 - e^{-ε₀})/(1 + e^{-ε₀-ε'}) · a).
(Its README publishes 0.5378040242374512 at n = 10⁵, ε₀ = 4, δ = 1e-6; the test reproduces it.
We recall FMT21's Thm 3.1 with the factor (e^{ε₀}-1)/(e^{ε₀}+1) and regime log(2/δ); we could not
check that text, so we use the code's version, which is the larger ε. Both factors are ≥ the
exact one, (e^{ε₀}-1)/(e^{ε₀}+e^{ε'}), that turns an (ε', δ) bound on the two Δ-branches into one
on P vs Q.) The closed form is an analytic upper bound on the same reduction's ε, so it is never
below the numerical one (tested); it is a reference only: `shuffled_epsilon` returns the
numerical bound, whose soundness does not rest on the recalled closed-form statement.

Calibration (`eps0_for_epsilon`): the largest ε₀ whose shuffled ε at (n, δ) is at most a
target ε, by bisection on the numerical bound, the returned value itself checked (certified).

DP-SSGD (`adaptive_clipping.linear_regression.dp_ssgd`). With `noise="laplace"` and b = 1 every
step is a pure ε₀-DP local randomizer of the one record it reads, for every prefix of outputs
(ℓ1 clip to C, per-coordinate Laplace scale 2C/ε₀; the argument is in that module's docstring),
so the hypothesis above holds exactly and `dp_ssgd(noise="laplace", batch_size=1,
amplification="shuffling")` is accounted by `shuffled_epsilon(ε₀, n, δ)`. The default Gaussian
DP-SSGD is **not** covered; its accounting stays unamplified (plain parallel composition, an
upper bound), and amplification is refused for it and for any b > 1:
1. Its noise is Gaussian, which is (ε₀, δ₀)-DP per example for no finite ε₀ with δ₀ = 0: the
   theorems above need pure ε₀-DP randomizers. Only FMT21's approximate-DP extension (the seed's
   Theorem 3.1 cites FMT21 Thm 3.8 for it) could apply, and we could **not verify its exact
   statement**. What is missing, precisely: (i) the additive δ term — we recall something of the
   form δ + (e^ε + 1)(1 + e^{-ε₀}/2)·n·δ₀ but have no readable source for the constant;
   (ii) its regime condition on ε₀ (and on n, δ₀); (iii) whether its ε is Thm 3.1's closed form
   at ε₀ itself or at a transformed ε₀ (approximate-to-pure reductions of local randomizers
   commonly inflate ε₀ by a constant factor), and so whether the *numerical* clone bound may be
   substituted for it; (iv) whether it is stated for adaptive randomizers, as DP-SGD needs.
   Searched: the stored ar5iv copy of 2012.12803 (abstract only), the authors' code (pure ε₀
   only, per its README), the differentialprivacy.org post "Privacy Doona" (says the result
   extends to approximate LDP, no statement), the seed (formulas lost), and the code index. One
   unattributed third-party script there uses the δ term in (i) but pairs it with another ε
   formula and regime (log(n/(8·log(2/δ')) - 1)) that match neither the authors' code nor our
   reading, so it verifies nothing. Implementing `shuffled_epsilon_approx` would need (i)-(iv)
   from FMT21's text (arXiv 2012.12803, §3, the (ε₀, δ₀) theorem and the lemma it rests on).
2. With blocks of b > 1 examples (the benchmark uses b = max(m, n/100)) a step is not a local
   randomizer of one record: its output depends jointly on b records. Treating each block as
   one "user" is possible (a uniform permutation cut into blocks is a uniform partition followed
   by a uniform order of the blocks), but then a randomizer must be private against replacing
   its whole block — sensitivity 2C instead of 2C/b, b²·ρ in zCDP — which destroys the gain.
So even with (i)-(iv) only b = 1 (the seed's Algorithm 1) could be amplified; with Laplace
noise and b = 1 it is, by the pure-DP theorem above.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
from scipy import special, stats

_DROP_WEIGHT = 1e-30
_ABS_SLACK = 1e-12
_MAX_EPS0 = 500.0  # calibration's search cap (e^ε₀ stays finite in float64)


def closed_form_epsilon(eps0: float, n: int, delta: float) -> Optional[float]:
    """The closed-form ε (FMT21 Thm 3.1 as the authors' released `closedformanalysis` computes
    it, see the module docstring) for n shuffled ε₀-DP (pure) local randomizers, or None outside
    the regime ε₀ ≤ log(n/(16·log(4/δ))). Not capped at ε₀. A reference: `shuffled_epsilon` does
    not use it."""
    eps0, n, delta = _check(eps0, n, delta)
    if eps0 > math.log(n / (16.0 * math.log(4.0 / delta))):
        return None
    e0 = math.exp(eps0)
    a = 8.0 * math.sqrt(e0 * math.log(4.0 / delta) / n) + 8.0 * e0 / n
    eps_prime = math.log1p(a)
    factor = -math.expm1(-eps0) / (1.0 + math.exp(-eps0 - eps_prime))  # (1 - e^{-ε₀})/(1 + e^{-ε₀-ε'})
    return math.log1p(factor * a)


class _Reduction:
    """The binomial-mixture pair (P, Q) of FMT21 Thm 3.2 for given (ε₀, n), with the weights
    P[C = c] precomputed; `delta(eps)` is an upper bound on max(D_{e^ε}(P‖Q), D_{e^ε}(Q‖P))."""

    def __init__(self, eps0: float, n: int):
        self.eps0 = eps0
        self.alpha = 1.0 / (1.0 + math.exp(-eps0))
        m, p = n - 1, math.exp(-eps0)
        # C's support, cut to mean ± 40 sd (+ 16): the mass outside is added to δ below
        half = 40.0 * math.sqrt(m * p * (1.0 - p)) + 16.0
        lo, hi = max(0, math.floor(m * p - half)), min(m, math.ceil(m * p + half))
        c = np.arange(lo, hi + 1, dtype=np.float64)
        w = stats.binom.pmf(c, m, p) if m > 0 else np.ones(1)
        keep = w >= _DROP_WEIGHT
        self.c = c[keep]
        self.w = w[keep]
        outside = (stats.binom.cdf(lo - 1, m, p) if lo > 0 else 0.0) + (stats.binom.sf(hi, m, p) if hi < m else 0.0)
        # mass not summed (each conditional divergence is ≤ 1), and the float slack
        self.extra = float(np.sum(w[~keep])) + float(outside) + _ABS_SLACK * (1.0 + math.exp(eps0))

    def _tail(self, j: np.ndarray) -> np.ndarray:
        """S_c(j) = P[Bin(c, 1/2) ≥ j], elementwise over self.c."""
        c = self.c
        inside = (j >= 1) & (j <= c)
        safe_j = np.where(inside, j, 1.0)
        safe_c = np.where(inside, c, 1.0)
        val = special.bdtrc((safe_j - 1.0).astype(np.int64), safe_c.astype(np.int64), 0.5)
        return np.where(j <= 0, 1.0, np.where(j > c, 0.0, val))

    def delta(self, eps: float) -> float:
        a = self.alpha
        e = math.exp(eps)
        a1 = a - e * (1.0 - a)
        a2 = e * a - (1.0 - a)
        if a1 <= 0.0:  # ε ≥ ε₀: P ≤ e^ε Q pointwise
            return self.extra
        k_star = np.floor((self.c + 1.0) * (a2 / (a1 + a2))) + 1.0
        # tails S_c(j) for j = k*-3 .. k*+2, each computed once; the candidate boundaries are
        # k = k*-2 .. k*+2 (outside 0..c+2 the tail sums are those of 0 or c+2: S saturates)
        tails = [self._tail(k_star + j) for j in range(-3, 3)]
        best = np.zeros_like(self.c)
        for i in range(1, 6):
            best = np.maximum(best, a1 * tails[i - 1] - a2 * tails[i])
        return float(np.dot(self.w, best)) + self.extra


def clone_delta(eps0: float, n: int, eps: float) -> float:
    """Upper bound on the δ at which n shuffled ε₀-DP local randomizers are (ε, δ)-DP: the
    hockey-stick divergence of FMT21 Thm 3.2's pair (P, Q), both directions, computed exactly
    by summing over the binomial counts, plus the safety terms of the module docstring."""
    eps0, n, _ = _check(eps0, n, 0.5)
    if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    return _Reduction(eps0, n).delta(float(eps))


def numerical_epsilon(eps0: float, n: int, delta: float, *, iterations: int = 40) -> float:
    """The smallest ε (to the bisection's resolution ε₀·2^-iterations, rounded *up*) with
    `clone_delta(ε) ≤ δ`: FMT21's numerical ("empirical") bound for n shuffled ε₀-DP local
    randomizers. ≤ ε₀; whatever `iterations`, the returned ε satisfies clone_delta(ε) ≤ δ."""
    eps0, n, delta = _check(eps0, n, delta)
    if isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)) or iterations < 1:
        raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
    red = _Reduction(eps0, n)
    if red.delta(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, eps0  # hi: always a valid ε (ε₀ needs no amplification)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if red.delta(mid) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


def eps0_for_epsilon(epsilon: float, n: int, delta: float, *, iterations: int = 50) -> float:
    """Calibration, the inverse of `shuffled_epsilon`: the largest ε₀ (to the bisection's
    resolution, rounded *down*) such that n shuffled ε₀-DP local randomizers are (ε, δ)-DP by
    the numerical bound, i.e. `shuffled_epsilon(ε₀, n, δ) ≤ ε` — checked for the returned value
    itself (a certified point, as in `numerical_epsilon`), so nothing rests on the bound being
    monotone in ε₀ (it is, in every case tried, but that is not proved here).

    Always ≥ ε (ε₀ = ε needs no amplification: `shuffled_epsilon(ε, n, δ) ≤ ε`); > ε when
    shuffling amplifies at (n, δ). Search: the bracket [ε, hi] with hi doubled until
    `clone_delta(hi, n, ε) > δ`, then bisection on the cheap test `clone_delta(ε₀, n, ε) ≤ δ`
    (one divergence per candidate; the bisection keeps as `lo` only points that pass), then the
    final check `shuffled_epsilon(lo, n, δ) ≤ ε` (the value a run is charged), stepping `lo`
    down (by lo·2^-30, doubling) while `numerical_epsilon`'s upward rounding (≤ ε₀·2^-40) puts
    it a hair above ε; ε itself is the fallback."""
    epsilon, n, delta = _check(epsilon, n, delta)
    if isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)) or iterations < 1:
        raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")

    def passes(eps0: float) -> bool:
        return _Reduction(eps0, n).delta(epsilon) <= delta

    lo, hi = epsilon, 2.0 * epsilon
    while passes(hi):
        lo, hi = hi, 2.0 * hi
        if hi > _MAX_EPS0:
            raise ValueError(f"no eps0 <= {_MAX_EPS0} breaks epsilon = {epsilon} at n = {n}, delta = {delta}")
    for _ in range(int(iterations)):
        mid = 0.5 * (lo + hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    step = lo * 2.0 ** -30  # above numerical_epsilon's upward rounding, ε₀·2^-40
    for _ in range(30):
        if lo <= epsilon or shuffled_epsilon(lo, n, delta) <= epsilon:
            return lo
        lo = max(epsilon, lo - step)
        step *= 2.0
    return epsilon


def shuffled_epsilon(eps0: float, n: int, delta: float) -> float:
    """ε at δ for n shuffled ε₀-DP (pure) local randomizers, replace-one neighbours: the
    numerical bound (`numerical_epsilon`), ≤ ε₀. The closed form is not consulted (it is never
    smaller, and its statement is recalled, not checked; see the module docstring)."""
    return numerical_epsilon(eps0, n, delta)


def _check(eps0, n, delta) -> tuple[float, int, float]:
    if isinstance(eps0, bool) or not isinstance(eps0, (int, float)) or not (math.isfinite(eps0) and eps0 > 0):
        raise ValueError(f"eps0 must be finite and > 0 (a pure ε₀-DP randomizer), got {eps0!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not (0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return float(eps0), int(n), float(delta)
