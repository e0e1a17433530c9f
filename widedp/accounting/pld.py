"""Privacy-loss-distribution accountant (dp_accounting's PLD) for Gaussian-reducible steps.

Add/remove-one neighbours. Steps whose events reduce to one (Poisson-sampled) Gaussian —
plain DP-SGD, sparse steps with Gaussian thresholding, DP-FEST — are composed exactly up to
PLD discretization (pessimistic rounding, so never an under-estimate). Other selectors
raise UnsupportedEventError. Events with an additive δ (Gaussian partition selection, top
level only) contribute their Gaussian part here and their δ is subtracted from the target
(`base.split_additive_delta`); ε = inf when nothing is left. `supports` / `check` are
structural (`gaussian_reduction.gaussian_problem` after the additive-δ split).

Poisson-sampled groups (`GroupDpEvent(PoissonSampledDpEvent(q, Gaussian(σ)), k)`: user-level
DP by example sampling, each of a user's ≤ k examples sampled on its own) are composed as
their dominating pair, the mixture Σ_j Binom(j; k, q)·N(j, σ²) against N(0, σ²) (Ganesh 2024,
Thm. 3.1), by dp_accounting's `from_mixture_gaussian_mechanism` (pessimistic, connect the dots);
at k = 1 that is the sampled Gaussian itself (tests/test_group_accounting.py checks both).
"""

from __future__ import annotations

import math
from collections import OrderedDict

from dp_accounting.pld import privacy_loss_distribution

from typing import Optional

from widedp.accounting import events as ev
from widedp.accounting.base import Unsupported, register, split_event
from widedp.accounting.gaussian_reduction import GaussianReducibleAccountant, Piece, gaussian_pieces
from widedp.accounting.pld_gaussian import MAX_GRID_POINTS, gaussian_pld, grid_points, group_gaussian_pld, self_composed


@register
class PldAccountant(GaussianReducibleAccountant):
    name = "pld"
    sampled_groups = True

    def __init__(self, value_discretization_interval: float = 1e-4, group_value_discretization_interval: float = 1e-3):
        """`group_value_discretization_interval`: the grid of a history that holds a sampled
        group (every distribution of it: PLDs compose on one grid), coarser by default — a
        group's losses span about k times the range, so a 1e-4 grid costs ~15 s per
        distribution at k = 8 (1 s at 1e-3); the estimate stays pessimistic (an upper bound)
        and moved ε by < 1e-5 relative at σ = 1, q = 0.01, k = 8, 1,000 steps."""
        self.value_discretization_interval = value_discretization_interval
        self.group_value_discretization_interval = max(group_value_discretization_interval,
                                                       value_discretization_interval)

    def _event_problem(self, event: ev.DpEvent) -> Optional[Unsupported]:
        """The structural checks, then the grid: a Gaussian whose σ is so small that its PLD
        would need more than MAX_GRID_POINTS points (`pld_gaussian.grid_points`) is declined
        with a reason, not built until memory runs out ("auto" then uses RDP). From the
        event's parameters only (public), no ε."""
        problem = super()._event_problem(event)
        if problem is not None:
            return problem
        for q, sigma, _count, group in gaussian_pieces([(split_event(event, self.name)[0], 1)], self.name,
                                                       self.sampled_groups):
            if q == 0 or not 0 < sigma < math.inf:
                continue
            interval = self.group_value_discretization_interval if group > 1 else self.value_discretization_interval
            points = grid_points(sigma, q, interval, group)
            if points > MAX_GRID_POINTS:
                return Unsupported(event, f"noise multiplier {sigma:.3g} is too small for the PLD grid: about "
                                          f"{points:.2g} points at interval {interval:g} (at most "
                                          f"{MAX_GRID_POINTS:.0e}); use the rdp accountant (privacy.accountant = "
                                          "auto falls back to it)")
        return None

    def pieces_epsilon(self, pieces: list[Piece], delta: float) -> float:
        """ε at δ of the composed pieces, as dp_accounting's PLDAccountant composes the events
        GaussianDpEvent(σ) × count (one Gaussian of σ/√count) and PoissonSampledDpEvent(q,
        GaussianDpEvent(σ)) × count (one PLD self-composed count times); the distributions
        come from `pld_gaussian.gaussian_pld`, the same PMFs built faster. A sampled group
        (k > 1): the mixture of Gaussians (module docstring), self-composed count times."""
        groups = any(group > 1 and q < 1.0 for q, _, _, group in pieces)
        interval = self.group_value_discretization_interval if groups else self.value_discretization_interval
        key = (tuple(pieces), float(delta), interval)
        if key in _MEMO:
            _MEMO.move_to_end(key)
            return _MEMO[key]
        epsilon = _composed_epsilon(pieces, delta, interval)
        _MEMO[key] = epsilon
        if len(_MEMO) > MEMO_SIZE:
            _MEMO.popitem(last=False)
        return epsilon


#: ε of recent (pieces, δ, grid) triples, most recent last. The value is a pure function of the
#: key (deterministic PLD arithmetic), and a process asks for the same one again and again: a
#: calibration verifies its answer, the plan and the ledger re-account it, the budget check
#: re-accounts each step's history (measured: 22 of 49 PLD evaluations of one plan repeated).
_MEMO: "OrderedDict[tuple, float]" = OrderedDict()
MEMO_SIZE = 512


def _composed_epsilon(pieces: list[Piece], delta: float, interval: float) -> float:
    """`PldAccountant.pieces_epsilon` on the grid `interval`, computed."""
    composed = privacy_loss_distribution.identity(value_discretization_interval=interval)
    for q, sigma, count, group in pieces:
        if q == 0 or count == 0:
            continue
        if sigma == 0:
            return math.inf  # a release without noise
        if q < 1.0 and group > 1:
            composed = composed.compose(self_composed(group_gaussian_pld(sigma, q, group, interval), count))
        elif q < 1.0:
            composed = composed.compose(self_composed(gaussian_pld(sigma, q, interval), count))
        else:
            composed = composed.compose(gaussian_pld(sigma / math.sqrt(count), 1.0, interval))
    return float(composed.get_epsilon_for_delta(delta))

