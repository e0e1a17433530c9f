"""The privacy budget of a data set across runs: `DATASET/privacy_budget.jsonl`, append-only.

ε of one model is what *that model* reveals. Every run trained on the same data reveals more:
two models trained at ε = 8 each are, together, a release at up to ε = 16 (basic composition),
and tuning runs count like any other (docs/DESIGN.md §1, "The ledger only grows"). So every
`widedp train` on a data set (and every `widedp audit`, whose run also trains on it) appends
one JSON line per update of its spending:

    {"run_id", "run_dir", "mode", "target_epsilon", "delta", "accountant", "epsilon",
     "events_charged", "steps", "started", "updated", "status", "audit", "privacy_unit"}

`status` is "running" (appended before the run's first step: a crash leaves this line, and the
run can never spend more than its target_epsilon), "finished", "interrupted" or "failed". A
resumed run appends an updated line for the same run_id. The file is never rewritten or
truncated: each line is written with one `os.write` of the complete line on an O_APPEND file
descriptor, then fsync'd, so concurrent runs cannot interleave half lines and a crash loses at
most the line being written.

`widedp budget DATASET` prints, per run, its latest line, and the total: the sum of each
run's ε (its spent ε once it ended, its target while the latest line says "running") — an
upper bound on what all the runs together reveal by basic composition, at δ = the sum of the
runs' δs. It is not tight (a tight composition would compose every run's ledger under one
accountant); it is what one can state without trusting any run's ledger beyond its ε.
Nothing here is private: ε, δ and step counts are data-independent.

Privacy units (privacy.unit; lines without one are example level): the total is per example. A
user-level run's (ε, δ) bounds one example only through the user holding it — removing one
example of a user is two user-level steps away (remove the user, add them back without it) —
so it counts as (2ε, (1 + e^ε)·δ) there (group privacy of size 2). The user-level total sums
the user-level runs, and is infinite once any private example-level run trained on the data
set: such a run protects a user with m examples only as a group of m, and m is not bounded.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from pathlib import Path
from typing import Any, Optional

BUDGET_FILE = "privacy_budget.jsonl"
STATUSES = ("running", "finished", "interrupted", "failed")


def budget_path(dataset_dir) -> Path:
    return Path(dataset_dir) / BUDGET_FILE


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_record(*, run_id: str, run_dir, mode: str, target_epsilon: float, delta: Optional[float],
               accountant: Optional[str], epsilon: float, events_charged: Optional[int], steps: int, started: str,
               status: str, audit: bool = False, privacy_unit: str = "example") -> dict:
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    return {"run_id": run_id, "run_dir": str(Path(run_dir).absolute()), "mode": mode,
            "target_epsilon": float(target_epsilon), "delta": delta, "accountant": accountant,
            "epsilon": float(epsilon), "events_charged": None if events_charged is None else int(events_charged), "steps": int(steps),
            "started": started, "updated": now(), "status": status, "audit": bool(audit),
            "privacy_unit": privacy_unit}


def append(dataset_dir, record: dict) -> None:
    """Append one line to DATASET/privacy_budget.jsonl: one write of the whole line, fsync'd.
    ValueError naming the file when it cannot be written (a run must not train unrecorded)."""
    path = budget_path(dataset_dir)
    line = (json.dumps(record, sort_keys=True, allow_nan=True) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(f"short write ({written} of {len(line)} bytes)")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ValueError(f"{path}: cannot append this run's privacy spending ({exc.strerror or exc}); every run on "
                         f"a data set is recorded there: make the data set directory writable") from exc


def read(dataset_dir) -> list[dict]:
    """Every line of the budget file, in order ([] when there is none); ValueError naming the
    file and line when one is not a JSON object (a damaged file is reported, never skipped)."""
    path = budget_path(dataset_dir)
    if not path.exists():
        return []
    out = []
    for i, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {i} is not JSON ({exc}); the file is append-only: a damaged line "
                             "means it was edited or a write was cut off") from None
        if not isinstance(record, dict) or "run_id" not in record:
            raise ValueError(f"{path}: line {i} is not a run record (no run_id)")
        out.append(record)
    return out


def _bound(record: dict) -> float:
    """What a run can have spent: its ε once it ended, its target while it may still run."""
    if record.get("mode") == "nonprivate":
        return math.inf
    spent = float(record.get("epsilon", math.inf))
    if record.get("status") == "running":
        return max(spent, float(record.get("target_epsilon", math.inf)))
    return spent


def summary(dataset_dir) -> dict:
    """Per-run spending (each run's latest line) and the basic-composition total."""
    path = budget_path(dataset_dir)
    if not (Path(dataset_dir) / "dataset.json").exists():
        raise ValueError(f"{dataset_dir}: no dataset.json (not a widedp data set directory)")
    latest: dict[str, dict] = {}
    for record in read(dataset_dir):
        latest[record["run_id"]] = record  # dicts keep first-insertion order: runs in order of start
    runs = [dict(r, epsilon_bound=_bound(r)) for r in latest.values()]
    private = [r for r in runs if r.get("mode") != "nonprivate"]
    user = [r for r in private if r.get("privacy_unit", "example") == "user"]
    per_example = [(2 * r["epsilon_bound"], (1 + math.exp(min(r["epsilon_bound"], 700))) * (r.get("delta") or 0.0))
                   if r in user else (r["epsilon_bound"], r.get("delta") or 0.0) for r in private]
    nonprivate = len(runs) - len(private)
    return {
        "dataset": str(dataset_dir),
        "budget_file": str(path),
        "runs": runs,
        "num_runs": len(runs),
        "total_epsilon": math.inf if nonprivate else sum(e for e, _ in per_example),
        "total_delta": sum(d for _, d in per_example),
        "user_total_epsilon": (math.inf if nonprivate or len(user) < len(private)
                               else sum(r["epsilon_bound"] for r in user)) if user else None,
        "user_total_delta": sum(r.get("delta") or 0.0 for r in user) if user else None,
        "composition": ("basic composition: an upper bound on what all these runs together reveal about one "
                        "example, at δ = total_delta (the sum of the runs' δs; a user-level run counts as (2ε, "
                        "(1 + e^ε)·δ) for one example). A run whose latest line is 'running' counts at its target "
                        "ε (it may have crashed or still be training). Tuning and audit runs count like any other. "
                        "user_total_epsilon: the same for one user, over the user-level runs; infinite once an "
                        "example-level private run or a nonprivate run trained on the data set."),
    }


def record_audit(cfg: Any, record: dict, out_dir) -> None:
    """`widedp audit`'s run trained on the data set too: append what it spent (claimed ε)."""
    import uuid

    when = now()
    append(cfg.data.path, run_record(
        run_id=uuid.uuid4().hex, run_dir=out_dir, mode=cfg.train.mode, target_epsilon=cfg.privacy.target_epsilon,
        delta=record.get("delta"), accountant=cfg.privacy.accountant, epsilon=record.get("claimed_epsilon", math.inf),
        events_charged=None, steps=record.get("steps", 0), started=when, status="finished", audit=True,
        privacy_unit=cfg.privacy.unit))


# ---- CLI ----------------------------------------------------------------------------------------
def add_commands(sub) -> dict:
    b = sub.add_parser("budget", help="every run's privacy spending on a data set, and the total")
    b.add_argument("dataset", metavar="DATASET", help="a data set directory (holds dataset.json)")
    return {"budget": cmd_budget}


def cmd_budget(args) -> dict:
    return summary(args.dataset)
