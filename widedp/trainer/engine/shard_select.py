"""Selection on the shard that owns the rows (docs/DESIGN.md §2.2): thresholding of its rows'
statistics, or its top-k candidates, with the shard's own keyed stream (shard s at step t:
`key.generator(t, s)`), merged exactly at the coordinator (`Selector.merge`). `ShardSelection`
reads the shard's rows (`ShardStorage`) and this step's gradients (`ShardGradients`: the
trainers' caches and the clipped row sums) and keeps nothing of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from widedp.selection._sparse import unique_ints
from widedp.selection.keyed_random import NoiseKey
from widedp.trainer.engine.shard_rows import ShardGradients
from widedp.trainer.engine.shard_storage import ShardStorage


@dataclasses.dataclass(frozen=True)
class ShardSelect:
    """The arguments of one shard's `select_rows` for a step, sent with the clipped row sums
    when one trainer's sums are the step's whole G (`clipped_row_sums(select=...)`), plus
    `keep_rows`: global flat ids of this shard's rows the coordinator selects regardless
    (DP-FEST's fixed rows), whose sums must come back too."""

    selection: str
    params: object
    dense_tables: tuple
    key: NoiseKey  # the shard-selection stream's key (trainer/engine/randomness.py)
    step: int
    clip_norm: Optional[float]
    expected_batch_size: Optional[float]
    keep_rows: np.ndarray


class ShardSelection:
    """The shard's part of a step's private selection (see the module docstring)."""

    def __init__(self, storage: ShardStorage, gradients: ShardGradients):
        self.storage, self.gradients = storage, gradients

    def select_rows(self, selection: str, params, dense_tables, key: NoiseKey, step: int, clip_norm: Optional[float] = None,
                    expected_batch_size: Optional[float] = None):
        """This shard's part of the step's selection over its own rows of the sparse tables
        (docs/DESIGN.md §2.2), in global ids: selector `selection`'s `shard_select` on the
        statistic it declares (`Selector.shard_statistic`), over these rows:
          "counts": Σ_j w_j over the distinct (example j, row) pairs of each trainer's batch,
              w_j the weights each trainer sent with its clip factors for this shard's examples
              (computed from all of an example's rows: `selection.threshold.contribution_weights`);
          "example_counts": the same with w_j = 1 (how many examples touch the row);
          "norms": ‖G_r‖₂ of this step's reduced clipped row sums / b (`expected_batch_size`),
              as the coordinator sees them (float32 sums).
        Returns global ids (thresholding) or `ShardCandidates` with global ids (top-k).
        Randomness: `key.generator(step, shard)` — its own keyed stream per shard and step, so the
        parts are independent."""
        from widedp.selection.partitioned import ShardCandidates
        from widedp.selection.registry import get_selector

        selector = get_selector(selection)
        statistic = selector.shard_statistic
        if statistic not in ("counts", "example_counts", "norms"):
            raise ValueError(f"selection {selection!r} does not run on the shards (statistic {statistic!r})")
        sparse = np.array([t for t in range(len(self.storage.ranges)) if t not in set(dense_tables)], dtype=np.int64)
        sizes = np.array([self.storage.ranges[t][1] - self.storage.ranges[t][0] for t in sparse], dtype=np.int64)
        base = np.full(len(self.storage.ranges), -1, dtype=np.int64)  # local id of table t's first row here
        base[sparse] = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if sparse.size else []
        num_rows = int(sizes.sum())
        if num_rows == 0:
            return np.empty(0, np.int64)
        if statistic == "norms":
            touched, summed = self._row_norms(base, expected_batch_size)
        else:
            touched, summed = self._row_counts(base, statistic == "counts")
        rng = key.generator(int(step), self.storage.shard_index)
        part = selector.shard_select(touched, summed, num_rows, params, rng, clip_norm=clip_norm,
                                     expected_batch_size=expected_batch_size)

        def to_global(local):
            local = np.asarray(local, dtype=np.int64)
            table_of = sparse[np.searchsorted(base[sparse], local, side="right") - 1]
            return self.storage.layout.table_offsets[table_of] + self.storage.starts[table_of] + local - base[table_of]

        return part.remap(to_global(part.ids)) if isinstance(part, ShardCandidates) else to_global(part)

    def _row_norms(self, base: np.ndarray, expected_batch_size: Optional[float]) -> tuple[np.ndarray, np.ndarray]:
        """(sorted compact local ids, ‖sum / b‖₂) of this step's clipped row sums on the sparse tables."""
        if self.gradients.step_row_sums is None:
            raise RuntimeError(f"shard {self.storage.shard_index} has no clipped row sums this step")
        if not expected_batch_size:
            raise ValueError("selection by row norms needs expected_batch_size")
        keys, sums = self.gradients.step_row_sums
        table, local = keys // self.storage.max_rows, keys % self.storage.max_rows
        keep = base[table] >= 0
        compact = base[table[keep]] + local[keep]
        norms = np.linalg.norm(sums[torch.from_numpy(keep)].float().double().numpy() / float(expected_batch_size), axis=1)
        order = np.argsort(compact, kind="stable")
        return compact[order], norms[order]

    def _row_counts(self, base: np.ndarray, weighted: bool) -> tuple[np.ndarray, np.ndarray]:
        """(sorted compact local ids, Σ_j w_j over distinct (example j, row) pairs): contribution
        counts (`weighted`: the trainers' weights) or example counts (w = 1). At user level
        (`unit_sq_norms` ran this step) j ranges over units: distinct (unit, row) pairs."""
        from widedp.selection.threshold import weighted_row_counts

        rows, counts = [], []
        for trainer in sorted(self.gradients.caches):
            cache = self.gradients.caches[trainer]
            inp, bags = cache["inp"], cache["bags"]
            if not weighted:
                weights = np.ones(bags.examples.size)
            elif "selection_weights" in cache:
                weights = cache["selection_weights"]
            else:
                raise RuntimeError(f"trainer {trainer} sent shard {self.storage.shard_index} no selection weights this step")
            if "units" in cache:  # user level: distinct (unit, row) pairs, each unit's weight once
                units = cache["units"]
                per_unit = np.zeros(int(units.max()) + 1 if units.size else 0)
                per_unit[units] = weights  # the trainer sends its unit's weight for each example
                table = self.storage.feature_table[inp.feature]
                keep = base[table] >= 0
                r, c = weighted_row_counts(units[bags.id_example][keep], base[table[keep]] + inp.local_id[keep], per_unit)
            elif self.gradients.ids_never_repeat(cache):  # every (example, row) pair distinct: sum by row groups
                keys, group = self.gradients.row_groups(cache)
                table_of, local_of = keys // self.storage.max_rows, keys % self.storage.max_rows
                counts_all = np.bincount(group, weights=weights[bags.id_example], minlength=keys.size)
                keep = base[table_of] >= 0
                r, c = base[table_of[keep]] + local_of[keep], counts_all[keep]
            else:
                table = self.storage.feature_table[inp.feature]
                keep = base[table] >= 0
                r, c = weighted_row_counts(bags.id_example[keep], base[table[keep]] + inp.local_id[keep], weights)
            rows.append(r)
            counts.append(c)
        if len(rows) == 1:  # one trainer: its rows are already distinct and sorted
            return rows[0], counts[0]
        touched, inverse = unique_ints(np.concatenate(rows or [np.empty(0, np.int64)]), return_inverse=True)
        summed = np.bincount(inverse, weights=np.concatenate(counts or [np.empty(0)]), minlength=touched.size)
        return touched, summed

    def rows_for_coordinator(self, select: ShardSelect, tables: np.ndarray, global_ids: np.ndarray,
                             sums: np.ndarray) -> tuple:
        """This shard's selection on `select`'s arguments (`select_rows`), run where one
        trainer's clipped row sums (`tables`, `global_ids`, `sums`) are the step's whole G, and
        of those rows only the ones the coordinator can use: those in this shard's part of the
        selection or in `select.keep_rows`, and every touched row of a dense table.

        Returns (tables, global ids, sums, part) of the rows kept; `part` as `select_rows`."""
        from widedp.selection.partitioned import ShardCandidates

        part = self.select_rows(select.selection, select.params, select.dense_tables, select.key, select.step,
                                select.clip_norm, select.expected_batch_size)
        wanted = np.union1d(part.ids if isinstance(part, ShardCandidates) else part, select.keep_rows)
        flat_ids = self.storage.layout.table_offsets[tables] + global_ids
        keep = np.zeros(flat_ids.size, dtype=bool)
        if wanted.size:  # membership by binary search: `wanted` is sorted
            at = np.minimum(np.searchsorted(wanted, flat_ids), wanted.size - 1)
            keep = wanted[at] == flat_ids
        if select.dense_tables:
            keep |= np.isin(tables, np.asarray(select.dense_tables, dtype=np.int64))
        return tables[keep], global_ids[keep], sums[keep], part
