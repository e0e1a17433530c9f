"""Privacy-loss-distribution accountant (dp_accounting's PLD) for Gaussian-reducible steps.

Add/remove-one neighbours. Steps whose events reduce to one (Poisson-sampled) Gaussian —
plain DP-SGD, sparse steps with Gaussian thresholding, DP-FEST — are composed exactly up to
PLD discretization (pessimistic rounding, so never an under-estimate). Other selectors
raise UnsupportedEventError. Events with an additive δ (Gaussian partition selection, top
level only) contribute their Gaussian part here and their δ is subtracted from the target
(`base.split_additive_delta`); ε = inf when nothing is left. `supports` / `check` are
structural (`gaussian_reduction.gaussian_problem` after the additive-δ split).
"""

from __future__ import annotations

import math
from typing import Optional

from dp_accounting.pld import pld_privacy_accountant

from accounting import events as ev
from accounting.base import (Accountant, History, Unsupported, _split_event, check_delta, misplaced_additive_delta,
                             register, remaining_delta, split_additive_delta)
from accounting.gaussian_reduction import gaussian_pieces, gaussian_problem


@register
class PldAccountant(Accountant):
    name = "pld"

    def __init__(self, value_discretization_interval: float = 1e-4):
        self.value_discretization_interval = value_discretization_interval

    def _event_problem(self, event: ev.DpEvent) -> Optional[Unsupported]:
        return misplaced_additive_delta(event) or gaussian_problem(_split_event(event, self.name)[0])

    def epsilon(self, history: History, delta: float) -> float:
        delta = check_delta(delta)
        self.check(history)
        history, additive_delta = split_additive_delta(history, self.name)
        pieces = gaussian_pieces(history, self.name)
        delta = remaining_delta(delta, additive_delta)
        if delta is None:
            return math.inf
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=self.value_discretization_interval)
        for q, sigma, count in pieces:
            event = ev.GaussianDpEvent(sigma)
            if q < 1.0:
                event = ev.PoissonSampledDpEvent(q, event)
            acc.compose(event, count)
        return float(acc.get_epsilon(delta))
