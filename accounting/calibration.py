"""Calibration: target (ε, δ, q, T) → noise multiplier, and a selection/noise budget split.

A sparse step is PoissonSampled(q, Composed([selection, Gaussian(σ)])). The split `fraction`
f is the share of the step's (unsampled) zCDP budget ρ given to the selection:
  Gaussian σ:           ρ = 1/(2σ²)
  exponential top-k:    ρ = k·ε''²/8     (ε''-bounded range per draw)
  noisy-max (Laplace):  ρ = k·ε²/2       (pure ε-DP per round)
  sparse vector:        ρ = c·ε_round²/2 (pure ε_round-DP per round)
  Gaussian threshold:   ρ = 1/(2σ_sel²)  ⇒ σ_sel⁻² + σ_noise⁻² = σ⁻², one Gaussian
For every accountant the total ρ is then found by bisection on the accountant's own ε, so
the returned parameters spend exactly (to tolerance, never above) the target. The bisection
tries no budget below `RHO_FLOOR` (σ ≈ 7·10⁵): a target that even that spends more than —
because of the one-time events, or the RDP conversion's floor of about log(1/δ)/(α_max − 1) —
is refused by `UnreachableTargetError` (a ValueError) with the smallest reachable ε, before any
accountant is asked about a σ beyond its numerical range.
The `paper` accountant splits the per-step ε of Theorem 3 instead (ε' = fE, ε_g = (1-f)E) and
calibrates to its reported `epsilon`: Theorem 3 with the corrected amplification
log(1 + q(e^E - 1)) (see accounting/paper.py), never the seed's literal Lemma 1 (qE), which
under-counts; the literal value of the result is returned alongside, flagged.

Sparse vector (NumericSparse) has two modes: selection-only (`release_values=False`, ε1 = ε,
what the trainer runs and the default everywhere: `svt_event`, `calibrate`, `widedp epsilon`,
`widedp calibrate`), and value-releasing (Alg 1's 0.95/0.05 split, opt-in). The two give
different events for the same (ε, δ, c), so every caller must name the trainer's mode.

`calibrate` returns a frozen `Calibration`; its `to_dict()` is the JSON object `widedp
calibrate` prints (the keys of the dict `calibrate` used to return, in the same order).
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from scipy import optimize

from widedp.accounting import events as ev
from widedp.accounting.base import InvalidBoundError, UnsupportedEventError, make_accountant
from widedp.accounting.paper import advanced_composition



@dataclasses.dataclass(frozen=True)
class Calibration:
    """What `calibrate` found: the noise (and selection parameters) spending at most
    `target_epsilon` at `delta` over `steps` Poisson-sampled steps at `sample_rate`.

    Optional fields are None where a path does not produce them, and `to_dict()` leaves them
    out: `effective_noise_multiplier` (threshold selection with a tight accountant: the one
    Gaussian σ_eff that selection and noise compose to), and the paper accountant's `valid`,
    `violations`, `delta_prime`, `epsilon_seed_lemma_literal`, `seed_lemma_literal_note`.
    """

    noise_multiplier: float
    selection: str
    #: Read-only; keys per selection: em / noisy-max {epsilon_per_draw, k}; svt {epsilon, delta,
    #: max_answers, release_values}; threshold {noise_multiplier}; none / random {}.
    selection_params: Mapping[str, Any] = dataclasses.field(hash=False)
    selection_fraction: float
    epsilon: float
    target_epsilon: float
    delta: float
    sample_rate: float
    steps: int
    accountant: str
    effective_noise_multiplier: Optional[float] = None
    valid: Optional[bool] = None
    violations: Optional[tuple[str, ...]] = None
    delta_prime: Optional[float] = None
    epsilon_seed_lemma_literal: Optional[float] = None
    seed_lemma_literal_note: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "selection_params", MappingProxyType(dict(self.selection_params)))
        if self.violations is not None:
            object.__setattr__(self, "violations", tuple(self.violations))

    def to_dict(self) -> dict:
        """JSON-ready dict (plain dict / list values); optional fields only when set."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.default is None:
                continue
            if field.name == "selection_params":
                value = dict(value)
            elif field.name == "violations":
                value = list(value)
            out[field.name] = value
        return out


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
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps}")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta}")


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


def _selector(selection: str):
    """The registered selector for `selection`, or None for "none" (DP-SGD). Imported here, not
    at module level: the selectors import this module (`svt_event`)."""
    from widedp.selection.registry import NO_SELECTION, get_selector

    return None if selection == NO_SELECTION else get_selector(selection)


def _selection_from_rho(selector, rho: float, inputs):
    """(event, Calibration.selection_params) of a selector spending zCDP budget rho per
    (unsampled) step: `selector.from_budget`; a free selector (random, fest) spends nothing."""
    if selector is None:
        return None, {}
    if not selector.spends_per_step:
        return ev.NoOpDpEvent(), {}
    params = selector.from_budget(rho, inputs)
    return selector.event(params), selector.record(params)


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


def _bisect_increasing(f: Callable[[float], float], target: float, lo: float, hi: float,
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


def _check_selection_args(selector, fraction, inputs) -> None:
    if selector is None or not selector.spends_per_step:
        return
    if not (isinstance(fraction, (int, float)) and 0 < fraction < 1):
        raise ValueError(f"selection fraction must be in (0, 1) for selection {selector.name!r}, got {fraction}")
    selector.check_budget_inputs(inputs)


def calibrate(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    selection: str = "none",
    fraction: float = 0.0,
    accountant: str = "rdp",
    k: Optional[int] = None,
    max_answers: Optional[int] = None,
    selection_delta: Optional[float] = None,
    svt_release_values: bool = False,
    extra_history: Optional[list] = None,
    noise_event: Callable[[float], ev.DpEvent] = ev.GaussianDpEvent,
) -> Calibration:
    """Noise multiplier (and selector parameters) spending at most target_epsilon at delta.

    `noise_event`: σ ↦ the event of a step's noise (default the Gaussian; e.g. ModelMix's
    `lambda σ: ModelMixDpEvent(σ, w, k)`, which only the rdp accountant supports).

    `extra_history`: events charged besides the T steps (e.g. a one-time DP-FEST Gaussian).
    `svt_release_values`: NumericSparse mode for selection 'svt' (default False: selection-only,
    as the trainer runs it).

    Raises `UnreachableTargetError` (a ValueError naming `target_epsilon` and the smallest ε
    reachable) when even the least budget tried, `RHO_FLOOR`, spends more than the target."""
    check_run(sample_rate, steps, delta)
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target epsilon must be finite and > 0, got {target_epsilon}")
    from widedp.selection.registry import BudgetInputs

    selector = _selector(selection)
    selection_delta = delta if selection_delta is None else selection_delta
    inputs = BudgetInputs(k=k, max_answers=max_answers, delta=selection_delta, release_values=svt_release_values)
    _check_selection_args(selector, fraction, inputs)
    acc = make_accountant(accountant)
    if accountant == "paper":
        if noise_event is not ev.GaussianDpEvent:
            raise UnsupportedEventError("paper accountant: Theorem 3 covers Gaussian noise only")
        if extra_history:
            raise UnsupportedEventError("paper accountant: Theorem 3 covers only T identical steps")
        return _calibrate_paper(acc, target_epsilon, delta, sample_rate, steps, selection, fraction, k)
    sel_fraction = fraction if selector is not None and selector.spends_per_step else 0.0
    extra = list(extra_history or [])

    def build(rho):
        sel_event, params = _selection_from_rho(selector, sel_fraction * rho, inputs)
        sigma = 1.0 / math.sqrt(2.0 * (1.0 - sel_fraction) * rho)
        return sampled_step_event(sample_rate, noise_event(sigma), sel_event), sigma, params

    def spent(rho):
        return acc.epsilon(extra + [(build(rho)[0], steps)], delta)

    rho = _bisect_increasing(spent, target_epsilon, 1e-8, 1.0, floor=RHO_FLOOR)
    event, sigma, params = build(rho)
    return Calibration(
        noise_multiplier=sigma,
        selection=selection,
        selection_params=params,
        selection_fraction=sel_fraction,
        epsilon=acc.epsilon(extra + [(event, steps)], delta),
        target_epsilon=target_epsilon,
        delta=delta,
        sample_rate=sample_rate,
        steps=steps,
        accountant=accountant,
        # Set when selection and noise compose to one Gaussian (threshold selection).
        effective_noise_multiplier=(ev.gaussian_noise_multiplier(event.event)
                                    if isinstance(sel_event_of(event), ev.GaussianDpEvent) else None),
    )


def _invert_advanced_composition(target: float, k: int, delta: float) -> float:
    return _bisect_increasing(lambda e: advanced_composition(e, k, delta), target, 1e-12, 1.0)


def _paper_em(fE: float, k: int, delta_prime: float):
    eps = _invert_advanced_composition(fE, k, delta_prime) if k > 1 else fE
    return ev.ExponentialTopKDpEvent(eps, k), {"epsilon_per_draw": eps, "k": k}


def _paper_threshold(fE: float, k: int, delta_prime: float):
    s = math.sqrt(2 * math.log(1.25 / delta_prime)) / fE
    return ev.GaussianDpEvent(s), {"noise_multiplier": s}


#: Theorem 3 needs an (ε', δ')-DP selection: the paper calibration's own per-selector table (the
#: registry's `from_budget` speaks zCDP, which Theorem 3 does not use). Other spending
#: selectors are refused; free ones (random, fest) need no entry.
_PAPER_SELECTION = {"em": _paper_em, "em-count": _paper_em, "threshold": _paper_threshold, "fest-threshold": _paper_threshold}


def _calibrate_paper(acc, target_epsilon, delta, q, steps, selection, fraction, k) -> Calibration:
    selector = _selector(selection)
    spends = selector is not None and selector.spends_per_step
    if spends and selection not in _PAPER_SELECTION:
        raise UnsupportedEventError(f"paper calibration supports selection none, random, em, em-count, threshold, fest-threshold; got {selection!r}")
    f = fraction if spends else 0.0
    n_free = 1 if selector is None else 2  # Theorem 3 charges δ' to the noise and to the selection
    delta_prime = delta / (2.0 * steps * q * n_free)

    def build(E: float):
        sigma = math.sqrt(2 * math.log(1.25 / delta_prime)) / ((1 - f) * E)
        params: dict = {}
        sel: Optional[ev.DpEvent] = None if selector is None else ev.NoOpDpEvent()
        if spends:
            sel, params = _PAPER_SELECTION[selection](f * E, k, delta_prime)
        return step_event(q, sigma, sel), sigma, params

    # "epsilon" is Theorem 3 with the corrected amplification log(1 + q(e^E - 1)), not the seed's qE.
    E = _bisect_increasing(lambda E: acc.details([(build(E)[0], steps)], delta)["epsilon"], target_epsilon, 1e-9, 1.0)
    event, sigma, params = build(E)
    details = acc.details([(event, steps)], delta)
    return Calibration(
        noise_multiplier=sigma,
        selection=selection,
        selection_params=params,
        selection_fraction=f,
        epsilon=details["epsilon"],
        target_epsilon=target_epsilon,
        delta=delta,
        sample_rate=q,
        steps=steps,
        accountant="paper",
        valid=details["valid"],
        violations=details["violations"],
        delta_prime=details["delta_prime"],
        epsilon_seed_lemma_literal=details["epsilon_seed_lemma_literal"],
        seed_lemma_literal_note=details["seed_lemma_literal_note"],
    )


__all__ = ["Calibration", "UnreachableTargetError", "calibrate", "step_event", "svt_event", "InvalidBoundError"]
