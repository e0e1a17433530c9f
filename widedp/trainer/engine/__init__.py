"""The engine: one step of seed Algorithm 3 (at row granularity) over sharded tables
(`engine.Engine`, a pipeline of stages: trainer/engine/engine.py).

The engine package (trainer/engine/): the step and its parts — the shard (`shard`, composed of
`shard_storage`, `shard_rows`, `shard_select`, `shard_update`), the shard-group protocol and its in-process placement (`shard_group`), the
trainers' share of a step (`trainer_role`, `trainers`), dense per-example gradients and ghost
norms (`dense_grads`, `example_norms`), the noise and its keyed randomness (`step_noise`,
`randomness`, `layout`'s counter-based draws), DP-STAT (`adaptive_clip`), ModelMix (`modelmix`),
the recalibration (`recalibration`) and the selectable vocabulary (`vocabulary`); the step's
stages (`budget`, `selection_stage`, `noise_stage`, `release_stage`, `dense_update`), its
plan and outcome types (`plan`), evaluation (`evaluation`) and checkpoint (`checkpoint`).
May import: widedp.trainer.models (the dense models it trains), widedp.trainer.names, the pure
libraries, torch, FBGEMM, TorchRec, numpy.
Not: config, data, cluster, run, release or cli — an engine is built from values, a data set
and a shard group handed to it, never from a Config; Ray placements (trainer/cluster/) are
handed to it as factories.

The names below are imported lazily (PEP 562): a Ray worker that loads a shard or trainer actor
(`engine.shard`, `engine.trainer_role`) does not load the whole step.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"Engine": "engine", "EngineOptions": "engine", "EnginePrivacy": "engine", "PrivacyPlan": "plan",
            "StepStats": "plan", "RowSums": "plan", "step_event_of": "plan", "PrivacyBudget": "budget"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


if TYPE_CHECKING:  # pragma: no cover
    from widedp.trainer.engine.budget import PrivacyBudget
    from widedp.trainer.engine.engine import Engine, EngineOptions, EnginePrivacy
    from widedp.trainer.engine.plan import PrivacyPlan, RowSums, StepStats, step_event_of
