"""A sparse step calibrated to a target ε: the selector registry's builder for
`accounting.calibrate`, and the `Calibration` record that `widedp calibrate` prints.

`accounting.calibrate(build_event, ε, δ, ...)` knows no selector: it finds the least σ for any
σ ↦ event. This module supplies the event of an Algorithm 3 step from a registered selector
(`SplitStep`): a step PoissonSampled(q, Composed([selection, noise])) under add/remove-one,
whose per-step zCDP budget ρ = 1/(2σ²) — what one Gaussian of noise multiplier σ spends at ℓ2
sensitivity 1 — is split, `fraction` f to the selection and 1 − f to the noise:
  noise (Gaussian):     ρ_noise = (1 − f)ρ, σ_noise = σ/√(1 − f)
  selection:            `selector.from_budget(fρ, inputs)`, e.g.
    exponential top-k:    ρ = k·ε''²/8     (ε''-bounded range per draw)
    noisy-max (Laplace):  ρ = k·ε²/2       (pure ε-DP per round)
    sparse vector:        ρ = c·ε_round²/2 (pure ε_round-DP per round)
    Gaussian threshold:   ρ = 1/(2σ_sel²)  ⇒ σ_sel⁻² + σ_noise⁻² = σ⁻², one Gaussian
A selector that spends nothing per step (random, fest) gets f = 0, and "none" (DP-SGD) is the
Gaussian alone. `calibrate` (the trainer's `plan_privacy` and `widedp calibrate` both call it,
so they find the same σ) hands that builder to `accounting.calibrate`, so for every accountant
the total ρ is found by bisection on the accountant's own ε and the result spends exactly (to
tolerance, never above) the target, or raises `accounting.calibration.UnreachableTargetError`.

The `paper` accountant splits the per-step ε of Theorem 3 instead (ε' = fE, ε_g = (1-f)E) and
calibrates to its reported `epsilon`: Theorem 3 with the corrected amplification
log(1 + q(e^E - 1)) (see accounting/paper.py), never the seed's literal Lemma 1 (qE), which
under-counts; the literal value of the result is returned alongside, flagged. Theorem 3 needs
(ε', δ')-DP selections, not zCDP, so that path keeps its own small table (`_PAPER_SELECTION`).

`calibrate` returns a frozen `Calibration`; its `to_dict()` is the JSON object `widedp
calibrate` prints (the keys of the dict `calibrate` used to return, in the same order).
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from widedp.accounting import events as ev
from widedp.accounting import calibration as cal
from widedp.accounting.base import UnsupportedEventError, make_accountant
from widedp.selection.registry import NO_SELECTION, BudgetInputs, Selector, get_selector


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What `calibrate` found: the noise (and selection parameters) spending at most
    `target_epsilon` at `delta` over `steps` Poisson-sampled steps at `sample_rate`.

    Optional fields are None where a path does not produce them, and `to_dict()` leaves them
    out: `effective_noise_multiplier` (threshold selection with a tight accountant: the one
    Gaussian σ_eff that selection and noise compose to), and the paper accountant's `valid`,
    `violations`, `delta_prime`, `epsilon_seed_lemma_literal`, `seed_lemma_literal_note`;
    `accountant_used`: the accountant the "auto" accountant resolved to ("pld" or "rdp").
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
    accountant_used: Optional[str] = None

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


@dataclasses.dataclass(frozen=True)
class SplitStep:
    """σ ↦ the event of one Algorithm 3 step spending what Gaussian(σ) spends, split between the
    selection and the noise (module docstring): the `build_event` `accounting.calibrate` takes.

    `selector` None is DP-SGD; `fraction` is ignored (0) for a selector that spends nothing per
    step; `noise_event`: σ_noise ↦ the event of the step's noise (default the Gaussian; e.g.
    ModelMix's `lambda σ: ModelMixDpEvent(σ, w, k)`, or an adaptive clip's counts with it)."""

    selector: Optional[Selector]
    fraction: float
    inputs: BudgetInputs
    sample_rate: float
    noise_event: Callable[[float], ev.DpEvent] = ev.GaussianDpEvent

    def __post_init__(self):
        selector = self.selector
        if selector is not None and selector.spends_per_step:
            if not (isinstance(self.fraction, (int, float)) and 0 < self.fraction < 1):
                raise ValueError(f"selection fraction must be in (0, 1) for selection {selector.name!r}, "
                                 f"got {self.fraction}")
            selector.check_budget_inputs(self.inputs)

    @property
    def selection_fraction(self) -> float:
        return self.fraction if self.selector is not None and self.selector.spends_per_step else 0.0

    def parts(self, sigma: float) -> tuple[ev.DpEvent, float, dict]:
        """(the step's event, σ_noise, `Calibration.selection_params`) at total σ."""
        f = self.selection_fraction
        sel_event: Optional[ev.DpEvent] = None
        params: dict = {}
        if self.selector is not None and self.selector.spends_per_step:
            chosen = self.selector.from_budget(f / (2.0 * sigma * sigma), self.inputs)
            sel_event, params = self.selector.event(chosen), self.selector.record(chosen)
        elif self.selector is not None:  # a free selector (random, fest): its step's selection is data independent
            sel_event = ev.NoOpDpEvent()
        sigma_noise = sigma / math.sqrt(1.0 - f)
        return cal.sampled_step_event(self.sample_rate, self.noise_event(sigma_noise), sel_event), sigma_noise, params

    def __call__(self, sigma: float) -> ev.DpEvent:
        return self.parts(sigma)[0]


def step_builder(selection: str, fraction: float, sample_rate: float, *, k: Optional[int] = None,
                 max_answers: Optional[int] = None, selection_delta: float = 0.0, svt_release_values: bool = False,
                 noise_event: Callable[[float], ev.DpEvent] = ev.GaussianDpEvent) -> SplitStep:
    """The `SplitStep` of the registered selector `selection` ("none": DP-SGD), its budget
    inputs checked (`fraction` in (0, 1) for a selector that spends per step)."""
    selector = None if selection == NO_SELECTION else get_selector(selection)
    inputs = BudgetInputs(k=k, max_answers=max_answers, delta=selection_delta, release_values=svt_release_values)
    return SplitStep(selector, fraction, inputs, sample_rate, noise_event)


def calibrate(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    selection: str = NO_SELECTION,
    fraction: float = 0.0,
    accountant: str = "auto",
    k: Optional[int] = None,
    max_answers: Optional[int] = None,
    selection_delta: Optional[float] = None,
    svt_release_values: bool = False,
    extra_history: Optional[list] = None,
    noise_event: Callable[[float], ev.DpEvent] = ev.GaussianDpEvent,
    group_size: int = 1,
    unit_history: Optional[list] = None,
) -> Calibration:
    """Noise multiplier (and selector parameters) spending at most target_epsilon at delta over
    `steps` steps of `selection` at `sample_rate` (`SplitStep`, through `accounting.calibrate`).

    `noise_event`: σ ↦ the event of a step's noise (default the Gaussian; e.g. ModelMix's
    `lambda σ: ModelMixDpEvent(σ, w, k)`, which only the rdp accountant supports).

    `extra_history`: events charged besides the T steps (e.g. a one-time DP-FEST Gaussian).
    `svt_release_values`: NumericSparse mode for selection 'svt' (default False: selection-only,
    as the trainer runs it). `selection_delta`: SVT's δ (default `delta`). `group_size` k > 1:
    every event (the steps and `extra_history`) accounted for groups of k examples
    (`accounting.events.GroupDpEvent`: user-level DP by example sampling). `unit_history`:
    events charged as they are whatever `group_size` (their mechanisms already bound one
    whole group, e.g. per-user data statistics).

    Raises `UnreachableTargetError` (a ValueError naming `target_epsilon` and the smallest ε
    reachable) when even the least budget tried, `RHO_FLOOR`, spends more than the target."""
    cal.check_run(sample_rate, steps, delta)
    cal.check_target(target_epsilon)
    step = step_builder(selection, fraction, sample_rate, k=k, max_answers=max_answers,
                        selection_delta=delta if selection_delta is None else selection_delta,
                        svt_release_values=svt_release_values, noise_event=noise_event)
    acc = make_accountant(accountant)
    if accountant == "paper":
        if noise_event is not ev.GaussianDpEvent:
            raise UnsupportedEventError("paper accountant: Theorem 3 covers Gaussian noise only")
        if extra_history or unit_history:
            raise UnsupportedEventError("paper accountant: Theorem 3 covers only T identical steps")
        return _calibrate_paper(acc, target_epsilon, delta, sample_rate, steps, step.selector, selection, fraction, k)
    if group_size != 1 and accountant == "paper":
        raise UnsupportedEventError("paper accountant: Theorem 3 covers one example, not groups")
    extra = [(ev.grouped(e, group_size), c) for e, c in (extra_history or [])] + list(unit_history or [])
    sigma_total, spent = cal.calibrate_with_epsilon(lambda s: ev.grouped(step(s), group_size), target_epsilon, delta,
                                                    accountant=acc, steps=steps, extra_history=extra)
    event, sigma, params = step.parts(sigma_total)  # `step(sigma_total)` is the event whose ε was `spent`
    return Calibration(
        noise_multiplier=sigma,
        selection=selection,
        selection_params=params,
        selection_fraction=step.selection_fraction,
        epsilon=spent,
        target_epsilon=target_epsilon,
        delta=delta,
        sample_rate=sample_rate,
        steps=steps,
        accountant=accountant,
        # Set when selection and noise compose to one Gaussian (threshold selection).
        effective_noise_multiplier=(ev.gaussian_noise_multiplier(event.event)
                                    if isinstance(cal.sel_event_of(event), ev.GaussianDpEvent) else None),
        accountant_used=_accountant_used(acc, extra + [(event, steps)]),
    )


def _accountant_used(acc, history) -> Optional[str]:
    """The accountant "auto" resolved to for `history` (None for any other accountant)."""
    from widedp.accounting.auto import AutoAccountant  # dp_accounting loads with it: only when calibrating

    return acc.resolve(history) if isinstance(acc, AutoAccountant) else None


def _paper_em(fE: float, k: int, delta_prime: float):
    eps = cal.invert_advanced_composition(fE, k, delta_prime) if k > 1 else fE
    return ev.ExponentialTopKDpEvent(eps, k), {"epsilon_per_draw": eps, "k": k}


def _paper_threshold(fE: float, k: int, delta_prime: float):
    s = math.sqrt(2 * math.log(1.25 / delta_prime)) / fE
    return ev.GaussianDpEvent(s), {"noise_multiplier": s}


#: Theorem 3 needs an (ε', δ')-DP selection: the paper calibration's own per-selector table (the
#: registry's `from_budget` speaks zCDP, which Theorem 3 does not use). Other spending
#: selectors are refused; free ones (random, fest) need no entry.
_PAPER_SELECTION = {"em": _paper_em, "em-count": _paper_em, "threshold": _paper_threshold, "fest-threshold": _paper_threshold}


def _calibrate_paper(acc, target_epsilon, delta, q, steps, selector, selection, fraction, k) -> Calibration:
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
        return cal.step_event(q, sigma, sel), sigma, params

    # "epsilon" is Theorem 3 with the corrected amplification log(1 + q(e^E - 1)), not the seed's qE.
    E = cal.bisect_increasing(lambda E: acc.details([(build(E)[0], steps)], delta)["epsilon"], target_epsilon, 1e-9, 1.0)
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


__all__ = ["Calibration", "SplitStep", "calibrate", "step_builder"]
