"""Privacy accounting (pure library: no Ray, no trainer imports).

Events (`accounting.events`) are immutable records of what each mechanism did; accountants
(`rdp`, `pld`, `prv`, `paper`) say structurally whether they `supports` an event (and its
neighbouring relation) and compose them or raise UnsupportedEventError; the ledger persists
them; calibration turns a target ε into noise multipliers (a frozen `Calibration`).
"""

from widedp.accounting.base import (
    ACCOUNTANTS,
    Accountant,
    InvalidBoundError,
    UnsupportedEventError,
    make_accountant,
)
from widedp.accounting.calibration import Calibration, calibrate, step_event, svt_event
from widedp.accounting.events import NeighboringRelation
from widedp.accounting.ledger import PrivacyLedger

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "Calibration",
    "InvalidBoundError",
    "NeighboringRelation",
    "PrivacyLedger",
    "UnsupportedEventError",
    "calibrate",
    "make_accountant",
    "step_event",
    "svt_event",
]
