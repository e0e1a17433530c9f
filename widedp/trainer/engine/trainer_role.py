"""The trainer role: one data-parallel trainer's share of a step (docs/DESIGN.md §2.2).

Privacy assumption: none of its own. A trainer computes, for the examples of its partition that
the step's Poisson sample holds, exactly what the one-process step computes for them: the
lookup (at the shards), the dense forward/backward, the per-example clip factors
min(1, S1/‖g_j‖) over the example's whole gradient (embedding rows from ghost norms on the
shards + dense parameters), its clipped row sums (left at the shards that own the rows, or
returned by them when it is the only trainer in this process) and its dense clipped sum
Σ_j c_j ∇θ ℓ_j / b. Nothing it returns to the coordinator is released: the coordinator adds
the trainers' parts, selects, noises and records the step (trainer/engine/engine.py).

Local compute here, placement elsewhere: `InProcessTrainers` and `RayTrainers`
(trainer/engine/trainers.py) run the same `TrainerRole.step_part`, so N trainers on Ray are the
in-process step bit for bit. A trainer talks to the shards directly through a `ShardGroup`
(in-process, or `DirectShardGroup` of Ray actor handles): its bytes are its own.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np
import torch

from widedp.adaptive_clipping.dp_stat import counts_above
from widedp.selection.threshold import contribution_weights
from widedp.trainer.engine.dense_grads import DenseGradients, dense_gradients
from widedp.trainer.engine.example_norms import embedding_sq_norms
from widedp.trainer.engine.layout import ShardLayout, id_coordinates, route
from widedp.trainer.engine.vocabulary import SparseVocabulary


class PhaseClock:
    """Wall time per named phase: `mark(name)` closes the phase that ran since the last mark."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now

    def absorb(self, phases: dict) -> None:
        """Add phases measured elsewhere (a trainer's) and restart the clock now."""
        for name, seconds in phases.items():
            self.phases[name] = self.phases.get(name, 0.0) + seconds
        self._last = time.perf_counter()


@dataclasses.dataclass
class TrainerPart:
    """What one trainer returns for a step: per-example losses [B_i], the dense clipped sum / b
    (float64 per parameter), B_i, the clipped row sums when the shards returned them to this
    trainer (one trainer in-process; else None: they stay at the shards), its phase times and
    its CPU seconds for this part."""

    losses: torch.Tensor
    dense_sum: dict
    batch_size: int
    row_sums: Optional[list] = None  # per shard: (tables, ids, sums[, selection part, touched count])
    phases: dict = dataclasses.field(default_factory=dict)
    cpu_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class UnitSample:
    """A trainer's part of a user-level step (privacy.unit = "user"): its sampled examples
    (sorted dataset indices) and the unit of each, numbered 0..num_units-1 within this part.
    Every example of a sampled unit that the step uses is in the same trainer's part (the
    engine partitions by unit), so per-unit sums are complete here."""

    examples: np.ndarray
    units: np.ndarray
    num_units: int

    def __post_init__(self):
        if self.units.shape != self.examples.shape:
            raise ValueError(f"UnitSample: {self.units.size} units for {self.examples.size} examples")
        if self.units.size and (self.units.min() < 0 or self.units.max() >= self.num_units):
            raise ValueError(f"UnitSample: a unit outside [0, {self.num_units})")


def rows_by_unit(offsets: np.ndarray, ids: np.ndarray, units: np.ndarray, num_units: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per-example jagged rows (offsets, ids) regrouped per unit: unit u's rows are its
    examples' rows concatenated (in example order; repeats kept — the selectors count distinct
    (unit, row) pairs)."""
    counts = np.diff(offsets)
    owner = np.repeat(np.asarray(units, dtype=np.int64), counts)
    order = np.argsort(owner, kind="stable")
    per_unit = np.bincount(owner, minlength=num_units)
    return np.concatenate([[0], np.cumsum(per_unit)]).astype(np.int64), np.asarray(ids)[order]


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """What every trainer of a run knows (public configuration, no data)."""

    mode: str
    clip_norm: Optional[float]  # S1 (None: nonprivate)
    expected_batch_size: float  # b
    dense_grad_method: str = "auto"
    num_trainers: int = 1
    reduce_at_shards: bool = False  # leave the clipped row sums at the shards (N > 1 or trainers on Ray)
    # Selection on the shards by contribution counts: C1 (the weights min(1, C1/√n_j) of each
    # example, from all its sparse rows, travel to the shards with its clip factors); None: not needed.
    contribution_clip: Optional[float] = None
    dense_tables: tuple = ()
    # ModelMix's refined clipping (seed B Alg 2): after the ℓ2 clip to S1 every coordinate of each
    # example's gradient is clamped to ±S1/√k (k = this); 1: ℓ2 clipping only.
    coordinate_clip: int = 1
    # The embedding-gradient norms computed here from the ids and pooled-output gradients
    # (trainer/engine/example_norms.py), the pooled gradients sent with the clip factors (one round);
    # False, and always at user level: the shards compute them in a round of their own.
    norms_on_trainer: bool = True


def pooled_lookup(layout: ShardLayout, shards, batch, B: int, example_ids=None, averaged: bool = False,
                  trainer_arg: tuple = ()) -> tuple[np.ndarray, list]:
    """Pooled embeddings [B, F, D] and each shard's bags: each shard's partial pools of the bags
    it holds ids of, summed (from the averaged tables with `averaged`). `trainer_arg`: (i,)
    when the shards keep per-trainer state, else ()."""
    parts = route(layout, batch.sparse, B, example_ids=example_ids)
    bags = [p.bags(B) for p in parts]
    values = shards.call("lookup", [(p, B, True) if averaged else (p, B, False, *trainer_arg) for p in parts])
    F = len(layout.features)
    pooled = torch.zeros((B * F, layout.dim), dtype=torch.float32)
    for bag, v in zip(bags, values):  # a shard's bags are distinct; shards' parts of one bag add up
        # Ray hands actors' results over as read-only arrays: copied then (torch needs writable
        # memory), not in process
        pooled.index_add_(0, torch.from_numpy(bag.example * F + bag.feature),
                          torch.from_numpy(np.require(v, requirements="W")))
    return pooled.numpy().reshape(B, F, layout.dim), bags


def per_bag(g_pooled: np.ndarray, bags) -> np.ndarray:
    """The rows of a [B, F, D] array at a shard's bags (`ShardBags` order), [bags, D]."""
    B, F, D = g_pooled.shape
    return g_pooled.reshape(B * F, D).take(bags.example * F + bags.feature, axis=0)


def example_global_rows(layout: ShardLayout, batch, B: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, global row ids) per example across all features (jagged, batch order)."""
    kjt = batch.sparse
    values = kjt.values().numpy().astype(np.int64)
    feature, example = id_coordinates(kjt.lengths().numpy().astype(np.int64), len(layout.features), B)
    global_ids = values + layout.table_offsets[layout.feature_tables[feature]]
    order = np.argsort(example, kind="stable")
    counts = np.bincount(example, minlength=B)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), global_ids[order]


def weights_of_one_id_bags(layout: ShardLayout, lengths: np.ndarray, dense_tables, clip_norm: float) -> Optional[np.ndarray]:
    """`contribution_weights` min(1, C1/√n_j) without sorting, when no example can touch a row
    twice: every feature reads its own table and every bag [F, B] (`lengths`) holds at most
    one id, so n_j is example j's number of ids in sparse tables. None otherwise."""
    if not layout.no_row_repeats(lengths):
        return None
    sparse = ~np.isin(layout.feature_tables, np.asarray(tuple(dense_tables), dtype=np.int64))
    distinct_rows = lengths[sparse].sum(0)
    return np.minimum(1.0, clip_norm / np.sqrt(np.maximum(distinct_rows, 1)))


class TrainerRole:
    """Trainer `index`: its examples are dataset indices [lo, hi) (`bounds`); `model` is its
    replica of the dense model (the coordinator's own object in-process, a copy on Ray, kept
    equal by `load_dense`); `shards` is how it calls the shards."""

    def __init__(self, index: int, model, layout: ShardLayout, train_set, shards, options: TrainerOptions):
        self.index, self.model, self.layout, self.train_set = int(index), model, layout, train_set
        # a partitioned data set (trainer/data/format/partitioned.py `TrainerShare`): this trainer
        # opens its own parts and samples them itself (`draw_sample`); else the coordinator samples
        self.sampler = None
        if hasattr(train_set, "open") and hasattr(train_set, "generators"):
            self.train_set, self.sampler = train_set.open()
        self.shards, self.options = shards, options
        self.vocabulary = SparseVocabulary(np.array([t.num_rows for t in layout.tables]), tuple(options.dense_tables))
        self.bags: list = []  # this step's bags per shard (training lookup)
        self._batch: Optional[tuple] = None  # (batch, B, UnitSample or None) of this step
        self._pending: Optional[tuple] = None  # begin_part's state until finish_part
        # per shard, the pooled-output gradients of its bags still to be sent (with the clip
        # factors, `norms_on_trainer`); None when the shards already have them
        self._unsent_bag_grads: Optional[list] = None

    # ---- placement hooks ------------------------------------------------------------------------
    def set_shards(self, shards) -> None:
        """New shard handles (a lost shard was replaced)."""
        self.shards = shards

    def load_dense(self, state: dict) -> None:
        """The coordinator's dense parameters after its update (Ray replicas only)."""
        self.model.load_state_dict(state)

    def ping(self) -> int:
        return self.index

    def shard_bytes(self) -> tuple[int, int]:
        """(bytes sent to, received from) the shards by this trainer so far."""
        return int(self.shards.bytes_to_shards), int(self.shards.bytes_from_shards)

    # ---- its own sampling (a partitioned data set) -------------------------------------------------
    def draw_sample(self):
        """This step's Poisson sample of this trainer's parts (`PartitionSampler`): sorted indices
        into its parts, or a `UnitSample` at user level. Only with a partitioned data set."""
        if self.sampler is None:
            raise RuntimeError(f"trainer {self.index} samples nothing: the coordinator samples this data set")
        if self.sampler.unit_level:
            return UnitSample(*self.sampler.sample_units())
        return self.sampler.sample()

    def sampler_state(self) -> dict:
        if self.sampler is None:
            raise RuntimeError(f"trainer {self.index} has no sampler")
        return self.sampler.state_dict()

    def load_sampler_state(self, state: dict) -> None:
        if self.sampler is None:
            raise RuntimeError(f"trainer {self.index} has no sampler")
        self.sampler.load_state_dict(state)

    def num_examples(self) -> int:
        """Examples in this trainer's own data (its parts, or the whole split it was handed)."""
        return len(self.train_set)

    def _as(self, *args) -> tuple:
        """A shard call's arguments on behalf of this trainer (its index last; a lone
        in-process trainer omits it, the shards' default)."""
        return (*args, self.index) if self.options.num_trainers > 1 else args

    # ---- the step ---------------------------------------------------------------------------------
    def step_part(self, idx, dense_state: Optional[dict] = None, select: Optional[list] = None,
                  releases: Optional[list] = None) -> TrainerPart:
        """This trainer's share of a step on its sampled examples `idx` (sorted dataset
        indices of its partition) with the configured S1: `begin_part` then `finish_part`.
        `dense_state`: the dense parameters to load first (Ray). `select` (the only trainer;
        per shard, a `trainer.engine.shard.ShardSelect`): each shard runs its part of the selection
        with its row sums and returns the rows the coordinator can use and its part
        (`ShardGradients.clipped_row_sums`) — one round instead of two. `idx` may be a
        `UnitSample` (user level): the clip factors are then per unit (`begin_part`).
        `releases`: as in `begin_part`."""
        self.begin_part(idx, dense_state, releases=releases)
        return self.finish_part(self.options.clip_norm, select)

    def begin_part(self, idx, dense_state: Optional[dict] = None,
                   candidates: Optional[np.ndarray] = None, releases: Optional[list] = None) -> Optional[np.ndarray]:
        """The first half of the share, up to the per-example gradient norms: lookup, dense
        forward/backward, norms. With `candidates` (privacy.clip_norm = "adaptive",
        trainer/engine/adaptive_clip.py) returns the counts of this trainer's examples whose norm
        exceeds each candidate — the coordinator noises their sum and picks S1 — else None.
        User level (`idx` a `UnitSample`): the norms are per unit, ‖Σ_{j∈u} g_j‖ (the norm of
        the unit's summed gradient, embeddings and dense parameters), and so are the counts.
        `releases` (trainer actors, folded write-back): per shard, the coordinator's write-back
        calls still in flight; the lookup starts at each shard only after they ran there."""
        cpu = time.process_time()
        units: Optional[UnitSample] = None
        if isinstance(idx, UnitSample):
            idx, units = idx.examples, idx
        if dense_state is not None:
            self.load_dense(dense_state)
        clock = PhaseClock()
        o = self.options
        idx = np.asarray(idx, dtype=np.int64)
        batch, B = self.train_set.take(idx), int(idx.size)
        self._batch = (batch, B, units)
        if releases is not None:
            self.shards.follow(releases)
        pooled, self.bags = pooled_lookup(self.layout, self.shards, batch, B, example_ids=idx,
                                          trainer_arg=(self.index,) if o.num_trainers > 1 else ())
        clock.mark("lookup")
        losses, g_pooled, dense = self._dense_forward_backward(pooled, batch, B, grouped=units is not None)
        override = getattr(self.train_set, "override_pooled_grads", None)  # gradient canaries (trainer/run/audit.py)
        if override is not None and B:
            g_pooled = override(idx, g_pooled, self.layout.features)
        clock.mark("dense_forward_backward")
        sq = self._sq_norms(g_pooled, dense, B, units)
        clock.mark("norms")
        self._pending = (batch, B, losses, dense, sq, clock, time.process_time() - cpu, units)
        if candidates is None:
            return None
        return counts_above(np.sqrt(sq), candidates) if sq is not None else np.zeros(len(candidates), np.int64)

    def finish_part(self, clip_norm: Optional[float], select: Optional[list] = None) -> TrainerPart:
        """The second half: clip factors min(1, S1/‖g_j‖) with this step's S1 (`clip_norm`;
        None: nonprivate), clipped row sums at the shards and the dense clipped sum. User level:
        c_u = min(1, S1/‖Σ_{j∈u} g_j‖) for every example of unit u, so Σ_j c_{u(j)} g_j is the
        sum over units of each unit's clipped gradient (‖·‖ ≤ S1 per unit)."""
        if self._pending is None:
            raise RuntimeError(f"trainer {self.index}: finish_part without begin_part")
        cpu = time.process_time()
        batch, B, losses, dense, sq, clock, cpu_before, units = self._pending
        self._pending = None
        o = self.options
        if sq is not None and clip_norm is None:
            raise ValueError(f"trainer {self.index}: a private step needs this step's S1")
        factors = np.ones(B) if sq is None else np.minimum(1.0, clip_norm / np.maximum(np.sqrt(sq), 1e-30))
        if units is not None and sq is not None:
            factors = factors[units.units]  # each example takes its unit's factor
        bound = None if o.coordinate_clip == 1 or clip_norm is None else clip_norm / np.sqrt(o.coordinate_clip)
        if bound is not None and units is not None:
            raise ValueError("refined clipping (coordinate_clip > 1) clamps per example: not at user level")
        clock.mark("norms")
        weights = self._selection_weights(batch, B, units)
        clock.mark("selection_weights")
        # per shard: its examples' (factors, selection weights or None, pooled gradients or None)
        grads, self._unsent_bag_grads = self._unsent_bag_grads, None
        per_shard = [(factors[b.examples], None if weights is None else weights[b.examples],
                      None if grads is None else grads[s]) for s, b in enumerate(self.bags)]
        if bound is not None and select is not None:
            raise ValueError("refined clipping (coordinate_clip > 1) runs without selection (dpsgd mode)")
        row_sums = None
        # `bound`: refined clipping, every (example, row) clamped on the shards
        if o.reduce_at_shards:
            self.shards.call("add_clipped_row_sums", [(f, self.index, w, bound, g) for f, w, g in per_shard])
        else:
            sels = select if select is not None else [None] * len(per_shard)
            row_sums = self.shards.call("clipped_row_sums", [(f, 0, w, sel, bound, g)
                                                             for (f, w, g), sel in zip(per_shard, sels)])
        clock.mark("row_sums")
        dense_sum = self._dense_clipped_sum(dense, factors, bound)
        clock.mark("dense_clipped_sum")
        return TrainerPart(losses.detach(), dense_sum, B, row_sums, clock.phases,
                           cpu_before + time.process_time() - cpu)

    @torch.no_grad()
    def score_histogram(self, dense_params: dict, averaged: bool, batch_size: int, bins: int, clip: float,
                        unit_weighted: bool) -> tuple[np.ndarray, np.ndarray]:
        """The recalibration's exact counts (trainer/engine/recalibration.py `exact_histogram`)
        over this trainer's own examples — its parts of a partitioned data set — scored by the
        released model (`dense_params`, the shards' rows or, with `averaged`, their averages):
        (totals, positives) per logit bin, each example weighted 1 or, with `unit_weighted`
        (user level), 1/m for a unit of m examples (a unit's examples are all in one part, so
        m is the unit's count there). Nothing is noised here: the coordinator adds the trainers'
        counts and noises the sum once."""
        from widedp.trainer.engine.recalibration import exact_histogram, unit_weights

        weights = None
        if unit_weighted:
            units = self.train_set.units()
            if units is None:
                raise ValueError(f"trainer {self.index}: a user-level recalibration needs its parts' unit column")
            weights = unit_weights(np.unique(units, return_inverse=True)[1].reshape(-1))
        totals, positives = np.zeros(bins), np.zeros(bins)
        start = 0
        for batch in self.train_set.iter_batches(batch_size):
            pooled = pooled_lookup(self.layout, self.shards, batch, batch.size, averaged=averaged,
                                   trainer_arg=self._as())[0]
            logits = torch.func.functional_call(self.model, dense_params, (torch.from_numpy(pooled), batch.dense))
            w = None if weights is None else weights[start:start + batch.size]
            t, p = exact_histogram(logits.double().numpy().ravel(), batch.labels.double().numpy().ravel(), bins, clip, w)
            totals += t
            positives += p
            start += batch.size
        return totals, positives

    def example_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, global row ids) per example of this step's batch (count-based selectors
        on the coordinator ask for them); per unit at user level (`rows_by_unit`)."""
        if self._batch is None:
            raise RuntimeError(f"trainer {self.index} has no batch this step")
        batch, B, units = self._batch
        rows = example_global_rows(self.layout, batch, B)
        return rows if units is None else rows_by_unit(*rows, units.units, units.num_units)

    def _dense_forward_backward(self, pooled: np.ndarray, batch, B: int, grouped: bool = False):
        """Per-example losses, pooled-output gradients [B, F, D] (float32 numpy) and the dense
        part's pass 1 (None for an empty batch); `grouped`: per-unit norms will be asked for."""
        if not B:
            return torch.zeros(0), np.zeros((0, len(self.layout.features), self.layout.dim), np.float32), None
        dense = dense_gradients(self.model, torch.from_numpy(pooled), batch.dense, batch.labels,
                                self.options.dense_grad_method, grouped=grouped)
        return dense.losses, dense.pooled_grads.numpy().astype(np.float32), dense

    def _sq_norms(self, g_pooled: np.ndarray, dense: Optional[DenseGradients], B: int,
                  units: Optional[UnitSample] = None) -> Optional[np.ndarray]:
        """‖g_j‖² over each example's whole gradient: embedding rows (unique rows; here from the
        ids with `norms_on_trainer`, else on the shards) + dense parameters. Non-private: None
        (the shards get the pooled grads). User level: ‖Σ_{j∈u} g_j‖² per unit [num_units] — the
        two parts are disjoint parameter blocks, so the squared norms of the unit's summed
        gradient in each add up."""
        self._unsent_bag_grads = None
        here = self.options.norms_on_trainer and units is None
        if here:  # the shards get the pooled gradients with the clip factors (finish_part)
            self._unsent_bag_grads = [per_bag(g_pooled, b) for b in self.bags]
        if self.options.mode == "nonprivate":
            if not here:
                self.shards.call("set_pooled_grad", [self._as(per_bag(g_pooled, b)) for b in self.bags])
            return None
        if units is not None:
            parts = self.shards.call("unit_sq_norms", [self._as(per_bag(g_pooled, b), units.units[b.examples],
                                                                 units.num_units) for b in self.bags])
            sq = np.sum(parts, axis=0) if parts else np.zeros(units.num_units)
            if dense is not None:
                sq = sq + dense.group_sq_norms(torch.from_numpy(units.units), units.num_units).numpy()
            return sq
        sq = self.embedding_sq_norms(g_pooled, B)
        if dense is not None:
            sq = sq + dense.sq_norms.numpy()
        return sq

    def embedding_sq_norms(self, g_pooled: np.ndarray, B: int) -> np.ndarray:
        """Per-example squared norms of the embedding-row gradients [B] of this step's batch:
        here from its ids (`norms_on_trainer`: trainer/engine/example_norms.py; the pooled gradients go
        to the shards later, with the clip factors), or each shard gets the pooled-output
        gradients of its own bags and returns its examples' partial norms (the reference)."""
        if self._unsent_bag_grads is not None:
            if self._batch is None:
                raise RuntimeError(f"trainer {self.index} has no batch this step")
            return embedding_sq_norms(self.layout, self._batch[0].sparse, B, g_pooled)
        parts = self.shards.call("example_sq_norms", [self._as(per_bag(g_pooled, b)) for b in self.bags])
        sq = np.zeros(B)
        for bag, part in zip(self.bags, parts):
            sq[bag.examples] += part
        return sq

    def _selection_weights(self, batch, B: int, units: Optional[UnitSample] = None) -> Optional[np.ndarray]:
        """Each example's contribution weight min(1, C1/√n_j) over all its sparse rows, when the
        shards select by contribution counts (else None). User level: its unit's weight
        min(1, C1/√n_u), n_u the unit's distinct sparse rows over all its examples this step."""
        if self.options.contribution_clip is None:
            return None
        if units is not None:
            offsets, compact = self.vocabulary.restrict(
                *rows_by_unit(*example_global_rows(self.layout, batch, B), units.units, units.num_units))
            return contribution_weights(offsets, compact, self.options.contribution_clip)[units.units]
        lengths = batch.sparse.lengths().numpy().reshape(len(self.layout.features), B)
        fast = weights_of_one_id_bags(self.layout, lengths, self.options.dense_tables, self.options.contribution_clip)
        if fast is not None:
            return fast
        offsets, compact = self.vocabulary.restrict(*example_global_rows(self.layout, batch, B))
        return contribution_weights(offsets, compact, self.options.contribution_clip)

    def _dense_clipped_sum(self, dense: Optional[DenseGradients], factors: np.ndarray,
                           bound: Optional[float] = None) -> dict:
        """Σ_j c_j ∇_θ ℓ_j / b for every dense parameter (float64); zeros for an empty batch.
        `bound`: each clipped per-example coordinate clamped to ±bound first (refined clipping)."""
        b = self.options.expected_batch_size
        if dense is None:
            return {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in self.model.named_parameters()}
        f = torch.from_numpy(factors)
        sums = dense.clipped_sum(f) if bound is None else dense.clamped_sum(f, bound)
        return {n: g / b for n, g in sums.items()}


__all__ = ["PhaseClock", "TrainerOptions", "TrainerPart", "TrainerRole", "UnitSample", "example_global_rows",
           "pooled_lookup", "rows_by_unit", "weights_of_one_id_bags"]
