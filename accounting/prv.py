"""Opacus PRV accountant (Gopi, Lee & Wutschitz 2021) for Gaussian-reducible steps.

Add/remove-one neighbours; Poisson-sampled Gaussians only (others raise
UnsupportedEventError). Opacus reports an upper estimate within `eps_error`. Events with an
additive δ (Gaussian partition selection, top level only) contribute their Gaussian part here
and their δ is subtracted from the target (`base.split_additive_delta`); ε = inf when nothing
is left.
"""

from __future__ import annotations

import math
import warnings

from opacus.accountants import PRVAccountant as OpacusPRV

from accounting.base import Accountant, History, check_delta, register, remaining_delta, split_additive_delta
from accounting.gaussian_reduction import gaussian_pieces


@register
class PrvAccountant(Accountant):
    name = "prv"

    def __init__(self, eps_error: float = 0.01):
        self.eps_error = eps_error

    def epsilon(self, history: History, delta: float) -> float:
        delta = check_delta(delta)
        history, additive_delta = split_additive_delta(history, self.name)
        pieces = gaussian_pieces(history, self.name)
        delta = remaining_delta(delta, additive_delta)
        if delta is None:
            return math.inf
        if not pieces:
            return 0.0
        acc = OpacusPRV()
        acc.history = [(sigma, q, count) for q, sigma, count in pieces]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(acc.get_epsilon(delta, eps_error=self.eps_error))
