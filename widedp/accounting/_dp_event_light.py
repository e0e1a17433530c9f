"""Load dp_accounting's event classes without running dp_accounting's package `__init__`.

`import dp_accounting.dp_event` first runs `dp_accounting/__init__.py`, which imports the whole
library (PLD, RDP, mechanism calibration: scipy.signal, scipy.stats, scipy.optimize), about 1-2 s
of start-up. The events themselves need only `attr`: `dp_accounting/dp_event.py`,
`dp_event_builder.py` and `privacy_accountant.py` (where `NeighboringRelation` lives) import
nothing else of the library. Every process that only builds, records or checks events — a shard
or trainer actor, `widedp` commands that compute no ε — would pay for the whole library.

Importing this module loads those three modules under their own names
(`sys.modules["dp_accounting.dp_event"]`, ...) with a stand-in for the package present only
while they load, so `from dp_accounting.dp_event import GaussianDpEvent` afterwards finds them
without running the package. The classes are the library's own objects: when an accountant
later imports `dp_accounting` (or `dp_accounting.pld`), the package's `__init__` runs for real
and its `from dp_accounting import dp_event` binds the very modules loaded here (Python falls
back to `sys.modules` for a submodule the package does not hold yet), so
`dp_accounting.GaussianDpEvent is widedp.accounting.events.GaussianDpEvent` and dp_accounting's
accountants accept our events (tests/test_cli_startup.py checks both).

Nothing is done when dp_accounting is already imported (in full, or under way). Import this
module before any `from dp_accounting... import` of the accounting package's light modules.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

#: The dp_accounting modules the event classes need (in dependency order); nothing else of the library.
LIGHT_MODULES = ("dp_accounting.dp_event", "dp_accounting.dp_event_builder", "dp_accounting.privacy_accountant")


def _load_light_modules() -> None:
    if "dp_accounting" in sys.modules or all(name in sys.modules for name in LIGHT_MODULES):
        return
    spec = importlib.util.find_spec("dp_accounting")  # finds the package, does not run it
    if spec is None or spec.submodule_search_locations is None:
        return  # not installed as a package: the plain imports after us say so
    # A bare package object (its __path__ only) stands in while the three modules load: they
    # import each other with `from dp_accounting import dp_event`, which reads this object.
    stand_in = importlib.util.module_from_spec(spec)
    sys.modules["dp_accounting"] = stand_in
    try:
        for name in LIGHT_MODULES:
            importlib.import_module(name)
    finally:
        if sys.modules.get("dp_accounting") is stand_in:
            del sys.modules["dp_accounting"]


_load_light_modules()
