"""`widedp` command line. Each command prints one JSON object on stdout.

The cli package (trainer/cli/): the `widedp` command (here) and `widedp train` / `evaluate`'s
arguments (`train`).
May import: widedp.trainer.api, widedp.trainer.config, widedp.trainer.data,
widedp.trainer.engine, widedp.trainer.run, widedp.trainer.release, widedp.trainer.models,
widedp.trainer.names, widedp.trainer.strict_json, the pure libraries — each command's module
only when that command runs (fast start-up: benchmarks/cli_startup.py).

Bad arguments, and refusals (a run directory that holds a run, a ledger that does not extend
its checkpoint, a damaged checkpoint, a spent budget: ValueError), exit with code 2 and a
one-line reason on stderr. Ctrl-C exits with code 130 and one line (`widedp train`: the step it
stopped at and how to resume). The privacy commands (`epsilon`, `calibrate`) import no Ray.

`epsilon` and `calibrate` build exactly the events the trainer records (trainer/engine/engine.py,
`Engine._selection_event`; trainer/run/train.py, `plan_privacy`), so for the same parameters they
print the ε the training ledger reports (tests/test_cli_trainer_agreement.py):
- `--selection svt` is selection-only NumericSparse, as the trainer runs it;
  `--svt-release-values` opts into the value-releasing variant (Alg 1's 0.95/0.05 split),
  which the trainer never uses.
- `--selection fest --fest-sigma S` is a DP-FEST run: one Gaussian(S) charged before the steps,
  then data-independent steps (a `random`-style no-op selection).
`--selection` choices are "none" plus the selector registry's names (selection/registry.py);
which arguments a selector needs is read from its Params (`cli=` field metadata).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import sys
from typing import Any, Optional, Sequence

from widedp.trainer import strict_json

# Light on purpose (`widedp --help` and config errors in < 1.5 s, benchmarks/cli_startup.py):
# torch, Ray, dp_accounting and the selector registry are imported by the command that needs them.
NO_SELECTION = "none"  # == selection.registry.NO_SELECTION (tests/test_cli_startup.py)

LOG_LEVELS = ("debug", "info", "warning", "error")


def selection_choices() -> tuple[str, ...]:
    """`--selection` choices: "none" (DP-SGD) and every registered selector."""
    from widedp.selection.registry import selector_names

    return (NO_SELECTION, *selector_names())


ACCOUNTANT_CHOICES = ("auto", "paper", "rdp", "pld", "prv")
#: The default of --accountant: PLD where it applies, RDP elsewhere (accounting/auto.py).
DEFAULT_ACCOUNTANT = "auto"


class UsageError(Exception):
    """A bad argument: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default prints the whole usage)
        raise UsageError(message)


def _positive_float(name):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}")
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{name} must be finite and > 0, got {text}")
        return value
    return parse


def _sigma_or_auto(name):
    number = _positive_float(name)

    def parse(text):
        return "auto" if text == "auto" else number(text)
    return parse


def _rate(text):
    value = _positive_float("--sample-rate")(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"--sample-rate must be in (0, 1], got {text}")
    return value


def _delta(text):
    value = _positive_float("--delta")(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"--delta must be in (0, 1), got {text}")
    return value


def _nonnegative_float(name):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number >= 0, got {text!r}") from None
        if not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number >= 0, got {text!r}")
        return value
    return parse


def _positive_int(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}")
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {text}")
        return value
    return parse


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sample-rate", type=_rate, help="Poisson sampling rate q = b/n (with --steps)")
    p.add_argument("--steps", type=_positive_int("--steps"), help="steps T (with --sample-rate)")
    p.add_argument("--batch-size", type=_positive_float("--batch-size"),
                   help="expected (Poisson) batch B: q = B/n (with --dataset-size and --epochs, as Opacus users state it)")
    p.add_argument("--dataset-size", type=_positive_int("--dataset-size"), help="training examples n")
    p.add_argument("--epochs", type=_positive_float("--epochs"), help="epochs E: T = ceil(E·n/B) steps")
    p.add_argument("--delta", type=_delta, required=True)
    p.add_argument("--selection", choices=selection_choices(), default=NO_SELECTION)
    p.add_argument("--k", type=_positive_int("--k"), help="rows selected per step (em, noisy-max)")
    p.add_argument("--max-answers", type=_positive_int("--max-answers"), help="svt: answers per step (c)")
    p.add_argument("--selection-delta", type=_delta, help="svt: Alg 1's δ (default: --delta)")
    p.add_argument("--svt-release-values", action="store_true",
                   help="svt: NumericSparse also releasing the values (ε split 0.95/0.05); default: "
                        "selection-only, as the trainer runs it")
    p.add_argument("--fest-sigma", type=_positive_float("--fest-sigma"),
                   help="charge one DP-FEST top-k over the whole data set with this noise multiplier before "
                        "the steps (required by --selection fest)")
    p.add_argument("--dataset", metavar="DIR",
                   help="also charge the one-time events recorded in DIR/dataset.json (e.g. a private "
                        "vocabulary), as the trainer does before its first step")
    p.add_argument("--recalibration-sigma", type=_sigma_or_auto("--recalibration-sigma"), metavar="SIGMA|auto",
                   help="also charge train.recalibrate's one release after the last step (a Gaussian of this "
                        "noise multiplier; trainer/engine/recalibration.py), as the trainer plans a private run of a "
                        "binary model by default; auto (calibrate only, needs --dataset-size): the trainer's rule")


def _add_modelmix_args(p) -> None:
    """`--modelmix --mix-width W [--mix-coordinates K]` (epsilon and calibrate)."""
    p.add_argument("--modelmix", action="store_true",
                   help="steps are ModelMix steps (seed B, Alg 1): secret mixing of the two latest states over an "
                        "enforced gap; only the rdp accountant supports them (accounting/modelmix.py; auto resolves to rdp)")
    p.add_argument("--mix-width", type=_nonnegative_float("--mix-width"),
                   help="--modelmix: enforced gap τ in units of the update's ℓ2 sensitivity (τ = r·η with "
                        "gradients averaged over the expected batch b: r·b/c)")
    p.add_argument("--mix-coordinates", type=_positive_int("--mix-coordinates"), default=1,
                   help="--modelmix: k of Alg 2's refined clipping (clamp each coordinate to c/√k); 1 = ℓ2 clipping only")


def _add_privacy_commands(sub) -> dict:
    """`epsilon` and `calibrate` (this module's own commands; they read the selector registry)."""
    p = sub.add_parser("epsilon", help=COMMAND_HELP["epsilon"][1])
    p.add_argument("--accountant", choices=ACCOUNTANT_CHOICES, default=DEFAULT_ACCOUNTANT,
                   help="auto (default): pld where it applies, else rdp")
    p.add_argument("--noise-multiplier", type=_positive_float("--noise-multiplier"), required=True,
                   help="σ: gradient noise std / ℓ2 sensitivity")
    _add_run_args(p)
    p.add_argument("--selection-epsilon", type=_positive_float("--selection-epsilon"),
                   help="em, noisy-max: ε per draw; svt: Alg 1's ε")
    p.add_argument("--selection-sigma", type=_positive_float("--selection-sigma"),
                   help="threshold: noise multiplier of the noisy counts")
    _add_modelmix_args(p)

    c = sub.add_parser("calibrate", help=COMMAND_HELP["calibrate"][1])
    c.add_argument("--target-epsilon", type=_positive_float("--target-epsilon"), required=True)
    c.add_argument("--accountant", choices=ACCOUNTANT_CHOICES, default=DEFAULT_ACCOUNTANT,
                   help="auto (default): pld where it applies, else rdp")
    _add_run_args(c)
    c.add_argument("--selection-fraction", type=float, default=0.0,
                   help="share of the per-step budget given to selection, in (0, 1)")
    _add_modelmix_args(c)
    return {"epsilon": cmd_epsilon, "calibrate": cmd_calibrate}


# Every command: (the module whose `add_commands(subparsers) -> {name: handler(args) -> dict}`
# defines it, its one-line help), in the order `widedp --help` lists them. `widedp --help` reads
# only this table; a command's module is imported when that command runs (or its --help is asked).
# tests/test_cli_startup.py checks that each module registers exactly these names and helps.
COMMAND_HELP: dict[str, tuple[str, str]] = {
    "train": ("widedp.trainer.cli.train", "train a model (embedded local Ray unless --address is given)"),
    "evaluate": ("widedp.trainer.cli.train", "evaluate a run's checkpoint on its test split"),
    "tune": ("widedp.trainer.cli.tune", "choose hyper-parameters privately: the best of a secret random number of "
                                        "private trials, charged to the budget"),
    "export": ("widedp.trainer.cli.export", "write a run's releasable model (weights, loader) and privacy report"),
    "report": ("widedp.trainer.cli.report", "plots and a markdown summary of one or more run directories"),
    "epsilon": (__name__, "ε spent by T steps of DP-SGD or Algorithm 3"),
    "calibrate": (__name__, "noise multiplier (and selection parameters) for a target ε"),
    "budget": ("widedp.trainer.cli.budget", "every run's privacy spending on a data set, and the total"),
    "verify": ("widedp.trainer.cli.verify", "check a run's privacy records (ledger, journal, checkpoint, budget) and print "
                                        "its verified ε"),
    "convert": ("widedp.trainer.cli.data", "convert Criteo TSV, your own table (by a schema) or plain text to a data set"),
    "synth": ("widedp.trainer.cli.data", "synthetic data set with planted ground truth"),
    "audit": ("widedp.trainer.cli.audit", "train once with canaries and bound ε from below (one-run audit)"),
    "wide-linear": ("widedp.trainer.cli.wide_linear", "wide logistic model on a data set's categorical ids, by seed A's Alg 2"),
}


def _add_commands_of(module_name: str, sub) -> dict:
    if module_name == __name__:
        return _add_privacy_commands(sub)
    return importlib.import_module(module_name).add_commands(sub)


def build_parser(command: Optional[str] = None, *, lazy: bool = False) -> argparse.ArgumentParser:
    """The `widedp` parser with every command fully defined (imports every command's module);
    lazy=True: only `command`'s module is imported (none for None), the other commands are
    listed by name and help — what `main` uses, so `widedp --help` and config errors are fast."""
    parser = _Parser(prog="widedp", description="Differentially private training of wide models")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                        help="messages on stderr from this level up (logging's 'widedp' logger; default warning)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    done: set[str] = set()
    for name, (module, text) in COMMAND_HELP.items():
        if module in done:
            continue
        if not lazy or COMMAND_HELP.get(command or "", ("",))[0] == module:
            COMMANDS.update(_add_commands_of(module, sub))
            done.add(module)
        else:
            sub.add_parser(name, help=text, add_help=False)
    return parser


def _command_in(argv: Sequence[str]) -> Optional[str]:
    """The command `argv` runs (the first word that names one, after the global options)."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--log-level":
            skip = True
        elif not word.startswith("-"):
            return word if word in COMMAND_HELP else None
    return None


def _selector(args) -> Any:
    """The registered selector `--selection` names (None for "none")."""
    from widedp.selection.registry import get_selector

    return None if args.selection == NO_SELECTION else get_selector(args.selection)


def _cli_source(args) -> dict:
    """The argument values the selectors' Params read (their `cli=` dests); Alg 1's δ defaults
    to --delta."""
    return {**vars(args), "selection_delta": args.selection_delta or args.delta}


def _flag_fields() -> dict[str, list[str]]:
    """{boolean CLI dest: the selectors that read it}."""
    from widedp.selection.registry import get_selector, selector_names

    out: dict[str, list[str]] = {}
    for name in selector_names():
        sel = get_selector(name)
        for f in sel.fields():
            dest = f.metadata.get("cli")
            if dest and isinstance(f.default, bool):
                out.setdefault(dest, []).append(name)
    return out


def _selection_params(args, *, calibrating: bool):
    """The selector's Params from the arguments (None for "none"). `widedp epsilon` needs every
    field the selector's Params reads from the CLI; `widedp calibrate` computes the calibrated
    ones (`record=True`) and needs only the others (e.g. fest's --fest-sigma)."""
    from widedp.selection.registry import MissingParameter

    for dest, owners in _flag_fields().items():
        if getattr(args, dest, False) and args.selection not in owners:
            raise UsageError(f"--{dest.replace('_', '-')} applies only to --selection {' or '.join(owners)}")
    selector = _selector(args)
    if selector is None:
        return None
    required = tuple(f.name for f in selector.fields() if f.metadata.get("cli") and not isinstance(f.default, bool)
                     and not (calibrating and f.metadata.get("record")))
    source = _cli_source(args)
    try:
        if calibrating:  # only check: calibrate computes the recorded fields
            missing = tuple(dest for f, dest in selector.cli_fields().items() if f in required and source.get(dest) is None)
            if missing:
                raise MissingParameter(selector.name, "cli", missing)
            return None
        return selector.params_from(source, "cli", require=required)
    except MissingParameter as exc:
        raise UsageError(f"--selection {args.selection} needs {' and '.join(exc.spelled)}") from None


def _check_selection_flags(args) -> None:
    _selection_params(args, calibrating=True)


def _one_time_events(args) -> list:
    """Events charged once before the steps, as the trainer charges them: the data set's own
    (`--dataset DIR`: e.g. a private vocabulary, from DIR/dataset.json), then any selector's
    one-time event whose arguments are given (--fest-sigma: DP-FEST's Gaussian, also with
    `--selection random`, which is the same run)."""
    from widedp.selection.registry import Selector, get_selector, selector_names

    events = []
    if args.dataset is not None:
        from widedp.trainer.data.format.meta import read_meta

        events += [(event, 1) for _, event in read_meta(args.dataset).privacy_events]
    source = _cli_source(args)
    chosen = _selector(args)
    with_one_time = [s for s in map(get_selector, selector_names()) if type(s).one_time_event is not Selector.one_time_event]
    # The run's own selector's one-time event. A run whose steps select nothing privately
    # (none, random) may be a free one-time selector's run (fest: random's steps) when that
    # one's arguments are given; a spending selector without one is charged nothing more.
    if chosen in with_one_time:
        candidates = [chosen]
    elif chosen is None or not chosen.spends_per_step:
        candidates = [s for s in with_one_time if not s.spends_per_step]
    else:
        candidates = []
    for sel in candidates:
        needed = tuple(sel.cli_fields())
        if all(source.get(dest) is not None for dest in sel.cli_fields().values()):
            event = sel.one_time_event(sel.params_from(source, "cli", require=needed))
            if event is not None:
                events.append((event, 1))
    return events


def _recalibration(args, target_epsilon: Optional[float]) -> tuple[list, dict]:
    """--recalibration-sigma: ([(its GaussianDpEvent, 1)], what the output reports), or ([], {}).
    "auto" is the trainer's rule (`recalibration.auto_noise_multiplier`: n = --dataset-size, the
    target ε, δ, the accountant), so it needs a target and the data set's size."""
    sigma = args.recalibration_sigma
    if sigma is None:
        return [], {}
    from widedp.accounting import events as ev

    out: dict = {}
    if sigma == "auto":
        if target_epsilon is None:
            raise UsageError("--recalibration-sigma auto needs a target ε (widedp calibrate); give a number here")
        if args.dataset_size is None:
            raise UsageError("--recalibration-sigma auto needs --dataset-size (its σ grows with the training examples n)")
        from widedp.trainer.engine.recalibration import auto_noise_multiplier

        sigma, out["recalibration_rule"] = auto_noise_multiplier(args.dataset_size, target_epsilon, args.delta,
                                                                 args.accountant)
    out["recalibration_sigma"] = sigma
    return [(ev.GaussianDpEvent(sigma), 1)], out


def _selection_event(args) -> Any:
    """The per-step selection event, built as `trainer.engine.Engine._selection_event` builds it:
    the registered selector's `event(params)`."""
    params = _selection_params(args, calibrating=False)
    selector = _selector(args)
    return None if selector is None else selector.event(params)


def _modelmix_noise(args):
    """`--modelmix`: σ ↦ the ModelMix event a step's noise becomes (DP-SGD steps only: no
    selection); None without --modelmix."""
    from widedp.accounting.modelmix import ModelMixDpEvent

    if not args.modelmix:
        if args.mix_width is not None or args.mix_coordinates != 1:
            raise UsageError("--mix-width and --mix-coordinates apply only with --modelmix")
        return None
    if args.mix_width is None:
        raise UsageError("--modelmix needs --mix-width")
    if args.selection != NO_SELECTION:
        raise UsageError("--modelmix applies to DP-SGD steps only (--selection none)")
    return lambda sigma: ModelMixDpEvent(sigma, args.mix_width, args.mix_coordinates)


def _modelmix_out(args) -> dict:
    return {"modelmix": True, "mix_width": args.mix_width, "mix_coordinates": args.mix_coordinates} if args.modelmix else {}


def cmd_epsilon(args) -> dict:
    from widedp.accounting import events as ev
    from widedp.accounting import make_accountant, step_event

    mix = _modelmix_noise(args)
    event = (ev.PoissonSampledDpEvent(args.sample_rate, mix(args.noise_multiplier)) if mix is not None
             else step_event(args.sample_rate, args.noise_multiplier, _selection_event(args)))
    recalibration, recalibration_out = _recalibration(args, None)
    history = _one_time_events(args) + [(event, args.steps)] + recalibration
    details = make_accountant(args.accountant).details(history, args.delta)
    out = {
        "epsilon": details.pop("epsilon"),
        "delta": args.delta,
        "accountant": args.accountant,
        "noise_multiplier": args.noise_multiplier,
        "sample_rate": args.sample_rate,
        "steps": args.steps,
        "selection": args.selection,
    }
    selector = _selector(args)
    if selector is not None and "svt_release_values" in selector.cli_fields().values():
        out["svt_release_values"] = args.svt_release_values
    if args.fest_sigma is not None:
        out["fest_sigma"] = args.fest_sigma
    out.update(_modelmix_out(args))
    out.update(recalibration_out)
    sigma_eff = ev.gaussian_noise_multiplier(event.event)
    if sigma_eff is not None:
        out["effective_noise_multiplier"] = sigma_eff
    out.update({k: v for k, v in details.items() if k not in ("delta", "steps", "sample_rate")})
    return out


def cmd_calibrate(args) -> dict:
    from widedp.selection.calibration import calibrate

    _check_selection_flags(args)
    mix = _modelmix_noise(args)
    # As trainer.run.train.plan_privacy calibrates: the steps plus the one-time events (DP-FEST's Gaussian).
    from widedp.accounting.calibration import UnreachableTargetError

    recalibration, recalibration_out = _recalibration(args, args.target_epsilon)
    extra = _one_time_events(args) + recalibration
    try:
        out = calibrate(
            args.target_epsilon, args.delta, args.sample_rate, args.steps,
            selection=args.selection, fraction=args.selection_fraction, accountant=args.accountant,
            k=args.k, max_answers=args.max_answers, selection_delta=args.selection_delta,
            svt_release_values=args.svt_release_values, extra_history=extra or None,
            **({"noise_event": mix} if mix is not None else {}),
        ).to_dict()
    except UnreachableTargetError as exc:
        raise exc.renamed("--target-epsilon") from None
    out["selection"] = args.selection
    out.update(_modelmix_out(args))
    if args.fest_sigma is not None:
        out["fest_sigma"] = args.fest_sigma
    out.update(recalibration_out)
    return out


COMMANDS: dict = {}  # name -> handler, filled by build_parser from the modules it imports


def _resolve_sampling(args) -> None:
    """--sample-rate/--steps, or --batch-size/--dataset-size/--epochs (trainer/api.py `sampling`)."""
    if not hasattr(args, "sample_rate"):
        return
    from widedp.trainer.api import sampling

    flags = {k: "--" + k.replace("_", "-") for k in ("sample_rate", "steps", "batch_size", "dataset_size", "epochs")}
    try:
        args.sample_rate, args.steps = sampling(sample_rate=args.sample_rate, steps=args.steps,
                                                batch_size=args.batch_size, dataset_size=args.dataset_size,
                                                epochs=args.epochs, names=flags)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def main_result(argv: Sequence[str]) -> dict:
    """The command's result (what `main` prints as JSON); its errors are raised, not printed."""
    args = build_parser(_command_in(argv), lazy=True).parse_args(list(argv))
    _configure_logging(args.log_level)
    _resolve_sampling(args)
    return COMMANDS[args.command](args)


def _configure_logging(level: str) -> None:
    """The 'widedp' logger writes `widedp: LEVEL: message` lines on stderr from `level` up."""
    logger = logging.getLogger("widedp")
    handler = next((h for h in logger.handlers if getattr(h, "_widedp_cli", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("widedp: %(levelname)s: %(message)s"))
        handler._widedp_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    else:  # main() called again in one process (tests, notebooks): today's stderr (the old one may be closed)
        handler.stream = sys.stderr  # type: ignore[attr-defined]
    logger.setLevel(level.upper())


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        result = main_result(sys.argv[1:] if argv is None else argv)
    except (UsageError, ValueError, ArithmeticError) as exc:  # accounting's UnsupportedEventError is a ValueError
        print(f"widedp: error: {exc}".replace("\n", " "), file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # trainer.run.train.TrainingInterrupted says where and how to resume
        print(f"widedp: {str(exc) or 'interrupted'}".replace("\n", " "), file=sys.stderr)
        return 130
    sys.stdout.write(strict_json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
