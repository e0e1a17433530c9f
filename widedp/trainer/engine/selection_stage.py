"""The step's private row selection over the whole vocabulary (docs/DESIGN.md §1 step 3), and
DP-FEST's one-time selection that fixes the trainable rows before the first step.

Privacy assumption: the selection runs over every row of the sparse tables, untouched rows
included (their score is 0 but they stay selectable: `SparseVocabulary` gives the selector one
compact id space), with the selector's own stream — on the coordinator (the reference path), or
on the shards that own the rows, each with its own keyed stream, merged exactly
(`Selector.merge`). The event the selector *returns* is what the step charges (the engine
checks it against the budgeted one).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from widedp.accounting import events as ev
from widedp.selection._sparse import unique_ints
from widedp.selection.keyed_random import NoiseKey
from widedp.selection.registry import SelectionContext, get_selector
from widedp.selection.result import Selection
from widedp.trainer.engine.layout import ShardLayout
from widedp.trainer.engine.plan import PrivacyPlan, RowSums
from widedp.trainer.engine.shard import ShardSelect
from widedp.trainer.engine.trainer_role import rows_by_unit
from widedp.trainer.engine.trainers import TrainerGroup
from widedp.trainer.engine.vocabulary import SparseVocabulary


class RowSelection:
    """One engine's selection: which rows a step updates, and DP-FEST's fixed rows.

    `step_count()` and `clip()` give the engine's step (the shards' streams are keyed by it) and
    this step's S1 (fixed, or DP-STAT's choice); `trainers` (set once the engine has them) give
    the batch's per-example rows for selectors that count contributions."""

    def __init__(self, *, mode: str, plan: Optional[PrivacyPlan], layout: ShardLayout,
                 vocabulary: SparseVocabulary, dense_tables: tuple, shards, rng: np.random.Generator,
                 shard_key: NoiseKey, expected_batch_size: float, on_shards: bool, fuse: bool, num_trainers: int,
                 step_count: Callable[[], int], clip: Callable[[], float]):
        self.mode, self.plan, self.layout, self.vocabulary = mode, plan, layout, vocabulary
        self.dense_tables, self.shards, self.rng, self.shard_key = dense_tables, shards, rng, shard_key
        self.b, self.on_shards, self.fuse, self.num_trainers = float(expected_batch_size), on_shards, fuse, num_trainers
        self.step_count, self.clip = step_count, clip
        # A step selects privately only when some table is sparse (no sparse table: DP-SGD).
        self.selects = mode == "sparse" and vocabulary.num_rows > 0
        self.fixed_rows: Optional[np.ndarray] = None  # DP-FEST's one-time selection (compact sparse ids)
        self._keep_rows: Optional[tuple] = None  # (fixed rows it was made from, per-shard global ids)
        self.trainers: Optional[TrainerGroup] = None

    @property
    def _plan(self) -> PrivacyPlan:
        if self.plan is None:
            raise RuntimeError("a private selection ran without a privacy plan (mode nonprivate)")
        return self.plan

    # ---- DP-FEST: once, before the first step ---------------------------------------------------------
    def needs_one_time_selection(self) -> bool:
        """Whether the plan's selector selects once before training (DP-FEST)."""
        sel = self.plan.selector if self.plan is not None and self.selects else None
        return sel is not None and sel.one_time_event(self._plan.selection_params) is not None

    def prepare_fest(self, feature_rows: Callable[[str], tuple[np.ndarray, np.ndarray]], num_examples: int,
                     example_units: Optional[np.ndarray], num_units: int, charge: Callable[[ev.DpEvent], None]) -> None:
        """A one-time selection (DP-FEST): charge the selector's one-time event (`charge`), then
        fix the trainable rows for all steps (over the sparse tables' rows, as compact ids)."""
        p = self._plan
        selector = get_selector(p.selection)
        event = selector.one_time_event(p.selection_params)
        if event is None:
            raise ValueError(f"selection {p.selection!r} has no one-time selection")
        n, offsets_of = num_examples, self.layout.table_offsets
        # One example's global rows across all features: concatenate per-feature jagged rows
        # (at user level then regrouped per unit: each unit counts its first L distinct rows).
        per_feature = [(f, *feature_rows(f.name)) for f in self.layout.features]
        lengths = sum(np.diff(off) for _, off, _ in per_feature)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = np.empty(offsets[-1], dtype=np.int64)
        cursor = offsets[:-1].copy()
        for f, off, vals in per_feature:
            t = self.layout.table_index(f.table)
            counts = np.diff(off)
            example = np.repeat(np.arange(n), counts)
            within = np.arange(vals.size) - np.repeat(off[:-1], counts)
            ids[cursor[example] + within] = vals + offsets_of[t]
            cursor += counts
        if example_units is not None:
            offsets, ids = rows_by_unit(offsets, ids, example_units, num_units)
        offsets, compact = self.vocabulary.restrict(offsets, ids)  # only the sparse tables' rows compete
        charge(event)  # before the selection is used
        sel = selector.one_time_select(offsets, compact, self.vocabulary.num_rows, p.selection_params, self.rng)
        if sel.event != event:
            raise RuntimeError(f"the one-time selection ran {sel.event!r} but {event!r} was charged")
        self.fixed_rows = sel.ids

    # ---- each step ---------------------------------------------------------------------------------------
    def shard_selects(self) -> Optional[list]:
        """Per shard, the `ShardSelect` of this step when the selection runs in the row-sum
        call (one trainer, a selector with a shard statistic, `fuse`); else None. `keep_rows`:
        the shard's DP-FEST fixed rows (global flat ids), which are selected here whatever the
        shards pick, so their sums must come back too."""
        if not (self.fuse and self.selects and self.on_shards and self.num_trainers == 1):
            return None
        p = self._plan
        if get_selector(p.selection).shard_statistic is None:
            return None
        offsets = self.layout.table_offsets
        if self._keep_rows is None or self._keep_rows[0] is not self.fixed_rows:
            per_shard = [np.empty(0, np.int64)] * self.layout.num_shards
            if self.fixed_rows is not None:
                flat = self.vocabulary.to_global(self.fixed_rows)
                t = np.searchsorted(offsets, flat, side="right") - 1
                owner = self.layout.owner(t, flat - offsets[t])
                per_shard = [np.sort(flat[owner == s]) for s in range(self.layout.num_shards)]
            self._keep_rows = (self.fixed_rows, per_shard)
        return [ShardSelect(p.selection, p.selection_params, tuple(self.dense_tables), self.shard_key,
                            self.step_count(), p.clip_norm, self.b, keep)  # adaptive S1: set when chosen
                for keep in self._keep_rows[1]]

    def select(self, rows: RowSums, shard_parts: Optional[list] = None) -> Optional[Selection]:
        """The step's selection over every row of the sparse tables (its global ids and the
        event the selector returned). Non-private: every touched row, no event; no sparse table
        (DP-SGD): None. The selector sees the sparse tables' rows as one compact id space.
        `shard_parts`: the shards' parts of the selection, made with their row sums."""
        if self.mode == "nonprivate":
            return Selection(unique_ints(rows.global_ids), ev.NoOpDpEvent())
        if not self.selects:
            return None
        p, vocab = self._plan, self.vocabulary
        if self.on_shards and get_selector(p.selection).shard_statistic is not None:
            return self.select_on_shards(shard_parts)
        keep, touched = vocab.to_compact(rows.global_ids)
        context = SelectionContext(
            num_rows=vocab.num_rows, touched_ids=touched, row_norms=np.linalg.norm(rows.grads[keep], axis=1),
            clip_norm=self.clip(), expected_batch_size=self.b,
            example_rows=lambda: vocab.restrict(*self.batch_global_rows()), fixed_rows=self.fixed_rows)
        sel = get_selector(p.selection).select(context, p.selection_params, self.rng)
        return Selection(vocab.to_global(sel.ids), sel.event)

    def select_on_shards(self, parts: Optional[list] = None) -> Selection:
        """Each shard selects among its own rows of the sparse tables (`ShardSelection.select_rows`:
        thresholding, or its top-k candidates) and the selector merges the parts (the union, or
        the exact top-k of the candidates). For contribution counts the trainers sent each
        shard the weights of their examples there, computed from all of each example's rows."""
        p, vocab = self._plan, self.vocabulary
        selector = get_selector(p.selection)
        if parts is None:
            parts = self.shards.broadcast("select_rows", p.selection, p.selection_params, self.dense_tables,
                                          self.shard_key, self.step_count(), self.clip(), self.b)
        fixed = None if self.fixed_rows is None else vocab.to_global(self.fixed_rows)
        sel = selector.merge(parts, p.selection_params, fixed)
        return Selection(sel.ids, sel.event)

    def restrict(self, rows: RowSums, selection: Optional[Selection]) -> tuple[np.ndarray, torch.Tensor]:
        """(selected global ids sorted, Δ = G ⊙ M on them); no selection (DP-SGD, every table
        dense): no rows. The rows of dense tables are not here (the step's dense part)."""
        if selection is None:
            return np.empty(0, np.int64), torch.zeros((0, self.layout.dim), dtype=torch.float64)
        selected = unique_ints(np.asarray(selection.ids, dtype=np.int64))
        delta = np.zeros((selected.size, self.layout.dim))
        if selected.size:  # SVT / thresholding may legitimately select nothing
            pos = np.searchsorted(selected, rows.global_ids)
            hit = (pos < selected.size) & (selected[np.minimum(pos, selected.size - 1)] == rows.global_ids)
            delta[pos[hit]] = rows.grads[hit]
        return selected, torch.from_numpy(delta)

    def batch_global_rows(self):
        """(offsets, global row ids) per example over the trainers' batches, in trainer order."""
        assert self.trainers is not None
        parts = self.trainers.example_rows()
        shifts = np.cumsum([0] + [int(off[-1]) for off, _ in parts[:-1]])
        offsets = np.concatenate([[0]] + [off[1:] + shift for (off, _), shift in zip(parts, shifts)])
        return offsets.astype(np.int64), np.concatenate([ids for _, ids in parts])
