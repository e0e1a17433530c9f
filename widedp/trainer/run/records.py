"""A run directory's privacy records, written before each release and verified by everything
that reads them (`--resume`, `widedp export`, `widedp verify`).

The records (docs/DESIGN.md §1, docs/THREAT_MODEL.md "Operator mistakes and forgeries"):
- ledger.json: every charged event, its hash chain, and its header (what the ε means, fixed at
  the run's start: trainer/config/semantics.py), rewritten atomically after every charge;
- journal.jsonl: append-only, one line per session and per charge (trainer/run/journal.py);
- checkpoint.pt's record of both: the ledger's chain (events, digest), the journal's head, the
  run's semantics, lineage and the data set budget's head — signed when the run is keyed.

`LedgerStore` is the engine's persistence hook (ledger.json, then the journal's charge line,
then the release). `verified_records` is the one reading of them: it refuses, naming the file,
a ledger.json that is missing, not readable, shorter than or not an extension of the
checkpoint's chain or of the journal's last charge, or whose accountant or δ differ from the
checkpoint's; a journal that is missing while the checkpoint records one, or does not extend
the checkpoint's head; and for a keyed run, any of them unsigned or signed with another key.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from widedp.accounting import PrivacyLedger
from widedp.accounting.atomic import atomic_write_bytes
from widedp.trainer.config import semantics as run_semantics
from widedp.trainer.run.ledger_key import KEY_ENV, LedgerKey, LedgerKeyError, require_key
from widedp.trainer.run.journal import JOURNAL_FILE, JournalError, ReleaseJournal

LEDGER_FILE = "ledger.json"
#: What a checkpoint's signed record covers (the keyed run's "records_mac").
SIGNED_CHECKPOINT_FIELDS = ("ledger_chain", "journal_head", "semantics", "lineage", "budget_head", "run_id")


class RecordError(ValueError):
    """A run's privacy records are missing, damaged, edited or inconsistent (the message names the file)."""


class LedgerStore:
    """The engine's hook after each charge: ledger.json (signed when keyed), then the journal's
    charge line — both before the release the charge pays for."""

    def __init__(self, run_dir: Path, journal: ReleaseJournal, key: Optional[LedgerKey], step_count):
        self.path = Path(run_dir) / LEDGER_FILE
        self.journal, self.key, self._step_count = journal, key, step_count

    def __call__(self, ledger: PrivacyLedger) -> None:
        write_ledger(self.path, ledger, self.key)
        self.journal.charged(ledger.chain(), self._step_count())


def write_ledger(path: Path, ledger: PrivacyLedger, key: Optional[LedgerKey] = None) -> None:
    state = ledger.state_dict()
    if key is not None:
        state = key.sign(state)
    atomic_write_bytes(path, json.dumps(state, indent=1).encode())


def read_ledger(path: Path, key: Optional[LedgerKey] = None, signed: bool = False) -> PrivacyLedger:
    """ledger.json, its chain checked (PrivacyLedger.load) and, for a keyed run, its signature."""
    ledger = PrivacyLedger.load(path)
    if signed:
        assert key is not None
        try:
            key.verify(json.loads(Path(path).read_text()), str(path))
        except LedgerKeyError as exc:
            raise RecordError(str(exc)) from None
    return ledger


def sign_checkpoint_record(state: dict, key: Optional[LedgerKey]) -> None:
    """Add the keyed run's "records_mac" over the checkpoint's record of the run (in place)."""
    if key is not None:
        state["records_mac"] = key.mac({k: state.get(k) for k in SIGNED_CHECKPOINT_FIELDS})


def recorded_semantics(state: dict) -> dict:
    """The run's semantics as its checkpoint records them; a checkpoint of an older widedp
    records none: derived from its config (that session's values; the δ its ledger holds)."""
    if isinstance(state.get("semantics"), dict):
        return state["semantics"]
    saved = (state.get("engine") or {}).get("ledger")
    delta = saved.get("delta") if isinstance(saved, dict) else None
    out = run_semantics.semantics(state.get("config") or {}, delta, state.get("dataset") or {}, None)
    out.pop(run_semantics.DATA_IDENTITY)  # compared by the identity check of its own
    out.pop(run_semantics.LEDGER_KEY_ID)
    return out


@dataclasses.dataclass
class RunRecords:
    """What `verified_records` read: the ledger (None for a non-private run), the journal, the
    run's semantics and its sticky settings (each true if any session had it)."""

    ledger: Optional[PrivacyLedger]
    journal: ReleaseJournal
    semantics: dict
    sticky: dict
    key_id: Optional[str]

    @property
    def lineage(self) -> list[str]:
        return self.journal.segments

    def check_against_budget(self, data_path, run_dir: Path, remedy: str) -> Optional[dict]:
        """`dataset_budget.check_run` on the data set at `data_path` (the budget's head, or None
        when no data set is there to check against)."""
        from widedp.trainer.run import budget as dataset_budget

        if not data_path or not (Path(data_path) / "dataset.json").exists():
            return None
        dataset_budget.check_run(data_path, self.lineage, self.key_id, Path(run_dir) / LEDGER_FILE, remedy)
        return dataset_budget.head(data_path)


def verified_records(run_dir: Path, state: dict, key: Optional[LedgerKey], remedy: str,
                     ckpt_file: Optional[Path] = None, signer: bool = False) -> RunRecords:
    """Read and verify the run's records against its checkpoint `state` (module docstring).
    `remedy`: what the refusal tells the user to do. `signer`: the reader signs off the ε (`widedp
    verify`, `widedp export`): holding a key, it refuses a run whose records are not signed with
    it — a keyed run whose records were rewritten as an unkeyed one is not told apart otherwise."""
    run_dir = Path(run_dir)
    ckpt_file = ckpt_file or run_dir / "checkpoint.pt"
    semantics = recorded_semantics(state)
    key_id = semantics.get(run_semantics.LEDGER_KEY_ID)
    try:
        require_key(key_id, key, str(ckpt_file))
    except LedgerKeyError as exc:
        raise RecordError(f"{exc}; {remedy}") from None
    if signer and key is not None and key_id is None:
        raise RecordError(f"{ckpt_file}: {KEY_ENV} holds a ledger key (key id {key.key_id}), but the run's records "
                          f"are not signed: it was trained without the key, or its records were rewritten without "
                          f"it; unset {KEY_ENV} to read an unkeyed run; {remedy}")
    keyed = key_id is not None
    if keyed:
        assert key is not None
        expected = key.mac({k: state.get(k) for k in SIGNED_CHECKPOINT_FIELDS})
        if state.get("records_mac") != expected:
            raise RecordError(f"{ckpt_file}: its record of the run (ledger chain, journal head, semantics) is not signed "
                              f"by the ledger key (key id {key_id}): it was edited or forged; {remedy}")
    ledger = None
    saved = (state.get("engine") or {}).get("ledger")
    if saved is not None:
        ledger = _verified_ledger(run_dir, ckpt_file, saved, state, key, keyed, remedy)
    try:
        journal = ReleaseJournal.open(run_dir / JOURNAL_FILE, key, signed=keyed)
    except JournalError as exc:
        raise RecordError(f"{exc}; {remedy}") from None
    head = state.get("journal_head")
    if head is not None:
        if not journal.path.exists():
            raise RecordError(f"{journal.path}: missing, but {ckpt_file} records {head['lines']} journal lines (the "
                              f"record of what the run released); {remedy}")
        if not journal.extends(head):
            raise RecordError(f"{journal.path}: does not extend the {head['lines']} lines {ckpt_file} records: it was "
                              f"truncated, replaced or edited; {remedy}")
    if ledger is not None:
        try:
            journal.check_ledger(ledger, run_dir / LEDGER_FILE, remedy)
        except JournalError as exc:
            raise RecordError(str(exc)) from None
    sticky = dict(journal.sticky)
    for k, v in (state.get("sticky") or {}).items():
        sticky[k] = bool(sticky.get(k)) or bool(v)
    return RunRecords(ledger, journal, semantics, sticky, key_id)


def _verified_ledger(run_dir: Path, ckpt_file: Path, saved: dict, state: dict, key: Optional[LedgerKey],
                     keyed: bool, remedy: str) -> PrivacyLedger:
    """ledger.json, verified against the checkpoint's chain (and its signature when keyed)."""
    ledger_file = run_dir / LEDGER_FILE
    in_ckpt = PrivacyLedger(saved.get("accountant", "rdp"), saved.get("delta", 1e-6))
    try:
        in_ckpt.load_state_dict(saved)
    except (ValueError, KeyError) as exc:
        raise RecordError(f"{ckpt_file}: its ledger is invalid: {exc}; {remedy}") from None
    chain = state.get("ledger_chain") or in_ckpt.chain()  # checkpoints of format 1 embed the ledger only
    if in_ckpt.chain() != chain:
        raise RecordError(f"{ckpt_file}: its ledger does not hash to the chain it records "
                          f"({in_ckpt.steps} events vs {chain.get('events')}): the checkpoint was edited or damaged; "
                          f"{remedy}")
    if not ledger_file.exists():
        raise RecordError(f"{ledger_file}: missing, but {ckpt_file} records {chain['events']} charged events; a ledger "
                          f"is never rebuilt from a checkpoint (steps released after it would be forgotten): {remedy}")
    try:
        on_disk = read_ledger(ledger_file, key, signed=keyed)
    except RecordError as exc:
        raise RecordError(f"{exc}; {remedy}") from None
    except (ValueError, KeyError, OSError) as exc:
        raise RecordError(f"{exc}; {remedy}") from None
    if on_disk.steps < chain["events"]:
        raise RecordError(f"{ledger_file}: holds {on_disk.steps} charged events, fewer than the {chain['events']} "
                          f"{ckpt_file} records: it was truncated or rolled back; {remedy}")
    if not on_disk.extends(chain):
        raise RecordError(f"{ledger_file}: its first {chain['events']} events differ from those {ckpt_file} records "
                          f"(chain digest {on_disk.digest_at(chain['events'])[:12]}… vs {chain['digest'][:12]}…): "
                          f"it was replaced or edited; {remedy}")
    if (on_disk.accountant.name, on_disk.delta) != (in_ckpt.accountant.name, in_ckpt.delta):
        raise RecordError(f"{ledger_file}: accountant {on_disk.accountant.name}, δ = {on_disk.delta} differ from "
                          f"{ckpt_file}'s ({in_ckpt.accountant.name}, δ = {in_ckpt.delta}): it was edited; {remedy}")
    return on_disk
