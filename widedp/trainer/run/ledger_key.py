"""The opt-in keyed ledger: an HMAC key kept outside the run directory signs a run's records.

Who it is for: teams where the person who runs training is not the one who signs off the ε.
Without a key, a run's records (ledger.json, journal.jsonl, the checkpoint's recorded chain) are
hash-chained, which catches accidents, rollbacks and edits, but not a forger who recomputes the
chains (sha256 is public). With a key, each of those records carries an HMAC-SHA256 under the
key; whoever verifies (`widedp verify`, `widedp export`, `--resume`) must hold the key, and a
record forged or edited without it is refused.

Where the key comes from: the environment variable `WIDEDP_LEDGER_KEY_FILE` names a file holding
the key (at least 32 bytes; hex text or raw bytes). The key itself is never written, printed or
stored: a run records only its *key id*, a hash of the key (`key_id`), so a resume with another
key, or none, is refused by id. A key file inside the run directory is refused (the run's
records would carry their own key).

What it protects: ledger.json, every journal line and the checkpoint's record of the chain
(`sign` / `verify` of their canonical JSON). What it does not: anyone holding the key (the
training process itself has it, so a key mounted into the training job is trusted with it); a
rollback of *all* of a run directory's records to an earlier signed state (each earlier state
verifies; the data set's budget file, outside the run directory, records what each session
charged by its end, and `widedp verify` checks the run against it); the model weights in the
checkpoint (they are not signed: the ε is a claim about the mechanism, the weights are its output).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path
from typing import Optional

from widedp.accounting.ledger import canonical_json

KEY_ENV = "WIDEDP_LEDGER_KEY_FILE"
MIN_KEY_BYTES = 32
MAC_FIELD = "mac"


class LedgerKeyError(ValueError):
    """A key that cannot be used, or a record whose signature does not verify."""


class LedgerKey:
    """An HMAC-SHA256 key (never printed: repr shows the id only)."""

    def __init__(self, secret: bytes, source: str = "the key"):
        if len(secret) < MIN_KEY_BYTES:
            raise LedgerKeyError(f"{source}: a ledger key needs at least {MIN_KEY_BYTES} bytes, got {len(secret)}")
        self._secret = bytes(secret)
        self.source = source

    @property
    def key_id(self) -> str:
        """What a run records of its key: 16 hex digits of a hash of it (not the key)."""
        return hashlib.sha256(b"widedp-ledger-key-id\x00" + self._secret).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"LedgerKey(id={self.key_id})"

    def mac(self, record: dict) -> str:
        """HMAC-SHA256 (hex) of `record`'s canonical JSON, its own "mac" field left out."""
        body = {k: v for k, v in record.items() if k != MAC_FIELD}
        return hmac.new(self._secret, canonical_json(body), hashlib.sha256).hexdigest()

    def sign(self, record: dict) -> dict:
        """`record` with its "mac" field set."""
        return {**{k: v for k, v in record.items() if k != MAC_FIELD}, MAC_FIELD: self.mac(record)}

    def verify(self, record: dict, what: str) -> None:
        """LedgerKeyError naming `what` unless `record` carries a valid "mac" under this key."""
        given = record.get(MAC_FIELD)
        if not isinstance(given, str):
            raise LedgerKeyError(f"{what}: not signed, but the run is keyed (key id {self.key_id}): it was replaced "
                                 "by an unsigned copy")
        if not hmac.compare_digest(given, self.mac(record)):
            raise LedgerKeyError(f"{what}: its signature does not verify under the ledger key (key id {self.key_id}): "
                                 "it was edited or forged without the key")


def read_key(path: str | os.PathLike, run_dir: Optional[Path] = None) -> LedgerKey:
    """The key in the file at `path` (hex text of >= 64 digits, else its raw bytes). Refuses a
    file inside `run_dir`."""
    p = Path(path)
    where = f"{KEY_ENV}={path}"
    if run_dir is not None:
        try:
            inside = p.resolve().is_relative_to(Path(run_dir).resolve())
        except OSError:
            inside = False
        if inside:
            raise LedgerKeyError(f"{where}: the ledger key lies inside the run directory {run_dir}; keep it outside "
                                 "(the run's records would carry their own key)")
    try:
        raw = p.read_bytes()
        mode = p.stat().st_mode
    except OSError as exc:
        raise LedgerKeyError(f"{where}: cannot read the ledger key ({exc.strerror or exc})") from None
    text = raw.strip()
    try:
        secret = bytes.fromhex(text.decode("ascii")) if len(text) >= 2 * MIN_KEY_BYTES else raw
    except (UnicodeDecodeError, ValueError):
        secret = raw
    key = LedgerKey(secret, where)
    if mode & stat.S_IROTH:
        import logging

        logging.getLogger(__name__).warning("%s: the ledger key file is readable by every user (chmod 600 it)", where)
    return key


def key_from_environment(run_dir: Optional[Path] = None) -> Optional[LedgerKey]:
    """The key `WIDEDP_LEDGER_KEY_FILE` names, or None when it is unset or empty."""
    path = os.environ.get(KEY_ENV, "")
    return read_key(path, run_dir) if path else None


def require_key(key_id: Optional[str], key: Optional[LedgerKey], what: str) -> None:
    """A run recorded `key_id` (None: unkeyed): the key at hand must be that one."""
    if key_id is None:
        return
    if key is None:
        raise LedgerKeyError(f"{what}: the run's records are signed with a ledger key (key id {key_id}); set "
                             f"{KEY_ENV} to that key's file to verify them")
    if key.key_id != key_id:
        raise LedgerKeyError(f"{what}: the run's records are signed with ledger key id {key_id}, but {KEY_ENV} "
                             f"holds key id {key.key_id}")
