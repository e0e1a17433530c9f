"""The privacy budget of a data set across runs: `DATASET/privacy_budget.jsonl`, append-only and
hash-chained, with its head in `DATASET/privacy_budget.head.json`.

ε of one model is what *that model* reveals. Every model trained on the same data reveals more:
two models trained at ε = 8 each are, together, a release at up to ε = 16 (basic composition),
and tuning runs count like any other (docs/DESIGN.md §1, "The ledger only grows"). So every
session of `widedp train` on a data set (and every `widedp audit`, whose run also trains on it)
appends one JSON line per update of its spending:

    {"run_id", "lineage", "base_events", "run_dir", "mode", "target_epsilon", "delta", "accountant",
     "epsilon", "events_charged", "steps", "started", "updated", "status", "audit", "privacy_unit",
     "voids", "prev"}

`status` is "running" (appended before the session's first step: a crash leaves this line, and
the run can never spend more than its target_epsilon), "finished", "interrupted" or "failed".

**Models, not directory names.** `lineage` is the run's list of session segments (its journal,
trainer/run/journal.py): every start and resume adds a fresh segment, so a run directory copied
and resumed in two places becomes two lineages sharing a prefix — two models. `base_events` is
the ledger's length when the session started. A lineage is *superseded* (its spending is
included in a later line's) by a lineage that extends it by one segment and started where it
ended: at or after its last recorded events once it ended, or in the same run directory while
its line still says "running" (a crashed session, resumed; one session at a time holds a run
directory). Every other lineage is a model of its own: `summary` sums them.

**Voiding runs.** A line's `voids` lists why its ε does not bound what the run released
(`run_semantics.void_reasons`: non-private, reproducible — the seed is in config.json —,
train.debug_metrics in any session; an audit run trained deliberately broken): such a run counts
as ε = ∞, and the total with it, with the reasons listed.

**The file only grows, and its loss is detected.** Line i carries `prev`, the chain digest
before it: d_0 = sha256("widedp-budget-chain-v1"), d_i = sha256(d_{i-1} ‖ sha256(line i)). The
head file holds (budget_id, lines, digest) after the last append; every append and every read
verifies the file against it and refuses (naming the file) a budget file that is missing while
the head records lines, shorter than the head, or whose lines do not hash to it — never
re-created silently when runs are on record. Every run's checkpoint records the head after its
own line, and a resume refuses a budget that does not extend it: the file was truncated or
replaced, or data.path is a *copy* of the data set the run started on (a copy's budget is
another file: see README, "Copies of a data set"). An append holds an exclusive lock
(`privacy_budget.lock`), so concurrent runs cannot interleave or fork the chain; each line is
one `os.write` on an O_APPEND descriptor, fsync'd before the head is replaced. The head is
created before the first chained line, so a crash between a line and its head leaves a head
behind the lines (accepted), never chained lines without a head. A data set at an s3:// URI
keeps the same two objects, replaced by conditional writes (`_ObjectBudget`). A budget file
from an older widedp (no `prev` and no head) is accepted and chained from its next line.

`widedp budget DATASET` prints, per model (each lineage not superseded), its latest line, and
the total: the sum of the models' ε (its spent ε once it ended, its target while it may still
run) — an upper bound on what all of them together reveal by basic composition, at δ = the sum
of their δs. It is not tight (a tight composition would compose every run's ledger under one
accountant); it is what one can state without trusting any run's ledger beyond its ε.
Nothing here is private: ε, δ, step counts and segment ids are data-independent.

**Tunings** (`widedp tune`, trainer/run/tune.py): the tuning appends a line of its own
(`kind` = "tuning", its `run_id` the tuning's id, at its target ε while "running") before its
first trial, and every trial's lines carry that id (`tuning_id`); a trial of a tuning on record
is counted inside it (the tuning's ε bounds all of its trials together, Papernot & Steinke 2022),
not as a model of its own. The file therefore records how many trials ran: it stays with the
data set, inside the trust boundary (docs/THREAT_MODEL.md); the tuning's release does not say.

Privacy units (privacy_unit; lines without one are example level): the total is per example. A
user-level run's (ε, δ) bounds one example only through the user holding it — removing one
example of a user is two user-level steps away (remove the user, add them back without it) —
so it counts as (2ε, (1 + e^ε)·δ) there (group privacy of size 2). The user-level total sums
the user-level runs, and is infinite once any private example-level run trained on the data
set: such a run protects a user with m examples only as a group of m, and m is not bounded.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

from widedp.trainer.data.errors import DataError
from widedp.trainer.data.format.remote import RemoteDir, dataset_of, local_path, refuse_staged_copy, remote_dir

BUDGET_FILE = "privacy_budget.jsonl"
HEAD_FILE = "privacy_budget.head.json"
LOCK_FILE = "privacy_budget.lock"
STATUSES = ("running", "finished", "interrupted", "failed")
BUDGET_SEED = hashlib.sha256(b"widedp-budget-chain-v1").hexdigest()


class BudgetError(ValueError):
    """The budget file is missing, truncated, edited, or not the one a run recorded (names the file)."""


def budget_path(dataset_dir) -> Path:
    """The budget file of a local data set (`budget_location` names it for any data set)."""
    return local_path(dataset_dir) / BUDGET_FILE


def head_path(dataset_dir) -> Path:
    return local_path(dataset_dir) / HEAD_FILE


def budget_location(dataset_dir) -> str:
    """Where the budget of the data set at `dataset_dir` (a local path or a URI) is: an absolute
    path, or the object's URI (without the URI's options)."""
    remote = remote_dir(dataset_dir)
    return remote.where(BUDGET_FILE) if remote is not None else str(budget_path(dataset_dir).absolute())


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_record(*, run_id: str, run_dir, mode: str, target_epsilon: float, delta: Optional[float],
               accountant: Optional[str], epsilon: float, events_charged: Optional[int], steps: int, started: str,
               status: str, audit: bool = False, privacy_unit: str = "example", lineage: Optional[list] = None,
               base_events: Optional[int] = None, voids: Optional[list] = None, dir_identity: Optional[dict] = None,
               ledger_key_id: Optional[str] = None, tuning_id: Optional[str] = None, kind: str = "run") -> dict:
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    return {"run_id": run_id, "lineage": list(lineage) if lineage else [run_id],
            "base_events": None if base_events is None else int(base_events),
            "run_dir": str(Path(run_dir).absolute()), "mode": mode,
            "target_epsilon": float(target_epsilon), "delta": delta, "accountant": accountant,
            "epsilon": float(epsilon), "events_charged": None if events_charged is None else int(events_charged), "steps": int(steps),
            "started": started, "updated": now(), "status": status, "audit": bool(audit),
            "privacy_unit": privacy_unit, "voids": list(voids or []), "dir_identity": dir_identity,
            "ledger_key_id": ledger_key_id,
            **({"tuning_id": tuning_id} if tuning_id is not None else {}), **({"kind": kind} if kind != "run" else {})}


def _link(digest: str, line: bytes) -> str:
    return hashlib.sha256(bytes.fromhex(digest) + hashlib.sha256(line).digest()).hexdigest()


class _Verified:
    """The budget file as verified: its records, the chain digest after each line, its id."""

    def __init__(self, records: list[dict], digests: list[str], budget_id: Optional[str]):
        self.records, self.digests, self.budget_id = records, digests, budget_id

    @property
    def lines(self) -> int:
        return len(self.records)

    @property
    def digest(self) -> str:
        return self.digests[-1] if self.digests else BUDGET_SEED

    def digest_at(self, lines: int) -> str:
        return BUDGET_SEED if lines == 0 else self.digests[lines - 1]

    def head(self, dataset_dir) -> dict:
        return {"budget_id": self.budget_id, "lines": self.lines, "digest": self.digest,
                "path": budget_location(dataset_dir)}

    def head_record(self) -> dict:
        """The head file's contents for this state ({"budget_id", "lines", "digest"}); a budget
        with no id yet is given one (its first chained line will carry it)."""
        return {"budget_id": self.budget_id or uuid.uuid4().hex, "lines": self.lines, "digest": self.digest}

    def extends(self, head: dict) -> bool:
        n = int(head.get("lines", 0))
        return (head.get("budget_id") in (None, self.budget_id) and n <= self.lines
                and self.digest_at(n) == head.get("digest"))


def _read_head(dataset_dir) -> Optional[dict]:
    path = head_path(dataset_dir)
    if not path.exists():
        return None
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BudgetError(f"{path}: unreadable ({exc}): the budget's head was damaged or edited") from None
    return _parse_head(data, str(path))


def _parse_head(data: bytes, path: str) -> dict:
    try:
        head = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BudgetError(f"{path}: unreadable ({exc}): the budget's head was damaged or edited") from None
    if not isinstance(head, dict) or not isinstance(head.get("lines"), int) or not isinstance(head.get("digest"), str):
        raise BudgetError(f"{path}: not a budget head (lines, digest)")
    return head


def _verified(dataset_dir) -> _Verified:
    """Read and verify the budget file against its chain and head (module docstring)."""
    remote = remote_dir(dataset_dir)
    if remote is not None:
        return _ObjectBudget(remote).verified()[0]
    path = budget_path(dataset_dir)
    head = _read_head(dataset_dir)
    return _verify(path.read_bytes() if path.exists() else None, head, str(path), str(head_path(dataset_dir)))


def _verify(data: Optional[bytes], head: Optional[dict], path: str, hpath: str) -> _Verified:
    """The budget file's bytes (None: there is none) verified against its chain and `head`
    (None: no head); BudgetError naming `path` / `hpath`."""
    if data is None:
        if head is not None and head["lines"] > 0:
            raise BudgetError(f"{path}: missing, but {hpath} records {head['lines']} lines of spending on this data "
                              "set: the budget file was deleted or moved; restore it (a budget is never re-created "
                              "while runs are on record)")
        return _Verified([], [], head.get("budget_id") if head else None)
    records, digests, d, chained = [], [], BUDGET_SEED, False
    budget_id = head.get("budget_id") if head else None
    lines = data.split(b"\n")
    if lines[-1].strip() and (head is None or len([x for x in lines[:-1] if x.strip()]) >= head["lines"]):
        # a last line without its newline, past the head: a write a machine crash cut off (the head
        # is replaced only after the whole line is on disk): not a record; `append` drops it
        lines = lines[:-1]
    for i, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BudgetError(f"{path}: line {i} is not JSON ({exc}); the file is append-only: a damaged line "
                              "means it was edited or a write was cut off") from None
        if not isinstance(record, dict) or "run_id" not in record:
            raise BudgetError(f"{path}: line {i} is not a run record (no run_id)")
        if "prev" in record:
            if record["prev"] != d:
                raise BudgetError(f"{path}: line {i} does not continue the file's hash chain: lines before it were "
                                  "removed, reordered or edited")
            chained = True
            budget_id = budget_id or record.get("budget_id")
        elif chained:
            raise BudgetError(f"{path}: line {i} carries no chain digest after chained lines: it was inserted")
        d = _link(d, raw)
        records.append(record)
        digests.append(d)
    verified = _Verified(records, digests, budget_id)
    if head is None:
        if chained:
            raise BudgetError(f"{path}: its lines are chained but {hpath} is missing: the budget's head was deleted "
                              "(it guards the file against truncation)")
        return verified  # an older widedp's file: chained from its next line
    if head["lines"] > verified.lines:
        raise BudgetError(f"{path}: holds {verified.lines} lines, fewer than the {head['lines']} {hpath} records: it "
                          "was truncated or replaced by an older copy")
    if verified.digest_at(head["lines"]) != head["digest"]:
        raise BudgetError(f"{path}: its first {head['lines']} lines do not hash to the digest {hpath} records: it was "
                          "edited or replaced")
    return verified


@contextlib.contextmanager
def _locked(dataset_dir) -> Iterator[None]:
    path = local_path(dataset_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise BudgetError(f"{budget_path(dataset_dir)}: cannot append this run's privacy spending "
                          f"({exc.strerror or exc}); every run on a data set is recorded there: make the data set "
                          "directory writable") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def append(dataset_dir, record: dict) -> dict:
    """Append one line to DATASET/privacy_budget.jsonl (verified first; one write of the whole
    line, fsync'd) and replace the head. Returns the head after it ({"budget_id", "lines",
    "digest", "path"}). BudgetError naming the file when it cannot be written or verified (a
    run must not train unrecorded). A data set at an s3:// URI: the same two objects, each
    replaced by a conditional write (`_ObjectBudget`)."""
    from widedp.accounting.atomic import atomic_write_bytes

    remote = remote_dir(dataset_dir)
    if remote is not None:
        return _ObjectBudget(remote).append(record)
    refuse_staged_copy(dataset_dir)  # a staged copy's spending belongs at its URI
    path = budget_path(dataset_dir)
    with _locked(dataset_dir):
        verified = _verified(dataset_dir)
        try:
            if not head_path(dataset_dir).exists():
                # the head before the first chained line: a crash between the line and its head then
                # leaves a head one line behind (accepted), never chained lines without one (refused)
                atomic_write_bytes(head_path(dataset_dir), _head_bytes(verified.head_record()))
                _fsync_directory(head_path(dataset_dir).parent)  # the head's name on disk before any line
                verified = _verified(dataset_dir)
        except OSError as exc:
            raise BudgetError(f"{path}: cannot append this run's privacy spending ({exc.strerror or exc}); every run "
                              f"on a data set is recorded there: make the data set directory writable") from exc
        raw, head = _next_line(verified, record)
        line = raw + b"\n"
        try:
            created = not path.exists()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                _drop_torn_tail(fd, path)
                written = os.write(fd, line)
                if written != len(line):
                    raise OSError(f"short write ({written} of {len(line)} bytes)")
                os.fsync(fd)
            finally:
                os.close(fd)
            if created:
                _fsync_directory(path.parent)
            atomic_write_bytes(head_path(dataset_dir), _head_bytes(head))
        except OSError as exc:
            raise BudgetError(f"{path}: cannot append this run's privacy spending ({exc.strerror or exc}); every run "
                              f"on a data set is recorded there: make the data set directory writable") from exc
    return {**head, "path": str(path.absolute())}


def _fsync_directory(directory: Path) -> None:
    """Make a file's creation in `directory` durable (its entry, not only its bytes)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _head_bytes(head: dict) -> bytes:
    return (json.dumps(head, sort_keys=True) + "\n").encode()


def _next_line(verified: _Verified, record: dict) -> tuple[bytes, dict]:
    """(the line appending `record` to the verified budget, without its newline; the head after it)."""
    record = {k: v for k, v in record.items() if k not in ("prev", "budget_id")}
    budget_id = verified.budget_id or uuid.uuid4().hex
    if not any("prev" in r for r in verified.records):
        record["budget_id"] = budget_id  # the first chained line names the budget (the head names it too)
    record["prev"] = verified.digest
    raw = json.dumps(record, sort_keys=True, allow_nan=True).encode()
    return raw, {"budget_id": budget_id, "lines": verified.lines + 1, "digest": _link(verified.digest, raw)}


#: beside a budget on S3: the object `_ObjectBudget.check_conditional_writes` probes the store with
CHECK_FILE = "privacy_budget.conditional-check"
_CONDITIONAL_WRITES_CHECKED: set = set()
_CLIENTS: dict = {}


class _ObjectBudget:
    """The budget of a data set at an s3:// URI: the same two objects as on disk
    (privacy_budget.jsonl, privacy_budget.head.json), each replaced whole by a **conditional
    write** (If-Match on the ETag read, If-None-Match: * for the first): two runs appending at
    once cannot both succeed on one version, so the loser re-reads, re-verifies and appends
    after the winner's line — the object store's compare-and-swap in place of the local
    file's lock. The head is advanced the same way and never moved back (a head already past
    this line, written by a later appender, stays). A crash between the two writes leaves the
    head one line behind, which the verification accepts (as on disk).

    Args:
        remote: the data set's `RemoteDir` (its endpoint and region options are boto3's too).
    """

    ATTEMPTS = 64

    def __init__(self, remote: RemoteDir):
        self.remote = remote
        if remote.scheme not in ("s3", "s3a"):
            raise BudgetError(f"{remote.where(BUDGET_FILE)}: a data set's budget at a URI needs conditional writes "
                              "(so that two runs never overwrite each other's spending); widedp writes it on "
                              "s3:// (and S3-compatible servers) only: keep this data set on S3 or a local or "
                              "shared filesystem")
        self.bucket, self.prefix = remote.bucket_and_prefix()
        endpoint = remote.option("endpoint_override")
        if endpoint and "://" not in endpoint:
            endpoint = f"{remote.option('scheme') or 'https'}://{endpoint}"
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise BudgetError(f"{remote.where(BUDGET_FILE)}: writing a budget on S3 needs boto3 (a dependency of "
                              "widedp: reinstall it)") from None
        where = (endpoint or None, remote.option("region") or None)
        if where not in _CLIENTS:  # one client per store and process (every budget read makes an _ObjectBudget)
            _CLIENTS[where] = boto3.client("s3", endpoint_url=where[0], region_name=where[1],
                                           config=Config(connect_timeout=10, read_timeout=60,
                                                         retries={"max_attempts": 3}))
        self.client = _CLIENTS[where]

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _get(self, name: str) -> tuple[Optional[bytes], Optional[str]]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
            return answer["Body"].read(), answer["ETag"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None, None
            raise BudgetError(f"{self.remote.where(name)}: cannot read it ({exc})") from None
        except BotoCoreError as exc:
            raise BudgetError(f"{self.remote.where(name)}: cannot read it ({exc})") from None

    def _put(self, name: str, body: bytes, etag: Optional[str]) -> bool:
        """Replace `name` if it is still at `etag` (None: only if absent); False when it was not."""
        from botocore.exceptions import BotoCoreError, ClientError

        condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=body, **condition)
            return True
        except ClientError as exc:
            error = exc.response.get("Error", {}).get("Code")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if error in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return False
            raise BudgetError(f"{self.remote.where(name)}: cannot append this run's privacy spending ({exc}); "
                              "every run on a data set is recorded there: give the run write access to it") from None
        except BotoCoreError as exc:
            raise BudgetError(f"{self.remote.where(name)}: cannot append this run's privacy spending ({exc})") from None

    def verified(self) -> tuple[_Verified, Optional[bytes], Optional[str], Optional[str]]:
        """(the verified budget, the file's bytes, their ETag, the head's ETag)."""
        head_raw, head_etag = self._get(HEAD_FILE)
        data, data_etag = self._get(BUDGET_FILE)
        if head_raw is None and data is not None and b'"prev"' in data:
            # another run created the head and its first line between the two reads: the head again
            head_raw, head_etag = self._get(HEAD_FILE)
        where, hwhere = self.remote.where(BUDGET_FILE), self.remote.where(HEAD_FILE)
        head = None if head_raw is None else _parse_head(head_raw, hwhere)
        return _verify(data, head, where, hwhere), data, data_etag, head_etag

    def check_conditional_writes(self) -> None:
        """Refuse a store that ignores If-None-Match or If-Match (some S3-compatible servers do):
        there two runs' writes would both succeed and one's line be lost. Probed once per process
        and location, on an object of its own beside the budget (`CHECK_FILE`): created if
        absent; then written only if absent, and with another ETag, which must both fail; then
        with its own ETag, which must succeed."""
        key = (self.remote.where(""), self.bucket, self.prefix)
        if key in _CONDITIONAL_WRITES_CHECKED:
            return
        self._put(CHECK_FILE, b"widedp: this store honours conditional writes\n", None)
        ignored = []
        if self._put(CHECK_FILE, b"widedp: this store ignored If-None-Match\n", None):
            ignored.append("If-None-Match: * on an object that exists")
        _, etag = self._get(CHECK_FILE)
        if self._put(CHECK_FILE, b"widedp: this store ignored If-Match\n", '"widedp-not-an-etag"'):
            ignored.append("If-Match with another ETag")
        elif etag is None or not self._put(CHECK_FILE, b"widedp: this store honours conditional writes\n", etag):
            ignored.append("If-Match with the object's own ETag (refused)")
        if ignored:
            raise BudgetError(f"{self.remote.where(BUDGET_FILE)}: the object store did not honour conditional writes "
                              f"on {self.remote.where(CHECK_FILE)} ({'; '.join(ignored)}); two runs appending at once "
                              "would lose a line of spending: keep the data set's budget on a store that honours "
                              "them (AWS S3 does)")
        _CONDITIONAL_WRITES_CHECKED.add(key)

    def append(self, record: dict) -> dict:
        import random
        import time

        self.check_conditional_writes()
        for attempt in range(self.ATTEMPTS):
            verified, data, data_etag, head_etag = self.verified()
            if head_etag is None:
                # the head before the first chained line (a head behind the lines is accepted, chained
                # lines without a head are not): then read again, with the head's version
                self._put(HEAD_FILE, _head_bytes(verified.head_record()), None)
                continue
            raw, head = _next_line(verified, record)
            kept = b"" if data is None else data[:data.rfind(b"\n") + 1]  # a torn tail is not a record
            if self._put(BUDGET_FILE, kept + raw + b"\n", data_etag):
                self._advance_head(head, head_etag)
                return {**head, "path": self.remote.where(BUDGET_FILE)}
            time.sleep(random.uniform(0, min(1.0, 0.01 * 2 ** min(attempt, 7))))  # another run appended: again
        raise BudgetError(f"{self.remote.where(BUDGET_FILE)}: other runs kept appending; this run's spending was not "
                          f"recorded after {self.ATTEMPTS} attempts (nothing trained): start it again")

    def _advance_head(self, head: dict, etag: Optional[str]) -> None:
        body = _head_bytes(head)
        for _ in range(self.ATTEMPTS):
            if self._put(HEAD_FILE, body, etag):
                return
            current, etag = self._get(HEAD_FILE)
            if current is not None and _parse_head(current, self.remote.where(HEAD_FILE))["lines"] >= head["lines"]:
                return  # a later append's head (it appended after this line): never moved back
        raise BudgetError(f"{self.remote.where(HEAD_FILE)}: could not advance the budget's head past line "
                          f"{head['lines']} (other runs kept replacing it); the line is recorded")


def _same_location(a: str, b: str) -> bool:
    """Whether two recorded budget locations name one file: one object on one store (bucket,
    key and endpoint host compared; a URI's other options, and the endpoint's scheme, not), or
    one local file (symlinks resolved)."""
    if a == b:
        return True
    ra, rb = remote_dir(dataset_of(a)), remote_dir(dataset_of(b))
    if ra is None and rb is None:
        try:
            return os.path.samefile(a, b)
        except OSError:
            return os.path.realpath(a) == os.path.realpath(b)
    if ra is None or rb is None:
        return False

    def key(r: RemoteDir, where: str) -> tuple:
        endpoint = (r.option("endpoint_override") or "").split("://")[-1].rstrip("/").lower()
        return (r.scheme.replace("s3a", "s3"), *r.bucket_and_prefix(), where.split("?")[0].rsplit("/", 1)[-1],
                endpoint)

    return key(ra, a) == key(rb, b)


def _has_budget(dataset_dir) -> bool:
    remote = remote_dir(dataset_dir)
    if remote is not None:
        return _ObjectBudget(remote)._get(BUDGET_FILE)[0] is not None
    return budget_path(dataset_dir).exists()


def _drop_torn_tail(fd: int, path: Path) -> None:
    """Truncate a last line without its newline (see `_verified`) before appending."""
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete < len(data):
        os.ftruncate(fd, complete)


def read(dataset_dir) -> list[dict]:
    """Every line of the budget file, in order ([] when there is none), verified (BudgetError
    naming the file and line otherwise: a damaged file is reported, never skipped)."""
    return _verified(dataset_dir).records


def head(dataset_dir) -> dict:
    """The verified budget's head ({"budget_id", "lines", "digest", "path"})."""
    return _verified(dataset_dir).head(dataset_dir)


def check_recorded_head(dataset_dir, recorded: Optional[dict], what: str) -> None:
    """A resumed run's checkpoint recorded the budget's head after its own line: the data set's
    budget must extend it, else the run's spending would land where the run's earlier spending
    is not (BudgetError naming both)."""
    if not recorded:
        return  # a checkpoint of an older widedp
    verified = _verified(dataset_dir)
    path = budget_location(dataset_dir)
    recorded_path = recorded.get("path")
    if not verified.extends(recorded):
        where = f" (it recorded {recorded_path})" if recorded_path and not _same_location(str(recorded_path), path) else ""
        raise BudgetError(f"{path}: does not hold this run's earlier spending ({what} records the budget at line "
                          f"{recorded.get('lines')}, digest {str(recorded.get('digest'))[:12]}…, budget id "
                          f"{recorded.get('budget_id')}){where}: the budget file was replaced or truncated, or "
                          f"data.path is a copy of the data set the run started on; resume on that data set")
    if recorded_path and not _same_location(str(recorded_path), path):
        original = dataset_of(str(recorded_path))
        try:
            other = _verified(original) if _has_budget(original) else None
        except (BudgetError, DataError, OSError):
            other = None
        if other is not None and other.budget_id == verified.budget_id:
            raise BudgetError(f"{path}: data.path is a copy of {original}, where this run's spending is recorded "
                              f"({what}); both directories hold the budget {verified.budget_id}: resume with "
                              f"data.path = {original} (a copy's budget counts separately: README, \"Copies of a "
                              "data set\")")


def check_run(dataset_dir, lineage: list, key_id: Optional[str], ledger_file, remedy: str) -> None:
    """What the data set's budget (outside the run directory) recorded of a run, against the
    run's records: the lines of every session of the run recorded its ledger key's id — records
    now unsigned or signed with another key were replaced (BudgetError naming both files).

    (A run directory restored whole to an earlier state — its ledger, journal and checkpoint
    together — is not refused here: it is a fork of the run from that state, whose own ledger
    states its model's ε exactly; the session it forked from keeps its lines, so `models` counts
    both — the restored session starts behind where that one ended.)"""
    if not _has_budget(dataset_dir):
        return
    mine = tuple(lineage)
    for number, record in enumerate(_verified(dataset_dir).records, start=1):
        lin = _lineage(record)
        if lin != mine[:len(lin)]:
            continue
        signed = record.get("ledger_key_id")
        if signed is not None and signed != key_id:
            state = "unsigned" if key_id is None else f"signed with key id {key_id}"
            raise BudgetError(f"{ledger_file}: the run's records are {state}, but {budget_location(dataset_dir)} line "
                              f"{number} records its session {lin[-1][:12]}… as signed with ledger key id {signed}: "
                              f"they were replaced; {remedy}")


def _lineage(record: dict) -> tuple:
    return tuple(record.get("lineage") or [record["run_id"]])


def _voids(record: dict) -> list:
    return list(record.get("voids") or [])


def _bound(record: dict) -> float:
    """What a run can have spent: ∞ for a voiding run, its ε once it ended, its target while it may still run."""
    if record.get("mode") == "nonprivate" or _voids(record):
        return math.inf
    spent = float(record.get("epsilon", math.inf))
    if record.get("status") == "running":
        return max(spent, float(record.get("target_epsilon", math.inf)))
    return spent


def _supersedes(later: dict, earlier: dict) -> bool:
    """Whether `later`'s session continued from where `earlier`'s lineage ended (module docstring)."""
    lin, prefix = _lineage(later), _lineage(earlier)
    if len(lin) != len(prefix) + 1 or lin[:-1] != prefix:
        return False
    base = later.get("base_events")
    if base is None:  # an older widedp's line: a resume of the same run
        return True
    if earlier.get("status") == "running":
        # a session that may still be training elsewhere is included only by one that continued it
        # in the very same journal file on the same machine: that one held the file's lock, which
        # the earlier session held while it trained, so the earlier one had ended, and everything
        # it released is charged in that file (a copy, even at the same path, is another file)
        same = earlier.get("dir_identity")
        return same is not None and later.get("dir_identity") == same and later.get("run_dir") == earlier.get("run_dir")
    return int(base) >= int(earlier.get("events_charged") or 0)


def models(records: list[dict]) -> list[dict]:
    """Each model's latest line: every lineage that no later session continued (module docstring)."""
    latest: dict[tuple, dict] = {}
    first_line: dict[tuple, dict] = {}
    for record in records:
        lin = _lineage(record)
        latest[lin] = record  # dicts keep first-insertion order: models in order of start
        first_line.setdefault(lin, record)
    return [r for lin, r in latest.items()
            if not any(_supersedes(first_line[other], r) for other in latest if len(other) == len(lin) + 1)]


def summary(dataset_dir) -> dict:
    """Per-model spending (each lineage not superseded, its latest line) and the basic-composition total."""
    path = budget_location(dataset_dir)
    remote = remote_dir(dataset_dir)
    if remote is not None:
        if not remote.exists("partitions.json"):
            raise ValueError(f"{dataset_dir}: no partitions.json (not a partitioned widedp data set)")
    elif not (local_path(dataset_dir) / "dataset.json").exists() and not (local_path(dataset_dir) / "partitions.json").exists():
        raise ValueError(f"{dataset_dir}: no dataset.json or partitions.json (not a widedp data set directory)")
    verified = _verified(dataset_dir)
    latest = models(verified.records)
    tunings = {r["run_id"] for r in latest if r.get("kind") == "tuning"}
    # a trial of a tuning on record is part of it (its ε is inside the tuning's: trainer/run/tune.py);
    # a line naming a tuning the file does not hold counts on its own
    runs = [dict(r, lineage=list(_lineage(r)), voids=_voids(r), epsilon_bound=_bound(r))
            for r in latest if r.get("tuning_id") not in tunings]
    private = [r for r in runs if r.get("mode") != "nonprivate"]
    user = [r for r in private if r.get("privacy_unit", "example") == "user"]
    per_example = [(2 * r["epsilon_bound"], (1 + math.exp(min(r["epsilon_bound"], 700))) * (r.get("delta") or 0.0))
                   if r in user else (r["epsilon_bound"], r.get("delta") or 0.0) for r in private]
    voided = [{"run_dir": r["run_dir"], "lineage": r.get("lineage"), "reasons": _voids(r) or
               ["train.mode = nonprivate: no privacy guarantee"]}
              for r in runs if r.get("mode") == "nonprivate" or _voids(r)]
    return {
        "dataset": str(dataset_dir),
        "budget_file": str(path),
        "budget_id": verified.budget_id,
        "lines": verified.lines,
        "runs": runs,
        "num_runs": len(runs),
        "total_epsilon": math.inf if voided else sum(e for e, _ in per_example),
        "total_delta": sum(d for _, d in per_example),
        "user_total_epsilon": (math.inf if voided or len(user) < len(private)
                               else sum(r["epsilon_bound"] for r in user)) if user else None,
        "user_total_delta": sum(r.get("delta") or 0.0 for r in user) if user else None,
        "voided_by": voided,
        "composition": ("basic composition: an upper bound on what all these models together reveal about one "
                        "example, at δ = total_delta (the sum of their δs; a user-level run counts as (2ε, "
                        "(1 + e^ε)·δ) for one example). One entry per model: a run directory copied and resumed "
                        "in two places is two models (their lineages fork). A model whose latest line is 'running' "
                        "counts at its target ε (it may have crashed or still be training). Tuning and audit runs "
                        "count like any other; a run in voided_by (non-private, reproducible, debug statistics, a "
                        "deliberately broken audit) makes the total infinite. user_total_epsilon: the same for one "
                        "user, over the user-level runs; infinite once an example-level private run or a voiding "
                        "run trained on the data set."),
    }


def record_audit(cfg: Any, record: dict, out_dir) -> None:
    """`widedp audit`'s run trained on the data set too: append what it spent (claimed ε), as
    voiding when it ran a broken variant, reproducibly or non-privately."""
    from widedp.trainer.config.semantics import void_reasons

    when = now()
    voids = void_reasons({"privacy.reproducible": cfg.privacy.reproducible}, {}, cfg.train.mode)
    if record.get("broken"):
        voids.insert(0, f"widedp audit --broken {record['broken']}: trained deliberately broken, no guarantee")
    append(cfg.data.path, run_record(
        run_id=uuid.uuid4().hex, run_dir=out_dir, mode=cfg.train.mode, target_epsilon=cfg.privacy.target_epsilon,
        delta=record.get("delta"), accountant=cfg.privacy.accountant, epsilon=record.get("claimed_epsilon", math.inf),
        events_charged=None, steps=record.get("steps", 0), started=when, status="finished", audit=True,
        privacy_unit=cfg.privacy.unit, voids=voids))
