"""Reduce a history to Gaussian-only pieces, for accountants that only know Gaussians.

Each history entry becomes (sampling probability q, σ_eff, count) when its event is a
Gaussian, a composition of Gaussians (σ_eff⁻² = Σσ_i⁻²), or a Poisson-sampled one; NoOp
entries vanish. Anything else raises UnsupportedEventError naming the event.

`gaussian_problem` is the structural twin used by the accountants' `supports` / `check`: it
walks types and parameters only (no ε), and `gaussian_pieces` succeeds exactly when it finds
no problem.

`merge_pieces` sums the counts of identical (q, σ) pieces (first-appearance order) before an
accountant composes them: composition is commutative, so ε is unchanged, and a history written
as T separate (event, 1) entries costs what one (event, T) entry does (PLD and PRV build one
distribution per piece and self-compose it, instead of T convolutions).
"""

from __future__ import annotations

import abc
import math
from typing import Optional

from widedp.accounting import events as ev
from widedp.accounting.base import (Accountant, History, Unsupported, UnsupportedEventError, split_event, check_delta,
                             count_problem, misplaced_additive_delta, nonnegative_problem, probability_problem,
                             remaining_delta, split_additive_delta)

_NOT_REDUCIBLE = ("only Gaussian-reducible steps are supported (a Gaussian, compositions of Gaussians, "
                  "Poisson-sampled ones); {name} is not ({event!r}). Use --accountant rdp for this selection.")


def _reducible_problem(event: ev.DpEvent) -> Optional[Unsupported]:
    """Why `event` (unsampled) does not reduce to one Gaussian with valid parameters, else None."""
    if type(event) is ev.GaussianDpEvent:  # exact types: a subclass may mean another mechanism
        return nonnegative_problem(event, event.noise_multiplier, "noise_multiplier")
    if type(event) is ev.NoOpDpEvent:
        return None
    if type(event) is ev.ComposedDpEvent and isinstance(event.events, (list, tuple)):
        return next((p for p in map(_reducible_problem, event.events) if p is not None), None)
    if type(event) is ev.SelfComposedDpEvent:
        return count_problem(event, event.count) or _reducible_problem(event.event)
    return Unsupported(event, _NOT_REDUCIBLE.format(name=type(event).__name__, event=event))


def gaussian_problem(event: ev.DpEvent) -> Optional[Unsupported]:
    """Structural: why `gaussian_pieces` would refuse the entry `event` (additive-δ events
    already split off), else None."""
    q, inner = 1.0, event
    if type(event) is ev.PoissonSampledDpEvent:
        problem = probability_problem(event, event.sampling_probability, "sampling_probability")
        if problem is not None:
            return problem
        q, inner = event.sampling_probability, event.event
    problem = _reducible_problem(inner)
    if problem is not None:
        return problem
    sigma = ev.gaussian_noise_multiplier(inner)  # a closed-form reduction of parameters, not an ε
    if sigma == 0 and q != 0:
        zero = next((e for e in ev.walk(inner) if isinstance(e, ev.GaussianDpEvent) and e.noise_multiplier == 0), inner)
        return Unsupported(zero, "noise multiplier 0 is not private")
    return None


def gaussian_pieces(history: History, accountant: str) -> list[tuple[float, float, int]]:
    pieces: list[tuple[float, float, int]] = []
    for event, count in history:
        problem = gaussian_problem(event)
        if problem is not None:
            raise UnsupportedEventError(f"{accountant} accountant: {problem.reason}", accountant=accountant,
                                        event=problem.event)
        q, inner = 1.0, event
        if isinstance(event, ev.PoissonSampledDpEvent):
            q, inner = float(event.sampling_probability), event.event
        sigma = ev.gaussian_noise_multiplier(inner)
        # gaussian_problem(event) found no problem, so `inner` reduces to one Gaussian (or a NoOp).
        assert sigma is not None
        if math.isinf(sigma) or q == 0:
            continue  # no-op
        pieces.append((q, sigma, int(count)))
    return pieces


def merge_pieces(pieces: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """`pieces` with identical (q, σ) merged: counts summed, in the order of first appearance.

    Sound because composition is commutative: the composed privacy loss of a multiset of
    mechanisms does not depend on their order, so the history reordered and grouped has the
    same privacy curve (and the same ε under every accountant composing these pieces)."""
    merged: dict[tuple[float, float], int] = {}
    for q, sigma, count in pieces:
        merged[(q, sigma)] = merged.get((q, sigma), 0) + int(count)
    return [(q, sigma, count) for (q, sigma), count in merged.items()]


class GaussianReducibleAccountant(Accountant):
    """Base of the accountants that compose Poisson-sampled Gaussian pieces (pld, prv).

    It owns the part they share: the structural check (additive-δ events only at the top level,
    everything else Gaussian-reducible), the additive-δ split (their Gaussian part composed,
    their δ taken out of the target; ε = inf when nothing is left), the merge of identical
    pieces (`merge_pieces`). A subclass gives `pieces_epsilon(pieces, delta)` for the (q, σ,
    count) pieces at the remaining δ, each (q, σ) once.
    """

    def _event_problem(self, event: ev.DpEvent) -> Optional[Unsupported]:
        return misplaced_additive_delta(event) or gaussian_problem(split_event(event, self.name)[0])

    def epsilon(self, history: History, delta: float) -> float:
        delta = check_delta(delta)
        self.check(history)
        history, additive_delta = split_additive_delta(history, self.name)
        pieces = merge_pieces(gaussian_pieces(history, self.name))
        rest = remaining_delta(delta, additive_delta)
        if rest is None:
            return math.inf
        return self.pieces_epsilon(pieces, rest)

    @abc.abstractmethod
    def pieces_epsilon(self, pieces: list[tuple[float, float, int]], delta: float) -> float:
        """ε of the Poisson-sampled Gaussian pieces (q, σ, count) at δ."""
