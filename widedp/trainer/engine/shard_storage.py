"""A shard's rows: one FBGEMM table-batched embedding (TBE) holding every table's rows that this
shard owns, its flat [R, D] storage, and the maps between the layout's features, the TBE's
channels and the tables (trainer/engine/shard.py puts it together with the step's gradients,
selection and write-back).

Each feature reads its table through a TBE channel; tables no feature reads get a channel of
their own, so every table can be written; channels are ordered by table (FBGEMM's CPU row-wise
Adagrad needs a table's channels adjacent). The TBE keeps the optimizer state (Adagrad's
row-wise accumulator) in its own storage; updates are applied in place to the flat storage by
`ShardUpdates` (trainer/engine/shard_update.py), never by the TBE's fused backward.
"""

from __future__ import annotations

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from widedp.trainer.engine.layout import ShardLayout, public_key, row_block_normal

TBE_OPTIMIZER_STATE = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}


def _device() -> tuple[torch.device, ComputeDevice, EmbeddingLocation]:
    if torch.cuda.is_available():  # the same code picks the CUDA build and device when present
        return torch.device("cuda"), ComputeDevice.CUDA, EmbeddingLocation.DEVICE
    return torch.device("cpu"), ComputeDevice.CPU, EmbeddingLocation.HOST


class ShardStorage:
    """Shard `shard_index`'s rows of every table of `layout`, initialised from the public init
    stream (`public_key(seed)`, N(0, init_std²) per row), as one TBE.

    Attributes read by the other parts of a shard: `layout`, `shard_index`, `ranges` (table t's
    global rows [start, end) here), `starts`, `row_base` (flat index of table t's first row),
    `max_rows`, `feature_table`, `feature_rows` (rows of each feature's table here),
    `tables_unshared`, `feature_channel`, `num_channels`, `tbe`, `flat`, `device`."""

    def __init__(self, layout: ShardLayout, shard_index: int, optimizer: str = "sgd", lr: float = 0.1,
                 eps: float = 1e-8, seed: int = 0, init_std: float = 0.01):
        self.layout, self.shard_index = layout, shard_index
        self.device, compute, location = _device()
        self.ranges = [layout.row_range(t, shard_index) for t in layout.tables]
        self.starts = np.array([start for start, _ in self.ranges], dtype=np.int64)
        num_tables, dim = len(layout.tables), layout.dim
        self.feature_table = layout.feature_tables
        # Each feature reads its own table: ids of different bags never share a row.
        self.tables_unshared = layout.tables_unshared
        # Feature f is channel feature_channel[f]; a write-back of table t goes to its rows in
        # the flat storage (row_base[t] onwards).
        unused = [t for t in range(num_tables) if t not in set(self.feature_table.tolist())]
        owner = np.concatenate([self.feature_table, np.array(unused, dtype=np.int64)])
        by_table = np.argsort(owner, kind="stable")  # channel c holds feature (or unused table) by_table[c]
        self.channel_table = owner[by_table]
        self.num_channels = self.channel_table.size
        self.feature_channel = np.argsort(by_table)[: self.feature_table.size]
        rows = [max(end - start, 1) for start, end in self.ranges]  # a table with no rows here keeps one unused
        self.row_base = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)  # flat index of row 0
        self.max_rows = max(rows)
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(r, dim, location, compute) for r in rows],
            optimizer=TBE_OPTIMIZER_STATE.get(optimizer, EmbOptimType.EXACT_SGD),
            learning_rate=lr, eps=eps, pooling_mode=PoolingMode.SUM, feature_table_map=self.channel_table.tolist(),
            bounds_check_mode=BoundsCheckMode.NONE,  # `ShardGradients.lookup` checks the ids itself first
        )
        self.feature_rows = np.array([self.ranges[t][1] - self.ranges[t][0] for t in self.feature_table], dtype=np.int64)
        # Every table's rows as one [R, D] tensor (the TBE's own storage, tables back to back).
        self.flat = (self.tbe.weights_dev if compute == ComputeDevice.CUDA else self.tbe.weights_host).view(-1, dim)
        split = self.tbe.split_embedding_weights()
        if any(w.data_ptr() != self.flat[base].data_ptr() for w, base in zip(split, self.row_base)):
            raise RuntimeError("FBGEMM's TBE does not store its tables back to back; "
                               "trainer/engine/shard_storage.py needs updating")
        with torch.no_grad():
            for t, (start, end) in enumerate(self.ranges):
                self.weights(t).copy_(row_block_normal(public_key(seed), "init", 0, t, start, end, dim, init_std))

    def weights(self, t: int) -> torch.Tensor:
        """Table t's rows on this shard (a view of the TBE's storage)."""
        start, end = self.ranges[t]
        return self.flat[self.row_base[t]: self.row_base[t] + end - start]

    def adagrad_state(self) -> torch.Tensor:
        """EXACT_ROWWISE_ADAGRAD's per-row accumulator, every table back to back."""
        return self.tbe.momentum1_dev if self.flat.is_cuda else self.tbe.momentum1_host

    def per_table(self, flat: torch.Tensor) -> list:
        """Copies of a flat per-row tensor's rows, one array per table (the checkpoint format)."""
        return [flat[base: base + end - start].detach().cpu().numpy().copy()
                for base, (start, end) in zip(self.row_base, self.ranges)]

    def load_per_table(self, flat: torch.Tensor, saved: list) -> None:
        """The inverse of `per_table`: `saved`'s arrays into `flat`'s rows, in place."""
        for base, (start, end), s in zip(self.row_base, self.ranges, saved):
            flat[base: base + end - start].copy_(torch.from_numpy(np.array(s)))

    def rows_of(self, keys: np.ndarray, sums: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(table index, global row id, float32 sums) of row keys t·max_rows + local id."""
        tables, local = keys // self.max_rows, keys % self.max_rows
        return tables, local + self.starts[tables], sums.float().numpy()
