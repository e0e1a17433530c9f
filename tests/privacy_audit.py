"""A small statistical privacy-audit harness (black-box lower bounds on ε).

A mechanism M is (ε, δ)-DP only if, for every pair of neighbouring inputs D, D' and every
event E,  P[M(D) ∈ E] ≤ e^ε · P[M(D') ∈ E] + δ.  Run M `n` times on D and `n'` times on D'
and count how often a **pre-specified** event E occurs (E must be fixed from the worst-case
analysis *before* looking at the samples; choosing it from the same samples voids the
guarantee below). With one-sided Clopper-Pearson bounds p_D ≥ p_D_lower and p_D' ≤ p_D'_upper,

    eps_lb = log((p_D_lower - δ) / p_D'_upper)

is a lower bound on the true ε of M: if M really is (ε, δ)-DP then eps_lb ≤ ε except with
probability ≤ alpha (the false-alarm rate). Each direction needs two one-sided bounds; testing
both directions (D vs D' and D' vs D) needs four, so each bound gets alpha / (number of bounds)
(Bonferroni) and the overall false-alarm rate of one audit stays ≤ alpha (default 1e-6).

When p_D_lower ≤ δ the event carries no evidence and eps_lb = -inf.

The Gaussian helpers give the exact privacy curve of the Gaussian mechanism with ℓ2
sensitivity 1 and noise N(0, σ²), μ = 1/σ (Balle & Wang 2018, Thm 8):
δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2), attained by the half-space event
{x ≥ x*}, x* = ε/μ + μ/2 (in units of σ, measured from the lower mean).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from scipy import special, stats

DEFAULT_ALPHA = 1e-6


# --------------------------------------------------------------------------------------------
# Clopper-Pearson one-sided bounds
# --------------------------------------------------------------------------------------------


def _check_counts(hits: int, trials: int) -> tuple[int, int]:
    hits, trials = int(hits), int(trials)
    if trials < 1 or not 0 <= hits <= trials:
        raise ValueError(f"need 0 <= hits <= trials and trials >= 1, got hits={hits}, trials={trials}")
    return hits, trials


def clopper_pearson_lower(hits: int, trials: int, alpha: float) -> float:
    """One-sided lower confidence bound on a binomial p: P(p < bound) ≤ alpha."""
    hits, trials = _check_counts(hits, trials)
    if hits == 0:
        return 0.0
    return float(stats.beta.ppf(alpha, hits, trials - hits + 1))


def clopper_pearson_upper(hits: int, trials: int, alpha: float) -> float:
    """One-sided upper confidence bound on a binomial p: P(p > bound) ≤ alpha."""
    hits, trials = _check_counts(hits, trials)
    if hits == trials:
        return 1.0
    return float(stats.beta.ppf(1.0 - alpha, hits + 1, trials - hits))


# --------------------------------------------------------------------------------------------
# Event counts
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EventCounts:
    """How often the pre-specified event occurred in `trials` independent runs."""

    hits: int
    trials: int

    def __post_init__(self):
        _check_counts(self.hits, self.trials)

    @property
    def frequency(self) -> float:
        return self.hits / self.trials

    @classmethod
    def from_bools(cls, occurred) -> "EventCounts":
        """From a boolean array (one entry per independent run)."""
        occurred = np.asarray(occurred, dtype=bool).ravel()
        return cls(int(np.count_nonzero(occurred)), int(occurred.size))


def count_event(outputs: Iterable[Any], event: Callable[[Any], bool]) -> EventCounts:
    """Apply `event` to each recorded output."""
    return EventCounts.from_bools([bool(event(out)) for out in outputs])


def run_trials(mechanism: Callable[[], Any], event: Callable[[Any], bool], trials: int) -> EventCounts:
    """Call `mechanism()` (one independent run per call) `trials` times; count `event(output)`.

    The event is applied as each output is produced, so nothing is stored.
    """
    hits = 0
    for _ in range(int(trials)):
        hits += bool(event(mechanism()))
    return EventCounts(hits, int(trials))


# --------------------------------------------------------------------------------------------
# ε lower bounds
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EpsilonLowerBound:
    """eps_lb for "P[M(D) ∈ E] ≤ e^ε P[M(D') ∈ E] + δ" and what it was computed from."""

    eps_lb: float
    on_d: EventCounts  # the side whose event probability is bounded below (numerator)
    on_dprime: EventCounts  # the side bounded above (denominator)
    p_d_lower: float
    p_dprime_upper: float
    delta: float
    alpha_per_bound: float
    direction: str = "D vs D'"

    def __str__(self) -> str:
        return (
            f"eps_lb={self.eps_lb:.4f} [{self.direction}] (event {self.on_d.hits}/{self.on_d.trials} vs "
            f"{self.on_dprime.hits}/{self.on_dprime.trials}; p_lo={self.p_d_lower:.5g}, "
            f"p'_hi={self.p_dprime_upper:.5g}, delta={self.delta:.4g}, alpha/bound={self.alpha_per_bound:.2g})"
        )


def _one_direction(on_d: EventCounts, on_dprime: EventCounts, delta: float, alpha_per_bound: float, direction: str) -> EpsilonLowerBound:
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must be in [0, 1), got {delta}")
    p_lo = clopper_pearson_lower(on_d.hits, on_d.trials, alpha_per_bound)
    p_hi = clopper_pearson_upper(on_dprime.hits, on_dprime.trials, alpha_per_bound)
    numerator = p_lo - delta
    eps = math.log(numerator / p_hi) if numerator > 0 else -math.inf  # p_hi > 0 always
    return EpsilonLowerBound(eps, on_d, on_dprime, p_lo, p_hi, float(delta), alpha_per_bound, direction)


def epsilon_lower_bound(on_d: EventCounts, on_dprime: EventCounts, delta: float = 0.0, alpha: float = DEFAULT_ALPHA) -> EpsilonLowerBound:
    """One direction: lower bound on ε from "P[M(D) ∈ E] ≤ e^ε P[M(D') ∈ E] + δ".

    `on_d` / `on_dprime`: counts of the same pre-specified event E on D and on D'.
    False-alarm rate ≤ alpha (two one-sided bounds at alpha/2 each).
    """
    return _one_direction(on_d, on_dprime, delta, alpha / 2.0, "D vs D'")


def epsilon_lower_bound_both_directions(
    event_on_d: EventCounts,
    event_on_dprime: EventCounts,
    delta: float = 0.0,
    alpha: float = DEFAULT_ALPHA,
    reverse_event_on_d: EventCounts | None = None,
    reverse_event_on_dprime: EventCounts | None = None,
) -> EpsilonLowerBound:
    """The larger of the two directions, D vs D' (event E) and D' vs D (event E_rev, default E).

    Four one-sided bounds at alpha/4 each, so the overall false-alarm rate stays ≤ alpha.
    E_rev must also be pre-specified (e.g. the complement of E); pass its counts on D and D'.
    """
    rev_d = event_on_d if reverse_event_on_d is None else reverse_event_on_d
    rev_dp = event_on_dprime if reverse_event_on_dprime is None else reverse_event_on_dprime
    a = alpha / 4.0
    forward = _one_direction(event_on_d, event_on_dprime, delta, a, "D vs D'")
    backward = _one_direction(rev_dp, rev_d, delta, a, "D' vs D")
    return forward if forward.eps_lb >= backward.eps_lb else backward


def audit(
    outputs_d: Sequence[Any],
    outputs_dprime: Sequence[Any],
    event: Callable[[Any], bool],
    delta: float = 0.0,
    alpha: float = DEFAULT_ALPHA,
    both_directions: bool = False,
) -> EpsilonLowerBound:
    """Convenience: recorded outputs on D and D' plus a pre-specified event → eps lower bound."""
    on_d, on_dp = count_event(outputs_d, event), count_event(outputs_dprime, event)
    if both_directions:
        return epsilon_lower_bound_both_directions(on_d, on_dp, delta, alpha)
    return epsilon_lower_bound(on_d, on_dp, delta, alpha)


# --------------------------------------------------------------------------------------------
# The exact Gaussian privacy curve (sensitivity 1, noise std σ, μ = 1/σ)
# --------------------------------------------------------------------------------------------


def gaussian_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of the Gaussian mechanism with μ = sensitivity / noise std (Balle & Wang 2018)."""
    if mu <= 0:
        raise ValueError(f"mu must be > 0, got {mu}")
    return float(special.ndtr(-epsilon / mu + mu / 2.0) - math.exp(epsilon) * special.ndtr(-epsilon / mu - mu / 2.0))


def gaussian_optimal_threshold(epsilon: float, mu: float) -> float:
    """x* (in noise-std units above the lower mean) such that {x ≥ x*} attains δ(ε):
    the likelihood ratio of N(μ, 1) to N(0, 1) equals e^ε exactly at x*."""
    if mu <= 0:
        raise ValueError(f"mu must be > 0, got {mu}")
    return epsilon / mu + mu / 2.0


def gaussian_event_probabilities(epsilon: float, mu: float) -> tuple[float, float]:
    """(P[N(μ,1) ≥ x*], P[N(0,1) ≥ x*]) for the optimal event at ε; p1 - e^ε p0 = δ(ε)."""
    x = gaussian_optimal_threshold(epsilon, mu)
    return float(special.ndtr(mu - x)), float(special.ndtr(-x))


def audit_neighbours(mechanism: Callable[[Any, np.random.Generator], Any], data_d: Any, data_dprime: Any,
                     event: Callable[[Any], bool], trials: int, delta: float, seed: int,
                     alpha: float = DEFAULT_ALPHA) -> EpsilonLowerBound:
    """ε lower bound from `trials` runs of mechanism(data, rng) on each of two neighbouring data
    sets: the pre-specified event E on D' (numerator) against D, and E's complement in the reverse
    direction (four one-sided bounds, Bonferroni inside `epsilon_lower_bound_both_directions`)."""
    rng = np.random.default_rng(seed)
    on_d = EventCounts.from_bools([event(mechanism(data_d, rng)) for _ in range(trials)])
    on_dp = EventCounts.from_bools([event(mechanism(data_dprime, rng)) for _ in range(trials)])
    return epsilon_lower_bound_both_directions(
        on_dp, on_d, delta=delta, alpha=alpha,
        reverse_event_on_d=EventCounts(trials - on_dp.hits, trials),
        reverse_event_on_dprime=EventCounts(trials - on_d.hits, trials))

