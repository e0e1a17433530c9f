"""Bring your own model: a team's TorchRec embedding tables and dense `nn.Module`, trained
privately by the same engine as `widedp train`.

    import widedp
    trainer = widedp.make_private(ebc, tower, loss_fn, data, target_epsilon=8.0, batch_size=256, steps=500)
    while trainer.step() is not None:    # None: the next step would pass the target ε
        pass
    trainer.epsilon(); trainer.embedding_state_dict()  # ε spent; weights the user's EBC loads

`make_private` (trainer/private/wrap.py) wraps what the user has: `EmbeddingBagCollection`s and
`EmbeddingCollection`s (or their configs) whose rows become widedp's sharded tables
(trainer/private/features.py: sequences as position bags, tables of any width), the user's
dense module (`UserDenseModel`, trainer/private/dense.py: it receives the pooled and sequence
embeddings by feature name and the dense features) and a per-example loss, over a data set of
KeyedJaggedTensor rows (`KJTDataset`, trainer/private/data.py) that widedp Poisson-samples
itself — so the guarantee is the one `widedp train` states (docs/DESIGN.md §1) — or over the
examples the user's own loader reads for each step's sample (`LoaderData`,
trainer/private/loader.py, which says what the user must then hold). The engine is built by
trainer/private/build.py, the one builder `widedp train` uses too.

May import: widedp.trainer.config, widedp.trainer.engine, widedp.trainer.cluster,
widedp.trainer.data, widedp.trainer.models, widedp.trainer.names, widedp.trainer.run.budget (the
data set's budget file, stdlib only), the pure libraries.
Not: the rest of run/, release/ or cli/ (they are clients of this package).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KJTDataset", "LoaderData", "PrivateTrainer", "UserDenseModel", "make_private"]
_WHERE = {"KJTDataset": "data", "LoaderData": "loader", "UserDenseModel": "dense", "PrivateTrainer": "wrap",
          "make_private": "wrap"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"widedp.trainer.private.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
