"""The `widedp` command line is light: help and config errors import neither torch, Ray nor
dp_accounting (benchmarks/cli_startup.py measures the seconds; here the imports are checked,
which is what makes them fast and does not depend on the machine). Its output is strict JSON,
and --log-level drives the 'widedp' logger."""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest

from widedp.trainer import cli, strict_json

HEAVY = ("torch", "ray", "dp_accounting", "opacus", "fbgemm_gpu", "torchrec", "scipy")
ROOT = Path(__file__).resolve().parents[1]


def _modules_after(argv: list[str], tmp_path: Path) -> tuple[set[str], int]:
    """The heavy top-level modules loaded by `widedp ARGV` in a fresh interpreter, and its exit code."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys, json\n"
        "from widedp.trainer.cli import main\n"
        "try:\n"
        f"    code = main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        f"print(json.dumps([sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r})), code]))\n")
    done = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    loaded, code = json.loads(done.stdout.strip().splitlines()[-1])
    return set(loaded), code


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, str]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {c.dest: c.help for c in action._choices_actions}


def test_command_table_is_what_the_modules_register():
    """`widedp --help` lists COMMAND_HELP without importing any command's module, so the table
    must say exactly what each module registers (names, order-independent, and help lines)."""
    full = _subcommands(cli.build_parser())
    assert full == {name: text for name, (_, text) in cli.COMMAND_HELP.items()}
    lazy = _subcommands(cli.build_parser(lazy=True))
    assert lazy == full


def test_the_light_selection_name_is_the_registrys():
    from widedp.selection.registry import NO_SELECTION

    assert cli.NO_SELECTION == NO_SELECTION
    assert cli.selection_choices()[0] == NO_SELECTION


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_help_imports_nothing_heavy(argv, tmp_path):
    loaded, code = _modules_after(argv, tmp_path)
    assert code == 0
    assert loaded == set()


def test_the_import_probe_sees_a_heavy_command(tmp_path):
    """The probe above is not blind: `widedp epsilon --help` reads the selector registry."""
    loaded, code = _modules_after(["epsilon", "--help"], tmp_path)
    assert code == 0 and "dp_accounting" in loaded


#: What only an accountant computing ε needs: dp_accounting's package __init__ (all of the library)
#: and the scipy it pulls in. A shard or trainer actor builds events (selection) and never computes ε.
ACCOUNTANT_MODULES = ("dp_accounting", "dp_accounting.pld", "dp_accounting.rdp", "dp_accounting.mechanism_calibration",
                      "opacus")
SCIPY_OF_ACCOUNTANTS = ("scipy.signal", "scipy.stats", "scipy.optimize")
HEAVY_OF_BATCHES = ("torchrec", "torchrec.distributed", "torchmetrics")

_ACTOR_PROBE = """
import json, sys
watched = {watched!r}
seen = {{}}
for module in ("widedp.trainer.engine.shard", "widedp.trainer.engine.trainer_role"):  # the actor classes' modules (Ray workers)
    __import__(module)
    seen[module] = sorted(m for m in watched if m in sys.modules)
light = sorted(m for m in sys.modules if m.startswith("dp_accounting."))
import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
from widedp.accounting import events as ev
event = ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(1.0))
same = {{"GaussianDpEvent": dp_accounting.GaussianDpEvent is ev.GaussianDpEvent,
        "DpEvent": dp_accounting.DpEvent is ev.DpEvent,
        "NeighboringRelation": dp_accounting.NeighboringRelation is ev.NeighboringRelation,
        "dp_event module": dp_accounting.dp_event is sys.modules["dp_accounting.dp_event"],
        "accepted": pld_privacy_accountant.PLDAccountant().supports(event)}}
from widedp.trainer.data.format.jagged import KeyedJaggedTensor
import torchrec
same["KeyedJaggedTensor"] = torchrec.KeyedJaggedTensor is KeyedJaggedTensor
same["torchrec in full"] = hasattr(torchrec, "EmbeddingBagCollection")
print(json.dumps([seen, light, same]))
"""


def test_actor_modules_load_the_event_classes_but_no_accountant(tmp_path):
    """A Ray actor (shard, trainer) imports its class's module in a fresh worker. The events it
    builds come from dp_accounting's event modules alone (accounting/_dp_event_light.py): the
    package __init__, which imports PLD, RDP, mechanism calibration and scipy.signal/stats/
    optimize (~1-2 s per actor), runs only when something computes ε. Later the full import
    binds the same classes, so dp_accounting's accountants take our events. Likewise torchrec's package
    (torchrec.distributed, ~2-3 s) and torchmetrics (~2 s) stay out; a later `import torchrec`
    binds the jagged types already loaded."""
    probe = tmp_path / "actor_probe.py"
    probe.write_text(_ACTOR_PROBE.format(watched=list(ACCOUNTANT_MODULES + SCIPY_OF_ACCOUNTANTS + HEAVY_OF_BATCHES)))
    done = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen, light, same = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["widedp.trainer.engine.shard"] == [], seen
    # nor does the trainer role: batches are torchrec's jagged types without torchrec's package
    # (trainer/data/format/jagged.py), AUC is ranks without torchmetrics (trainer/models/auc.py)
    assert seen["widedp.trainer.engine.trainer_role"] == [], seen
    assert light == ["dp_accounting.dp_event", "dp_accounting.dp_event_builder", "dp_accounting.privacy_accountant"]
    assert all(same.values()), same


def test_the_lazy_accounting_package_exports_every_name_from_its_module():
    """widedp.accounting imports its names on first use (so that `widedp.accounting.events` alone
    stays light): each name of __all__ resolves, to the object its module defines."""
    import importlib

    import widedp.accounting as accounting

    assert sorted(accounting._HOMES) == sorted(accounting.__all__)
    for name, home in accounting._HOMES.items():
        assert getattr(accounting, name) is getattr(importlib.import_module(f"widedp.accounting.{home}"), name), name
    with pytest.raises(AttributeError, match="no attribute 'nosuch'"):
        getattr(accounting, "nosuch")


def test_config_errors_are_reported_before_torch_and_ray_load(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nstepz = 3\n")
    for argv in (["train", "--config", str(bad)],
                 ["train", "--config", str(tmp_path / "missing.toml")],
                 ["train", "--config", "configs/quickstart.toml", "--set", "train.steps=abc"],
                 ["train", "--config", "configs/quickstart.toml", "--set", "nosuch"]):
        loaded, code = _modules_after(argv, tmp_path)
        assert code == 2, argv
        assert loaded == set(), (argv, loaded)


def test_a_broken_lazy_table_would_be_caught(monkeypatch):
    """The table check above fails if a command's help drifts from its module's."""
    monkeypatch.setitem(cli.COMMAND_HELP, "budget", ("widedp.trainer.cli.budget", "some other text"))
    full = _subcommands(cli.build_parser())
    assert full["budget"] != cli.COMMAND_HELP["budget"][1]


def test_the_command_is_found_after_global_options():
    assert cli._command_in(["--log-level", "debug", "train", "--config", "x"]) == "train"
    assert cli._command_in(["--help"]) is None
    assert cli._command_in(["nosuch"]) is None


def test_strict_json_has_no_infinity():
    text = strict_json.dumps({"epsilon": math.inf, "x": [float("nan"), 1.0]})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict constant {c}")) == {"epsilon": None,
                                                                                                  "x": [None, 1.0]}
    with pytest.raises(ValueError):  # what the CLI wrote before: Python's json accepts, strict parsers refuse
        json.dumps({"epsilon": math.inf}, allow_nan=False)


def test_cli_prints_strict_json(capsys):
    """An ε that is infinite (δ of the data set's one-time events alone) prints as null."""
    code = cli.main(["epsilon", "--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps", "10",
                     "--delta", "1e-5"])
    out, err = capsys.readouterr()
    assert code == 0, err
    json.loads(out, parse_constant=lambda c: pytest.fail(f"non-strict constant {c}"))


def test_log_level_sets_the_widedp_logger(capsys):
    code = cli.main(["--log-level", "info", "epsilon", "--noise-multiplier", "1.0", "--sample-rate", "0.01",
              "--steps", "10", "--delta", "1e-5"])
    assert code == 0, capsys.readouterr().err
    logger = logging.getLogger("widedp")
    assert logger.level == logging.INFO
    logging.getLogger("widedp.trainer.run.train").info("hello from the trainer")
    assert "widedp: INFO: hello from the trainer" in capsys.readouterr().err
    cli.main(["epsilon", "--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5"])
    assert logger.level == logging.WARNING
    logging.getLogger("widedp.trainer.run.train").info("not shown")
    assert "not shown" not in capsys.readouterr().err


def test_out_of_range_values_and_unknown_names_are_reported_before_torch_and_ray_load(tmp_path):
    for override in ("train.mode=fast", "train.batch_size=0", "privacy.delta=2", "train.lr_schedule=nope",
                     "train.optimizer=nope", "model.name=nope", "model.interaction=nope", "train.selection=nope",
                     "privacy.accountant=nope", "data.synth=nope"):
        loaded, code = _modules_after(["train", "--config", "configs/quickstart.toml", "--set", override], tmp_path)
        assert code == 2 and loaded == set(), (override, loaded)


def test_the_light_name_lists_are_the_registries():
    """trainer/names.py mirrors or is each registry the config is checked against."""
    from widedp.accounting.base import accountant_names
    from widedp.selection.registry import selector_names
    from widedp.trainer import names
    from widedp.trainer.models import MODELS
    from widedp.trainer.models import dlrm
    from widedp.trainer.engine import shard

    assert names.selectors() == tuple(sorted(selector_names()))
    assert names.ACCOUNTANTS == accountant_names()
    assert names.MODELS == tuple(sorted(MODELS))
    assert shard.OPTIMIZERS is names.OPTIMIZERS and dlrm.INTERACTIONS is names.INTERACTIONS


def test_a_selector_file_added_without_its_registration_is_seen(tmp_path, monkeypatch):
    """The light selector list reads selection/selectors/'s files: a new file shows up there, so
    the equality above would fail until the selector registers under that name."""
    import importlib.util

    from widedp.trainer import names

    real = importlib.util.find_spec

    class Spec:
        submodule_search_locations = [str(tmp_path)]

    (tmp_path / "selectors").mkdir()
    for stem in ("__init__", "em", "my_new_one"):
        (tmp_path / "selectors" / f"{stem}.py").write_text("")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: Spec() if name == "widedp.selection" else real(name))
    assert names.selectors() == ("em", "my-new-one")


def test_the_full_pass_checks_the_registries_themselves(monkeypatch):
    """A name the light list holds but the registry does not (a stale mirror) is still refused by train()."""
    from widedp.trainer import names
    from widedp.trainer.engine import shard
    from widedp.trainer.config import ConfigError, light_names, load_config

    assert shard.OPTIMIZERS is names.OPTIMIZERS  # imported before the mirror goes stale
    monkeypatch.setattr(names, "OPTIMIZERS", (*names.OPTIMIZERS, "stale"))
    cfg = load_config("configs/quickstart.toml", ["train.optimizer=stale", "data.path=/nonexistent"])
    with light_names():
        cfg.validate()
    with pytest.raises(ConfigError, match="train.optimizer must be one of"):
        cfg.validate()
