"""The accountant interface and registry.

An accountant turns a history of privacy events — a list of (event, count) pairs, all under
the add/remove-one neighbouring relation — into ε at a given δ. It raises
`UnsupportedEventError` for anything it cannot bound soundly: never a guess, never an
under-estimate.
"""

from __future__ import annotations

import abc
from typing import Sequence

import attr

from accounting import events as ev
from accounting.events import DpEvent

History = Sequence[tuple[DpEvent, int]]


class UnsupportedEventError(ValueError):
    """The accountant cannot bound this event (or this combination) soundly."""


class InvalidBoundError(ValueError):
    """The bound's validity conditions do not hold for these parameters."""


class Accountant(abc.ABC):
    """Composes a history of events; stateless, so one instance serves many ledgers."""

    name: str = ""

    @abc.abstractmethod
    def epsilon(self, history: History, delta: float) -> float:
        """Smallest ε this accountant can certify for the composed history at δ."""

    def check(self, history: History) -> None:
        """Raise UnsupportedEventError if `history` cannot be accounted (default: try it)."""
        self.epsilon(history, 0.5)

    def details(self, history: History, delta: float) -> dict:
        """ε plus accountant-specific diagnostics (for the CLI's JSON)."""
        return {"epsilon": self.epsilon(history, delta)}


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
        reduced, add = _split_event(event, accountant)
        out.append((reduced, count))
        total += int(count) * add
    return out, total


def remaining_delta(delta: float, additive_delta: float):
    """δ left for the Gaussian-reducible part after the additive δ; None when nothing is left."""
    rest = delta - additive_delta
    return rest if rest > 0 else None


def _split_event(event: DpEvent, accountant: str) -> tuple[DpEvent, float]:
    if isinstance(event, ev.ADDITIVE_DELTA_EVENTS):
        return ev.GaussianDpEvent(event.noise_multiplier), float(event.unseen_delta)
    if isinstance(event, ev.ComposedDpEvent):
        parts = [_split_event(sub, accountant) for sub in event.events]
        total = sum(add for _, add in parts)
        return (ev.ComposedDpEvent([sub for sub, _ in parts]) if total else event), total
    if isinstance(event, ev.SelfComposedDpEvent):
        sub, add = _split_event(event.event, accountant)
        return (ev.SelfComposedDpEvent(sub, event.count) if add else event), event.count * add
    nested = _nested_additive_delta_event(event)
    if nested is not None:
        raise UnsupportedEventError(
            f"{accountant} accountant: {type(nested).__name__} must be applied once to the whole data set "
            f"(top level of the history); found inside {type(event).__name__}, where its additive δ "
            f"would need amplification")
    return event, 0.0


def _nested_additive_delta_event(event: DpEvent):
    """The first additive-δ event anywhere inside `event` (any wrapper type), else None."""
    if isinstance(event, ev.ADDITIVE_DELTA_EVENTS):
        return event
    if not attr.has(type(event)):
        return None
    for field in attr.fields(type(event)):
        value = getattr(event, field.name)
        for sub in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(sub, DpEvent):
                found = _nested_additive_delta_event(sub)
                if found is not None:
                    return found
    return None


ACCOUNTANTS: dict[str, type[Accountant]] = {}


def register(cls: type[Accountant]) -> type[Accountant]:
    ACCOUNTANTS[cls.name] = cls
    return cls


def make_accountant(name: str, **kwargs) -> Accountant:
    # Import for registration side effects (each accountant lives in its own module).
    from accounting import paper, pld, prv, rdp  # noqa: F401

    if name not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {name!r}; choose one of {sorted(ACCOUNTANTS)}")
    return ACCOUNTANTS[name](**kwargs)
