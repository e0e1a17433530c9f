"""A run's release journal, `RUN_DIR/journal.jsonl`: append-only, hash-chained, one line per
session and one per charge — the record a resume checks so that it never charges fewer events
than were released (docs/DESIGN.md §1, "The ledger only grows").

ledger.json is rewritten atomically after every charge; a copy of it taken at a checkpoint is a
valid ledger of the checkpoint's length, and restoring it used to be accepted, forgetting every
step released after the checkpoint. The journal is a second record, appended (one `os.write`
of the whole line on an O_APPEND descriptor, then fsync) after ledger.json and before the
release it precedes:

    {"kind": "session", "segment", "started", "resumed", "base": {"events", "digest"},
     "debug_metrics", "debug_tensorboard", ["inherited"], "prev"}
    {"kind": "charge", "after_step", "events", "digest", "prev"}

`prev` is the chain digest before the line: d_0 = sha256("widedp-journal-chain-v1"),
d_i = sha256(d_{i-1} ‖ sha256(line i's bytes)). A checkpoint records the journal's head (lines,
digest); a resume refuses a journal that is missing, does not extend the head, or whose chain
is broken, and a ledger.json that does not extend the journal's last charge (fewer events, or
other ones). A keyed run (trainer/run/ledger_key.py) signs every line.

Sessions and lineage: every start and every resume appends a session line with a fresh
`segment` id; the run's lineage is its segments in order. A copied run directory resumed in two
places writes two different segments after the shared prefix: two models, which the data set's
budget counts separately (trainer/run/budget.py). (A run started by an older widedp has no
journal: its first session line here names the run's id as `inherited`, the lineage's start.)
The session lines also carry the settings
whose weaker meaning holds for the whole run once any session had them (train.debug_metrics:
`sticky`).

A session holds an exclusive lock on the journal (flock) while it trains: a second process
resuming the same run directory is refused.

Nothing here is private: event counts, chain digests and segment ids are data-independent.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from widedp.accounting.ledger import canonical_json
from widedp.trainer.run.ledger_key import LedgerKey, LedgerKeyError

JOURNAL_FILE = "journal.jsonl"
JOURNAL_SEED = hashlib.sha256(b"widedp-journal-chain-v1").hexdigest()
#: The settings a session line records whose weaker meaning is the whole run's once any session had them.
STICKY_KEYS = ("debug_metrics", "debug_tensorboard")


class JournalError(ValueError):
    """journal.jsonl is missing, damaged, edited or held by another process (message names the file)."""


def _link(digest: str, line: bytes) -> str:
    return hashlib.sha256(bytes.fromhex(digest) + hashlib.sha256(line).digest()).hexdigest()


class ReleaseJournal:
    """The journal of one run directory, read and verified on open (`open`)."""

    def __init__(self, path: Path, key: Optional[LedgerKey] = None):
        self.path = Path(path)
        self.key = key
        self.records: list[dict] = []
        self.digest = JOURNAL_SEED
        self._digests: list[str] = []  # chain digest after each line
        self._fd: Optional[int] = None

    # ---- reading -----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: Path, key: Optional[LedgerKey] = None, signed: Optional[bool] = None) -> "ReleaseJournal":
        """Read and verify `path` (missing: an empty journal). `signed`: whether the run is keyed
        (every line must then carry a valid signature under `key`)."""
        journal = cls(path, key)
        if not journal.path.exists():
            return journal
        try:
            data = journal.path.read_bytes()
        except OSError as exc:
            raise JournalError(f"{journal.path}: cannot read ({exc.strerror or exc})") from None
        lines = data.split(b"\n")
        complete, tail = lines[:-1], lines[-1]
        # A last line without its newline is a write a machine crash cut off: that charge never
        # completed, so its release never happened (it follows the fsync of the whole line).
        del tail
        for number, line in enumerate(complete, start=1):
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise JournalError(f"{journal.path}: line {number} is not JSON ({exc}); the journal is append-only: "
                                   "it was edited or damaged") from None
            if not isinstance(record, dict) or record.get("kind") not in ("session", "charge"):
                raise JournalError(f"{journal.path}: line {number} is not a journal record")
            if record.get("prev") != journal.digest:
                raise JournalError(f"{journal.path}: line {number} does not continue the journal's hash chain: lines "
                                   "were removed, reordered or edited")
            if signed and key is not None:
                try:
                    key.verify(record, f"{journal.path}: line {number}")
                except LedgerKeyError as exc:
                    raise JournalError(str(exc)) from None
            journal.records.append(record)
            journal.digest = _link(journal.digest, line)
            journal._digests.append(journal.digest)
        return journal

    @property
    def lines(self) -> int:
        return len(self.records)

    def head(self) -> dict:
        """What a checkpoint records: {"lines", "digest"}."""
        return {"lines": self.lines, "digest": self.digest}

    def digest_at(self, lines: int) -> str:
        if not 0 <= lines <= self.lines:
            raise ValueError(f"the journal has {self.lines} lines, not {lines}")
        return JOURNAL_SEED if lines == 0 else self._digests[lines - 1]

    def extends(self, head: dict) -> bool:
        n = int(head["lines"])
        return n <= self.lines and self.digest_at(n) == head["digest"]

    @property
    def segments(self) -> list[str]:
        """The run's lineage: the segment id of every session, in order."""
        out: list[str] = []
        for r in self.records:
            if r["kind"] == "session":
                out += [str(s) for s in r.get("inherited") or []] + [r["segment"]]
        return out

    @property
    def sticky(self) -> dict:
        """Each sticky setting: whether any session had it."""
        return {k: any(bool(r.get(k)) for r in self.records if r["kind"] == "session") for k in STICKY_KEYS}

    @property
    def last_charge(self) -> Optional[dict]:
        """The last charge line ({"events", "digest", "step"}), None before any."""
        for record in reversed(self.records):
            if record["kind"] == "charge":
                return record
        return None

    @property
    def charges(self) -> int:
        return sum(1 for r in self.records if r["kind"] == "charge")

    def check_ledger(self, ledger, ledger_file: Path, remedy: str) -> None:
        """The ledger must hold every event the journal says was charged before a release."""
        last = self.last_charge
        if last is None:
            return
        events = int(last["events"])
        if ledger.steps < events:
            raise JournalError(f"{ledger_file}: holds {ledger.steps} charged events, but {self.path} records "
                               f"{events} charged before releases (the last after step {last.get('after_step')}): "
                               f"ledger.json was rolled back or replaced by an older copy; {remedy}")
        if ledger.digest_at(events) != last["digest"]:
            raise JournalError(f"{ledger_file}: its first {events} events differ from those {self.path} records as "
                               f"charged (chain digest {ledger.digest_at(events)[:12]}… vs {last['digest'][:12]}…): it "
                               f"was replaced or edited; {remedy}")

    # ---- writing -----------------------------------------------------------------------------
    def lock(self) -> None:
        """Hold the journal for this session (created if missing): `hold` it, then `adopt`."""
        if self._fd is None:
            fd = hold(self.path, new=False, create=True)
            assert fd is not None
            self.adopt(fd)

    def adopt(self, fd: int) -> None:
        """Take over `fd`, a descriptor of this journal that `hold` locked; a torn last line
        (module docstring) is dropped before anything is appended."""
        size = os.fstat(fd).st_size
        complete = sum(len(line) + 1 for line in self.path.read_bytes().split(b"\n")[:-1])
        if size > complete:
            os.ftruncate(fd, complete)
        self._fd = fd

    def identity(self) -> dict:
        """Which file this journal is, on which machine (the data set's budget tells a session
        resumed in this very file from one resumed in a copy: trainer/run/budget.py)."""
        st = os.fstat(self._fd) if self._fd is not None else os.stat(self.path)
        return {"machine": machine_id(), "dev": int(st.st_dev), "ino": int(st.st_ino)}

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None

    def _append(self, record: dict) -> None:
        if self._fd is None:
            self.lock()
        assert self._fd is not None
        record = {**record, "prev": self.digest}
        if self.key is not None:
            record = self.key.sign(record)
        line = canonical_json(record)
        data = line + b"\n"
        written = os.write(self._fd, data)
        if written != len(data):
            raise JournalError(f"{self.path}: short write ({written} of {len(data)} bytes)")
        os.fsync(self._fd)
        self.records.append(json.loads(line))
        self.digest = _link(self.digest, line)
        self._digests.append(self.digest)

    def begin_session(self, segment: str, started: str, resumed: bool, base: dict, sticky: dict,
                      inherited: Optional[list] = None) -> None:
        """A session's line, before it charges or releases anything. `inherited`: the lineage
        before this journal (a run of an older widedp, resumed)."""
        self._append({"kind": "session", "segment": segment, "started": started, "resumed": bool(resumed),
                      "base": {"events": int(base["events"]), "digest": base["digest"]},
                      **{k: bool(sticky.get(k, False)) for k in STICKY_KEYS},
                      **({"inherited": list(inherited)} if inherited else {})})

    def charged(self, chain: dict, after_step: int) -> None:
        """After ledger.json holds `chain` (events, digest), before the release it pays for
        (`after_step`: the steps completed before that release)."""
        self._append({"kind": "charge", "after_step": int(after_step), "events": int(chain["events"]),
                      "digest": chain["digest"]})

    def holds_a_charge(self) -> bool:
        return any(r["kind"] == "charge" for r in self.records)


def hold(path: Path, new: bool, create: bool = False) -> Optional[int]:
    """Open and lock a run's journal for one session, before anything of the run is read or
    written: `new`, a new run's, created here (O_EXCL: a journal already there is a run, refused);
    else an existing run's (None when there is none and not `create`: a run of an older widedp).
    JournalError when another process holds it."""
    flags = os.O_RDWR | os.O_APPEND
    try:
        if new:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        elif create:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, flags | os.O_CREAT, 0o644)
        else:
            fd = os.open(path, flags)
    except FileExistsError:
        raise JournalError(f"{Path(path).parent} holds a run ({Path(path).name}): a run directory is never "
                           f"overwritten; continue it with `widedp train --resume {Path(path).parent}`") from None
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise JournalError(f"{path}: another process is training this run (it holds the journal); one session at "
                           "a time") from None
    return fd


def machine_id() -> str:
    """This machine's id (systemd's /etc/machine-id), else its host name."""
    for candidate in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            text = Path(candidate).read_text().strip()
        except OSError:
            continue
        if text:
            return text
    import socket

    return socket.gethostname()


def journal_holds_a_record(path: Path) -> bool:
    """Whether journal.jsonl holds more than session lines (a new run that failed before its
    first charge left only its own session line: nothing to keep)."""
    try:
        for line in Path(path).read_bytes().split(b"\n"):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or record.get("kind") != "session":
                return True
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return True
    return False
