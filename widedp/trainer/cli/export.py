"""`widedp export RUN_DIR OUT_DIR`: the releasable model and its privacy report (trainer/release/export.py)."""

from __future__ import annotations

from widedp.trainer.release.export import export_run


# ---- CLI --------------------------------------------------------------------------------------------
def add_commands(sub) -> dict:
    e = sub.add_parser("export", help="write a run's releasable model (weights, loader) and privacy report")
    e.add_argument("run_dir_pos", nargs="?", metavar="RUN_DIR", help="the run (or --run-dir, as `widedp evaluate`)")
    e.add_argument("out_dir_pos", nargs="?", metavar="OUT_DIR", help="new (or empty) directory (or --out-dir)")
    e.add_argument("--run-dir", dest="run_dir_opt", metavar="RUN_DIR")
    e.add_argument("--out-dir", dest="out_dir_opt", metavar="OUT_DIR")
    return {"export": cmd_export}


def _one_of(positional, option, what: str, flag: str):
    if positional is not None and option is not None:
        raise ValueError(f"give {what} once: as {flag} or positionally, not both")
    if positional is None and option is None:
        raise ValueError(f"{flag} (or {what} positionally) is required")
    return positional if positional is not None else option


def cmd_export(args) -> dict:
    if args.run_dir_opt is not None and args.run_dir_pos is not None and args.out_dir_pos is None:
        args.run_dir_pos, args.out_dir_pos = None, args.run_dir_pos  # `export --run-dir R OUT`
    run_dir = _one_of(args.run_dir_pos, args.run_dir_opt, "RUN_DIR", "--run-dir")
    out_dir = _one_of(args.out_dir_pos, args.out_dir_opt, "OUT_DIR", "--out-dir")
    return export_run(run_dir, out_dir)
