"""The rows the selection runs over: the sparse tables' rows as one compact id space
(`SparseVocabulary`; the per-table policy that makes some tables dense is the config's:
trainer/config/table_policy.py)."""

from __future__ import annotations

import numpy as np


class SparseVocabulary:
    """The rows of the sparse tables as one id space [0, num_rows) for the selectors.

    Global id g = offset_t + r (tables concatenated in layout order); the compact id of a row
    of a sparse table is its position among the sparse tables' rows, in the same order. With no
    dense table the two id spaces coincide."""

    def __init__(self, table_rows: np.ndarray, dense_tables: tuple[int, ...] | list[int]):
        rows = np.asarray(table_rows, dtype=np.int64)
        self.global_offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.is_sparse = np.ones(rows.size, dtype=bool)
        self.is_sparse[list(dense_tables)] = False
        sparse_rows = np.where(self.is_sparse, rows, 0)
        self.compact_offsets = np.concatenate([[0], np.cumsum(sparse_rows)]).astype(np.int64)
        self.num_rows = int(self.compact_offsets[-1])
        self.identity = bool(self.is_sparse.all())

    def table_of(self, global_ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.global_offsets, global_ids, side="right") - 1

    def to_compact(self, global_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mask of the ids in sparse tables, their compact ids)."""
        global_ids = np.asarray(global_ids, dtype=np.int64)
        if self.identity:
            return np.ones(global_ids.size, dtype=bool), global_ids
        t = self.table_of(global_ids)
        keep = self.is_sparse[t]
        return keep, global_ids[keep] - self.global_offsets[t[keep]] + self.compact_offsets[t[keep]]

    def restrict(self, offsets: np.ndarray, global_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Jagged per-example rows (offsets, global ids) → the same examples' rows in sparse
        tables only, as (offsets, compact ids)."""
        keep, compact = self.to_compact(global_ids)
        if self.identity:
            return np.asarray(offsets, dtype=np.int64), compact
        example = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        counts = np.bincount(example[keep], minlength=len(offsets) - 1)
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), compact

    def to_global(self, compact_ids: np.ndarray) -> np.ndarray:
        compact_ids = np.asarray(compact_ids, dtype=np.int64)
        if self.identity:
            return compact_ids
        # side="right" over the compact offsets skips the empty ranges of dense tables.
        t = np.searchsorted(self.compact_offsets, compact_ids, side="right") - 1
        return compact_ids - self.compact_offsets[t] + self.global_offsets[t]
