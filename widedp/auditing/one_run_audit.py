"""One-run privacy audit: ε lower bounds from guessing canaries' membership after one training run.

Steinke, Nasr & Jagielski, "Privacy auditing with one (1) training run" (NeurIPS 2023,
arXiv:2305.08846).

Setting and neighbouring relation. m canaries; the auditor draws S_1, …, S_m ∈ {−1, +1}
independently and uniformly with its own coins (+1: canary i is in the training set, −1: it is
not; everything else in the training set is fixed). The audited training algorithm M is assumed
(ε, δ)-DP w.r.t. **adding/removing one example** (so w.r.t. flipping any one S_i). After one run,
a guesser that sees M's output and its own independent randomness — never S — outputs
T ∈ {−1, 0, +1}^m with at most r non-zero entries (0 = abstain); W = #{i : T_i = S_i} counts the
correct guesses.

What is proven (the paper's analysis, §5: its main theorem and the corollary that instantiates
it for (ε, δ)-DP — Theorem 5.2 and Corollary 5.4 in arXiv v1's numbering as cited by secondary
sources; the NeurIPS version may number them differently). With q_ε = e^ε / (1 + e^ε) (the accuracy
of ε-DP randomized response) and f_ε(v) = P[Binomial(r, q_ε) ≥ v]:

* if M is ε-DP, W is stochastically dominated by Binomial(r, q_ε): P[W ≥ v] ≤ f_ε(v);
* if M is (ε, δ)-DP,  P[W ≥ v] ≤ f_ε(v) + 2mδ · max_{i = 1..v} (f_ε(v − i) − f_ε(v)) / i.

So p(ε, δ) = min(1, right-hand side at the observed v) is a valid p-value for the null hypothesis
"M is (ε, δ)-DP" (`one_run_p_value`). The audit rejects every ε with p(ε, δ) ≤ β = 1 − confidence;
(ε', δ)-DP implies (ε, δ)-DP for every ε ≥ ε', so rejecting ε rejects every smaller ε' too and
the largest rejected ε is a lower bound: **if M is (ε, δ)-DP, then P[bound > ε] ≤ β**, over the
auditor's coins S, M's randomness and the guesser's randomness (for any guesser and any fixed
choice of r). At δ = 0 the δ term vanishes and the (ε, δ) bound is exactly the pure one.

Reconstructed, not read from the paper's PDF: the statement above and the procedure — the α term
max_i (f(v − i) − f(v)) / i accumulated over i = 1..v, the factor 2m (m = all canaries, not r),
the bisection on ε — follow the authors' own routine in the paper's appendix
(`p_value_DP_audit` / `get_eps_audit`) as reproduced in public code (e.g. DeepMind's
`jax_privacy.auditing`); the tests pin this implementation to two values the paper prints
(0.673 and 2.675, transcribed from a secondary source), which dropping the δ term or scaling it by
r instead of m misses.

What the search returns. `epsilon_lower_bound` bisects on ε keeping the invariant "p(lo) ≤ β was
evaluated" (or lo = 0, a bound that is always true), so the returned ε is always one whose null
was actually rejected, even if p(·, δ) were not monotone in ε (its δ term need not be); for δ = 0
p is increasing in ε and the result is the largest rejected ε to within `_TOLERANCE`.

Not covered: the guesser must not see S (scores computed from the membership coins void
everything); the numbers of guesses (k+, k−) must be fixed before looking at the outcome, or the
choice paid for by splitting β (`best_guess_counts`, Bonferroni). Ties in scores are broken by a
random order drawn independently of S (`audit_from_scores`), never by the caller's array order.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Sequence

import numpy as np
from scipy import special, stats

# Bisection stops when the bracket is this narrow (absolute, in ε).
_TOLERANCE = 1e-12
# q_ε rounds to 1.0 in float64 beyond ε ≈ 37, where every p-value is 1: no bracket reaches this.
_EPSILON_CAP = 1e4


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def _check_counts(guesses: object, correct: object) -> tuple[int, int]:
    r, v = _count("guesses", guesses), _count("correct", correct)
    if v > r:
        raise ValueError(f"correct must be <= guesses, got correct={v}, guesses={r}")
    return r, v


def _check_canaries(canaries: object, guesses: int) -> int:
    m = _count("canaries", canaries)
    if m < 1 or guesses > m:
        raise ValueError(f"canaries must be >= 1 and >= guesses, got canaries={m}, guesses={guesses}")
    return m


def _check_confidence(confidence: object) -> float:
    if isinstance(confidence, bool) or not isinstance(confidence, numbers.Real) or not 0.0 < float(confidence) < 1.0:
        raise ValueError(f"confidence must be a number in (0, 1), got {confidence!r}")
    return float(confidence)


def _check_delta(delta: object) -> float:
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0.0 <= float(delta) < 1.0:
        raise ValueError(f"delta must be a number in [0, 1), got {delta!r}")
    return float(delta)


# --------------------------------------------------------------------------------------------
# The p-value and the bound
# --------------------------------------------------------------------------------------------


def randomized_response_accuracy(epsilon: float) -> float:
    """q_ε = e^ε / (1 + e^ε): the probability that ε-DP randomized response reports a bit right."""
    return float(special.expit(epsilon))


def _tail(guesses: int, correct: int, q: float) -> float:
    """f(v) = P[Binomial(r, q) ≥ v]."""
    return float(stats.binom.sf(correct - 1, guesses, q))


def _delta_slope(guesses: int, correct: int, q: float) -> float:
    """α = max_{i = 1..v} P[v − i ≤ Binomial(r, q) < v] / i  (= max_i (f(v − i) − f(v)) / i).

    Terms i > v add no mass (f(v − i) = 1 there) while i grows, so they never attain the max."""
    if correct == 0:
        return 0.0
    mass = np.cumsum(stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, q))  # i = 1..v
    return float(np.max(mass / np.arange(1, correct + 1)))


def one_run_p_value(guesses: int, correct: int, epsilon: float, delta: float = 0.0, canaries: Optional[int] = None) -> float:
    """p-value of "≥ `correct` right out of `guesses`" under the null "M is (ε, δ)-DP".

    `guesses` r: canaries guessed (not abstained on); `correct` v: guesses equal to the true
    membership; `epsilon`, `delta`: the null's parameters; `canaries` m: all canaries, each
    included with probability ½ (needed when delta > 0: the δ term is 2mδα, module docstring).
    """
    r, v = _check_counts(guesses, correct)
    delta = _check_delta(delta)
    if not (isinstance(epsilon, numbers.Real) and float(epsilon) >= 0.0):
        raise ValueError(f"epsilon must be a number >= 0, got {epsilon!r}")
    if delta > 0.0 and canaries is None:
        raise ValueError("canaries (the total number of canaries m) is needed when delta > 0")
    q = randomized_response_accuracy(float(epsilon))
    p = _tail(r, v, q)
    if delta > 0.0:
        m = _check_canaries(canaries, r)
        p += 2.0 * m * delta * _delta_slope(r, v, q)
    return min(p, 1.0)


def _largest_rejected_epsilon(guesses: int, correct: int, delta: float, beta: float, canaries: int) -> float:
    """Bisection on ε for the largest ε with p(ε, δ) ≤ β; invariant: p(lo) ≤ β evaluated, or lo = 0."""

    def rejected(eps: float) -> bool:
        return one_run_p_value(guesses, correct, eps, delta, canaries) <= beta

    if correct == 0 or not rejected(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejected(hi):
        lo, hi = hi, 2.0 * hi
        if hi > _EPSILON_CAP:  # unreachable: q_ε = 1.0 (p-value 1) long before
            raise RuntimeError(f"no ε up to {_EPSILON_CAP} explains {correct}/{guesses} correct guesses")
    while hi - lo > _TOLERANCE:
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:  # float resolution reached
            break
        if rejected(mid):
            lo = mid
        else:
            hi = mid
    return lo


def epsilon_lower_bound_pure(guesses: int, correct: int, confidence: float) -> float:
    """Pure-DP bound: the largest ε with P[Binomial(r, q_ε) ≥ v] ≤ 1 − confidence (0.0 if none).

    `guesses` r, `correct` v (see `one_run_p_value`); `confidence` in (0, 1). If M is ε-DP this
    exceeds ε with probability ≤ 1 − confidence. Closed form at v = r: logit((1 − confidence)^(1/r))
    (or 0 when that is negative).
    """
    r, v = _check_counts(guesses, correct)
    beta = 1.0 - _check_confidence(confidence)
    return _largest_rejected_epsilon(r, v, 0.0, beta, max(r, 1))


def epsilon_lower_bound(guesses: int, correct: int, delta: float, confidence: float, canaries: int) -> float:
    """(ε, δ) bound (the paper's corollary for (ε, δ)-DP, module docstring): the largest ε whose
    null "M is (ε, δ)-DP" has p-value f_ε(v) + 2mδ·max_i (f_ε(v − i) − f_ε(v)) / i ≤ 1 − confidence.

    `guesses` r, `correct` v, `canaries` m ≥ r (all canaries, guessed or not), `delta` in [0, 1),
    `confidence` in (0, 1). If M is (ε, δ)-DP this exceeds ε with probability ≤ 1 − confidence.
    Equals `epsilon_lower_bound_pure` at δ = 0 and never exceeds it.
    """
    r, v = _check_counts(guesses, correct)
    m = _check_canaries(canaries, r)
    delta = _check_delta(delta)
    beta = 1.0 - _check_confidence(confidence)
    return _largest_rejected_epsilon(r, v, delta, beta, m)


# --------------------------------------------------------------------------------------------
# From canary scores
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OneRunAudit:
    """One audit's counts and its ε lower bound.

    `canaries` m, `guesses` r (= guesses_positive + guesses_negative), `correct` v; the bound
    holds at `confidence` for the null "(ε, `delta`)-DP". `comparisons` > 1 when the guess
    counts were the best of that many pre-registered choices, each tested at
    β / comparisons (`best_guess_counts`); `confidence` is then the family-wise level.
    """

    canaries: int
    guesses: int
    correct: int
    delta: float
    confidence: float
    epsilon_lower_bound: float
    guesses_positive: int = 0
    guesses_negative: int = 0
    comparisons: int = 1

    def __post_init__(self):
        r, v = _check_counts(self.guesses, self.correct)
        _check_canaries(self.canaries, r)
        _check_delta(self.delta)
        _check_confidence(self.confidence)
        if self.guesses_positive + self.guesses_negative not in (0, r):
            raise ValueError(
                f"guesses_positive + guesses_negative must equal guesses, got "
                f"{self.guesses_positive} + {self.guesses_negative} != {r}"
            )
        if _count("comparisons", self.comparisons) < 1:
            raise ValueError(f"comparisons must be >= 1, got {self.comparisons}")
        if not (math.isfinite(self.epsilon_lower_bound) and self.epsilon_lower_bound >= 0.0):
            raise ValueError(f"epsilon_lower_bound must be finite and >= 0, got {self.epsilon_lower_bound!r}")


def _check_scores(scores: object, included: object) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64)
    member = np.asarray(included)
    if s.ndim != 1 or member.shape != s.shape:
        raise ValueError(f"scores and included must be 1-D of the same length, got shapes {s.shape} and {member.shape}")
    if s.size == 0:
        raise ValueError("scores must hold at least one canary")
    if np.isnan(s).any():
        raise ValueError("scores must not contain NaN")
    if member.dtype != np.bool_:
        if not np.isin(member, (0, 1)).all():
            raise ValueError("included must be binary (bool, or 0/1 for not included / included)")
        member = member.astype(bool)
    return s, member


def _guess_order(scores: np.ndarray, tie_break_seed: int) -> np.ndarray:
    """Canary indices from highest to lowest score; equal scores in a random order drawn from
    `tie_break_seed` (independent of the membership coins, unlike the array order)."""
    tie_break = np.random.default_rng(tie_break_seed).permutation(scores.size)
    return np.lexsort((tie_break, -scores))


def _correct_guesses(order: np.ndarray, member: np.ndarray, k_pos: int, k_neg: int) -> int:
    positive = order[:k_pos]
    negative = order[order.size - k_neg:] if k_neg > 0 else order[:0]
    return int(np.count_nonzero(member[positive]) + np.count_nonzero(~member[negative]))


def _check_guess_counts(k_pos: object, k_neg: object, m: int) -> tuple[int, int]:
    kp, kn = _count("guesses_positive", k_pos), _count("guesses_negative", k_neg)
    if kp + kn > m:
        raise ValueError(f"guesses_positive + guesses_negative must be <= the number of canaries {m}, got {kp} + {kn}")
    return kp, kn


def audit_from_scores(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    guesses_positive: int,
    guesses_negative: int,
    delta: float,
    confidence: float,
    *,
    tie_break_seed: int = 0,
) -> OneRunAudit:
    """Guess "member" for the `guesses_positive` highest scores and "non-member" for the
    `guesses_negative` lowest, abstain on the rest, count correct guesses, bound ε.

    `scores`: one per canary, higher = more likely a member, computed from the trained model
    only (never from `included`); `included`: the auditor's membership coins (bool or 0/1);
    `delta`, `confidence`: the null's δ and the bound's confidence (see `epsilon_lower_bound`).
    The guess counts must be fixed before the scores are seen.
    """
    s, member = _check_scores(scores, included)
    kp, kn = _check_guess_counts(guesses_positive, guesses_negative, s.size)
    delta, confidence = _check_delta(delta), _check_confidence(confidence)
    v = _correct_guesses(_guess_order(s, tie_break_seed), member, kp, kn)
    eps = epsilon_lower_bound(kp + kn, v, delta, confidence, s.size)
    return OneRunAudit(s.size, kp + kn, v, delta, confidence, eps, kp, kn)


def best_guess_counts(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    choices: Sequence[tuple[int, int]],
    delta: float,
    confidence: float,
    *,
    tie_break_seed: int = 0,
) -> OneRunAudit:
    """The largest bound over several (guesses_positive, guesses_negative) `choices`, with a
    Bonferroni adjustment: each choice is tested at β / len(choices) (β = 1 − confidence), so
    P[any choice's bound > ε] ≤ β for an (ε, δ)-DP run (union bound) and the maximum holds at
    `confidence`. `choices` must be fixed before the scores are seen (a data-dependent list
    voids the adjustment). Ties between choices: the first one listed.
    """
    s, member = _check_scores(scores, included)
    delta, confidence = _check_delta(delta), _check_confidence(confidence)
    if len(choices) == 0:
        raise ValueError("choices must list at least one (guesses_positive, guesses_negative) pair")
    k = len(choices)
    per_choice_confidence = confidence if k == 1 else 1.0 - (1.0 - confidence) / k
    order = _guess_order(s, tie_break_seed)
    best: Optional[OneRunAudit] = None
    for pair in choices:
        kp, kn = _check_guess_counts(*pair, s.size)
        v = _correct_guesses(order, member, kp, kn)
        eps = epsilon_lower_bound(kp + kn, v, delta, per_choice_confidence, s.size)
        if best is None or eps > best.epsilon_lower_bound:
            best = OneRunAudit(s.size, kp + kn, v, delta, confidence, eps, kp, kn, comparisons=k)
    assert best is not None
    return best
