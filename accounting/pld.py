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

from dp_accounting.pld import privacy_loss_distribution

from widedp.accounting.base import register
from widedp.accounting.gaussian_reduction import GaussianReducibleAccountant
from widedp.accounting.pld_gaussian import gaussian_pld


@register
class PldAccountant(GaussianReducibleAccountant):
    name = "pld"

    def __init__(self, value_discretization_interval: float = 1e-4):
        self.value_discretization_interval = value_discretization_interval

    def pieces_epsilon(self, pieces: list[tuple[float, float, int]], delta: float) -> float:
        """ε at δ of the composed pieces, as dp_accounting's PLDAccountant composes the events
        GaussianDpEvent(σ) × count (one Gaussian of σ/√count) and PoissonSampledDpEvent(q,
        GaussianDpEvent(σ)) × count (one PLD self-composed count times); the distributions
        come from `pld_gaussian.gaussian_pld`, the same PMFs built faster."""
        interval = self.value_discretization_interval
        composed = privacy_loss_distribution.identity(value_discretization_interval=interval)
        for q, sigma, count in pieces:
            if q == 0 or count == 0:
                continue
            if sigma == 0:
                return math.inf  # a release without noise
            if q < 1.0:
                composed = composed.compose(gaussian_pld(sigma, q, interval).self_compose(count))
            else:
                composed = composed.compose(gaussian_pld(sigma / math.sqrt(count), 1.0, interval))
        return float(composed.get_epsilon_for_delta(delta))
