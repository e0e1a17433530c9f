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

The ledger only grows (docs/DESIGN.md §1): every charged event extends a hash chain,
    d_0 = sha256("widedp-ledger-chain-v1"),  d_i = sha256(d_{i-1} ‖ sha256(canonical JSON of event i)),
one link per *charged event* (an entry of count c adds c links), so the digest after any
number of events is defined whatever the run-length encoding, and a ledger that extends an
older one reproduces the older one's (events, digest) pair (`digest_at`, `extends`). Version 3
files store each entry's digest (after its last event) and the final one; `load_state_dict`
recomputes the chain from the events and refuses a file whose events do not hash to it (a hand
edit). A checkpoint records `chain()` = (events charged, digest) and a resume refuses a ledger
that is not an extension of it (trainer/run/train.py). The chain detects accidents and edits, not
an adversary who rewrites the checkpoint too: neither file is signed here (a caller that needs
that signs the state it persists: trainer/run/ledger_key.py).

A ledger may carry a *header* (version 4): a JSON object fixed before the first event — what
the run's ε means (unit of privacy, reproducible mode, the data set...: trainer/config/semantics.py).
It is bound into the chain: with a header the chain starts at
    d_0 = sha256(bytes(CHAIN_SEED) ‖ canonical JSON of the header)
instead of CHAIN_SEED, so a ledger whose header was edited no longer extends any chain recorded
with the original one. Without a header (versions 1-3, or none given) d_0 = CHAIN_SEED.

Speed (in memory only, never in `state_dict`): a step's budget check costs one accountant call
(PLD: ~0.5 s) unless a *certificate* covers it. `certify(event, count, target)` computes
ε(history + count × event) once and, if it is ≤ target, remembers it; `would_exceed(event,
target)` then answers False without computing while everything recorded since is that same
event and the steps asked for stay within the certified count, at the same δ and accountant,
for a target ≥ the certified ε. Sound because composition is monotone: the history then is a
prefix of the certified one, and a prefix is a post-processing of the whole (drop the later
outputs), so its ε is at most the whole's — at most the certified bound, at most the target.
Recording any other event voids the certificate; so does `load_state_dict`. `epsilon()` is
cached by (charged events, chain digest, δ, accountant) — the digest names the history — and
`epsilon_snapshot()` hands out ε at the current history, computed only if and when asked.
"""

from __future__ import annotations

import hashlib
import dataclasses
import json
import os
from typing import Callable, Optional

from widedp.accounting.atomic import atomic_write_bytes
from widedp.accounting.base import Accountant, InvalidBoundError, check_delta, make_accountant
from widedp.accounting.events import DpEvent, NeighboringRelation, event_from_dict, event_to_dict

#: Format written by `state_dict`. 4: adds the "header" (bound into the chain). 3: adds the hash
#: chain ("digest" per entry and in all). 2: adds "neighboring_relation". 1: implicit add/remove one.
LEDGER_VERSION = 4
_READABLE_VERSIONS = (1, 2, 3, 4)

CHAIN_SEED = hashlib.sha256(b"widedp-ledger-chain-v1").hexdigest()


def canonical_json(obj) -> bytes:
    """The one serialization hashed here: sorted keys, no spaces, exact float repr, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True, ensure_ascii=False).encode()


def chain_seed(header: Optional[dict] = None) -> str:
    """d_0 of the chain: CHAIN_SEED, or bound to `header` (module docstring)."""
    if header is None:
        return CHAIN_SEED
    return hashlib.sha256(bytes.fromhex(CHAIN_SEED) + canonical_json(header)).hexdigest()


def event_hash(event_dict: dict) -> bytes:
    """sha256 of an event's canonical JSON (sorted keys, no spaces, exact float repr)."""
    text = json.dumps(event_dict, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).digest()


def extend_chain(digest: str, event_dict: dict, count: int = 1) -> str:
    """The chain digest after charging `event_dict` `count` more times."""
    h = event_hash(event_dict)
    d = bytes.fromhex(digest)
    for _ in range(count):
        d = hashlib.sha256(d + h).digest()
    return d.hex()


@dataclasses.dataclass
class Certificate:
    """ε(history at certification + `count` × `event`) = `epsilon` ≤ the target it was made for,
    by `accountant` at `delta`; `used`: applications of `event` recorded since (nothing else was)."""

    event: DpEvent
    key: str  # repr(event): the ledger's identity of events (as its run-length encoding)
    count: int
    epsilon: float
    delta: float
    accountant: Accountant
    used: int = 0

    def covers(self, event: DpEvent, target_epsilon: float, delta: float, accountant: Accountant, count: int) -> bool:
        return (accountant is self.accountant and delta == self.delta and self.epsilon <= target_epsilon
                and self.used + count <= self.count and repr(event) == self.key)


#: How many ε values `PrivacyLedger` keeps (by charged events, digest, δ, accountant).
_EPSILON_CACHE_SIZE = 16


class PrivacyLedger:
    def __init__(self, accountant: str | Accountant = "rdp", delta: float = 1e-6, header: Optional[dict] = None):
        """`header`: a JSON object bound into the chain (module docstring); None: no header."""
        self.accountant = make_accountant(accountant) if isinstance(accountant, str) else accountant
        self.delta = check_delta(delta)
        self._header: Optional[dict] = _checked_header(header)
        self._seed = chain_seed(self._header)
        self._history: list[list] = []  # [event, count], run-length encoded
        self._digests: list[str] = []  # the chain digest after each entry's last event
        self._certificate: Optional[Certificate] = None  # in memory only (module docstring)
        self._epsilon_cache: dict[tuple, float] = {}

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
        extended = extend_chain(self.digest, event_to_dict(event), count)
        cert, key = self._certificate, repr(event)
        if cert is not None:
            cert.used += count
            if key != cert.key or cert.used > cert.count:
                self._certificate = None  # something it did not certify was recorded
        if self._history and repr(self._history[-1][0]) == key:
            self._history[-1][1] += count
            self._digests[-1] = extended
        else:
            self._history.append([event, count])
            self._digests.append(extended)

    # -- the header --------------------------------------------------------------------------------
    @property
    def header(self) -> Optional[dict]:
        """The header bound into the chain (a copy), None without one."""
        return None if self._header is None else json.loads(canonical_json(self._header))

    def set_header(self, header: dict) -> None:
        """Bind `header` into the chain; only before the first event (the chain starts from it)."""
        if self._history:
            raise ValueError(f"a ledger's header is fixed before its first event; this one holds {self.steps}")
        self._header = _checked_header(header)
        self._seed = chain_seed(self._header)
        self._epsilon_cache.clear()

    # -- the hash chain -------------------------------------------------------------------------
    @property
    def digest(self) -> str:
        """The chain digest after every charged event (the chain's seed when nothing is charged)."""
        return self._digests[-1] if self._digests else self._seed

    def chain(self) -> dict:
        """What a checkpoint records: {"events": charged so far, "digest": the chain's digest}."""
        return {"events": self.steps, "digest": self.digest}

    def digest_at(self, events: int) -> str:
        """The chain digest after the first `events` charged events (0 <= events <= steps)."""
        if not 0 <= events <= self.steps:
            raise ValueError(f"the ledger has {self.steps} charged events, not {events}")
        d, seen = self._seed, 0
        for (event, count), after in zip(self._history, self._digests):
            if seen + count <= events:
                d, seen = after, seen + count
                continue
            return extend_chain(d, event_to_dict(event), events - seen)
        return d

    def extends(self, chain: dict) -> bool:
        """Whether this ledger is `chain` (a `chain()` of an earlier state) plus zero or more events."""
        events = int(chain["events"])
        return events <= self.steps and self.digest_at(events) == chain["digest"]

    # -- querying -----------------------------------------------------------------------------
    def epsilon(self, delta: Optional[float] = None) -> float:
        """ε of everything charged, at δ (default the ledger's); cached, so asking again is free."""
        return self.epsilon_snapshot(delta)()

    def epsilon_snapshot(self, delta: Optional[float] = None) -> Callable[[], float]:
        """A function returning ε of the history as it is now (whatever is recorded later),
        computed on its first call only (and shared with `epsilon()` through the cache)."""
        delta = self.delta if delta is None else check_delta(delta)
        history, accountant = self.history, self.accountant
        key = (self.steps, self.digest, delta, accountant)  # the accountant by identity

        def epsilon() -> float:
            if not history:
                return 0.0
            value = self._epsilon_cache.get(key)
            if value is None:
                value = float(accountant.epsilon(history, delta))
                if len(self._epsilon_cache) >= _EPSILON_CACHE_SIZE:
                    self._epsilon_cache.pop(next(iter(self._epsilon_cache)))  # the oldest
                self._epsilon_cache[key] = value
            return value

        return epsilon

    def would_exceed(self, event: DpEvent, target_epsilon: float, delta: Optional[float] = None, count: int = 1) -> bool:
        """True if recording `event` (count times) would make ε exceed target_epsilon. Free (no
        accountant call) when a certificate covers it (`certify`), else computed."""
        delta = self.delta if delta is None else check_delta(delta)
        if self.certified(event, target_epsilon, delta, count):
            return False
        return self.accountant.epsilon(self.history + [(event, count)], delta) > target_epsilon

    # -- certificates (module docstring; in memory only) -------------------------------------------
    @property
    def certificate(self) -> Optional[Certificate]:
        return self._certificate

    def certified(self, event: DpEvent, target_epsilon: float, delta: Optional[float] = None, count: int = 1) -> bool:
        """Whether the certificate shows that `count` more applications of `event` stay within
        `target_epsilon` (no ε computed)."""
        cert = self._certificate
        delta = self.delta if delta is None else delta
        return cert is not None and cert.covers(event, target_epsilon, delta, self.accountant, count)

    def certify(self, event: DpEvent, count: int, target_epsilon: float, delta: Optional[float] = None) -> bool:
        """Compute ε(history + count × event) once; if it is ≤ target_epsilon, keep it as the
        certificate (replacing any other) and return True. False (certificate unchanged) if it
        exceeds the target or the accountant's bound does not hold there (InvalidBoundError).
        An event the accountant does not support raises UnsupportedEventError."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an integer >= 1, got {count!r}")
        delta = self.delta if delta is None else check_delta(delta)
        try:
            eps = float(self.accountant.epsilon(self.history + [(event, count)], delta))
        except InvalidBoundError:
            return False
        if not eps <= target_epsilon:
            return False
        self._certificate = Certificate(event, repr(event), count, eps, delta, self.accountant)
        return True

    def certify_most(self, event: DpEvent, max_count: int, target_epsilon: float,
                     delta: Optional[float] = None) -> int:
        """Certify as many applications of `event` as possible, up to `max_count`: `max_count`
        itself if it fits (one accountant call), else the largest count found by bisection
        (about log2(max_count) calls; ε grows with the count). Returns the count certified, 0 if
        not even one application fits (the certificate is then unchanged)."""
        if self.certify(event, max_count, target_epsilon, delta):
            return max_count
        lo, hi = 0, max_count  # certified lo (0: trivially), hi does not fit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.certify(event, mid, target_epsilon, delta):
                lo = mid
            else:
                hi = mid
        return lo

    # -- persistence ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "version": LEDGER_VERSION,
            "header": self.header,
            "accountant": self.accountant.name,
            "neighboring_relation": self.neighboring_relation.name,
            "delta": self.delta,
            "history": [{"event": event_to_dict(e), "count": c, "digest": d}
                        for (e, c), d in zip(self._history, self._digests)],
            "events": self.steps,
            "digest": self.digest,
        }

    def load_state_dict(self, state: dict) -> None:
        """Replace this ledger's state by `state` (all of it validated first: on error, nothing
        changes). Refuses a ledger recorded for another neighbouring relation, and (version 3) one
        whose events do not hash to its recorded chain."""
        version = state.get("version")
        if version not in _READABLE_VERSIONS:
            raise ValueError(f"unsupported ledger version {version!r} (this widedp reads {list(_READABLE_VERSIONS)})")
        accountant = self.accountant if state["accountant"] == self.accountant.name else make_accountant(state["accountant"])
        relation = _relation(state, version)
        if relation != accountant.neighboring_relation:
            raise ValueError(f"ledger was recorded for the {relation.name} neighbouring relation; the {accountant.name} "
                             f"accountant accounts {accountant.neighboring_relation.name}: refusing to load it")
        delta = check_delta(state["delta"])
        header = _checked_header(state.get("header")) if version >= 4 else None
        history = []
        for i, entry in enumerate(state["history"]):
            try:
                count = entry["count"]
                if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                    raise ValueError(f"count must be an integer >= 1, got {count!r}")
                history.append([event_from_dict(entry["event"]), count])
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"ledger history entry {i} is invalid: {exc}") from exc
        seed = chain_seed(header)
        digests, d = [], seed
        for i, (entry, (_, count)) in enumerate(zip(state["history"], history)):
            d = extend_chain(d, entry["event"], count)
            if version >= 3 and entry.get("digest") != d:
                raise ValueError(f"ledger history entry {i} does not hash to its recorded chain digest: the "
                                 "ledger was edited or damaged after it was written")
            digests.append(d)
        if version >= 3 and (state.get("digest") != d or state.get("events") != sum(c for _, c in history)):
            raise ValueError("the ledger's events do not hash to its recorded chain digest (or their count differs "
                             "from its recorded events): the ledger was edited or damaged after it was written")
        self.accountant, self.delta, self._history, self._digests = accountant, delta, history, digests
        self._header, self._seed = header, seed
        self._certificate = None  # it certified the history it replaced

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


def _checked_header(header) -> Optional[dict]:
    """A header is a JSON object that survives its canonical serialization unchanged."""
    if header is None:
        return None
    if not isinstance(header, dict):
        raise ValueError(f"a ledger header must be a JSON object, got {type(header).__name__}")
    try:
        return json.loads(canonical_json(header))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a ledger header must be plain JSON: {exc}") from None


def _relation(state: dict, version: int) -> NeighboringRelation:
    if version == 1:
        return NeighboringRelation.ADD_OR_REMOVE_ONE  # v1 ledgers predate the field: all add/remove one
    name = state.get("neighboring_relation")
    try:
        return NeighboringRelation[name]
    except (KeyError, TypeError):
        raise ValueError(f"ledger neighboring_relation {name!r} is not one of "
                         f"{[r.name for r in NeighboringRelation]}") from None
