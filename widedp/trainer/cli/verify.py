"""`widedp verify RUN_DIR`: check a run's privacy records and print its verified ε (trainer/run/verify.py)."""

from __future__ import annotations

from widedp.trainer.run.verify import verify_run


def add_commands(sub) -> dict:
    v = sub.add_parser("verify", help="check a run's privacy records (ledger, journal, checkpoint, budget) and print "
                                      "its verified ε")
    v.add_argument("run_dir", metavar="RUN_DIR")
    return {"verify": cmd_verify}


def cmd_verify(args) -> dict:
    return verify_run(args.run_dir)
