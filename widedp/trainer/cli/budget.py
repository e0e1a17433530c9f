"""`widedp budget DATASET`: every model's privacy spending on a data set and the total (trainer/run/budget.py)."""

from __future__ import annotations

from widedp.trainer.run.budget import summary


# ---- CLI ----------------------------------------------------------------------------------------
def add_commands(sub) -> dict:
    b = sub.add_parser("budget", help="every run's privacy spending on a data set, and the total")
    b.add_argument("dataset", metavar="DATASET", help="a data set directory (holds dataset.json, or partitions.json for a partitioned one)")
    return {"budget": cmd_budget}


def cmd_budget(args) -> dict:
    return summary(args.dataset)
