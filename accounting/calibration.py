"""Calibration: the noise multiplier σ that makes a mechanism spend a target (ε, δ), for any
mechanism the caller describes — this module knows no mechanism and no selector.

In the manner of dp_accounting's `mechanism_calibration.calibrate_dp_mechanism`, `calibrate`
takes a function building the mechanism's event from σ (`build_event: σ ↦ DpEvent`) and finds,
by bisection on the chosen accountant's own ε, the least σ whose history
`extra_history + [(build_event(σ), steps)]` spends at most `target_epsilon` at `delta` — never
above it (to tolerance). ε must decrease as σ grows (more noise, more privacy). The search runs
on ρ = 1/(2σ²), the zCDP budget of a Gaussian of noise multiplier σ under add/remove-one with
ℓ2 sensitivity 1, by Brent's method on log ρ; it tries no ρ below `RHO_FLOOR` (σ ≈ 7·10⁵): a
target that even that spends more than — because of the one-time events, or the RDP
conversion's floor of about log(1/δ)/(α_max − 1) — is refused by `UnreachableTargetError` (a
ValueError) with the smallest reachable ε, before any accountant is asked about a σ beyond its
numerical range.

What a σ means is the builder's: σ of the one Gaussian of a DP-SGD step, or (selection's
`selection.calibration`) the σ whose budget ρ a sparse step splits between its row selection and
its noise. The step structure every caller shares is here too: `sampled_step_event`
(PoissonSampled(q, [selection, noise])), `step_event` (with Gaussian noise), `sel_event_of`.

Sparse vector (NumericSparse) has two modes: selection-only (`release_values=False`, ε1 = ε,
what the trainer runs and the default everywhere: `svt_event`, `widedp epsilon`,
`widedp calibrate`), and value-releasing (Alg 1's 0.95/0.05 split, opt-in). The two give
different events for the same (ε, δ, c), so every caller must name the trainer's mode.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

from scipy import optimize

from widedp.accounting import events as ev
from widedp.accounting.base import Accountant, InvalidBoundError, make_accountant
from widedp.accounting.paper import advanced_composition


def step_event(sample_rate: float, noise_multiplier: float, selection_event: Optional[ev.DpEvent] = None) -> ev.DpEvent:
    """The event of one Algorithm 3 step (or one DP-SGD step when selection_event is None)."""
    return sampled_step_event(sample_rate, ev.GaussianDpEvent(noise_multiplier), selection_event)


def sampled_step_event(sample_rate: float, noise_event: ev.DpEvent,
                       selection_event: Optional[ev.DpEvent] = None) -> ev.DpEvent:
    """The one structure of a step's event: PoissonSampled(q, [selection, noise]) — used for the
    budget (`step_event`) and for what a step actually ran (the engine's record)."""
    inner = noise_event if selection_event is None else ev.ComposedDpEvent([selection_event, noise_event])
    return ev.PoissonSampledDpEvent(sample_rate, inner)


def sel_event_of(step: ev.DpEvent) -> Optional[ev.DpEvent]:
    """The selection event inside a `step_event` (None for a DP-SGD step)."""
    inner = step.event if isinstance(step, ev.PoissonSampledDpEvent) else step
    return inner.events[0] if isinstance(inner, ev.ComposedDpEvent) else None


def check_run(sample_rate: float, steps: int, delta: float) -> None:
    if not (isinstance(sample_rate, (int, float)) and 0 < sample_rate <= 1):
        raise ValueError(f"sample rate q must be in (0, 1], got {sample_rate}")
    _check_steps_delta(steps, delta)


def _check_steps_delta(steps: int, delta: float) -> None:
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps}")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def check_target(target_epsilon: float) -> None:
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target epsilon must be finite and > 0, got {target_epsilon}")


def svt_event(epsilon: float, delta: float, max_answers: int, *, release_values: bool) -> ev.SparseVectorDpEvent:
    """The event `selection.numeric_sparse(..., release_values=release_values)` emits for these
    Alg 1 parameters (sensitivity 1).

    `release_values` has no default on purpose: selection-only SVT (False, what the trainer runs)
    and NumericSparse releasing values (True: ε split 0.95/0.05) are different events for the
    same (ε, δ, c), and a caller relying on a default once made `widedp epsilon` disagree with
    the training ledger.
    """
    eps1, eps2 = (0.95 * epsilon, 0.05 * epsilon) if release_values else (epsilon, None)
    unit = math.sqrt(32.0 * max_answers * math.log(2.0 / delta))
    b_t = unit / eps1
    return ev.SparseVectorDpEvent(
        threshold_noise=b_t, query_noise=2 * b_t, value_noise=2 * unit / eps2 if eps2 is not None else None,  # eps2 is None iff not release_values
        max_answers=max_answers, epsilon=epsilon, delta=delta,
    )


#: The least per-step zCDP budget ρ the calibration tries (σ = 1/√(2ρ) ≈ 7·10⁵ for DP-SGD, a
#: selection budget as small): far more noise than any useful run, and still inside the range
#: where Opacus' sampled-Gaussian RDP is numerically sound (beyond ρ ≈ 1e-16 it fails with
#: "The result of subtraction must be non-negative.").
RHO_FLOOR = 1e-12


class UnreachableTargetError(ValueError):
    """The target ε is below the least ε the calibration can reach: `smallest`, spent at the
    least budget it tries (`RHO_FLOOR`). What still costs ε there is what no noise level
    removes: the one-time events (`extra_history`, e.g. a private vocabulary or DP-FEST's
    top-k) and the accountant's own conversion to (ε, δ) (RDP: about log(1/δ)/(α_max − 1))."""

    def __init__(self, target: float, smallest: float, name: str = "target_epsilon"):
        self.target, self.smallest, self.name = target, smallest, name
        super().__init__(
            f"{name} = {target:g} is unreachable: the smallest ε this run can reach is {smallest:.4g} "
            f"(with all but a negligible budget taken from the noise and the selection, the one-time "
            f"events and the accountant's (ε, δ) conversion still spend it); set {name} to at least "
            f"{_round_up(smallest)}, or change δ, the accountant or the one-time events")

    def renamed(self, name: str) -> "UnreachableTargetError":
        """The same refusal naming the caller's parameter (e.g. `privacy.target_epsilon`)."""
        return UnreachableTargetError(self.target, self.smallest, name)


def _round_up(x: float) -> str:
    """x rounded up to 3 significant digits (a value that is certainly reachable)."""
    if not (math.isfinite(x) and x > 0):
        return f"{x:g}"
    scale = 10.0 ** (math.floor(math.log10(x)) - 2)
    return f"{math.ceil(x / scale * (1 - 1e-12)) * scale:.3g}"


def bisect_increasing(f: Callable[[float], float], target: float, lo: float, hi: float,
                      floor: Optional[float] = None) -> float:
    """Largest x (to ~1e-9 relative) with f(x) ≤ target, for f increasing in x.

    `floor`: the least x tried (default lo / 1e22); if even f(floor) > target, the target is
    unreachable: UnreachableTargetError with f(floor), the smallest value reachable.
    Brent's method on log x brackets the crossing in ~10 evaluations (PLD evaluations cost
    ~0.3 s each); the answer is then nudged down until f(x) ≤ target, so it never overspends.
    """
    floor = lo * 1e-22 if floor is None else min(floor, lo)
    while (value := f(lo)) > target:
        if lo <= floor:
            raise UnreachableTargetError(target, value)
        lo = max(lo / 100, floor)
    while f(hi) <= target:
        lo, hi = hi, hi * 100
        if hi > 1e12:
            return lo
    x = math.exp(optimize.brentq(lambda t: f(math.exp(t)) - target, math.log(lo), math.log(hi), xtol=1e-10, rtol=1e-12))
    for i in range(60):  # brentq may land a hair above the crossing
        if f(x) <= target:
            return x
        x = max(lo, x * (1 - 1e-10 * 2**i))
    return lo


def sigma_of_rho(rho: float) -> float:
    """σ = 1/√(2ρ): the noise multiplier of the Gaussian that spends zCDP budget ρ (sensitivity 1)."""
    return 1.0 / math.sqrt(2.0 * rho)


def calibrate(
    build_event: Callable[[float], ev.DpEvent],
    target_epsilon: float,
    delta: float,
    *,
    accountant: Union[str, Accountant] = "rdp",
    steps: int = 1,
    extra_history: Optional[Sequence[tuple[ev.DpEvent, int]]] = None,
) -> float:
    """The least noise multiplier σ whose mechanism spends at most `target_epsilon` at `delta`.

    `build_event`: σ ↦ the event of the mechanism run with noise multiplier σ (e.g.
    `lambda s: PoissonSampledDpEvent(q, GaussianDpEvent(s))` for a DP-SGD step); ε must
    decrease as σ grows. The history charged is `extra_history` (events applied once besides,
    e.g. a private vocabulary: room is left for them inside the target) and then `steps`
    applications of `build_event(σ)`; it is accounted by `accountant` (a registered name or an
    `Accountant`), under that accountant's neighbouring relation (add/remove one). The answer
    spends the target to tolerance and never more.

    Raises `UnreachableTargetError` (a ValueError naming `target_epsilon` and the smallest ε
    reachable) when even σ = 1/√(2·RHO_FLOOR) spends more than the target, and the accountant's
    UnsupportedEventError for an event it cannot bound."""
    check_target(target_epsilon)
    _check_steps_delta(steps, delta)
    acc = accountant if isinstance(accountant, Accountant) else make_accountant(accountant)
    extra = list(extra_history or [])

    def spent(rho: float) -> float:
        return acc.epsilon(extra + [(build_event(sigma_of_rho(rho)), steps)], delta)

    return sigma_of_rho(bisect_increasing(spent, target_epsilon, 1e-8, 1.0, floor=RHO_FLOOR))


def invert_advanced_composition(target: float, k: int, delta: float) -> float:
    """The per-mechanism ε whose k-fold advanced composition (at δ) is `target`."""
    return bisect_increasing(lambda e: advanced_composition(e, k, delta), target, 1e-12, 1.0)


__all__ = ["RHO_FLOOR", "InvalidBoundError", "UnreachableTargetError", "bisect_increasing", "calibrate", "check_run",
           "check_target", "invert_advanced_composition", "sampled_step_event", "sel_event_of", "sigma_of_rho",
           "step_event", "svt_event"]
