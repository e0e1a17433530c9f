"""The Gaussian mechanism's exact privacy profile, once for every package that needs it.

For a function of ℓ2 sensitivity Δ released with N(0, s²I) noise (μ = Δ/s; equivalently any
μ-GDP mechanism, Dong, Roth & Su 2019, Cor. 2.13) the smallest δ at which it is (ε, δ)-DP is
(Balle & Wang 2018, Thm 8; both directions equal)

    δ(ε) = Φ(μ/2 − ε/μ) − e^ε·Φ(−μ/2 − ε/μ).

`gaussian_delta` evaluates it in log space (the second term is a tiny number times a huge one
at large ε) and rounds it up by a relative 1e-9, so a claim computed from it is never smaller
than the exact profile; `log_gaussian_delta` is the unrounded
log δ(ε) for lower bounds (auditing), which must not round up.
"""

from __future__ import annotations

import math

from scipy import special


def _check_mu(mu: float) -> float:
    if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not (math.isfinite(mu) and mu > 0):
        raise ValueError(f"mu must be a finite number > 0, got {mu!r}")
    return float(mu)


def log_gaussian_delta(epsilon: float, mu: float) -> float:
    """log δ(ε), not rounded (−inf where δ = 0): for lower bounds, which must not round up.

    Args:
        epsilon: ε ≥ 0 (finite). mu: μ > 0.
    """
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
    mu = _check_mu(mu)
    log_a = float(special.log_ndtr(mu / 2.0 - epsilon / mu))
    log_b = float(special.log_ndtr(-mu / 2.0 - epsilon / mu))
    gap = epsilon + log_b - log_a  # < 0: the profile is positive for every finite ε
    return -math.inf if gap >= 0.0 else log_a + math.log(-math.expm1(gap))


def gaussian_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of the Gaussian mechanism with μ = sensitivity / noise std (module docstring).

    Args:
        epsilon: ε ≥ 0 (finite). mu: μ > 0.
    Returns:
        δ in [0, 1], rounded up by a relative 1e-9 (a claim's direction).
    """
    log_delta = log_gaussian_delta(epsilon, mu)
    return 0.0 if log_delta == -math.inf else min(1.0, math.exp(log_delta) * (1.0 + 1e-9))

