"""Reduce a history to Gaussian-only pieces, for accountants that only know Gaussians.

Each history entry becomes (sampling probability q, σ_eff, count, group size k) when its event
is a Gaussian, a composition of Gaussians (σ_eff⁻² = Σσ_i⁻²), or a Poisson-sampled one; NoOp
entries vanish. A `GroupDpEvent(e, k)` (user-level DP by example sampling) is e's piece with
group size k — unsampled, the Gaussian of σ_eff/k (k = 1 then); sampled, (q, σ_eff, count, k),
the mixture of Gaussians that only accountants with `sampled_groups` compose (PLD). Anything
else raises UnsupportedEventError naming the event.

`gaussian_problem` is the structural twin used by the accountants' `supports` / `check`: it
walks types and parameters only (no ε), and `gaussian_pieces` succeeds exactly when it finds
no problem.

`merge_pieces` sums the counts of identical (q, σ, k) pieces (first-appearance order) before an
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


def gaussian_problem(event: ev.DpEvent, sampled_groups: bool = False) -> Optional[Unsupported]:
    """Structural: why `gaussian_pieces` would refuse the entry `event` (additive-δ events
    already split off), else None. `sampled_groups`: the accountant composes Poisson-sampled
    groups (mixtures of Gaussians)."""
    if type(event) is ev.GroupDpEvent:
        inner = event.event
        if type(inner) is ev.PoissonSampledDpEvent and not sampled_groups and event.group_size > 1:
            return Unsupported(event, "a Poisson-sampled group (user-level DP by example sampling) is a mixture of "
                                      "Gaussians: only the pld accountant composes it (privacy.accountant = pld or auto)")
        if type(inner) is ev.GroupDpEvent:
            return Unsupported(event, "a group of groups: give one GroupDpEvent with the product of the sizes")
        return gaussian_problem(inner, sampled_groups)
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


Piece = tuple[float, float, int, int]  # (q, σ, count, group size k)


def gaussian_pieces(history: History, accountant: str, sampled_groups: bool = False) -> list[Piece]:
    pieces: list[Piece] = []
    for event, count in history:
        problem = gaussian_problem(event, sampled_groups)
        if problem is not None:
            raise UnsupportedEventError(f"{accountant} accountant: {problem.reason}", accountant=accountant,
                                        event=problem.event)
        group = 1
        if isinstance(event, ev.GroupDpEvent):
            group, event = int(event.group_size), event.event
        q, inner = 1.0, event
        if isinstance(event, ev.PoissonSampledDpEvent):
            q, inner = float(event.sampling_probability), event.event
        sigma = ev.gaussian_noise_multiplier(inner)
        # gaussian_problem(event) found no problem, so `inner` reduces to one Gaussian (or a NoOp).
        assert sigma is not None
        if math.isinf(sigma) or q == 0:
            continue  # no-op
        if q == 1.0 and group > 1:  # unsampled: every member is in, the mean moves by ≤ k
            sigma, group = sigma / group, 1
        pieces.append((q, sigma, int(count), group))
    return pieces


def merge_pieces(pieces: list[Piece]) -> list[Piece]:
    """`pieces` with identical (q, σ, k) merged: counts summed, in the order of first appearance.

    Sound because composition is commutative: the composed privacy loss of a multiset of
    mechanisms does not depend on their order, so the history reordered and grouped has the
    same privacy curve (and the same ε under every accountant composing these pieces)."""
    merged: dict[tuple[float, float, int], int] = {}
    for q, sigma, count, group in pieces:
        merged[(q, sigma, group)] = merged.get((q, sigma, group), 0) + int(count)
    return [(q, sigma, count, group) for (q, sigma, group), count in merged.items()]


class GaussianReducibleAccountant(Accountant):
    """Base of the accountants that compose Poisson-sampled Gaussian pieces (pld, prv).

    It owns the part they share: the structural check (additive-δ events only at the top level,
    everything else Gaussian-reducible), the additive-δ split (their Gaussian part composed,
    their δ taken out of the target; ε = inf when nothing is left), the merge of identical
    pieces (`merge_pieces`). A subclass gives `pieces_epsilon(pieces, delta)` for the (q, σ,
    count) pieces at the remaining δ, each (q, σ) once.
    """

    #: Whether `pieces_epsilon` composes Poisson-sampled groups (pieces with k > 1).
    sampled_groups = False

    def _event_problem(self, event: ev.DpEvent) -> Optional[Unsupported]:
        return misplaced_additive_delta(event) or gaussian_problem(split_event(event, self.name)[0],
                                                                   self.sampled_groups)

    def epsilon(self, history: History, delta: float) -> float:
        delta = check_delta(delta)
        self.check(history)
        history, additive_delta = split_additive_delta(history, self.name)
        pieces = merge_pieces(gaussian_pieces(history, self.name, self.sampled_groups))
        rest = remaining_delta(delta, additive_delta)
        if rest is None:
            return math.inf
        return self.pieces_epsilon(pieces, rest)

    @abc.abstractmethod
    def pieces_epsilon(self, pieces: list[Piece], delta: float) -> float:
        """ε of the Poisson-sampled Gaussian pieces (q, σ, count, k) at δ (k = 1 unless
        `sampled_groups`)."""
