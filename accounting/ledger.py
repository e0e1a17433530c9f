"""The privacy ledger: every released step's event, in order, persisted atomically.

Protocol (docs/DESIGN.md §1): `record(event)` is called **before** the step's update is released, so
a crash can only over-count, never under-count. `would_exceed(event, target)` lets the
trainer stop before a step would spend past the target ε. History is run-length encoded
((event, count) pairs), so a long run of identical steps costs one entry.

`record` refuses an event its accountant does not support (`Accountant.check`, structural: no ε
is computed, so recording is cheap). A ledger is stated for its accountant's neighbouring
relation (add/remove one for all of ours); `state_dict` stores it (format version 2) and
`load_state_dict` refuses a ledger recorded for another relation. Version 1 files (no relation
stored) were all add/remove-one and still load.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from accounting.atomic import atomic_write_bytes
from accounting.base import Accountant, check_delta, make_accountant
from accounting.events import DpEvent, NeighboringRelation, event_from_dict, event_to_dict

#: Format written by `state_dict`. 2: adds "neighboring_relation". 1: implicit add/remove one.
LEDGER_VERSION = 2
_READABLE_VERSIONS = (1, 2)


class PrivacyLedger:
    def __init__(self, accountant: str | Accountant = "rdp", delta: float = 1e-6):
        self.accountant = make_accountant(accountant) if isinstance(accountant, str) else accountant
        self.delta = check_delta(delta)
        self._history: list[list] = []  # [event, count], run-length encoded

    # -- recording ----------------------------------------------------------------------------
    @property
    def history(self) -> list[tuple[DpEvent, int]]:
        return [(e, c) for e, c in self._history]

    @property
    def neighboring_relation(self) -> NeighboringRelation:
        """The relation the recorded events and ε are stated for (the accountant's)."""
        return self.accountant.neighboring_relation

    @property
    def steps(self) -> int:
        return sum(c for _, c in self._history)

    def record(self, event: DpEvent, count: int = 1) -> None:
        """Append `count` applications of `event`. Call before releasing the update."""
        if not isinstance(event, DpEvent):
            raise TypeError(f"record() needs a DpEvent, got {type(event).__name__}")
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        # Refuse what cannot be accounted, before spending (structural: no ε computed here).
        self.accountant.check([(event, count)])
        if self._history and repr(self._history[-1][0]) == repr(event):
            self._history[-1][1] += count
        else:
            self._history.append([event, count])

    # -- querying -----------------------------------------------------------------------------
    def epsilon(self, delta: Optional[float] = None) -> float:
        if not self._history:
            return 0.0
        return self.accountant.epsilon(self.history, self.delta if delta is None else delta)

    def would_exceed(self, event: DpEvent, target_epsilon: float, delta: Optional[float] = None, count: int = 1) -> bool:
        """True if recording `event` (count times) would make ε exceed target_epsilon."""
        hist = self.history + [(event, count)]
        return self.accountant.epsilon(hist, self.delta if delta is None else delta) > target_epsilon

    # -- persistence ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "version": LEDGER_VERSION,
            "accountant": self.accountant.name,
            "neighboring_relation": self.neighboring_relation.name,
            "delta": self.delta,
            "history": [{"event": event_to_dict(e), "count": c} for e, c in self._history],
        }

    def load_state_dict(self, state: dict) -> None:
        """Replace this ledger's state by `state` (all of it validated first: on error, nothing
        changes). Refuses a ledger recorded for another neighbouring relation."""
        version = state.get("version")
        if version not in _READABLE_VERSIONS:
            raise ValueError(f"unsupported ledger version {version!r} (this widedp reads {list(_READABLE_VERSIONS)})")
        accountant = self.accountant if state["accountant"] == self.accountant.name else make_accountant(state["accountant"])
        relation = _relation(state, version)
        if relation != accountant.neighboring_relation:
            raise ValueError(f"ledger was recorded for the {relation.name} neighbouring relation; the {accountant.name} "
                             f"accountant accounts {accountant.neighboring_relation.name}: refusing to load it")
        delta = check_delta(state["delta"])
        history = []
        for i, entry in enumerate(state["history"]):
            try:
                history.append([event_from_dict(entry["event"]), int(entry["count"])])
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"ledger history entry {i} is invalid: {exc}") from exc
        self.accountant, self.delta, self._history = accountant, delta, history

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (temp file, fsync, rename): never a half-written ledger."""
        atomic_write_bytes(path, json.dumps(self.state_dict(), indent=1).encode())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PrivacyLedger":
        try:
            with open(path) as f:
                state = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a valid ledger file ({exc})") from exc
        ledger = cls(state.get("accountant", "rdp"), state.get("delta", 1e-6))
        try:
            ledger.load_state_dict(state)
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{path}: {exc}") from exc
        return ledger


def _relation(state: dict, version: int) -> NeighboringRelation:
    if version == 1:
        return NeighboringRelation.ADD_OR_REMOVE_ONE  # v1 ledgers predate the field: all add/remove one
    name = state.get("neighboring_relation")
    try:
        return NeighboringRelation[name]
    except (KeyError, TypeError):
        raise ValueError(f"ledger neighboring_relation {name!r} is not one of "
                         f"{[r.name for r in NeighboringRelation]}") from None
