"""The coordinator: one step of seed Algorithm 3 (at row granularity) over sharded tables.

Privacy assumption: add/remove-one neighbouring datasets, Poisson sampling at rate q = b/n,
sums normalized by the expected batch size b (docs/DESIGN.md §1). One step (docs/DESIGN.md §2):
  sample → route ids → shards: partial pooled embeddings of their bags → coordinator: dense
  forward/backward (dense per-example norms by ghost norms, trainer/dense_grads.py) → shards:
  per-example partial squared norms over unique rows → clip factors min(1, S1/‖g_j‖) over
  embeddings + dense → shards: clipped row sums → selection over the whole vocabulary → S2 clip
  → Gaussian noise on selected rows and dense params → ledger.record(event) → release: (ids,
  noisy rows) of selected rows to the shards, dense optimizer step.
Modes: `nonprivate` (no clip/noise, touched rows updated), `dpsgd` (every row and dense param
noised), `sparse` (the above with a selector). In `sparse` mode a public per-table policy
(trainer/table_policy.py) may make some tables dense: their rows are noised and updated every
step as in `dpsgd` (same noise stream, so an all-dense sparse engine equals `dpsgd`), and the
selection runs over the rows of the other tables only.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from accounting import PrivacyLedger
from accounting import events as ev
from accounting.calibration import sampled_step_event, step_event
from selection import NoisyStep, noisy_step
from selection.registry import SelectionContext, Selector, get_selector, is_selector
from selection.result import Selection
from selection.threshold import contribution_weights
from trainer.dense_grads import DenseGradients, dense_gradients
from trainer.layout import ShardLayout, route
from trainer.models import DenseModel
from trainer.randomness import PrivacyRandomness
from trainer.shard_group import ShardLostError
from trainer.table_policy import SparseVocabulary


@dataclasses.dataclass
class PrivacyPlan:
    """Everything the step needs to know about privacy, fixed before training starts."""

    noise_multiplier: float  # σ of the gradient noise (std = σ · sensitivity)
    clip_norm: float  # S1
    second_clip_norm: Optional[float]  # S2
    selection: str  # a registered selector's name (selection.registry), or "none" (DP-SGD)
    selection_params: Any = None  # that selector's Params (None for "none")

    @property
    def selector(self) -> Optional[Selector]:
        return get_selector(self.selection) if is_selector(self.selection) else None


@dataclasses.dataclass
class StepStats:
    step: int
    batch_size: int
    loss: float
    rows_touched: int
    rows_selected: int
    epsilon: float
    phases: dict = dataclasses.field(default_factory=dict)  # seconds per phase of this step


@dataclasses.dataclass(frozen=True)
class RowSums:
    """G on the touched rows: table index, row id within the table, clipped sum / b, global id."""

    tables: np.ndarray
    row_ids: np.ndarray
    grads: np.ndarray  # float64 [m, D]
    global_ids: np.ndarray

    def subset(self, mask: np.ndarray) -> "RowSums":
        return RowSums(self.tables[mask], self.row_ids[mask], self.grads[mask], self.global_ids[mask])


class PhaseClock:
    """Wall time per named phase: `mark(name)` closes the phase that ran since the last mark."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now


class Engine:
    def __init__(self, model: DenseModel, layout: ShardLayout, shards, train_set, sampler, *, mode: str,
                 expected_batch_size: float, sample_rate: float, plan: Optional[PrivacyPlan], ledger: Optional[PrivacyLedger],
                 target_epsilon: float, dense_optimizer: torch.optim.Optimizer,
                 randomness: Optional[PrivacyRandomness] = None, secure_mode: bool = False, ledger_path=None,
                 dense_tables: tuple[int, ...] = (), ema_decay: float = 0.0, dense_grad_method: str = "auto",
                 num_trainers: int = 1, selection_on_shards: bool = False):
        """`dense_tables`: in `sparse` mode, the indices of the tables noised densely every step
        (trainer/table_policy.py); `dpsgd` noises every table, `nonprivate` none. `ema_decay`
        β > 0: evaluate (and checkpoint for export) the exponential moving average of the
        iterates, ema_t = β·ema_{t-1} + (1-β)·w_t — post-processing of the released iterates,
        free in privacy. The shards must be built with the same β (they average the tables).
        `num_trainers` N: the data-parallel split of docs/DESIGN.md §2.2, run in this process.
        Trainer i owns examples [⌊i·n/N⌋, ⌊(i+1)·n/N⌋) and takes its part of each step's Poisson
        sample (one sampler, so the union is the global sample exactly); it does the lookup,
        the dense part and the clip factors of its own examples, its clipped row sums are
        reduced at the shards that own the rows, and the dense clipped sums are added here.
        `selection_on_shards`: a selector that can (`Selector.shard_statistic`) selects on the
        shards, each over its own rows with its own stream, merged here (the same distribution
        as the selection over the whole vocabulary here, which is the reference path)."""
        self.model, self.layout, self.shards = model, layout, shards
        self.dense_grad_method = dense_grad_method  # trainer/dense_grads.py: auto, ghost or per_example
        self.train_set, self.sampler = train_set, sampler
        self.mode, self.b, self.q = mode, float(expected_batch_size), float(sample_rate)
        self.plan, self.ledger, self.target_epsilon = plan, ledger, target_epsilon
        self.ledger_path = ledger_path  # if set, the ledger is persisted before each release
        self.dense_optimizer = dense_optimizer
        self._dense_base_lrs = [group["lr"] for group in dense_optimizer.param_groups]
        # This step's learning rates are the configured ones times lr_scale (set by the run loop
        # from train.lr_schedule: a function of the step count only, so public).
        self.lr_scale = 1.0
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        self.ema_decay = float(ema_decay)
        self.dense_ema: Optional[dict] = (
            {n: p.detach().clone() for n, p in model.named_parameters()} if self.ema_decay > 0 else None)
        self.secure_mode = secure_mode
        # Secret by default (trainer/randomness.py): a caller that passes nothing gets fresh OS entropy.
        self.randomness = PrivacyRandomness.fresh() if randomness is None else randomness
        if secure_mode and self.randomness.reproducible:
            raise ValueError("privacy.secure_mode needs secret randomness: unset privacy.reproducible")
        self.selection_rng = self.randomness.selection_rng()
        self.noise_gen = self.randomness.noise_generator()
        self.dpsgd_noise_seed = self.randomness.dpsgd_noise_seed()
        self.shard_selection_seed = self.randomness.shard_selection_seed()
        self.selection_on_shards = bool(selection_on_shards)
        self.step_count = 0
        self.table_offsets = layout.table_offsets
        all_tables = tuple(range(len(layout.tables)))
        if any(t not in all_tables for t in dense_tables):
            raise ValueError(f"dense_tables {tuple(dense_tables)} must be table indices in {all_tables}")
        self.dense_tables = {"dpsgd": all_tables, "nonprivate": ()}.get(mode, tuple(sorted(set(dense_tables))))
        self.dense_table_rows = sum(layout.tables[t].num_rows for t in self.dense_tables)
        self.sparse_vocabulary = SparseVocabulary(np.array([t.num_rows for t in layout.tables]), self.dense_tables)
        # A step selects privately only when some table is sparse (no sparse table: DP-SGD).
        self.selects = mode == "sparse" and self.sparse_vocabulary.num_rows > 0
        self.fixed_rows: Optional[np.ndarray] = None  # DP-FEST's one-time selection (compact sparse ids)
        if isinstance(num_trainers, bool) or not isinstance(num_trainers, int) or num_trainers < 1:
            raise ValueError(f"num_trainers must be an integer >= 1, got {num_trainers!r}")
        self.num_trainers = num_trainers
        n = len(train_set)
        self.trainer_bounds = np.array([(i * n) // num_trainers for i in range(num_trainers + 1)], dtype=np.int64)
        self._row_sums_of_one: list = []  # one trainer: the shards' clipped row sums of this step
        self._bags: dict[int, list] = {}  # this step's ShardBags per shard, per trainer (training lookups)
        self._event = self._step_event()

    @property
    def private_plan(self) -> PrivacyPlan:
        """The plan of a private run; the private phases only run when there is one."""
        if self.plan is None:
            raise RuntimeError("a private step phase ran without a privacy plan (mode nonprivate)")
        return self.plan

    # ---- privacy events ----------------------------------------------------------------------
    def _selection_event(self) -> Optional[ev.DpEvent]:
        """The per-step selection event: the registered selector's `event(params)`."""
        return get_selector(self.private_plan.selection).event(self.private_plan.selection_params)

    def _step_event(self) -> Optional[ev.DpEvent]:
        if self.mode == "nonprivate":
            return None
        sel = self._selection_event() if self.selects else None
        return step_event(self.q, self.private_plan.noise_multiplier, sel)

    @property
    def step_event(self) -> Optional[ev.DpEvent]:
        return self._event

    def needs_one_time_selection(self) -> bool:
        """Whether the plan's selector selects once before training (DP-FEST)."""
        sel = self.plan.selector if self.plan is not None and self.selects else None
        return sel is not None and sel.one_time_event(self.private_plan.selection_params) is not None

    def prepare_fest(self, feature_rows: Callable[[str], tuple[np.ndarray, np.ndarray]]) -> None:
        """A one-time selection (DP-FEST): charge the selector's one-time event, then fix the
        trainable rows for all steps (over the sparse tables' rows, as compact ids)."""
        p = self.private_plan
        selector = get_selector(p.selection)
        event = selector.one_time_event(p.selection_params)
        if event is None:
            raise ValueError(f"selection {p.selection!r} has no one-time selection")
        n = len(self.train_set)
        # One example's global rows across all features: concatenate per-feature jagged rows.
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
            ids[cursor[example] + within] = vals + self.table_offsets[t]
            cursor += counts
        offsets, compact = self.sparse_vocabulary.restrict(offsets, ids)  # only the sparse tables' rows compete
        self.charge(event)  # before the selection is used
        sel = selector.one_time_select(offsets, compact, self.sparse_vocabulary.num_rows, p.selection_params,
                                       self.selection_rng)
        if sel.event != event:
            raise RuntimeError(f"the one-time selection ran {sel.event!r} but {event!r} was charged")
        self.fixed_rows = sel.ids

    def charge(self, event: ev.DpEvent) -> None:
        """Record a one-time event (DP-FEST, a private vocabulary) and persist the ledger,
        before anything that depends on that mechanism's output is used."""
        if self.ledger is None:
            raise RuntimeError("charge() needs a privacy ledger (a nonprivate run has none)")
        self.ledger.record(event)
        if self.ledger_path is not None:
            self.ledger.save(self.ledger_path)

    # ---- one step ---------------------------------------------------------------------------------
    def would_exceed_budget(self) -> bool:
        if self._event is None or self.ledger is None:
            return False
        return self.ledger.would_exceed(self._event, self.target_epsilon)

    def dense_gradients(self, pooled: torch.Tensor, dense: torch.Tensor, labels: torch.Tensor) -> DenseGradients:
        """Pass 1 of the dense part (trainer/dense_grads.py): per-example losses, pooled-output
        gradients [B,F,D] and squared dense-gradient norms; `clipped_sum(factors)` is pass 2."""
        return dense_gradients(self.model, pooled, dense, labels, self.dense_grad_method)

    def step(self) -> Optional[StepStats]:
        """One step of docs/DESIGN.md §2; None (and nothing spent) if it would exceed the target ε.

        The ledger records the event composed from what the selector and the noise step
        *returned*; it must equal the event budgeted in advance (`step_event`)."""
        try:
            return self._step()
        except ShardLostError as err:
            raise ShardLostError(f"step {self.step_count + 1}: {err}") from err

    def _step(self) -> Optional[StepStats]:
        if self.would_exceed_budget():
            return None
        clock = PhaseClock()
        idx = self.sampler.sample()
        B = int(idx.size)
        clock.mark("sample")
        losses, dense_grads, batches = [], None, []
        for trainer, own in enumerate(self._trainer_samples(idx)):
            part = self._trainer_part(trainer, own, clock)
            losses.append(part[0])
            batches.append(part[2])
            dense_grads = part[1] if dense_grads is None else {n: dense_grads[n] + g for n, g in part[1].items()}
        assert dense_grads is not None
        rows = self._reduced_row_sums()
        clock.mark("row_sums")
        dense_part = rows.subset(np.isin(rows.tables, self.dense_tables))
        selection = self._select(rows, batches)
        selected, delta_rows = self._restrict_to_selection(rows, selection)
        clock.mark("selection")
        noisy = self._clip_and_noise(delta_rows, dense_grads, torch.from_numpy(dense_part.grads))
        clock.mark("clip_and_noise")
        self._record(selection, noisy)  # ledger first: a crash after this can only over-count
        clock.mark("ledger")
        if noisy is None:  # nonprivate: the touched rows, unclipped and un-noised
            self._release_rows(selected, delta_rows.float())
        else:
            self._release_rows(selected, noisy.rows)
            self._release_dense_tables(noisy.shard_rows, noisy.std, dense_part)
        clock.mark("write_back")
        self._dense_update(noisy.dense if noisy is not None else dense_grads)
        clock.mark("dense_update")
        self.step_count += 1
        eps = self.ledger.epsilon() if noisy is not None and self.ledger is not None else 0.0
        return StepStats(self.step_count, B, float(torch.cat(losses).mean()) if B else float("nan"),
                         int(rows.global_ids.size), int(selected.size) + self.dense_table_rows, eps, clock.phases)

    # ---- the phases of one step ---------------------------------------------------------------------
    def _trainer_samples(self, idx: np.ndarray) -> list[np.ndarray]:
        """Each trainer's part of the step's sample (sorted dataset indices in its partition)."""
        cut = np.searchsorted(idx, self.trainer_bounds)
        return [idx[cut[i]: cut[i + 1]] for i in range(self.num_trainers)]

    def _trainer_part(self, trainer: int, idx: np.ndarray, clock: PhaseClock):
        """One trainer's share of a step, on its own examples: lookup, dense forward/backward,
        clip factors, clipped row sums (left at the shards when N > 1) and the dense clipped
        sum. Returns (per-example losses, dense clipped sum / b, (batch, B_i))."""
        batch, B = self.train_set.take(idx), int(idx.size)
        pooled = self._lookup(batch, B, idx, trainer=trainer)
        clock.mark("lookup")
        losses, g_pooled, dense = self._dense_forward_backward(pooled, batch, B)
        clock.mark("dense_forward_backward")
        factors = self._clip_factors(g_pooled, dense, B, trainer)
        clock.mark("norms")
        if self.num_trainers == 1:
            self._row_sums_of_one = self.shards.call(
                "clipped_row_sums", [(factors[b.examples],) for b in self._bags[trainer]])
        else:
            self.shards.call("add_clipped_row_sums", [(factors[b.examples], trainer) for b in self._bags[trainer]])
        clock.mark("row_sums")
        dense_grads = self._dense_clipped_sum(dense, factors)
        clock.mark("dense_clipped_sum")
        return losses, dense_grads, (batch, B)

    def _as(self, trainer: int, *args) -> tuple:
        """A shard call's arguments on behalf of `trainer` (its index last; one trainer: omitted,
        the shards' default, so a one-trainer step sends what it always did)."""
        return (*args, trainer) if self.num_trainers > 1 else args

    def _lookup(self, batch, B: int, example_ids=None, averaged: bool = False, trainer: int = 0) -> np.ndarray:
        """Pooled embeddings [B, F, D]: each shard's partial pools of the bags it holds ids of,
        summed (from the averaged tables with `averaged`). A training lookup keeps the step's
        bags (per trainer): the later shard calls send each shard only its own bags' and
        examples' values."""
        parts = route(self.layout, batch.sparse, B, example_ids=example_ids)
        bags = [p.bags(B) for p in parts]
        if not averaged:
            self._bags[trainer] = bags
        values = self.shards.call("lookup", [(p, B, True) if averaged else self._as(trainer, p, B, False) for p in parts])
        pooled = np.zeros((B, len(self.layout.features), self.layout.dim), dtype=np.float32)
        for bag, v in zip(bags, values):
            pooled[bag.example, bag.feature] += v  # a shard's bags are distinct
        return pooled

    def _dense_forward_backward(self, pooled: np.ndarray, batch, B: int):
        """Per-example losses, pooled-output gradients [B, F, D] (float32 numpy) and the dense
        part's pass 1 (None for an empty batch)."""
        if not B:
            return torch.zeros(0), np.zeros((0, len(self.layout.features), self.layout.dim), np.float32), None
        dense = self.dense_gradients(torch.from_numpy(pooled), batch.dense, batch.labels)
        return dense.losses, dense.pooled_grads.numpy().astype(np.float32), dense

    def _clip_factors(self, g_pooled: np.ndarray, dense: Optional[DenseGradients], B: int, trainer: int = 0) -> np.ndarray:
        """min(1, S1/‖g_j‖) over each example's whole gradient: embedding rows (ghost norms on the
        shards, unique rows) + dense parameters. Non-private: 1 (the shards keep the pooled grads)."""
        if self.mode == "nonprivate":
            self.shards.call("set_pooled_grad", [self._as(trainer, g_pooled[b.example, b.feature]) for b in self._bags[trainer]])
            return np.ones(B)
        sq = self._embedding_sq_norms(g_pooled, B, trainer)
        if dense is not None:
            sq = sq + dense.sq_norms.numpy()
        return np.minimum(1.0, self.private_plan.clip_norm / np.maximum(np.sqrt(sq), 1e-30))

    def _embedding_sq_norms(self, g_pooled: np.ndarray, B: int, trainer: int = 0) -> np.ndarray:
        """Per-example squared norms of the embedding-row gradients [B]: each shard gets the
        pooled-output gradients of its own bags and returns its examples' partial norms."""
        bags = self._bags[trainer]
        parts = self.shards.call("example_sq_norms", [self._as(trainer, g_pooled[b.example, b.feature]) for b in bags])
        sq = np.zeros(B)
        for bag, part in zip(bags, parts):
            sq[bag.examples] += part
        return sq

    def _dense_clipped_sum(self, dense: Optional[DenseGradients], factors: np.ndarray) -> dict:
        """Σ_j c_j ∇_θ ℓ_j / b for every dense parameter (float64); zeros for an empty batch."""
        if dense is None:
            return {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in self.model.named_parameters()}
        return {n: g / self.b for n, g in dense.clipped_sum(torch.from_numpy(factors)).items()}

    def _reduced_row_sums(self) -> "RowSums":
        """G restricted to the touched rows: Σ_j clipped row gradients / b, from every shard
        (with N > 1 trainers, each shard's sum over the trainers' parts it reduced)."""
        if self.num_trainers == 1:
            sums = self._row_sums_of_one
        else:
            sums = self.shards.call("reduced_row_sums", [() for _ in range(self.layout.num_shards)])
        tables = np.concatenate([s[0] for s in sums])
        row_ids = np.concatenate([s[1] for s in sums])
        grads = np.concatenate([s[2] for s in sums]).astype(np.float64) / self.b
        return RowSums(tables, row_ids, grads, self.table_offsets[tables] + row_ids)

    def _restrict_to_selection(self, rows: "RowSums", selection: Optional[Selection]):
        """(selected global ids sorted, Δ = G ⊙ M on them); no selection (DP-SGD, every table
        dense): no rows. The rows of dense tables are not here (`dense_part` of the step)."""
        if selection is None:
            return np.empty(0, np.int64), torch.zeros((0, self.layout.dim), dtype=torch.float64)
        selected = np.unique(selection.ids).astype(np.int64)
        delta = np.zeros((selected.size, self.layout.dim))
        if selected.size:  # SVT / thresholding may legitimately select nothing
            pos = np.searchsorted(selected, rows.global_ids)
            hit = (pos < selected.size) & (selected[np.minimum(pos, selected.size - 1)] == rows.global_ids)
            delta[pos[hit]] = rows.grads[hit]
        return selected, torch.from_numpy(delta)

    def _clip_and_noise(self, delta_rows: torch.Tensor, dense_grads: dict, dense_table_rows: torch.Tensor
                        ) -> Optional[NoisyStep]:
        """The audited Gaussian step (`selection.noisy_step`) over one vector: the selected rows
        (noised here), the dense parameters (noised here) and the touched rows of the dense
        tables (scaled here, noised on the shards with the same std); None in non-private mode."""
        if self.mode == "nonprivate":
            return None
        p = self.private_plan
        return noisy_step(delta_rows, dense_grads, p.noise_multiplier, p.clip_norm, self.b, p.second_clip_norm,
                          self.noise_gen, secure=self.secure_mode,
                          shard_noised=dense_table_rows if self.dense_tables else None)

    def _record(self, selection: Optional[Selection], noisy: Optional[NoisyStep]) -> None:
        """Compose the step's event from the events the mechanisms returned, check it is the one
        budgeted, record and persist it — before anything is released."""
        if noisy is None:
            return
        ran = sampled_step_event(self.q, noisy.event, None if selection is None else selection.event)
        if ran != self._event:
            raise RuntimeError(f"the step ran {ran!r} but the budget was checked for {self._event!r}; "
                               "nothing was recorded or released")
        self.charge(ran)

    def _dense_update(self, grads: dict) -> None:
        for n, p in self.model.named_parameters():
            p.grad = grads[n].view_as(p).to(p.dtype)
        for group, base in zip(self.dense_optimizer.param_groups, self._dense_base_lrs):
            group["lr"] = base * self.lr_scale
        self.dense_optimizer.step()
        self.dense_optimizer.zero_grad(set_to_none=True)
        if self.dense_ema is not None:
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    self.dense_ema[n].mul_(self.ema_decay).add_(p.detach(), alpha=1 - self.ema_decay)

    def _release_dense_tables(self, values: Optional[torch.Tensor], std: float, part: "RowSums") -> None:
        """Dense tables (every table in DP-SGD): the clipped touched rows plus the noise std —
        each shard noises and updates every row it owns of those tables."""
        if not self.dense_tables:
            return
        assert values is not None
        update = values.numpy()
        owner = self.layout.owner(part.tables, part.row_ids)
        self.shards.call("apply_dense_noise_update", [
            (self.step_count, self.dpsgd_noise_seed, std, part.tables[owner == s], part.row_ids[owner == s],
             update[owner == s], self.secure_mode, self.dense_tables, self.lr_scale)
            for s in range(self.layout.num_shards)])

    def _release_rows(self, selected: np.ndarray, update: torch.Tensor) -> None:
        """Send the update of the selected rows (global ids) to the shards that own them."""
        if self.dense_tables and not selected.size:
            return  # nothing selected: the dense-table release clears the shards' step cache
        values = update.numpy()
        t = np.searchsorted(self.table_offsets, selected, side="right") - 1
        local_ids = selected - self.table_offsets[t]
        owner = self.layout.owner(t, local_ids)
        self.shards.call("apply_rows", [(t[owner == s], local_ids[owner == s], values[owner == s], self.lr_scale,
                                         self.step_count + 1) for s in range(self.layout.num_shards)])

    # ---- selection ------------------------------------------------------------------------------
    def _select(self, rows: "RowSums", batches: list) -> Optional[Selection]:
        """The step's selection over every row of the sparse tables (its global ids and the
        event the selector returned). Non-private: every touched row, no event; no sparse table
        (DP-SGD): None. The selector sees the sparse tables' rows as one compact id space."""
        if self.mode == "nonprivate":
            return Selection(np.unique(rows.global_ids), ev.NoOpDpEvent())
        if not self.selects:
            return None
        p, rng, vocab = self.private_plan, self.selection_rng, self.sparse_vocabulary
        if self.selection_on_shards and get_selector(p.selection).shard_statistic == "counts":
            return self._select_on_shards(batches)
        keep, touched = vocab.to_compact(rows.global_ids)
        context = SelectionContext(
            num_rows=vocab.num_rows, touched_ids=touched, row_norms=np.linalg.norm(rows.grads[keep], axis=1),
            clip_norm=p.clip_norm, expected_batch_size=self.b,
            example_rows=lambda: vocab.restrict(*self._batch_global_rows(batches)), fixed_rows=self.fixed_rows)
        sel = get_selector(p.selection).select(context, p.selection_params, rng)
        return Selection(vocab.to_global(sel.ids), sel.event)

    def _select_on_shards(self, batches: list) -> Selection:
        """Each shard selects among its own rows of the sparse tables (`EmbeddingShard.select_rows`)
        and the selector merges the parts. The coordinator sends each shard the contribution
        weights of its own examples, computed here from all of each example's sparse rows."""
        p, vocab = self.private_plan, self.sparse_vocabulary
        selector = get_selector(p.selection)
        clip = p.selection_params.contribution_clip
        weights = []  # per trainer: each example's weight min(1, C1/√n_j), batch order
        for batch, B in batches:
            offsets, compact = vocab.restrict(*self._example_global_rows(batch, B))
            weights.append(contribution_weights(offsets, compact, clip))
        per_shard = []
        for s in range(self.layout.num_shards):
            own = {t: w[self._bags[t][s].examples] for t, w in enumerate(weights) if t in self._bags}
            per_shard.append((p.selection, p.selection_params, self.dense_tables, own, self.shard_selection_seed,
                              self.step_count))
        parts = self.shards.call("select_rows", per_shard)
        fixed = None if self.fixed_rows is None else vocab.to_global(self.fixed_rows)
        sel = selector.merge(parts, p.selection_params, fixed)
        return Selection(sel.ids, sel.event)

    def _batch_global_rows(self, batches: list):
        """`_example_global_rows` over the trainers' batches, in trainer order."""
        parts = [self._example_global_rows(batch, B) for batch, B in batches]
        shifts = np.cumsum([0] + [int(off[-1]) for off, _ in parts[:-1]])
        offsets = np.concatenate([[0]] + [off[1:] + shift for (off, _), shift in zip(parts, shifts)])
        return offsets.astype(np.int64), np.concatenate([ids for _, ids in parts])

    def _example_global_rows(self, batch, B):
        """(offsets, global row ids) per example across all features (for threshold counts)."""
        kjt = batch.sparse
        values = kjt.values().numpy().astype(np.int64)
        lengths = kjt.lengths().numpy().astype(np.int64).reshape(len(self.layout.features), B)
        table_of = np.array([self.layout.table_index(f.table) for f in self.layout.features])
        feature = np.repeat(np.repeat(np.arange(lengths.shape[0]), B), lengths.reshape(-1))
        example = np.repeat(np.tile(np.arange(B), lengths.shape[0]), lengths.reshape(-1))
        global_ids = values + self.table_offsets[table_of[feature]]
        order = np.argsort(example, kind="stable")
        counts = np.bincount(example, minlength=B)
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), global_ids[order]

    # ---- evaluation & state ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, dataset, batch_size: int, averaged: Optional[bool] = None) -> dict:
        """The model's metrics on `dataset`: with `averaged` (default: when ema_decay > 0) the
        averaged tables and dense parameters, else the last iterate."""
        averaged = self.dense_ema is not None if averaged is None else averaged
        if averaged and self.dense_ema is None:
            raise ValueError("averaged evaluation needs ema_decay > 0")
        dense_params = (self.dense_ema if averaged else None) or dict(self.model.named_parameters())
        outputs, labels = [], []
        for batch in dataset.iter_batches(batch_size):
            pooled = torch.from_numpy(self._lookup(batch, batch.size, averaged=averaged))
            outputs.append(torch.func.functional_call(self.model, dense_params, (pooled, batch.dense)))
            labels.append(batch.labels)
        if not outputs:
            return {}
        return self.model.metrics(torch.cat(outputs), torch.cat(labels))

    def state_dict(self) -> dict:
        """Everything a resumed run needs. Generator states only in reproducible mode: a secret
        run's randomness never reaches disk (a resumed secret run draws a fresh root)."""
        state = {
            "step": self.step_count,
            # Copies: a checkpoint held in memory must not change as training continues.
            "model": copy.deepcopy(self.model.state_dict()),
            "dense_optimizer": copy.deepcopy(self.dense_optimizer.state_dict()),
            "shards": self.shards.broadcast("state_dict"),
            "ledger": self.ledger.state_dict() if self.ledger is not None else None,
            "fixed_rows": self.fixed_rows,
            "reproducible": self.randomness.reproducible,
        }
        if self.dense_ema is not None:
            # the released model, with the averaged dense parameters (the shards' states carry
            # the averaged tables as "averaged_weights"); also all a resume needs of the average
            state["averaged_model"] = {**copy.deepcopy(self.model.state_dict()),
                                       **{n: v.clone() for n, v in self.dense_ema.items()}}
        if self.randomness.reproducible:
            state["rng"] = {
                "sampler": self.sampler.state_dict(),
                "selection_rng": self.selection_rng.bit_generator.state,
                "noise_gen": self.noise_gen.get_state(),
                "dpsgd_noise_seed": self.dpsgd_noise_seed,
                "shard_selection_seed": self.shard_selection_seed,
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint. Generator states are reused only when both the checkpoint and
        this engine are reproducible (bit-identical replay); otherwise this engine keeps its
        fresh secret streams, so replayed steps get fresh noise (and are charged again)."""
        self.step_count = state["step"]
        self.model.load_state_dict(state["model"])
        self.dense_optimizer.load_state_dict(state["dense_optimizer"])
        self.shards.call("load_state_dict", [(s,) for s in state["shards"]])
        rng = state.get("rng")
        if rng is not None and self.randomness.reproducible:
            self.sampler.load_state_dict(rng["sampler"])
            self.selection_rng.bit_generator.state = rng["selection_rng"]
            self.noise_gen.set_state(rng["noise_gen"])
            self.dpsgd_noise_seed = rng["dpsgd_noise_seed"]
            self.shard_selection_seed = rng.get("shard_selection_seed", self.shard_selection_seed)
        if self.ledger is not None and state["ledger"] is not None:
            self.ledger.load_state_dict(state["ledger"])
        self.fixed_rows = state["fixed_rows"]
        if self.dense_ema is not None:
            if "averaged_model" not in state:
                raise ValueError("the checkpoint has no averaged parameters but train.ema_decay > 0: "
                                 "resume with the checkpoint's train.ema_decay")
            self.dense_ema = {n: state["averaged_model"][n].clone() for n in self.dense_ema}
