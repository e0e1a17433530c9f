"""The names a config is checked against, readable before torch, FBGEMM, Ray and dp_accounting load.

`widedp train` checks its whole config in well under a second (trainer/cli/train.py), the
names included: a misspelled model, selector, optimizer or accountant is reported before the
registries are imported. Each list here is either the one definition (OPTIMIZERS, INTERACTIONS:
trainer/engine/shard.py and trainer/models/dlrm.py import them) or read without importing the registry
(selectors: the module files of selection/selectors/), or a mirror that
tests/test_cli_startup.py holds equal to its registry (models, accountants). `train()` then
checks the config again against the registries themselves (`config.registry`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: The sparse tables' optimizers (trainer/engine/shard.py implements each).
OPTIMIZERS = ("sgd", "adagrad", "adam")
#: DLRM's interactions (trainer/models/dlrm.py).
INTERACTIONS = ("dot", "cat")
#: trainer.models.MODELS's keys.
MODELS = ("cbow", "dlrm")
#: A model named by import path ("package.module:Class", trainer/models `model_class`).
IMPORT_PATH = r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*"


def is_import_path(name: str) -> bool:
    """Whether `name` has the form "package.module:Class" (imported only when the model is built)."""
    import re

    return re.fullmatch(IMPORT_PATH, name) is not None


#: accounting.base.accountant_names().
ACCOUNTANTS = ("auto", "paper", "pld", "prv", "rdp")


def selectors() -> tuple[str, ...]:
    """The selector registry's names from selection/selectors/'s module files (one selector per
    file, named as registered with "-" for "_"), without importing them."""
    spec = importlib.util.find_spec("widedp.selection")  # imports widedp only, not widedp.selection
    assert spec is not None and spec.submodule_search_locations
    folder = Path(next(iter(spec.submodule_search_locations))) / "selectors"
    return tuple(sorted(p.stem.replace("_", "-") for p in folder.glob("*.py") if p.stem != "__init__"))
