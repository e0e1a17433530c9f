"""Privacy amplification by shuffling for *pure* ε₀-DP local randomizers (Feldman, McMillan &
Talwar, "Hiding Among the Clones", FOCS 2021 — FMT21 below; arXiv 2012.12803; the authors' code is
github.com/apple/ml-shuffling-amplification, read at commit 993d285, never copied), and its
extension to (ε₀, δ₀)-DP randomizers such as the Gaussian (Lemma S below, proved here).

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
amplification="shuffling")` is accounted by `shuffled_epsilon(ε₀, n, δ)`.

Approximate-DP randomizers ((ε₀, δ₀), the Gaussian): what was read, and what is used.
- FMT21's approximate-DP theorem is its Thm 3.8 (the seed's §3.1 cites "(Feldman et al., 2021,
  Theorem 3.8)" for DP-SSGD; the seed's Thm A.3 restates it, in words only: "R^(i)(z_{1:i-1}, ·)
  is a (·)-DP local randomizer for all values of auxiliary inputs ... samples a uniformly random
  permutation ... Then for any δ such that (·), A_s is (·)-DP", formulas lost in extraction; its
  proof then uses "the Gaussian mechanism" per step and "the assumption in Theorem A.3" on ε₀).
  FMT21's own text still could not be read (stored ar5iv copy: abstract and introduction only;
  its abstract says the result "extends to approximate differential privacy with nearly the same
  guarantees"). Two third-party readings of Thm 3.8 were found, agreeing with each other:
  (a) issue #1 of apple/ml-shuffling-amplification (a reader, 2026): the regime condition
  "ε₀ ≤ log(n/(16 log(2/δ)))" appears in "Lemma 3.5, Theorem 3.8, and Proposition 5.3" and should
  read log(4/δ) as in the authors' code; (b) a third-party script in the code index (a
  "MusCATPrivacy" class, not by the authors) computing, for n shuffled (ε₀, δ₀)-DP steps,
  ε = Thm 3.1's closed form at ε₀ itself and δ_total = δ + (e^ε + 1)(1 + e^{-ε₀}/2)·n·δ₀ under the
  regime ε₀ ≤ log(n/(16 log(2/δ))). Neither is the theorem's text, neither says whether the
  *numerical* bound may replace the closed form, and (b) is unattributed. So nothing below rests
  on them: we use instead the following statement, proved here (the tests check each step of the
  construction on random finite randomizers and the end result on an exactly enumerated protocol).

Lemma S. Let each R^(i)(z_<i, ·) be an (ε₀, δ₀)-DP local randomizer for every prefix z_<i
(D_{e^{ε₀}}(R(x)‖R(x')) ≤ δ₀ for all records x, x'), with δ₀ ≤ 1 - e^{-ε₀}, each record read by
exactly one step (the shuffled one-pass setting above, replace-one neighbours). If δ ≥ δ_pure(ε),
the (P, Q) divergence at ε₀ computed by `clone_delta`, then A_s is (ε, δ + (1 + e^ε)·n·κ·δ₀)-DP
with κ = max(1, 2e^{-ε₀}). [Compare (b): our κ ≤ 1 + e^{-ε₀}/2 for ε₀ ≥ log(3/2); below that ours
is the larger, up to 2 vs 1.5.]
Proof. Fix the neighbours X0 = (x_1^0, x_2..x_n), X1 = (x_1^1, x_2..x_n) and a prefix; write
R_b = R(x_1^b), R_j = R(x_j), p = e^{-ε₀}. (1) The pair: R'_0 = min(R_0, e^{ε₀}R_1) + g_0,
R'_1 = min(R_1, e^{ε₀}R_0) + g_1 with g_b ≥ 0 of mass m_b = D_{e^{ε₀}}(R_b‖R_{1-b}) ≤ δ₀ placed
under the slack e^{ε₀}min(R_{1-b}, e^{ε₀}R_b) - min(R_b, e^{ε₀}R_{1-b}) (its mass,
e^{ε₀}(1 - m_{1-b}) - (1 - m_b), is ≥ m_b as m_{1-b} ≤ 1 - p). Then R'_0, R'_1 are
distributions, e^{-ε₀} ≤ R'_0/R'_1 ≤ e^{ε₀} pointwise, and TV(R_b, R'_b) ≤ m_b ≤ δ₀.
(2) The others: with c = (p/2)(R'_0 + R'_1), the deficit (c - R_j)_+ is at most
(p/2)[(R_0 - e^{ε₀}R_j)_+ + (R_1 - e^{ε₀}R_j)_+ + g_0 + g_1] (as p·e^{ε₀} = 1), of mass
≤ (p/2)(2δ₀ + 2δ₀) = 2pδ₀; R'_j = max(R_j, c) - t·(R_j - c)_+, t = deficit mass / mass of
(R_j - c)_+ ≤ 1, is a distribution ≥ c with TV(R_j, R'_j) ≤ 2pδ₀ (a value x_j equal to x_1^b
takes R'_b, TV ≤ δ₀: hence κ = max(1, 2p)). (3) On the values of X0 ∪ X1, for every prefix,
R' satisfies exactly what FMT21's reduction uses: R'_0 = αQ_0 + (1-α)Q_1,
R'_1 = (1-α)Q_0 + αQ_1 with Q_0, Q_1 distributions (possible iff the pair is ε₀-close), and
R'_j = (p/2)Q_0 + (p/2)Q_1 + (1-p)·LO_j (all depending on the prefix), so A_s run with R' is a
post-processing of (P, Q): given the counts (k_0, k_1) of Q_0- and Q_1-draws, pick the
C = k_0 + k_1 - 1 clones uniformly among users 2..n, put the k_0 + k_1 "Q-users" and the others
at uniformly random positions with a uniformly random arrangement of the labels (π is uniform
and independent of the labels, so given the counts this is the true joint law), then run the
steps in order drawing from Q_0^(i)(z_<i), Q_1^(i)(z_<i) or LO_j^(i)(z_<i) — which needs only
x_1^0, x_1^1, x_2..x_n, not which of X0, X1 holds. Hence A_s run with R' is
(ε, δ_pure(ε))-DP for this pair. (4) Run on the same data, A_s with R and with R' differ by at most the sum of
the per-step TVs (hybrid over the n steps): T ≤ n·κ·δ₀. Then
P[A(X0) ∈ S] ≤ P[A'(X0) ∈ S] + T ≤ e^ε P[A'(X1) ∈ S] + δ + T ≤ e^ε P[A(X1) ∈ S] + δ + (1 + e^ε)T. ∎
`approx_shuffled_epsilon` evaluates this (exact numerical δ_pure, never the closed form).
The Gaussian: a step adding N(0, s²I) to a function of one record with ℓ2 sensitivity Δ (over
all pairs of records) is (ε₀, δ₀(ε₀))-DP for every ε₀ on its exact profile
δ₀(ε₀) = Φ(Δ/(2s) - ε₀s/Δ) - e^{ε₀}Φ(-Δ/(2s) - ε₀s/Δ) (`gaussian_delta`); any ε₀ may be chosen,
so `gaussian_shuffled_epsilon` / `gaussian_noise_for_epsilon` scan ε₀ and keep the best, and
also compare with no amplification (the profile itself: each record is read once).
Scope, precisely:
1. One record per randomizer. For DP-SSGD this is b = 1 (the seed's Algorithm 1): step i reads
   x_π(i), outputs g_i = clip_C(∇ℓ(w_{i-1}; x_π(i))) + N(0, (σC)²I) with w_{i-1} a function of
   g_<i, so Δ = 2C (replace-one: two arbitrary records) and s = σC.
2. Blocks of b > 1 (the benchmark's Gaussian schedule, b = max(m, n/100)) are NOT covered by the
   functions here as a b = 1 bound. Sound only: cutting a uniform permutation into blocks is a
   uniform partition (data-independent, same under X0 and X1) followed by a uniform order of the
   blocks, so conditionally on the partition the n/b blocks are "super-records" shuffled once and
   Lemma S applies to them, but with (ε₀, δ₀) of a block randomizer against an *arbitrary* other
   block: the block mean (1/b)Σ clip_C(g) moves by up to Δ = 2C, against noise s = σC/b, i.e.
   Δ/s = 2b/σ instead of one record's 2/σ. That bound is what the functions here give when
   called with Δ = 2C, s = σC/b and n/b records; at b = n/100 it is far worse than no
   amplification (see benchmarks/dp_ambssgd.py). (FMT21's SODA 2023 follow-up separates the
   pair's ε from the clones'; it was not read and is not used.)
3. Replace-one neighbours only; δ₀ ≤ 1 - e^{-ε₀}; the adaptive form as in Thm 3.2 above.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
from scipy import special, stats

from widedp.accounting.gaussian_profile import gaussian_delta as profile_delta

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


# ---- approximate-DP local randomizers ((ε₀, δ₀)), and the Gaussian ---------------------------

def approx_delta_term(eps: float, eps0: float, delta0: float, n: int) -> float:
    """The additive price of δ₀ > 0 (Lemma S of the module docstring): (1 + e^ε)·n·max(1, 2e^{-ε₀})·δ₀,
    added to the pure reduction's δ(ε) at ε₀. (FMT21's own Thm 3.8 states
    (e^ε + 1)(1 + e^{-ε₀}/2)·n·δ₀ per our third-party reading; not used, see the docstring.)"""
    return (1.0 + math.exp(eps)) * n * max(1.0, 2.0 * math.exp(-eps0)) * delta0


def approx_shuffled_epsilon(eps0: float, delta0: float, n: int, delta: float, *, iterations: int = 40) -> float:
    """ε at δ for n shuffled adaptive (ε₀, δ₀)-DP local randomizers (one record each, replace-one
    neighbours), by Lemma S of the module docstring: the smallest certified ε (bisection, the
    returned point checked) with clone_delta(ε₀, n, ε) + approx_delta_term(ε, ε₀, δ₀, n) ≤ δ, or
    ε₀ when that is smaller and δ₀ ≤ δ (no amplification: each record read once), or `math.inf`
    when neither reaches δ. δ₀ = 0 gives exactly `shuffled_epsilon(ε₀, n, δ)`.
    Needs δ₀ ≤ 1 - e^{-ε₀} (the lemma's condition; ValueError otherwise)."""
    eps0, n, delta = _check(eps0, n, delta)
    delta0 = _check_delta0(delta0, eps0)
    if isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)) or iterations < 1:
        raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
    if delta0 == 0.0:
        return numerical_epsilon(eps0, n, delta, iterations=int(iterations))
    fallback = eps0 if delta0 <= delta else math.inf
    red = _Reduction(eps0, n)

    def ok(eps: float) -> bool:
        return red.delta(eps) + approx_delta_term(eps, eps0, delta0, n) <= delta

    if ok(0.0):
        return 0.0
    if not ok(eps0):  # δ(ε) ≥ the δ₀ term, which grows with ε: nothing at or above ε₀ passes either
        # below ε₀ the term is smaller; search [0, ε₀] for any passing point by bisection from a scan
        grid = [eps0 * k / 64.0 for k in range(1, 64)]
        passing = [e for e in grid if ok(e)]
        if not passing:
            return fallback
        hi = passing[0]
        lo = hi - eps0 / 64.0
    else:
        lo, hi = 0.0, eps0
    for _ in range(int(iterations)):
        mid = 0.5 * (lo + hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return min(hi, fallback)


def gaussian_delta(eps: float, sensitivity: float, noise_std: float) -> float:
    """The exact privacy profile of the Gaussian mechanism (Balle & Wang 2018, analytic Gaussian):
    the smallest δ for which adding N(0, s²I) to a function of ℓ2 sensitivity Δ is (ε, δ)-DP,
    δ(ε) = Φ(Δ/(2s) - εs/Δ) - e^ε·Φ(-Δ/(2s) - εs/Δ), both directions equal. Evaluated in log
    space (no cancellation) and rounded up by a relative 1e-9."""
    eps = _nonneg("eps", eps)
    mu = _positive_finite("sensitivity", sensitivity) / _positive_finite("noise_std", noise_std)
    return profile_delta(eps, mu)


def gaussian_epsilon(delta: float, sensitivity: float, noise_std: float) -> float:
    """The Gaussian mechanism's own ε at δ (no amplification): the smallest ε (bisection, rounded
    up, the returned point checked) with `gaussian_delta(ε) ≤ δ`."""
    delta = _check(1.0, 1, delta)[2]
    if gaussian_delta(0.0, sensitivity, noise_std) <= delta:
        return 0.0
    hi = 1.0
    while gaussian_delta(hi, sensitivity, noise_std) > delta:
        hi *= 2.0
    lo = 0.0 if hi == 1.0 else hi / 2.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if gaussian_delta(mid, sensitivity, noise_std) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


def gaussian_shuffled_epsilon(sensitivity: float, noise_std: float, n: int, delta: float) -> dict:
    """(ε, δ) of n shuffled adaptive Gaussian local randomizers, each reading ONE record and adding
    N(0, s²I) to a function of that record with ℓ2 sensitivity Δ over all pairs of records (for
    DP-SSGD with b = 1 and ℓ2 clip C: Δ = 2C). Each step is (ε₀, δ₀(ε₀))-DP for every ε₀ with
    δ₀ = `gaussian_delta`; this scans ε₀ (32 points of (0, log(n) + 2], then 16 between the best
    one's neighbours; any choice is a valid bound) with `approx_shuffled_epsilon`, and also takes
    the unamplified ε (`gaussian_epsilon`: each record is read once). Returns {"epsilon", "eps0",
    "delta0", "amplified", "unamplified_epsilon"}; the ε returned is certified whatever the grid."""
    n = _check(1.0, n, 0.5)[1]
    delta = _check(1.0, 1, delta)[2]
    plain = gaussian_epsilon(delta, sensitivity, noise_std)
    best: dict = {"epsilon": plain, "eps0": None, "delta0": None, "amplified": False, "unamplified_epsilon": plain}

    def try_eps0(eps0: float) -> float:
        delta0 = gaussian_delta(eps0, sensitivity, noise_std)
        if delta0 > min(delta, -math.expm1(-eps0)):
            return math.inf
        eps = approx_shuffled_epsilon(eps0, delta0, n, delta, iterations=30)
        if eps < best["epsilon"]:
            best.update(epsilon=eps, eps0=eps0, delta0=delta0, amplified=True)
        return eps

    top = max(1.0, math.log(n) + 2.0)
    coarse = np.linspace(0.0, top, 33)[1:]
    scores = [try_eps0(float(e)) for e in coarse]
    k = int(np.argmin(scores))
    if math.isfinite(scores[k]):
        lo, hi = (coarse[k - 1] if k > 0 else 0.0), (coarse[k + 1] if k + 1 < len(coarse) else top)
        for e in np.linspace(lo, hi, 18)[1:-1]:
            try_eps0(float(e))
    return best


def gaussian_noise_for_epsilon(epsilon: float, sensitivity: float, n: int, delta: float, *,
                               grid: int = 256, iterations: int = 50) -> dict:
    """Calibration: the smallest Gaussian noise std s (over a grid of ε₀, each found by bisection,
    rounded up) such that n shuffled one-record Gaussian randomizers of ℓ2 sensitivity Δ are
    (ε, δ)-DP by Lemma S, or by the unamplified profile when that needs less noise. For each ε₀
    in `grid` points of (ε, log(n) + 2]: the largest δ₀ Lemma S allows at ε,
    δ₀* = min((δ - clone_delta(ε₀, n, ε)) / ((1 + e^ε)·n·max(1, 2e^{-ε₀})), 1 - e^{-ε₀}),
    then the smallest s with gaussian_delta(ε₀, Δ, s) ≤ δ₀*. The returned triple (s, ε₀, δ₀) is
    re-checked against Lemma S's inequality (certified). Returns {"noise_std", "eps0",
    "delta0", "amplified", "unamplified_noise_std"} (eps0/delta0 None when unamplified)."""
    epsilon = _positive_finite("epsilon", epsilon)
    sensitivity = _positive_finite("sensitivity", sensitivity)
    n = _check(1.0, n, 0.5)[1]
    delta = _check(1.0, 1, delta)[2]
    if isinstance(grid, bool) or not isinstance(grid, (int, np.integer)) or grid < 1:
        raise ValueError(f"grid must be an integer >= 1, got {grid!r}")

    def smallest_std(eps: float, target: float) -> float:
        """The smallest s (rounded up) with gaussian_delta(eps, Δ, s) ≤ target (decreasing in s)."""
        hi = sensitivity
        while gaussian_delta(eps, sensitivity, hi) > target:
            hi *= 2.0
        lo = hi / 2.0
        while gaussian_delta(eps, sensitivity, lo) <= target and lo > 1e-12 * sensitivity:
            hi, lo = lo, lo / 2.0
        for _ in range(int(iterations)):
            mid = 0.5 * (lo + hi)
            if gaussian_delta(eps, sensitivity, mid) <= target:
                hi = mid
            else:
                lo = mid
        return hi

    plain = smallest_std(epsilon, delta)
    best: dict = {"noise_std": plain, "eps0": None, "delta0": None, "amplified": False,
                  "unamplified_noise_std": plain}
    top = max(epsilon, math.log(n) + 2.0)
    for eps0 in np.linspace(epsilon, top, int(grid) + 1)[1:]:
        eps0 = float(eps0)
        red = _Reduction(eps0, n)
        room = delta - red.delta(epsilon)
        if room <= 0.0:
            continue
        cap = min(room / approx_delta_term(epsilon, eps0, 1.0, n), -math.expm1(-eps0))
        s = smallest_std(eps0, cap)
        d0 = gaussian_delta(eps0, sensitivity, s)
        if s < best["noise_std"] and red.delta(epsilon) + approx_delta_term(epsilon, eps0, d0, n) <= delta \
                and d0 <= -math.expm1(-eps0):
            best.update(noise_std=s, eps0=eps0, delta0=d0, amplified=True)
    return best


def _check_delta0(delta0, eps0: float) -> float:
    if isinstance(delta0, bool) or not isinstance(delta0, (int, float)) or not (0 <= delta0 < 1):
        raise ValueError(f"delta0 must be in [0, 1), got {delta0!r}")
    if delta0 > -math.expm1(-eps0):
        raise ValueError(f"delta0 = {delta0!r} exceeds 1 - e^-eps0 = {-math.expm1(-eps0):.3g} (Lemma S's condition)")
    return float(delta0)


def _nonneg(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
    return float(v)


def _positive_finite(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be finite and > 0, got {v!r}")
    return float(v)
