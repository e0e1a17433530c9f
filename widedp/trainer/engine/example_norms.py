"""Per-example squared norms of the embedding-row gradients, computed where the batch is.

Privacy assumption: none of its own. These norms size each example's clip factor
min(1, S1/‖g_j‖) (DESIGN §1, clip S1): they must equal the norms of exactly the gradient whose
clipped sum is released, or the clipped contribution could exceed S1. They are the same
quantity `ShardGradients.example_sq_norms` computes from each shard's part (the slow, obvious
reference the tests pin this to), summed over the shards.

Why here: the row gradients of example j are determined by its ids and the pooled-output
gradients alone (trainer/engine/shard.py's docstring),
  ∂L_j/∂E[t, r] = Σ_{features f of table t} Σ_{i in bag(j, f), id_i = r} w_i · ∂L_j/∂pooled_{j,f},
so the trainer, which holds both, needs no round to the shards for them. The shards then get
the pooled-output gradients together with the clip factors (one round instead of two).

Sensitivity: none (nothing here is released). Neighbouring relation: not involved.
"""

from __future__ import annotations

import numpy as np
import torch

from widedp.selection._sparse import unique_ints
from widedp.trainer.engine.layout import ShardLayout, id_coordinates, id_weights


def embedding_sq_norms(layout: ShardLayout, kjt, batch_size: int, pooled_grads: np.ndarray) -> np.ndarray:
    """‖∂L_j/∂E‖² [B] (float64) over every embedding row example j touches, in all tables: ids
    repeated in a bag, or read by several features of one table, add up into one row gradient
    before the norm is taken (the per-example gradient of that row).

    `kjt`: the batch's KeyedJaggedTensor (keys = `layout.features`, feature-major lengths);
    `pooled_grads`: ∂L_j/∂pooled_{j,f} [B, F, D]."""
    B = int(batch_size)
    F, D = len(layout.features), layout.dim
    g = np.asarray(pooled_grads, dtype=np.float32).reshape(B, F, D)
    if B == 0:
        return np.zeros(0)
    lengths = kjt.lengths().numpy().astype(np.int64, copy=False)
    if layout.no_row_repeats(lengths) and not layout.weighted:
        # No example touches a row twice, and a bag's one id has weight 1 (sum, or the mean of
        # one): ‖∂L_j/∂E‖² = Σ_f [bag (j, f) not empty]·‖∂L_j/∂pooled_{j,f}‖², no gather needed.
        # (einsum accumulates in float64 without a float64 copy of g: 5x faster than torch's
        # .double().pow(2).sum() at B = 16,384, F = 26, D = 16, the same values to 1e-16)
        sq = np.einsum("bfd,bfd->bf", g, g, dtype=np.float64)
        return (sq * lengths.reshape(F, B).T).sum(1)
    values = kjt.values().numpy().astype(np.int64, copy=False)
    feature, example = id_coordinates(lengths, F, B)
    weight = torch.from_numpy(id_weights(layout, lengths, feature, example, B, kjt))
    grads = torch.from_numpy(g.reshape(B * F, D))
    contrib = weight.unsqueeze(1) * grads[torch.from_numpy(example * F + feature)]  # float32, as on the shards
    total_rows = max(layout.vocabulary_size, 1)
    rows = layout.table_offsets[layout.feature_tables[feature]] + values
    uniq, group = unique_ints(example * total_rows + rows, return_inverse=True)
    sums = torch.zeros((uniq.size, D), dtype=torch.float64).index_add_(
        0, torch.from_numpy(np.asarray(group, dtype=np.int64)), contrib.double())
    return torch.zeros(B, dtype=torch.float64).index_add_(
        0, torch.from_numpy(uniq // total_rows), sums.pow(2).sum(1)).numpy()


__all__ = ["embedding_sq_norms"]
