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

from __future__ import annotations

if __name__ != "widedp.accounting":  # the repository's top-level accounting/ is a link to widedp/accounting/ (README, "Layout")
    raise ImportError(f"import widedp.accounting, not {__name__}: each module exists once, under widedp (a second "
                      "copy under another name would hold second copies of its registries)")

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Each name is imported from its module on first use (PEP 562), so importing one module of the
# package (`widedp.accounting.events` in a shard actor) does not import the others.
_HOMES = {
    "ACCOUNTANTS": "base",
    "Accountant": "base",
    "InvalidBoundError": "base",
    "UnsupportedEventError": "base",
    "make_accountant": "base",
    "UnreachableTargetError": "calibration",
    "calibrate": "calibration",
    "step_event": "calibration",
    "svt_event": "calibration",
    "NeighboringRelation": "events",
    "PrivacyLedger": "ledger",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        # A submodule read as an attribute (`widedp.accounting.base`), as when this file imported them all.
        if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
