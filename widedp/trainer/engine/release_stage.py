"""The step's release: the noisy update of the selected rows, and of every row of the dense
tables, sent to the shards that own them (docs/DESIGN.md §2: only selected rows are written
back). Called after the step's event is charged (trainer/engine/budget.py); each write-back
travels with the shards' next call where the placement folds it (`ShardGroup.defer`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from widedp.selection.keyed_random import NoiseKey
from widedp.trainer.engine.layout import ShardLayout
from widedp.trainer.engine.plan import RowSums


def release_rows(shards, layout: ShardLayout, selected: np.ndarray, update: torch.Tensor, lr_scale: float,
                 step: int, dense_tables: tuple) -> None:
    """Send the update of the selected rows (global ids) to the shards that own them, for
    step `step` (1-based)."""
    if dense_tables and not selected.size:
        return  # nothing selected: the dense-table release clears the shards' step cache
    values = update.numpy()
    offsets = layout.table_offsets
    t = np.searchsorted(offsets, selected, side="right") - 1
    local_ids = selected - offsets[t]
    owner = layout.owner(t, local_ids)
    shards.defer("apply_rows", [(t[owner == s], local_ids[owner == s], values[owner == s], lr_scale, step)
                                for s in range(layout.num_shards)])


def release_dense_tables(shards, layout: ShardLayout, dense_tables: tuple, values: Optional[torch.Tensor], std: float,
                         part: RowSums, step_count: int, noise_key: NoiseKey, lr_scale: float,
                         mix: Optional[tuple] = None) -> None:
    """Dense tables (every table in DP-SGD): the clipped touched rows plus the noise std — each
    shard noises (counter-based, `noise_key` at step `step_count`) and updates every row it owns
    of those tables. `mix`: ModelMix's (key, gradient gap)."""
    if not dense_tables:
        return
    assert values is not None
    update = values.numpy()
    owner = layout.owner(part.tables, part.row_ids)
    shards.defer("apply_dense_noise_update", [
        (step_count, noise_key, std, part.tables[owner == s], part.row_ids[owner == s], update[owner == s],
         dense_tables, lr_scale, mix)
        for s in range(layout.num_shards)])
