"""Privacy accounting (pure library: no Ray, no trainer or selection imports): what is claimed.

Events (`accounting.events`) are immutable records of what each mechanism did; accountants
(`rdp`, `pld`, `prv`, `paper`, and the default `auto`: PLD where it applies, else RDP) say
structurally whether they `supports` an event (and its neighbouring relation) and compose them
or raise UnsupportedEventError; the ledger persists them (and certifies a run's remaining steps
at once, so a budget check per step costs no accountant call); `calibrate(build_event, target_epsilon, delta, ...)` turns a target ε into the noise
multiplier of any mechanism the caller describes as σ ↦ event (in the manner of dp_accounting's
`calibrate_dp_mechanism`; a selector's sparse step is `selection.calibration`'s). What a
trained model actually leaks is measured beside this package, in `auditing`.
"""

from widedp.accounting.base import (
    ACCOUNTANTS,
    Accountant,
    InvalidBoundError,
    UnsupportedEventError,
    make_accountant,
)
from widedp.accounting.calibration import UnreachableTargetError, calibrate, step_event, svt_event
from widedp.accounting.events import NeighboringRelation
from widedp.accounting.ledger import PrivacyLedger

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "InvalidBoundError",
    "NeighboringRelation",
    "PrivacyLedger",
    "UnreachableTargetError",
    "UnsupportedEventError",
    "calibrate",
    "make_accountant",
    "step_event",
    "svt_event",
]
