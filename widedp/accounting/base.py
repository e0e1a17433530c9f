"""The accountant interface and registry.

An accountant turns a history of privacy events — a list of (event, count) pairs — into ε at a
given δ, for its `neighboring_relation` (ours: add/remove one). It raises
`UnsupportedEventError` for anything it cannot bound soundly: never a guess, never an
under-estimate.

The contract, modelled on dp_accounting's `PrivacyAccountant` (`supports` via
`_maybe_compose(..., do_compose=False)`):

- `supports(event)` / `check(history)` are **structural**: they look at types, nesting and the
  validity of parameters (a probability in [0, 1], a noise multiplier ≥ 0, ...) and never
  compute ε, so they are cheap (the ledger calls `check` on every `record`).
  `supports(event)` is True iff `check([(event, 1)])` passes.
- `epsilon` / `details` run `check` first: an unsupported history raises
  `UnsupportedEventError` there too, and a supported one never does.
- What only a computation can tell — the validity conditions of a closed-form bound at this δ
  (the paper accountant: Lemma 3's ε_g < 1, ε̃ ≤ 1/√T, the δ budget left for δ') — stays in
  `epsilon` / `details` and raises `InvalidBoundError` (or is reported in `details`).
- An event stated for another neighbouring relation than the accountant's (a class-level
  `neighboring_relation`, see `accounting.events`) is unsupported, wherever it is nested.
"""

from __future__ import annotations

import abc
from typing import Optional, Sequence

import attr

from widedp.accounting import events as ev
from widedp.accounting.events import DpEvent, NeighboringRelation

History = Sequence[tuple[DpEvent, int]]


class UnsupportedEventError(ValueError):
    """The accountant cannot bound this event (or this combination) soundly.

    `accountant` (its name) and `event` (the offending event, possibly nested inside a history
    entry; None for a property of the whole history) are set when raised by `Accountant.check`."""

    def __init__(self, message: str, *, accountant: Optional[str] = None, event: Optional[DpEvent] = None):
        super().__init__(message)
        self.accountant = accountant
        self.event = event


class InvalidBoundError(ValueError):
    """The bound's validity conditions do not hold for these parameters."""


@attr.s(frozen=True, slots=True, auto_attribs=True)
class Unsupported:
    """Why an accountant refuses a history (like dp_accounting's CompositionErrorDetails):
    the offending event (a nested one where that is the culprit; None for a property of the
    whole history) and the reason, a sentence naming the offending event's type."""

    event: Optional[DpEvent]
    reason: str


class Accountant(abc.ABC):
    """Composes a history of events; stateless, so one instance serves many ledgers.

    Subclasses set `name`, implement `epsilon` (calling `check` first) and the structural
    `_event_problem`, and override `_history_problem` where a property of the whole history
    matters (the paper accountant's "T identical steps")."""

    name: str = ""
    #: The neighbouring relation this accountant's bounds are stated for (dp_accounting's enum).
    neighboring_relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE

    @abc.abstractmethod
    def epsilon(self, history: History, delta: float) -> float:
        """Smallest ε this accountant can certify for the composed history at δ."""

    @abc.abstractmethod
    def _event_problem(self, event: DpEvent) -> Optional[Unsupported]:
        """Structural: why `event`, as one entry at the top level of a history, cannot be
        accounted (None if it can). Types, nesting, parameters' validity only; no ε."""

    def _history_problem(self, history: History) -> Optional[Unsupported]:
        """Structural property of the whole history (default: none); entries already passed."""
        return None

    def unsupported(self, history: History) -> Optional[tuple[Optional[DpEvent], Unsupported]]:
        """(history entry's event, why) for the first entry this accountant cannot account, or
        (None, why) for a property of the whole history; None if `history` is supported."""
        for event, _count in history:
            problem = self._structural_problem(event)
            if problem is not None:
                return event, problem
        problem = self._history_problem(history)
        return None if problem is None else (None, problem)

    def supports(self, event: DpEvent) -> bool:
        """Whether `event` (applied once, on its own) can be accounted; structural, no ε."""
        return self.unsupported([(event, 1)]) is None

    def check(self, history: History) -> None:
        """Raise UnsupportedEventError, naming this accountant and the offending event type, if
        `history` cannot be accounted. Structural: no ε is computed."""
        found = self.unsupported(history)
        if found is None:
            return
        entry, problem = found
        if problem.event is None:
            message = f"{self.name} accountant: {problem.reason}"
        else:
            where = "" if problem.event is entry else f" (inside {type(entry).__name__})"
            message = f"{self.name} accountant does not support {type(problem.event).__name__}{where}: {problem.reason}"
        raise UnsupportedEventError(message, accountant=self.name, event=problem.event)

    def details(self, history: History, delta: float) -> dict:
        """ε plus accountant-specific diagnostics (for the CLI's JSON)."""
        return {"epsilon": self.epsilon(history, delta)}

    def _structural_problem(self, event) -> Optional[Unsupported]:
        if not isinstance(event, DpEvent):
            return Unsupported(None, f"history entries must hold DpEvents, got {type(event).__name__}")
        for sub in ev.walk(event):
            relation = ev.relation_of(sub)
            if relation is not None and relation != self.neighboring_relation:
                return Unsupported(sub, f"{type(sub).__name__} is stated for the {relation.name} neighbouring relation; "
                                        f"this accountant's bounds are for {self.neighboring_relation.name}")
        return self._event_problem(event)


# ---- parameter validity (structural) ------------------------------------------------------------

def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def probability_problem(event: DpEvent, value, name: str, allow_zero: bool = True) -> Optional[Unsupported]:
    """Unsupported unless `value` is a real number in [0, 1] ((0, 1] when not allow_zero)."""
    ok = _is_real(value) and (0 <= value if allow_zero else 0 < value) and value <= 1
    if ok:
        return None
    interval = "[0, 1]" if allow_zero else "(0, 1]"
    return Unsupported(event, f"{type(event).__name__}.{name} must be a number in {interval}, got {value!r}")


def nonnegative_problem(event: DpEvent, value, name: str, positive: bool = False) -> Optional[Unsupported]:
    """Unsupported unless `value` is a real number ≥ 0 (> 0 when positive); +inf allowed, NaN not."""
    ok = _is_real(value) and (value > 0 if positive else value >= 0)
    if ok:
        return None
    return Unsupported(event, f"{type(event).__name__}.{name} must be a number {'> 0' if positive else '>= 0'}, "
                              f"got {value!r}")


def count_problem(event: DpEvent, value, name: str = "count") -> Optional[Unsupported]:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return None
    return Unsupported(event, f"{type(event).__name__}.{name} must be an integer >= 0, got {value!r}")


def check_delta(delta: float) -> float:
    if not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return float(delta)


def split_additive_delta(history: History, accountant: str) -> tuple[list[tuple[DpEvent, int]], float]:
    """(history with each additive-δ event replaced by its Gaussian part, total additive δ).

    Events with an additive δ (`events.ADDITIVE_DELTA_EVENTS`, e.g.
    `GaussianPartitionSelectionDpEvent`) are a Gaussian mechanism except on an event of
    probability ≤ δ_add that is independent of the Gaussian's noise, so the whole history is
    (ε, δ_rest(ε) + Σ count·δ_add)-DP, δ_rest the privacy curve of the history with the
    Gaussian parts in their place (see the event's docstring for the proof). Accountants
    therefore compose the returned history at δ - total and report ε = inf when the total is
    ≥ δ (no finite ε can be certified then; `remaining_delta` returns None).

    Allowed at the top level of the history, also inside ComposedDpEvent / SelfComposedDpEvent
    there (their δ's add up). Inside any other wrapper — PoissonSampledDpEvent above all: the
    additive δ would need amplification too — raises UnsupportedEventError naming `accountant`.
    Entries without such events are returned unchanged (same objects).
    """
    out: list[tuple[DpEvent, int]] = []
    total = 0.0
    for event, count in history:
        reduced, add = split_event(event, accountant)
        out.append((reduced, count))
        total += int(count) * add
    return out, total


def remaining_delta(delta: float, additive_delta: float):
    """δ left for the Gaussian-reducible part after the additive δ; None when nothing is left."""
    rest = delta - additive_delta
    return rest if rest > 0 else None


def misplaced_additive_delta(event: DpEvent) -> Optional[Unsupported]:
    """Structural twin of `split_additive_delta`'s refusal: an additive-δ event nested anywhere
    but the top level of a history entry or inside top-level Composed/SelfComposed events."""
    if isinstance(event, ev.ADDITIVE_DELTA_EVENTS):
        return None
    if isinstance(event, ev.ComposedDpEvent):
        for sub in event.events:
            problem = misplaced_additive_delta(sub)
            if problem is not None:
                return problem
        return None
    if isinstance(event, ev.SelfComposedDpEvent):
        return misplaced_additive_delta(event.event)
    nested = _nested_additive_delta_event(event)
    if nested is None:
        return None
    return Unsupported(nested, _misplaced_reason(nested, event))


def _misplaced_reason(nested: DpEvent, wrapper: DpEvent) -> str:
    return (f"{type(nested).__name__} must be applied once to the whole data set (top level of the history); "
            f"found inside {type(wrapper).__name__}, where its additive δ would need amplification")


def split_event(event: DpEvent, accountant: str) -> tuple[DpEvent, float]:
    if isinstance(event, ev.ADDITIVE_DELTA_EVENTS):
        return ev.GaussianDpEvent(event.noise_multiplier), float(event.unseen_delta)
    if isinstance(event, ev.ComposedDpEvent):
        parts = [split_event(sub, accountant) for sub in event.events]
        total = sum(add for _, add in parts)
        return (ev.ComposedDpEvent([sub for sub, _ in parts]) if total else event), total
    if isinstance(event, ev.SelfComposedDpEvent):
        sub, add = split_event(event.event, accountant)
        return (ev.SelfComposedDpEvent(sub, event.count) if add else event), event.count * add
    nested = _nested_additive_delta_event(event)
    if nested is not None:
        raise UnsupportedEventError(f"{accountant} accountant: {_misplaced_reason(nested, event)}",
                                    accountant=accountant, event=nested)
    return event, 0.0


def _nested_additive_delta_event(event: DpEvent):
    """The first additive-δ event anywhere inside `event` (any wrapper type), else None."""
    return next((sub for sub in ev.walk(event) if isinstance(sub, ev.ADDITIVE_DELTA_EVENTS)), None)


ACCOUNTANTS: dict[str, type[Accountant]] = {}


def register(cls: type[Accountant]) -> type[Accountant]:
    """Class decorator: make `cls` available to `make_accountant(cls.name)`.

    Refuses (ValueError naming it) a name already taken by another class: a silent overwrite
    would change which bound every ledger, CLI call and calibration under that name computes.
    Registering the very same class object again is a no-op (idempotent)."""
    if not (isinstance(cls, type) and issubclass(cls, Accountant)):
        raise TypeError(f"register() needs an Accountant subclass, got {cls!r}")
    name = cls.name
    if not (isinstance(name, str) and name):
        raise ValueError(f"accountant class {cls.__qualname__} needs a non-empty `name` to be registered")
    existing = ACCOUNTANTS.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"accountant name {name!r} is already registered to {existing.__module__}.{existing.__qualname__}; "
                         f"refusing to overwrite it with {cls.__module__}.{cls.__qualname__} (choose another name)")
    ACCOUNTANTS[name] = cls
    return cls


def _import_accountants() -> None:
    # Import for registration side effects (each accountant lives in its own module).
    from widedp.accounting import auto, paper, pld, prv, rdp  # noqa: F401


def accountant_names() -> tuple[str, ...]:
    """The registered accountants' names (sorted)."""
    _import_accountants()
    return tuple(sorted(ACCOUNTANTS))


def make_accountant(name: str, **kwargs) -> Accountant:
    _import_accountants()

    if name not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {name!r}; choose one of {sorted(ACCOUNTANTS)}")
    return ACCOUNTANTS[name](**kwargs)
