"""`widedp train` and `widedp evaluate`: arguments and handlers.

Kept apart from trainer/run/train.py so that a command's config is read and checked (TOML syntax,
unknown sections and keys, types, `--set` syntax, a missing file, values out of range, unknown names) before
torch, Ray and the engine are imported: such a mistake is reported in well under a second
(benchmarks/cli_startup.py), not after the ~5 s of imports a training run needs; names of
models, selectors, optimizers and accountants too, from trainer/names.py (`config.light_names`).
"""

from __future__ import annotations

from pathlib import Path


def add_commands(sub) -> dict:
    t = sub.add_parser("train", help="train a model (embedded local Ray unless --address is given)")
    t.add_argument("--config", help="TOML config (with --resume: defaults to RUN_DIR/config.json)")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    t.add_argument("--run-dir")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint")
    t.add_argument("--address", help="Ray cluster address (default: embedded local Ray)")
    t.add_argument("--no-progress", action="store_true")
    e = sub.add_parser("evaluate", help="evaluate a run's checkpoint on its test split")
    e.add_argument("--run-dir", required=True)
    return {"train": cmd_train, "evaluate": cmd_evaluate}


def cmd_train(args) -> dict:
    from widedp.trainer.config import light_names, load_config, load_saved_config

    if args.resume and not args.config:
        config_path = Path(args.resume) / "config.json"
        if not config_path.exists():
            raise ValueError(f"--resume {args.resume}: no config.json there (pass --config)")
        cfg = load_saved_config(config_path, args.set)
    elif not args.config:
        raise ValueError("--config is required (or --resume RUN_DIR)")
    else:
        cfg = load_config(args.config, args.set)
    if args.address:
        cfg.cluster.address = args.address
    with light_names():  # the whole config, names from trainer/names.py, before torch/Ray load; train() again
        cfg.validate()
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "checkpoint.pt").exists():
            raise ValueError(f"--resume {run_dir}: no checkpoint.pt there")
    else:
        run_dir = Path(args.run_dir or cfg.run_dir or "runs/latest")
    from widedp.trainer.run.train import train  # torch, Ray and the engine: only now

    summary = train(cfg, run_dir, resume=bool(args.resume), progress=not args.no_progress)
    return {"run_dir": str(run_dir), **summary}


def cmd_evaluate(args) -> dict:
    run_dir = Path(args.run_dir)
    if not (run_dir / "checkpoint.pt").exists():
        raise ValueError(f"--run-dir {run_dir}: no checkpoint.pt there")
    from widedp.trainer.run.train import evaluate

    return evaluate(run_dir)
