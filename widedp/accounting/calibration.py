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

With a PLD accountant (`pld`, or `auto` where it resolves to PLD) each ε costs ~0.05–0.5 s at
the default discretization (1e-4; the distributions come from `pld_gaussian`, ~5–8× faster
than dp_accounting's builder, the rest is its convolution and ε search), and a bisection
takes ~15–25 of them. The search then runs
on a coarse twin (`COARSE_PLD_INTERVAL`, ~5–10× cheaper; only a guide, its values are never
returned) and is finished on the accountant itself: its ε at the coarse answer, then a short
bracketed search from there (`refine_increasing`, ~5–8 evaluations). Every σ returned was
verified with the accountant the caller named, so the answer still never spends above the
target; it spends it to a relative tolerance of about 1e-7 in ρ. A PLD (or PRV) search tries no
ρ above `RHO_CEILING_GRID` (σ ≈ 0.071), beyond which its grid grows costly and then outgrows
memory; a target no ρ below that reaches (ε ≳ 166 for one Gaussian) gets that σ.

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

    def __init__(self, target: float, smallest: float, name: str = "target_epsilon",
                 suggested: Optional[str] = None):
        """`suggested`: the value the message tells the user to set (default: `smallest` rounded
        up to 3 digits); a caller whose one-time costs depend on the target (an "auto" σ sized as
        a share of it) passes one it verified by planning at it."""
        self.target, self.smallest, self.name = target, smallest, name
        self.suggested = suggested if suggested is not None else _round_up(smallest)
        super().__init__(
            f"{name} = {target:g} is unreachable: the smallest ε this run can reach is {smallest:.4g} "
            f"(with all but a negligible budget taken from the noise and the selection, the one-time "
            f"events and the accountant's (ε, δ) conversion still spend it); set {name} to at least "
            f"{self.suggested}, or change δ, the accountant or the one-time events")

    def renamed(self, name: str) -> "UnreachableTargetError":
        """The same refusal naming the caller's parameter (e.g. `privacy.target_epsilon`)."""
        return UnreachableTargetError(self.target, self.smallest, name, self.suggested)


def round_up(x: float) -> str:
    """x rounded up to 3 significant digits, as text."""
    return _round_up(x)


def _round_up(x: float) -> str:
    """x rounded up to 3 significant digits (a value that is certainly reachable)."""
    if not (math.isfinite(x) and x > 0):
        return f"{x:g}"
    scale = 10.0 ** (math.floor(math.log10(x)) - 2)
    return f"{math.ceil(x / scale * (1 - 1e-12)) * scale:.3g}"


def bisect_increasing(f: Callable[[float], float], target: float, lo: float, hi: float,
                      floor: Optional[float] = None, log_xtol: float = 1e-10,
                      ceiling: Optional[float] = None) -> float:
    """Largest x (to ~1e-9 relative; `log_xtol` in log x) with f(x) ≤ target, for f increasing in x.

    `floor`: the least x tried (default lo / 1e22); if even f(floor) > target, the target is
    unreachable: UnreachableTargetError with f(floor), the smallest value reachable.
    `ceiling`: the largest x tried (default 1e12): if f(ceiling) ≤ target, that is the answer.
    Brent's method on log x brackets the crossing in ~10 evaluations (PLD evaluations cost
    ~0.3 s each); the answer is then nudged down until f(x) ≤ target, so it never overspends.
    """
    floor = lo * 1e-22 if floor is None else min(floor, lo)
    while (value := f(lo)) > target:
        if lo <= floor:
            raise UnreachableTargetError(target, value)
        lo = max(lo / 100, floor)
    ceiling = 1e12 if ceiling is None else ceiling
    hi = min(hi, ceiling)
    while f(hi) <= target:
        if hi >= ceiling:
            return hi
        lo, hi = hi, min(hi * 100, ceiling)
    from scipy import optimize  # loaded when something is calibrated, not with svt_event / step_event

    x = math.exp(optimize.brentq(lambda t: f(math.exp(t)) - target, math.log(lo), math.log(hi), xtol=log_xtol,
                                 rtol=min(1e-12, log_xtol)))
    for i in range(60):  # brentq may land a hair above the crossing
        if f(x) <= target:
            return x
        x = max(lo, x * (1 - log_xtol * 2**i))
    return lo


def refine_increasing(f: Callable[[float], float], target: float, lo: float, f_lo: float,
                      rtol: float = 1e-7, ceiling: float = 1e12) -> float:
    """Largest x (to `rtol` relative) with f(x) ≤ target, for f increasing, from a point `lo`
    already known to fit (f(lo) = `f_lo` ≤ target) and close below the crossing.

    The bracket's upper end assumes f grows at least like √x near the crossing (ε in ρ = 1/(2σ²)
    does: ε ≈ c√ρ for small ε, ≈ cρ for large), and widens itself if not. Returns an x at which
    f was evaluated and found ≤ target (`lo` at worst): never one that overspends. No x above
    `ceiling` is tried."""
    if not f_lo <= target:
        raise ValueError(f"refine_increasing needs f(lo) <= target, got {f_lo} > {target}")
    seen = {lo: f_lo}

    def value(x: float) -> float:
        if x not in seen:
            seen[x] = f(x)
        return seen[x]

    ratio = max((target / f_lo) ** 2 * (1 + 1e-3), 1 + 10 * rtol) if f_lo > 0 else 100.0
    if lo >= ceiling:
        return lo
    hi = min(lo * ratio, ceiling)
    while value(hi) <= target:
        if hi >= ceiling:
            return hi
        lo, hi = hi, min(hi * ratio, ceiling)
        ratio *= ratio
    from scipy import optimize  # loaded when something is calibrated, not with svt_event / step_event

    optimize.brentq(lambda x: value(x) - target, lo, hi, xtol=lo * rtol, rtol=1e-14)
    return max(x for x, v in seen.items() if v <= target)


#: The discretization of the coarse twin a PLD calibration searches with (module docstring).
COARSE_PLD_INTERVAL = 1e-3
#: The largest per-step budget ρ a PLD or PRV calibration tries (σ = 1/√(2ρ) ≈ 0.071): their
#: grids span the privacy loss, so the cost grows with ρ — PLD, one Gaussian at interval 1e-4
#: (dp_accounting's builder; `pld_gaussian`'s is a few times faster): ~0.5 s at ρ = 1, ~12 s at
#: ρ = 10², ~80 s at 10³, and at 10⁶ (which a target like 5·10⁷
#: reaches) 15 GiB: out of memory (PRV: 5.6 GiB there). A target that even ρ = 10² does not reach
#: — ε ≳ 166 for one Gaussian at δ = 1e-6, no privacy to speak of — gets σ = 1/√(2·RHO_CEILING_GRID):
#: more noise than needed, never more ε. (RDP's cost does not grow with ρ: no ceiling.)
RHO_CEILING_GRID = 1e2


def grid_delegate(acc: Accountant, history) -> Optional[Accountant]:
    """The discretizing accountant (PLD or PRV) that computes `acc`'s ε on histories like
    `history`: `acc` itself if it is one, the PLD delegate of "auto" where it resolves to PLD;
    None otherwise."""
    from widedp.accounting.auto import AutoAccountant
    from widedp.accounting.base import UnsupportedEventError
    from widedp.accounting.gaussian_reduction import GaussianReducibleAccountant

    if isinstance(acc, GaussianReducibleAccountant):
        return acc
    if isinstance(acc, AutoAccountant):
        try:
            return acc.pld if acc.resolve(history) == "pld" else None
        except UnsupportedEventError:
            return None  # the search with `acc` itself raises it
    return None


def coarse_twin(acc: Accountant, history) -> Optional[Accountant]:
    """A cheaper accountant to guide the search for `acc` on histories like `history`: PLD at
    `COARSE_PLD_INTERVAL` when `acc` computes by PLD (`grid_delegate`) at a finer interval; None
    otherwise (search with `acc` itself)."""
    from widedp.accounting.pld import PldAccountant

    pld = grid_delegate(acc, history)
    if not isinstance(pld, PldAccountant) or pld.value_discretization_interval >= COARSE_PLD_INTERVAL:
        return None
    return PldAccountant(value_discretization_interval=COARSE_PLD_INTERVAL)


def sigma_of_rho(rho: float) -> float:
    """σ = 1/√(2ρ): the noise multiplier of the Gaussian that spends zCDP budget ρ (sensitivity 1)."""
    return 1.0 / math.sqrt(2.0 * rho)


def calibrate(
    build_event: Callable[[float], ev.DpEvent],
    target_epsilon: float,
    delta: float,
    *,
    accountant: Union[str, Accountant] = "auto",
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
    return calibrate_with_epsilon(build_event, target_epsilon, delta, accountant=accountant, steps=steps,
                                  extra_history=extra_history)[0]


def calibrate_with_epsilon(
    build_event: Callable[[float], ev.DpEvent],
    target_epsilon: float,
    delta: float,
    *,
    accountant: Union[str, Accountant] = "auto",
    steps: int = 1,
    extra_history: Optional[Sequence[tuple[ev.DpEvent, int]]] = None,
) -> tuple[float, float]:
    """`calibrate`'s σ and the accountant's ε at it (the value the search verified, so the
    caller need not compute it again)."""
    check_target(target_epsilon)
    _check_steps_delta(steps, delta)
    acc = accountant if isinstance(accountant, Accountant) else make_accountant(accountant)
    extra = list(extra_history or [])

    def spent_by(accountant: Accountant) -> Callable[[float], float]:
        return lambda rho: accountant.epsilon(extra + [(build_event(sigma_of_rho(rho)), steps)], delta)

    seen: dict[float, float] = {}

    def spent(rho: float) -> float:
        if rho not in seen:
            seen[rho] = spent_by(acc)(rho)
        return seen[rho]

    def found(rho: float) -> tuple[float, float]:
        return sigma_of_rho(rho), spent(rho)

    probe = extra + [(build_event(1.0), steps)]
    ceiling = RHO_CEILING_GRID if grid_delegate(acc, probe) is not None else None
    coarse = coarse_twin(acc, probe)
    if coarse is not None:
        lo, hi = _rdp_bracket(spent_by, target_epsilon, ceiling)
        try:
            # A guide only: to well within the coarse/fine gap (~1% in ρ), not to the final tolerance.
            rho = bisect_increasing(spent_by(coarse), target_epsilon, lo, hi, floor=RHO_FLOOR, log_xtol=1e-4,
                                    ceiling=ceiling)
        except UnreachableTargetError:
            rho = None  # the coarse bound may miss a target the fine one reaches: search with `acc`
        if rho is not None and (value := spent(rho)) <= target_epsilon:
            return found(refine_increasing(spent, target_epsilon, rho, value, ceiling=ceiling or 1e12))
    return found(bisect_increasing(spent, target_epsilon, 1e-8, 1.0, floor=RHO_FLOOR, ceiling=ceiling))


def _rdp_bracket(spent_by: Callable[[Accountant], Callable[[float], float]], target_epsilon: float,
                 ceiling: Optional[float]) -> tuple[float, float]:
    """Where the coarse PLD search starts: [ρ_rdp, 4ρ_rdp], ρ_rdp being the budget RDP's (looser,
    ~20 ms per ε) calibration finds to 1% — PLD's answer lies a little above it, so Brent's method
    starts from a bracket ~5× narrower in log ρ than [1e-8, 1] (measured: 10 coarse PLD
    evaluations instead of 15). Only a starting bracket: `bisect_increasing` widens it when it
    misses, and the answer is verified on the caller's accountant. [1e-8, 1] when RDP cannot bound
    the history or finds no answer (its errors — unsupported, invalid, unreachable — are
    ValueErrors)."""
    from widedp.accounting.rdp import RdpAccountant

    try:
        rho = bisect_increasing(spent_by(RdpAccountant()), target_epsilon, 1e-8, 1.0, floor=RHO_FLOOR,
                                log_xtol=1e-2, ceiling=ceiling)
    except (ValueError, OverflowError):
        return 1e-8, 1.0
    return rho, rho * 4


def one_time_gaussian_sigma(useful: float, budget_share: float, delta: float,
                             accountant: Union[str, Accountant] = "auto") -> tuple[float, float]:
    """(σ, σ_affordable) of a one-time Gaussian release sized by two public rules: σ = max(useful,
    σ_affordable), σ_affordable being the least σ at which `GaussianDpEvent(σ)` alone spends at
    most `budget_share` at δ. As much noise as the caller's usefulness rule allows when that is
    cheap; never a one-time cost above the share when it is not (used by DP-FEST's count and the
    recalibration histogram). When `useful` ≥ σ_affordable, `useful` spends no more than the
    share (ε falls as σ grows) and is reported for both (callers read σ_affordable == useful as
    "the share was not binding").

    σ_affordable is searched first and ε is never asked at `useful`: a small `useful` (a small
    data set) is a Gaussian of large ρ, whose PLD grid costs seconds to minutes (RHO_CEILING_GRID)."""
    acc = accountant if isinstance(accountant, Accountant) else make_accountant(accountant)
    sigma = max(useful, calibrate(ev.GaussianDpEvent, budget_share, delta, accountant=acc))
    return sigma, sigma


def invert_advanced_composition(target: float, k: int, delta: float) -> float:
    """The per-mechanism ε whose k-fold advanced composition (at δ) is `target`."""
    return bisect_increasing(lambda e: advanced_composition(e, k, delta), target, 1e-12, 1.0)


__all__ = ["COARSE_PLD_INTERVAL", "InvalidBoundError", "RHO_CEILING_GRID", "RHO_FLOOR", "UnreachableTargetError",
           "bisect_increasing", "calibrate", "calibrate_with_epsilon", "check_run", "check_target", "coarse_twin",
           "grid_delegate", "invert_advanced_composition", "one_time_gaussian_sigma", "refine_increasing",
           "sampled_step_event", "sel_event_of", "sigma_of_rho", "step_event", "svt_event"]
