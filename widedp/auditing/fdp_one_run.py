"""One-run audit against a Gaussian-DP null: the f-DP refinement of the one-run bound.

Mahloujifar, Melis & Chaudhuri, "Auditing f-Differential Privacy in One Run" (ICML 2025,
arXiv:2410.22235).

Setting and neighbouring relation: as `one_run_audit` — m canaries, each included by the
auditor's own fair coin, the audited mechanism M claimed private w.r.t. **adding/removing one
example**; a guesser that never sees the coins guesses "member" for r canaries (its top scores)
and abstains on the rest; v of its guesses are right.

The null is not "(ε, δ)-DP" but "M is μ-GDP" (Dong, Roth & Su 2019): every test between M(D) and
M(D') for neighbours D, D' has type-II error ≥ f_μ(α) = Φ(Φ⁻¹(1 − α) − μ) at type-I error α. The
paper's analysis bounds, for an f-DP mechanism, how many of r guesses can be right with
probability more than β; its procedure for one-sided guesses (reconstructed from the paper's
algorithm as public auditing code implements it, e.g. DeepMind's `jax_privacy.auditing`; in
`_rejects_gdp`) walks the correct guesses down from v, growing the mass the
guesses' right part (`right`) and wrong part (`wrong`) must have under f, and rejects when that
mass exceeds the r/m the guesses have. With f = f_μ the blow-up inverse it needs is
x ↦ Φ(Φ⁻¹(x) − μ) (the inverse of x ↦ 1 − f_μ(x)).

What the bound says. If M is μ-GDP, P[`gdp_mu_lower_bound` > μ] ≤ β = 1 − confidence (over the
coins, M's and the guesser's randomness). `epsilon_lower_bound_gdp` reports it in the ledger's
units: the ε at which a μ̂-GDP mechanism is (ε, δ)-DP (Dong et al., Corollary 2.13). That ε is a
lower bound on the true ε(δ) **of a mechanism whose tradeoff curve is Gaussian** — DP-SGD with
every example in every step (q = 1) exactly, and composed subsampled Gaussians approximately (the
central limit theorem of Dong et al., §5, as the steps grow): μ-GDP is a stronger claim than one
(ε, δ) pair, so rejecting it does not by itself refute an (ε, δ) claim. Where the mechanism is
GDP-shaped this bound is much closer to the claim than the (ε, δ) one (`one_run_audit`), which
pays for the worst (ε, δ) mechanism; where it is not, read `one_run_audit`'s bound.

Not covered: as `one_run_audit` (the guesser must not see the coins, the number of guesses is
fixed before the scores are seen); only member guesses (one-sided), as in the paper's procedure.
"""

from __future__ import annotations

import math
import numbers

from scipy import optimize, special

from widedp.accounting.gaussian_profile import log_gaussian_delta
from widedp.auditing.one_run_audit import _check_canaries, _check_confidence, _check_counts, _check_delta

# μ above which every finite count is explained (Φ(Φ⁻¹(x) − μ) underflows to 0 for every x < 1).
_MU_CAP = 40.0
_TOLERANCE = 1e-9


def _gdp_blow_up_inverse(x: float, mu: float) -> float:
    """Φ(Φ⁻¹(x) − μ): the smallest type-I error a μ-GDP test needs for power x (the inverse of x ↦ 1 − f_μ(x))."""
    if x >= 1.0:
        return 1.0
    return float(special.ndtr(special.ndtri(x) - mu))


def _rejects_gdp(canaries: int, guesses: int, correct: int, mu: float, beta: float) -> bool:
    """True when v = `correct` right out of r = `guesses` member guesses among m = `canaries` has
    probability ≤ β under "M is μ-GDP" (the paper's recursion, module docstring)."""
    m, r, v = canaries, guesses, correct
    right, wrong = beta * v / m, beta * (r - v) / m
    for i in range(v - 1, -1, -1):
        grown = max(wrong, _gdp_blow_up_inverse(right, mu))
        if grown == wrong:  # neither part can change any more
            break
        right = min(right + (i / (r - i)) * (grown - wrong), 1.0)
        wrong = grown
    return right + wrong > r / m


def gdp_mu_lower_bound(guesses: int, correct: int, canaries: int, confidence: float) -> float:
    """The largest μ whose null "M is μ-GDP" is rejected by v right out of r member guesses
    (0.0 if none), to within 1e-9.

    Args:
        guesses: r, member guesses made (the r highest scores), 0 ≤ r ≤ m.
        correct: v, of those, canaries that were members.
        canaries: m, all canaries, each a member with probability ½ by the auditor's coin.
        confidence: in (0, 1); if M is μ-GDP the result exceeds μ with probability ≤ 1 − confidence.

    Returns:
        μ̂ ≥ 0. Rejection is monotone in μ (a larger μ allows more right guesses), so the
        bisection's lower end is a rejected μ throughout.
    """
    r, v = _check_counts(guesses, correct)
    m = _check_canaries(canaries, r)
    beta = 1.0 - _check_confidence(confidence)
    if v == 0 or not _rejects_gdp(m, r, v, 0.0, beta):
        return 0.0
    lo, hi = 0.0, 1.0
    while _rejects_gdp(m, r, v, hi, beta):
        lo, hi = hi, 2.0 * hi
        if hi > _MU_CAP:
            return lo
    while hi - lo > _TOLERANCE:
        mid = 0.5 * (lo + hi)
        if _rejects_gdp(m, r, v, mid, beta):
            lo = mid
        else:
            hi = mid
    return lo


def gdp_epsilon(mu: float, delta: float) -> float:
    """ε such that μ-GDP implies (ε, δ)-DP and no smaller ε does (Dong, Roth & Su 2019, Cor. 2.13):
    δ = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2). 0.0 when μ-GDP is already (0, δ)-DP.

    Args:
        mu: μ ≥ 0.
        delta: δ in (0, 1).
    """
    if isinstance(mu, bool) or not isinstance(mu, numbers.Real) or not (math.isfinite(mu) and mu >= 0):
        raise ValueError(f"mu must be a finite number >= 0, got {mu!r}")
    delta = _check_delta(delta)
    if delta <= 0.0:
        raise ValueError("delta must be > 0 (μ-GDP with μ > 0 is not (ε, 0)-DP for any finite ε)")
    if mu == 0.0:
        return 0.0

    def gap(eps: float) -> float:  # log δ(ε) − log δ, decreasing in ε (the profile unrounded: a lower bound)
        return log_gaussian_delta(eps, mu) - math.log(delta)

    if gap(0.0) <= 0.0:
        return 0.0
    hi = 1.0
    while gap(hi) > 0.0:
        hi *= 2.0
    return float(optimize.brentq(gap, 0.0, hi, xtol=1e-10))


def epsilon_lower_bound_gdp(guesses: int, correct: int, canaries: int, delta: float, confidence: float) -> float:
    """`gdp_mu_lower_bound` in ε at `delta`: gdp_epsilon(μ̂, δ) (module docstring: a lower bound
    on ε(δ) of a mechanism whose tradeoff curve is Gaussian).

    Args: as `gdp_mu_lower_bound`, and `delta` in (0, 1), the ledger's δ.
    """
    return gdp_epsilon(gdp_mu_lower_bound(guesses, correct, canaries, confidence), delta)


def gdp_mu_of_epsilon(epsilon: float, delta: float) -> float:
    """The μ whose `gdp_epsilon(μ, delta)` is `epsilon` (the GDP curve through a claim's (ε, δ)).

    Args:
        epsilon: ε > 0; delta: δ in (0, 1).
    """
    if not (isinstance(epsilon, numbers.Real) and math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
    hi = 1.0
    while gdp_epsilon(hi, delta) < epsilon:
        hi *= 2.0
    return float(optimize.brentq(lambda mu: gdp_epsilon(mu, delta) - epsilon, 0.0, hi, xtol=1e-10))
