"""Opacus PRV accountant (Gopi, Lee & Wutschitz 2021) for Gaussian-reducible steps.

Add/remove-one neighbours; Poisson-sampled Gaussians only (others raise
UnsupportedEventError; `supports` / `check` are structural, as in the PLD accountant). Opacus
reports an upper estimate within `eps_error`. Events with an additive δ (Gaussian partition
selection, top level only) contribute their Gaussian part here and their δ is subtracted from
the target (`base.split_additive_delta`); ε = inf when nothing is left.

Opacus is driven through its public API only: `IAccountant.load_state_dict` — the documented
counterpart of `state_dict()`, whose "history" holds (noise_multiplier, sample_rate, steps)
triples, the public entry point for a heterogeneous history with counts (`step()` adds one
step per call and merges consecutive identical ones, so a count would cost O(count) calls and
change the piece layout Opacus discretizes) — then `get_epsilon(delta, eps_error=...)`.
Only the warnings listed in `OPACUS_BENIGN_WARNINGS` are silenced, by category, message and
issuing module; any other warning reaches the caller.
"""

from __future__ import annotations

import warnings

from opacus.accountants import PRVAccountant as OpacusPRV

from widedp.accounting.base import register
from widedp.accounting.gaussian_reduction import GaussianReducibleAccountant

#: (category, message regex, issuing-module regex, why it is benign) of the Opacus 1.6 warnings
#: we silence — nothing else.
OPACUS_BENIGN_WARNINGS: tuple[tuple[type[Warning], str, str, str], ...] = (
    (UserWarning, r"Optimal order is the (smallest|largest) alpha", r"opacus\.accountants\.analysis\.rdp",
     "PRV sizes its discretization domain with an RDP bound (analysis.prv.domain.compute_safe_domain_size); "
     "an RDP bound at the edge of the order grid is still a valid (only looser) bound, so the domain stays safe "
     "and the PRV estimate's error is still governed by eps_error / delta_error"),
)
#: Only for pieces with sample rate q = 1: PoissonSubsampledGaussianPRV evaluates log(1 - q) = -inf,
#: which is the intended value there (the branch t > log(1 - q) is then always taken).
OPACUS_Q1_WARNING = (RuntimeWarning, r"divide by zero encountered in log", r"opacus\.accountants\.analysis\.prv\.prvs",
                     "log(1 - q) = -inf for q = 1, the intended value")


def opacus_prv_epsilon(pieces: list, delta: float, eps_error: float) -> float:
    """Opacus PRV ε (its upper estimate) of Poisson-sampled Gaussian pieces (q, σ, count, 1)
    (no sampled groups: `sampled_groups` is off here, so the structural check refused them)."""
    if any(group != 1 for *_, group in pieces):
        raise ValueError("the prv accountant composes no sampled groups (GroupDpEvent): use pld")
    pieces = [(q, sigma, count) for q, sigma, count, _ in pieces]
    acc = OpacusPRV()
    acc.load_state_dict({"history": [(sigma, q, count) for q, sigma, count in pieces],
                         "mechanism": OpacusPRV.mechanism()})
    benign = OPACUS_BENIGN_WARNINGS + ((OPACUS_Q1_WARNING,) if any(q == 1 for q, _, _ in pieces) else ())
    with warnings.catch_warnings():
        for category, message, module, _why in benign:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
        return float(acc.get_epsilon(delta, eps_error=eps_error))


@register
class PrvAccountant(GaussianReducibleAccountant):
    name = "prv"

    def __init__(self, eps_error: float = 0.01):
        self.eps_error = eps_error

    def pieces_epsilon(self, pieces: list, delta: float) -> float:
        return opacus_prv_epsilon(pieces, delta, self.eps_error) if pieces else 0.0
