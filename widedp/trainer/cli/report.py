"""`widedp report`: plots and a markdown summary of run directories (trainer/release/report.py)."""

from __future__ import annotations

from pathlib import Path
from widedp.trainer.release.report import ACCOUNTANT_NAMES, render


def add_commands(sub) -> dict:
    r = sub.add_parser("report", help="plots and a markdown summary of one or more run directories",
                       description="Plots (OUT/summary.png: ε per accountant, held-out metrics, loss, rows noised per "
                                   "step; and the single plots) and OUT/report.md for one or more `widedp train` run "
                                   "directories, given positionally and/or with --run-dir.")
    r.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="run directories (what `widedp train` writes)")
    r.add_argument("--run-dir", action="append", default=[], dest="run_dir_opts", metavar="RUN_DIR",
                   help="a run directory (repeatable; as in `widedp evaluate --run-dir`)")
    r.add_argument("--out", help="output directory (default RUN_DIR/report, or PARENT/report for several runs)")
    r.add_argument("--curve-points", type=int, default=12,
                   help="training steps at which ε is re-accounted per accountant (plus step 0; default 12)")
    r.add_argument("--accountants", default=",".join(ACCOUNTANT_NAMES),
                   help=f"comma-separated accountants to re-account the ledger with (default {','.join(ACCOUNTANT_NAMES)}; "
                        "pld and prv are the slow ones on long or varied ledgers)")
    return {"report": cmd_report}


def cmd_report(args) -> dict:
    run_dirs = list(args.run_dirs) + list(args.run_dir_opts)
    if not run_dirs:
        raise ValueError("report needs at least one run directory: RUN_DIR... or --run-dir RUN_DIR")
    accountants = [a.strip() for a in args.accountants.split(",") if a.strip()]
    result = render(run_dirs, Path(args.out) if args.out else None, curve_points=args.curve_points,
                    accountants=accountants)
    return {k: v for k, v in result.items() if k not in ("series", "drawn")}
