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

from dp_accounting.pld import pld_privacy_accountant

from widedp.accounting import events as ev
from widedp.accounting.base import register
from widedp.accounting.gaussian_reduction import GaussianReducibleAccountant


@register
class PldAccountant(GaussianReducibleAccountant):
    name = "pld"

    def __init__(self, value_discretization_interval: float = 1e-4):
        self.value_discretization_interval = value_discretization_interval

    def pieces_epsilon(self, pieces: list[tuple[float, float, int]], delta: float) -> float:
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=self.value_discretization_interval)
        for q, sigma, count in pieces:
            event: ev.DpEvent = ev.GaussianDpEvent(sigma)
            if q < 1.0:
                event = ev.PoissonSampledDpEvent(q, event)
            acc.compose(event, count)
        return float(acc.get_epsilon(delta))
