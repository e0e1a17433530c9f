"""`widedp tune`: private hyper-parameter selection charged to the data set's budget
(trainer/run/tune.py). The config and the grid are checked before torch and Ray load."""

from __future__ import annotations

from pathlib import Path

from widedp.trainer.cli.data import _positive_float_arg, _probability_arg

HELP = "choose hyper-parameters privately: the best of a secret random number of private trials, charged to the budget"


def _more_than_one(text: str) -> float:
    import argparse

    value = _positive_float_arg("--expected-trials")(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(f"--expected-trials must be in (1, inf), got {text}")
    return value


def add_commands(sub) -> dict:
    t = sub.add_parser("tune", help=HELP)
    t.add_argument("--config", required=True, help="the base TOML config (every trial is it plus one candidate)")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="overrides of the base config")
    t.add_argument("--grid", action="append", default=[], metavar="SECTION.KEY=V1,V2,...",
                   help="a tuned key and its values; the candidates are the product of every --grid")
    t.add_argument("--run-dir", required=True, help="the tuning's directory (must be empty or absent)")
    t.add_argument("--target-epsilon", type=_positive_float_arg("--target-epsilon"),
                   help="ε of the whole tuning (default: the config's privacy.target_epsilon)")
    t.add_argument("--expected-trials", type=_more_than_one, default=10.0,
                   help="E[K], the expected number of trials (default 10)")
    t.add_argument("--distribution", default="logarithmic",
                   help="the number of trials' distribution: logarithmic (default), geometric, poisson or tnb:ETA")
    t.add_argument("--validation-fraction", type=_probability_arg("--validation-fraction"), default=0.2,
                   help="each example's (user's) probability of landing in the validation part (default 0.2)")
    t.add_argument("--score", choices=("brier", "loss"),
                   help="the noised validation score (default: brier for binary models, else the clipped loss)")
    t.add_argument("--score-clip", type=_positive_float_arg("--score-clip"), default=10.0,
                   help="the per-example loss clip of --score loss (its sensitivity; default 10)")
    t.add_argument("--score-share", type=_probability_arg("--score-share"), default=0.05,
                   help="the share of the target ε the score's Gaussian alone would spend (default 0.05)")
    t.add_argument("--no-progress", action="store_true")
    return {"tune": cmd_tune}


def cmd_tune(args) -> dict:
    from widedp.trainer.config import light_names, load_config
    from widedp.trainer.run.tune import TuneSpec, parse_grid

    grid = parse_grid(args.grid)
    spec = TuneSpec(config=args.config, sets=tuple(args.set), grid=grid, target_epsilon=args.target_epsilon,
                    expected_trials=args.expected_trials, distribution=args.distribution,
                    validation_fraction=args.validation_fraction, score=args.score, score_clip=args.score_clip,
                    score_share=args.score_share)
    spec.trial_count()  # a bad --distribution before anything loads
    with light_names():  # every candidate's config, names from trainer/names.py, before torch/Ray load
        load_config(args.config, args.set).validate()
        for candidate in spec.candidates():
            try:
                load_config(args.config, [*args.set, *candidate]).validate()
            except ValueError as exc:
                raise ValueError(f"--grid candidate {' '.join(candidate)}: {exc}") from None
    from widedp.trainer.run.tune import tune

    return tune(spec, Path(args.run_dir), progress=not args.no_progress)
