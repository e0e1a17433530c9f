"""widedp: differentially private training of wide (embedding-dominated) models.

One namespace: `widedp.trainer` (config, run loop, engine, Ray roles, CLI), `widedp.selection`
(private row selection, the Gaussian step, keyed randomness, a selector's calibration),
`widedp.accounting` (events, accountants, ledger, calibration: what is claimed),
`widedp.auditing` (canaries, one-run ε lower bounds, exposure: what is measured),
`widedp.sparse_learners` and `widedp.adaptive_clipping` (the seeds' pure learners). Every module
lives here, under one name only: `widedp.<package>`; the repository's top-level folders of the
design card's layout (trainer/, selection/, ...) are links to these, and importing one by its
folder name (`import trainer` from the repository root) fails at once.

The Python API (trainer/api.py), imported on first use so `import widedp` stays light:
`load_config`, `train` (-> `RunResult`), `evaluate`, `export`, `epsilon`, `calibrate`, `sampling`;
and for a team's own model (trainer/private/): `make_private` (-> `PrivateTrainer`) over a
`KJTDataset`, or fed by your own loader through `LoaderData`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["KJTDataset", "LoaderData", "PrivateTrainer", "RunResult", "calibrate", "epsilon", "evaluate", "export", "load_config",
           "make_private", "sampling", "train"]
_BRING_YOUR_OWN = ("KJTDataset", "LoaderData", "PrivateTrainer", "make_private")


def __getattr__(name: str) -> Any:
    if name in _BRING_YOUR_OWN:
        return getattr(importlib.import_module("widedp.trainer.private"), name)
    if name in __all__:
        return getattr(importlib.import_module("widedp.trainer.api"), name)
    raise AttributeError(f"module 'widedp' has no attribute {name!r}")
