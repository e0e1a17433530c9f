"""The default accountant: PLD where it applies, RDP elsewhere ("auto").

Add/remove-one neighbours, as both accountants it delegates to. For a history the PLD
accountant supports (`pld.PldAccountant.check` passes: every step Gaussian-reducible —
DP-SGD, Gaussian thresholding, DP-FEST, additive-δ events at the top level), ε is PLD's;
otherwise, if the RDP accountant supports it (exponential / noisy-max / sparse-vector
selection, ModelMix, Laplace, zCDP events, ...), ε is RDP's; otherwise UnsupportedEventError,
naming why each of the two refuses it.

What it claims and why it is sound: each delegate's ε is a valid upper bound on the history's
ε at δ for add/remove-one neighbours (pessimistic PLD discretization; RDP's conversion of
Balle et al. 2020), so whichever is reported is one. The choice is made from the history's
events alone — their types, nesting and parameters, i.e. `check`, which is structural and
computes no ε — never from the ε values, so it reveals nothing beyond the (public) events, and
it is not a minimum over bounds computed on data-dependent quantities. Where both apply, PLD
is the tighter one in the regimes we train in (about 3× below RDP for DP-SGD at ε ≈ 0.3;
tests/test_auto_accountant.py keeps pld ≤ rdp and pld ≈ prv under test on a grid).

PLD also declines a Gaussian whose noise multiplier is so small that its grid would not fit in
memory (`pld_gaussian.grid_points` > MAX_GRID_POINTS: σ below ≈ 0.03 at the 1e-4 grid) — a
function of the event's public parameters, like the rest of the choice — and such a history
goes to RDP (a σ = 0.001 run once asked PLD for 5·10⁹ points: 38 GiB).

`supports` / `check` stay structural: a history is supported iff the PLD or the RDP accountant
supports all of it (`unsupported`). The RDP accountant supports every event the PLD one does,
so a ledger that checks each recorded entry on its own (`PrivacyLedger.record`) never holds a
history that neither supports. `details()` reports the delegate's details plus
`accountant_used` ("pld" or "rdp"); `resolve(history)` names the delegate without computing ε.
"""

from __future__ import annotations

from typing import Optional

from widedp.accounting import events as ev
from widedp.accounting.base import Accountant, History, Unsupported, check_delta, register
from widedp.accounting.pld import PldAccountant
from widedp.accounting.rdp import DEFAULT_ORDERS, RdpAccountant


@register
class AutoAccountant(Accountant):
    """PLD's ε for a history PLD supports, else RDP's (module docstring)."""

    name = "auto"

    def __init__(self, value_discretization_interval: float = 1e-4, orders=DEFAULT_ORDERS):
        self.pld = PldAccountant(value_discretization_interval=value_discretization_interval)
        self.rdp = RdpAccountant(orders=orders)
        for delegate in (self.pld, self.rdp):
            assert delegate.neighboring_relation == self.neighboring_relation

    # -- which accountant ---------------------------------------------------------------------
    def delegate(self, history: History) -> Accountant:
        """The accountant whose ε this one reports for `history`: PLD if it supports the whole
        history, else RDP if it does; UnsupportedEventError (naming both reasons) if neither.
        Structural only: no ε is computed."""
        if self.pld.unsupported(history) is None:
            return self.pld
        self.check(history)  # raises, naming both accountants' reasons, unless RDP supports it
        return self.rdp

    def resolve(self, history: History) -> str:
        """The name ("pld" or "rdp") of the accountant `history` resolves to (`delegate`)."""
        return self.delegate(history).name

    # -- the Accountant interface ---------------------------------------------------------------
    def unsupported(self, history: History) -> Optional[tuple[Optional[ev.DpEvent], Unsupported]]:
        """None iff the PLD or the RDP accountant supports all of `history`; else RDP's
        offending entry with both accountants' reasons."""
        via_pld = self.pld.unsupported(history)
        if via_pld is None:
            return None
        via_rdp = self.rdp.unsupported(history)
        if via_rdp is None:
            return None
        entry, problem = via_rdp
        reason = (f"neither accountant it chooses between supports this history — rdp: {problem.reason}; "
                  f"pld: {via_pld[1].reason}")
        return entry, Unsupported(problem.event, reason)

    def _event_problem(self, event: ev.DpEvent) -> Optional[Unsupported]:
        found = self.unsupported([(event, 1)])
        return None if found is None else found[1]

    def epsilon(self, history: History, delta: float) -> float:
        return self.details(history, delta)["epsilon"]

    def details(self, history: History, delta: float) -> dict:
        """The delegate's details (PLD: ε; RDP: ε and the order) plus `accountant_used`."""
        delta = check_delta(delta)
        chosen = self.delegate(history)
        out = chosen.details(history, delta)
        return {**out, "epsilon": float(out["epsilon"]), "accountant_used": chosen.name}


def resolve(history: History) -> str:
    """Which accountant ("pld" or "rdp") the "auto" accountant uses for `history` (structural:
    no ε computed); UnsupportedEventError if neither supports it."""
    return AutoAccountant().resolve(history)


__all__ = ["AutoAccountant", "resolve"]
