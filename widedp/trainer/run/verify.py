"""`widedp verify RUN_DIR`: check a run's privacy records before signing off its ε.

Runs every check `--resume` and `widedp export` run on a run directory's records
(trainer/run/records.py): ledger.json against the checkpoint's recorded chain and the journal's
last charge, the journal against the checkpoint's head, the ledger's header, and for a keyed
run (trainer/run/ledger_key.py; the key from WIDEDP_LEDGER_KEY_FILE) every signature; holding a key,
it refuses a run whose records are not signed with it. It also checks the run against its data
set's budget file (outside the run directory): the budget's lines of the run's sessions must
not record a ledger key the records lack. Prints the verified ε, δ and what they mean; exits 2
naming the file on any failure.
Reads only: nothing is written.
"""

from __future__ import annotations

from pathlib import Path

REMEDY = "its ε cannot be signed off"


def verify_run(run_dir) -> dict:
    from widedp.trainer.config import semantics as run_semantics
    from widedp.trainer.run.ledger_key import key_from_environment
    from widedp.trainer.run.records import verified_records
    from widedp.trainer.run.train import load_checkpoint

    run_dir = Path(run_dir)
    state = load_checkpoint(run_dir / "checkpoint.pt")
    key = key_from_environment(run_dir)
    records = verified_records(run_dir, state, key, REMEDY, signer=True)
    ledger = records.ledger
    data_path = (state.get("config") or {}).get("data", {}).get("path")
    budget = records.check_against_budget(data_path, run_dir, REMEDY)
    voids = run_semantics.void_reasons(records.semantics, records.sticky)
    return {
        "run_dir": str(run_dir),
        "verified": True,
        "keyed": records.key_id is not None,
        "ledger_key_id": records.key_id,
        "private": ledger is not None,
        "epsilon": ledger.epsilon() if ledger is not None else float("inf"),
        "delta": ledger.delta if ledger is not None else None,
        "accountant": ledger.accountant.name if ledger is not None else None,
        "events_charged": ledger.steps if ledger is not None else 0,
        "steps": (state.get("engine") or {}).get("step"),
        "lineage": records.lineage,
        "journal_lines": records.journal.lines,
        "semantics": run_semantics.public_semantics(records.semantics),
        "debug_metrics_in_run": bool(records.sticky.get("debug_metrics")),
        "voids": voids,
        "budget": budget,
        # the data set's budget is outside the run directory: checked when the data set is where the
        # run's config says (a relative data.path is read from the current directory)
        "not_checked": [] if budget is not None else
        [f"the data set's budget: no data set at data.path = {data_path!r} from here (run widedp verify where "
         "the run trains, or with the data set at that path)"],
        "checked": ["ledger.json against checkpoint.pt's chain and journal.jsonl's last charge",
                    "journal.jsonl's chain and checkpoint.pt's record of it",
                    "the ledger's header (bound into its chain)",
                    *(["every signature under the ledger key"] if records.key_id is not None else []),
                    *(["the data set's budget: its lines of this run's sessions record the same ledger key"]
                      if budget is not None else [])],
    }
