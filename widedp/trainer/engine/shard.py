"""One embedding shard: local compute over the rows it owns (no Ray here).

Storage is one FBGEMM table-batched embedding (TBE) per shard holding all of the shard's
tables: one TBE call looks up every feature's bags; updates are applied in place to the TBE's
storage, rows by index (the same SGD / row-wise Adagrad as FBGEMM's fused backward, pinned against
it in tests/test_shard_storage.py, without its lookup and backward pass). The shard computes partial pooled embeddings,
per-example partial squared gradient norms over the *unique* rows of each example (an id
repeated in a bag, or used by several features of one table, contributes the *sum* of its
gradients — the per-example gradient of that row), clipped per-row gradient sums, and applies
optimizer updates to given rows only.

Per-example row gradient (sum pooling with per-id weights w, mean pooling = w = 1/|bag|):
  ∂L_j/∂E[t, r] = Σ_{features f of table t} Σ_{i in bag(j, f), id_i = r} w_i · ∂L_j/∂pooled_{j,f}.
"""

from __future__ import annotations

import dataclasses
import time

from typing import Any, Optional, Sequence

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from widedp.selection._sparse import unique_ints
from widedp.selection.keyed_random import NoiseKey
from widedp.trainer.engine.layout import ShardInput, ShardLayout, public_key, row_block_normal, row_block_uniform
from widedp.trainer.engine.modelmix import mix

# The TBE keeps the optimizer state (Adagrad's row-wise accumulator) in its own storage; the
# updates themselves are applied in place by `_update_weights` (no TBE backward).
TBE_OPTIMIZER_STATE = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}
from widedp.trainer.names import OPTIMIZERS  # noqa: E402  (the one list: config checks it before torch loads)
UPDATE_CHUNK = 1 << 16


def _device() -> tuple[torch.device, ComputeDevice, EmbeddingLocation]:
    if torch.cuda.is_available():  # the same code picks the CUDA build and device when present
        return torch.device("cuda"), ComputeDevice.CUDA, EmbeddingLocation.DEVICE
    return torch.device("cpu"), ComputeDevice.CPU, EmbeddingLocation.HOST


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


# Shard methods that change a shard's state for good (the others fill its per-step cache).
MUTATING = frozenset({"apply_rows", "apply_dense_noise_update", "load_state_dict"})


def owned(obj: Any) -> Any:
    """`obj` with every numpy array and tensor in it (through tuples, lists, dicts and
    dataclasses such as ShardInput) replaced by a copy of its own, writable."""
    if isinstance(obj, np.ndarray):
        return np.array(obj, copy=True)
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, tuple):
        return tuple(owned(o) for o in obj)
    if isinstance(obj, list):
        return [owned(o) for o in obj]
    if isinstance(obj, dict):
        return {k: owned(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        copy = dataclasses.replace(obj, **{f.name: owned(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                          if f.init})
        return copy
    return obj


class EmbeddingShard:
    def __init__(self, layout: ShardLayout, shard_index: int, optimizer: str = "sgd", lr: float = 0.1,
                 seed: int = 0, init_std: float = 0.01, adam_betas: Sequence[float] = (0.9, 0.999),
                 eps: float = 1e-8, ema_decay: float = 0.0):
        """`ema_decay` β > 0 keeps an exponential moving average of every row's iterates
        (`averaged_weights`), updated lazily: only rows written in a step cost anything."""
        from widedp.trainer.engine.memory import keep_freed_memory

        keep_freed_memory()  # as the coordinator: a shard actor's per-step buffers stay in its heap
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"embedding optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        self.layout, self.shard_index, self.optimizer, self.lr = layout, shard_index, optimizer, lr
        self.adam_betas, self.eps = adam_betas, eps
        self._current_lr = lr  # lr · the step's lr_scale (begin_update)
        self._last_call_id: int = -1  # the last `dispatch` call run, and its answer
        self._last_answer: Any = None
        self._call_timings: Optional[list] = None  # `record_call_timings` (benchmarks only)
        self.device, compute, location = _device()
        self.ranges = [layout.row_range(t, shard_index) for t in layout.tables]
        self.starts = np.array([start for start, _ in self.ranges], dtype=np.int64)
        num_tables, dim = len(layout.tables), layout.dim
        self.feature_table = layout.feature_tables
        # Each feature reads its own table: ids of different bags never share a row.
        self.tables_unshared = layout.tables_unshared
        # One TBE holds every table of the shard. Its "features" (channels) are the layout's
        # features plus one channel for each table no feature uses (so every table can be
        # written), ordered by table: FBGEMM's CPU row-wise Adagrad needs a table's channels
        # adjacent. Feature f is channel feature_channel[f]; a write-back sends table t's rows
        # through channel update_channel[t].
        unused = [t for t in range(num_tables) if t not in set(self.feature_table.tolist())]
        owner = np.concatenate([self.feature_table, np.array(unused, dtype=np.int64)])
        by_table = np.argsort(owner, kind="stable")  # channel c holds feature (or unused table) by_table[c]
        self.channel_table = owner[by_table]
        self.num_channels = self.channel_table.size
        self.feature_channel = np.argsort(by_table)[: self.feature_table.size]
        self.feature_channel_t = torch.from_numpy(self.feature_channel)
        self.update_channel = np.searchsorted(self.channel_table, np.arange(num_tables)).astype(np.int64)
        rows = [max(end - start, 1) for start, end in self.ranges]  # a table with no rows here keeps one unused
        self.row_base = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)  # flat index of row 0
        self.max_rows = max(rows)
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(r, dim, location, compute) for r in rows],
            optimizer=TBE_OPTIMIZER_STATE.get(optimizer, EmbOptimType.EXACT_SGD),
            learning_rate=lr, eps=eps, pooling_mode=PoolingMode.SUM, feature_table_map=self.channel_table.tolist(),
            bounds_check_mode=BoundsCheckMode.NONE,  # `lookup` checks the ids itself, before the TBE sees them
        )
        self.feature_rows = np.array([self.ranges[t][1] - self.ranges[t][0] for t in self.feature_table], dtype=np.int64)
        # Every table's rows as one [R, D] tensor (the TBE's own storage, tables back to back).
        self.flat = (self.tbe.weights_dev if compute == ComputeDevice.CUDA else self.tbe.weights_host).view(-1, dim)
        split = self.tbe.split_embedding_weights()
        if any(w.data_ptr() != self.flat[base].data_ptr() for w, base in zip(split, self.row_base)):
            raise RuntimeError("FBGEMM's TBE does not store its tables back to back; trainer/engine/shard.py needs updating")
        with torch.no_grad():
            for t, (table, (start, end)) in enumerate(zip(layout.tables, self.ranges)):
                self.weights(t).copy_(row_block_normal(public_key(seed), "init", 0, t, start, end, dim, init_std))
        self.adam_state = None
        if optimizer == "adam":  # flat like the weights
            self.adam_state = {"m": torch.zeros_like(self.flat), "v": torch.zeros_like(self.flat),
                               "t": torch.zeros(self.flat.shape[0], dtype=torch.int64)}
        # Per-trainer step state (trainer index -> this step's input, bags and per-id
        # contributions): each data-parallel trainer talks to the shard about its own examples.
        self._caches: dict[int, dict] = {}
        self._row_sum_parts: list = []  # (keys, sums) of the trainers' clipped row sums this step
        self._step_row_sums: Optional[tuple] = None  # this step's (keys, float64 sums), for selection by norms
        # Parameter averaging (post-processing of the iterates). ema[r] is the EMA through step
        # ema_through[r]; row r's weight has not changed since then, so the EMA through any
        # later step T is β^n·ema + (1 - β^n)·w with n = T - ema_through (_ema_catch_up).
        self.ema_decay = float(ema_decay)
        self.step = 0  # the step whose update is being applied (begin_update), then the last one applied
        self.ema: Optional[torch.Tensor] = None
        if self.ema_decay > 0:
            self.ema = self.flat.detach().clone()
            self.ema_through = torch.zeros(self.flat.shape[0], dtype=torch.int64, device=self.flat.device)
        self._ema_current_at: Optional[int] = 0  # every row's EMA is through this step (None: not known)
        self.mix_previous: Optional[torch.Tensor] = None  # ModelMix's θ_{t-2} (train.modelmix; flat rows)

    # ---- forward ------------------------------------------------------------------------------
    def weights(self, t: int) -> torch.Tensor:
        """Table t's rows on this shard (a view of the TBE's storage)."""
        start, end = self.ranges[t]
        return self.flat[self.row_base[t]: self.row_base[t] + end - start]

    def lookup(self, inp: ShardInput, batch_size: int, averaged: bool = False, trainer: int = 0) -> np.ndarray:
        """Partial pooled embeddings of this shard's bags ([bags, D], in `inp.bags` order: only
        what this shard holds travels back); with `averaged`, from the averaged weights
        (evaluation only: no gradient cache is kept). One TBE call over every feature's bags
        (feature-major, like a KJT). `trainer`: whose examples these are (data-parallel
        trainers each keep their own step state here; example indices are the trainer's own)."""
        dim = self.layout.dim
        self._check_ids(inp, batch_size)
        bags = inp.bags(batch_size)
        if not averaged:
            self._caches[int(trainer)] = {"inp": inp, "batch_size": batch_size, "bags": bags}
        if batch_size == 0 or inp.example.size == 0:
            return np.zeros((0, dim), dtype=np.float32)
        channel = self.feature_channel[inp.feature]
        bag_of_id = channel * batch_size + inp.example
        if bool((bag_of_id[1:] >= bag_of_id[:-1]).all()):  # routed in bag order already (channel = feature order)
            order: "np.ndarray | slice" = slice(None)
        else:
            order = np.argsort(bag_of_id, kind="stable")  # stable: a bag keeps its ids' order
        bag = bag_of_id[order]
        n_bags = self.num_channels * batch_size
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(np.bincount(bag, minlength=n_bags))]))
        weights = torch.from_numpy(inp.weight[order])
        bag_channel = self.feature_channel[bags.feature]
        with torch.no_grad():
            if not averaged:
                ids = torch.from_numpy(inp.local_id[order])
                pooled = self.tbe(ids.to(self.device), offsets.to(self.device),
                                  per_sample_weights=weights.to(self.device))  # [B, channels·D]
                pooled = pooled.reshape(-1, dim)  # row example·channels + channel
                wanted = torch.from_numpy(bags.example * self.num_channels + bag_channel)
            else:  # the same weighted sum pooling over the averaged rows
                table = self.averaged_weights_flat()
                flat_ids = torch.from_numpy(self.row_base[self.feature_table[inp.feature[order]]] + inp.local_id[order])
                pooled = torch.nn.functional.embedding_bag(
                    flat_ids.to(table.device), table, offsets.to(table.device), mode="sum",
                    per_sample_weights=weights.float().to(table.device), include_last_offset=True)  # [channels·B, D]
                wanted = torch.from_numpy(bag_channel * batch_size + bags.example)
            out = pooled.index_select(0, wanted.to(pooled.device))
        return out.float().cpu().numpy()

    def _check_ids(self, inp: ShardInput, batch_size: int) -> None:
        """ValueError naming the feature and id of any id outside this shard's rows of its
        table (the TBE runs without its own bounds check), or an example outside the batch."""
        if inp.example.size == 0:
            return
        bad = (inp.local_id < 0) | (inp.local_id >= self.feature_rows[inp.feature])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            feature = self.layout.features[int(inp.feature[i])]
            raise ValueError(f"shard {self.shard_index}: feature {feature.name!r} id {int(inp.local_id[i])} (local) is "
                             f"outside this shard's {int(self.feature_rows[inp.feature[i]])} rows of table {feature.table!r}")
        if inp.example.min() < 0 or inp.example.max() >= batch_size:
            raise ValueError(f"shard {self.shard_index}: example index outside the batch of {batch_size}")

    # ---- per-example gradients ----------------------------------------------------------------
    def _cache(self, trainer: int) -> dict:
        cache = self._caches.get(int(trainer))
        if cache is None:
            raise RuntimeError(f"trainer {trainer} has no lookup on shard {self.shard_index} this step")
        return cache

    def _contributions(self, bag_grads: np.ndarray, trainer: int) -> torch.Tensor:
        """Each id's w_i · ∂L_j/∂pooled_{j,f} [nnz, D] from the pooled-output gradients of this
        shard's bags ([bags, D], `inp.bags` order) and cache them for the row sums."""
        cache = self._cache(trainer)
        inp, bags = cache["inp"], cache["bags"]
        grad = torch.from_numpy(np.asarray(bag_grads, dtype=np.float32).reshape(-1, self.layout.dim))
        contrib = torch.from_numpy(inp.weight).unsqueeze(1) * grad[torch.from_numpy(bags.id_bag)]
        cache.update(contrib=contrib, table=self.feature_table[inp.feature])
        return contrib

    def example_sq_norms(self, bag_grads: np.ndarray, trainer: int = 0) -> np.ndarray:
        """Per-example squared ℓ2 norms of this shard's part of each example's row gradients,
        for this shard's examples (`inp.bags(B).examples` order); `bag_grads` as in `lookup`."""
        contrib = self._contributions(bag_grads, trainer)
        cache = self._cache(trainer)
        inp, bags, table = cache["inp"], cache["bags"], cache["table"]
        if self._ids_never_repeat(cache):  # each id's contribution is its own row gradient
            return torch.zeros(bags.examples.size, dtype=torch.float64).index_add_(
                0, torch.from_numpy(bags.id_example), contrib.double().pow(2).sum(1)).numpy()
        # Group by (example, table, row): repeated ids add up before the norm is taken.
        n_tables = len(self.ranges)
        key = (bags.id_example * n_tables + table) * self.max_rows + inp.local_id
        uniq, group = np.unique(key, return_inverse=True)
        group_t = torch.from_numpy(group.astype(np.int64).reshape(-1))
        sums = torch.zeros((uniq.size, contrib.shape[1]), dtype=torch.float64).index_add_(0, group_t, contrib.double())
        sq = torch.zeros(bags.examples.size, dtype=torch.float64).index_add_(
            0, torch.from_numpy(uniq // (n_tables * self.max_rows)), sums.pow(2).sum(1))
        return sq.numpy()

    def unit_sq_norms(self, bag_grads: np.ndarray, units: np.ndarray, num_units: int, trainer: int = 0) -> np.ndarray:
        """Per-unit squared ℓ2 norms [num_units] of this shard's part of each privacy unit's
        (user's) summed row gradients: ‖Σ_{j∈u} ∂L_j/∂E[t, r]‖² summed over the (t, r) here.
        `units`: the unit (0..num_units-1) of each of this shard's examples (`inp.bags(B).examples`
        order). A row two examples of one unit touch adds up before the norm is taken, as repeated
        ids of one example do in `example_sq_norms` (which is this with one unit per example).
        The units are kept for this step's contribution counts (`_row_counts`: distinct (unit, row)
        pairs, each unit's weight once)."""
        contrib = self._contributions(bag_grads, trainer)
        cache = self._cache(trainer)
        inp, bags, table = cache["inp"], cache["bags"], cache["table"]
        units = np.asarray(units, dtype=np.int64)
        if units.shape != bags.examples.shape:
            raise ValueError(f"shard {self.shard_index}: {units.size} units for {bags.examples.size} examples")
        if units.size and (units.min() < 0 or units.max() >= num_units):
            raise ValueError(f"shard {self.shard_index}: a unit index outside [0, {num_units})")
        cache["units"] = units
        id_unit = units[bags.id_example]
        n_tables = len(self.ranges)
        key = (id_unit * n_tables + table) * self.max_rows + inp.local_id
        uniq, group = np.unique(key, return_inverse=True)
        sums = torch.zeros((uniq.size, contrib.shape[1]), dtype=torch.float64).index_add_(
            0, torch.from_numpy(group.astype(np.int64).reshape(-1)), contrib.double())
        sq = torch.zeros(int(num_units), dtype=torch.float64).index_add_(
            0, torch.from_numpy(uniq // (n_tables * self.max_rows)), sums.pow(2).sum(1))
        return sq.numpy()

    def clipped_row_sums(self, factors: np.ndarray, trainer: int = 0, selection_weights=None,
                         select: Optional[ShardSelect] = None, coordinate_bound: Optional[float] = None,
                         bag_grads: Optional[np.ndarray] = None):
        """Σ_j factor_j · ∂L_j/∂E[t, r] over the trainer's batch, for every touched (t, r) of
        this shard; `factors` for this shard's examples (`inp.bags(B).examples` order).
        `selection_weights`: the same examples' contribution weights, kept for `select_rows`.

        Returns (table index [m], global row id [m], sums [m, D] float32). With `select` (one
        trainer: these sums are the step's whole G here), this shard's selection runs in the
        same call (`select_rows` on `select`'s arguments) and only the rows the coordinator can
        use come back — those in this shard's part of the selection or in `select.keep_rows`,
        and every touched row of a dense table — as (tables, global ids, sums, part, touched:
        how many rows were touched here). `coordinate_bound`: refined clipping — each example's
        clipped row gradient clamped to ±bound per coordinate before the sum (`_clamped_row_sums64`).
        `bag_grads`: this step's pooled-output gradients of this shard's bags (as in
        `example_sq_norms`), when the trainer computed the norms itself (trainer/engine/example_norms.py)
        and no norms round ran: the pooled gradients and the factors travel in this one call."""
        if bag_grads is not None:
            self._contributions(bag_grads, trainer)
        self._keep_selection_weights(selection_weights, trainer)
        keys, sums = self._step_row_sums = (self._clipped_row_sums64(factors, trainer) if coordinate_bound is None
                                            else self._clamped_row_sums64(factors, trainer, coordinate_bound))
        if select is None:
            return self._rows_of(keys, sums)
        from widedp.selection.partitioned import ShardCandidates

        part = self.select_rows(select.selection, select.params, select.dense_tables, select.key, select.step,
                                select.clip_norm, select.expected_batch_size)
        tables, global_ids, flat = self._rows_of(keys, sums)
        wanted = np.union1d(part.ids if isinstance(part, ShardCandidates) else part, select.keep_rows)
        flat_ids = self.layout.table_offsets[tables] + global_ids
        keep = np.zeros(flat_ids.size, dtype=bool)
        if wanted.size:  # membership by binary search: `wanted` is sorted
            at = np.minimum(np.searchsorted(wanted, flat_ids), wanted.size - 1)
            keep = wanted[at] == flat_ids
        if select.dense_tables:
            keep |= np.isin(tables, np.asarray(select.dense_tables, dtype=np.int64))
        return tables[keep], global_ids[keep], flat[keep], part, int(keys.size)

    def add_clipped_row_sums(self, factors: np.ndarray, trainer: int, selection_weights=None,
                             coordinate_bound: Optional[float] = None, bag_grads: Optional[np.ndarray] = None) -> None:
        """Data-parallel trainers: add trainer `trainer`'s clipped row sums (as in
        `clipped_row_sums`, `bag_grads` too) to this step's reduction here, where the rows live;
        nothing travels back until `reduced_row_sums`."""
        if bag_grads is not None:
            self._contributions(bag_grads, trainer)
        self._keep_selection_weights(selection_weights, trainer)
        self._row_sum_parts.append(self._clipped_row_sums64(factors, trainer) if coordinate_bound is None
                                   else self._clamped_row_sums64(factors, trainer, coordinate_bound))

    def _keep_selection_weights(self, weights, trainer: int) -> None:
        if weights is not None:
            self._cache(trainer)["selection_weights"] = np.asarray(weights, dtype=np.float64)

    def discard_step(self) -> None:
        """Forget this step's per-trainer state and partial reductions (the step is redone
        after a lost actor was replaced)."""
        self._caches, self._row_sum_parts, self._step_row_sums = {}, [], None

    def ping(self) -> int:
        return self.shard_index

    def after(self, method: str, args: tuple, *released):
        """`method(*args)`, called by a trainer actor with the coordinator's unawaited
        write-back calls to this shard as `released` (their answers: Ray resolves ObjectRef
        arguments before the call starts, so the update is applied before this runs)."""
        return getattr(self, method)(*args)

    def dispatch(self, request: tuple):
        """One call of the shard group's data plane (trainer/engine/shard_group.py): `request` is
        (call_id, method, args, from_channel[, before]); runs each deferred `(m, a)` of `before`
        in order — the previous step's write-back, folded into this call (`ShardGroup.defer`;
        only MUTATING methods) — then `method(*args)`. A request whose call_id is the last one
        run returns that call's answer again without running any of it twice: the group re-sends
        a call after a lost actor without knowing which of the others had run it, and running
        again would apply an update twice (`apply_rows`) or add a reduction twice
        (`add_clipped_row_sums`, `reduced_row_sums`). `from_channel`: the args came through a
        compiled graph's channel, which reuses its buffers on the next call, so they are copied
        first (this shard keeps some arguments in its step cache); ordinary Ray calls hand the
        shard immutable objects that stay alive while referenced, so they are used as they are."""
        call_id, method, args, from_channel, *rest = request
        if call_id == self._last_call_id:
            return self._last_answer
        started, cpu = (time.perf_counter(), time.thread_time()) if self._call_timings is not None else (0.0, 0.0)
        for deferred, deferred_args in (rest[0] if rest else ()):
            if deferred not in MUTATING:
                raise ValueError(f"only state-changing calls are deferred, got {deferred!r}")
            getattr(self, deferred)(*(owned(deferred_args) if from_channel else deferred_args))
        answer = getattr(self, method)(*(owned(args) if from_channel else args))
        self._last_call_id, self._last_answer = call_id, answer
        if self._call_timings is not None:
            self._call_timings.append((call_id, method, started, time.perf_counter(), time.thread_time() - cpu))
        return answer

    def record_call_timings(self, on: bool) -> list:
        """Start (`on`) or stop recording, per `dispatch` call run, (call_id, method, start, end,
        CPU seconds of this thread): start and end on this machine's monotonic clock
        (`time.perf_counter`, comparable between processes of one machine only). Returns and
        forgets what was recorded. Benchmarks only (benchmarks/phase_breakdown.py): times of
        calls, which depend on the batch's sizes as the step times every run reports do."""
        recorded, self._call_timings = self._call_timings or [], ([] if on else None)
        return recorded

    def reduced_row_sums(self):
        """The sum over trainers of the clipped row sums added this step (float64 sums, then
        float32 as `clipped_row_sums` returns), and the reduction is emptied."""
        parts, self._row_sum_parts = self._row_sum_parts, []
        if not parts:
            self._step_row_sums = (np.empty(0, np.int64), torch.zeros((0, self.layout.dim), dtype=torch.float64))
            return self._rows_of(*self._step_row_sums)
        uniq, group = np.unique(np.concatenate([k for k, _ in parts]), return_inverse=True)
        sums = torch.zeros((uniq.size, self.layout.dim), dtype=torch.float64).index_add_(
            0, torch.from_numpy(group.astype(np.int64).reshape(-1)), torch.cat([v for _, v in parts]))
        self._step_row_sums = (uniq, sums)
        return self._rows_of(uniq, sums)

    def _ids_never_repeat(self, cache: dict) -> bool:
        """One id per bag and one table per feature: no example touches a (table, row) twice."""
        return self.tables_unshared and cache["bags"].example.size == cache["inp"].example.size

    def _row_groups(self, cache: dict) -> tuple[np.ndarray, np.ndarray]:
        """(sorted distinct keys t·max_rows + local id, each id's index among them) of the
        trainer's ids this step, computed once (row sums and selection counts share it)."""
        if "row_groups" not in cache:
            inp = cache["inp"]
            cache["row_groups"] = unique_ints(self.feature_table[inp.feature] * self.max_rows + inp.local_id,
                                              return_inverse=True)
        return cache["row_groups"]

    def _clipped_row_sums64(self, factors: np.ndarray, trainer: int) -> tuple[np.ndarray, torch.Tensor]:
        """(sorted row keys t·max_rows + local id, float64 sums) of the trainer's clipped rows."""
        cache = self._cache(trainer)
        if "contrib" not in cache:  # nonprivate mode skips the norm pass
            raise RuntimeError("clipped_row_sums needs bag_grads, or example_sq_norms (or set_pooled_grad) first")
        inp, contrib, bags = cache["inp"], cache["contrib"], cache["bags"]
        if inp.example.size == 0:
            return np.empty(0, np.int64), torch.zeros((0, self.layout.dim), dtype=torch.float64)
        per_id = torch.from_numpy(np.asarray(factors, dtype=np.float64))[torch.from_numpy(bags.id_example)]
        scaled = contrib.double() * per_id.unsqueeze(1)
        uniq, group = self._row_groups(cache)
        sums = torch.zeros((uniq.size, scaled.shape[1]), dtype=torch.float64).index_add_(0, torch.from_numpy(group), scaled)
        return uniq, sums

    def _clamped_row_sums64(self, factors: np.ndarray, trainer: int, bound: float) -> tuple[np.ndarray, torch.Tensor]:
        """As `_clipped_row_sums64`, with each example's clipped gradient of each row clamped to
        ±bound per coordinate before the rows are summed (ModelMix's refined clipping, seed B
        Alg 2): repeated ids of one example in one row add up first, as in `example_sq_norms`."""
        cache = self._cache(trainer)
        if "contrib" not in cache:
            raise RuntimeError("clipped_row_sums needs bag_grads or example_sq_norms first")
        inp, contrib, bags = cache["inp"], cache["contrib"], cache["bags"]
        if inp.example.size == 0:
            return np.empty(0, np.int64), torch.zeros((0, self.layout.dim), dtype=torch.float64)
        row_key = self.feature_table[inp.feature] * self.max_rows + inp.local_id
        span = len(self.ranges) * self.max_rows
        pair, group = unique_ints(bags.id_example * span + row_key, return_inverse=True)
        pair_sums = torch.zeros((pair.size, contrib.shape[1]), dtype=torch.float64).index_add_(
            0, torch.from_numpy(group), contrib.double())
        f = torch.from_numpy(np.asarray(factors, dtype=np.float64))[torch.from_numpy(pair // span)]
        clamped = (pair_sums * f.unsqueeze(1)).clamp(-bound, bound)
        rows, inverse = unique_ints(pair % span, return_inverse=True)
        sums = torch.zeros((rows.size, contrib.shape[1]), dtype=torch.float64).index_add_(
            0, torch.from_numpy(inverse), clamped)
        return rows, sums

    def _rows_of(self, keys: np.ndarray, sums: torch.Tensor):
        tables, local = keys // self.max_rows, keys % self.max_rows
        return tables, local + self.starts[tables], sums.float().numpy()

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
        sparse = np.array([t for t in range(len(self.ranges)) if t not in set(dense_tables)], dtype=np.int64)
        sizes = np.array([self.ranges[t][1] - self.ranges[t][0] for t in sparse], dtype=np.int64)
        base = np.full(len(self.ranges), -1, dtype=np.int64)  # local id of table t's first row here
        base[sparse] = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if sparse.size else []
        num_rows = int(sizes.sum())
        if num_rows == 0:
            return np.empty(0, np.int64)
        if statistic == "norms":
            touched, summed = self._row_norms(base, expected_batch_size)
        else:
            touched, summed = self._row_counts(base, statistic == "counts")
        rng = key.generator(int(step), self.shard_index)
        part = selector.shard_select(touched, summed, num_rows, params, rng, clip_norm=clip_norm,
                                     expected_batch_size=expected_batch_size)

        def to_global(local):
            local = np.asarray(local, dtype=np.int64)
            table_of = sparse[np.searchsorted(base[sparse], local, side="right") - 1]
            return self.layout.table_offsets[table_of] + self.starts[table_of] + local - base[table_of]

        return part.remap(to_global(part.ids)) if isinstance(part, ShardCandidates) else to_global(part)

    def _row_norms(self, base: np.ndarray, expected_batch_size: Optional[float]) -> tuple[np.ndarray, np.ndarray]:
        """(sorted compact local ids, ‖sum / b‖₂) of this step's clipped row sums on the sparse tables."""
        if self._step_row_sums is None:
            raise RuntimeError(f"shard {self.shard_index} has no clipped row sums this step")
        if not expected_batch_size:
            raise ValueError("selection by row norms needs expected_batch_size")
        keys, sums = self._step_row_sums
        table, local = keys // self.max_rows, keys % self.max_rows
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
        for trainer in sorted(self._caches):
            cache = self._caches[trainer]
            inp, bags = cache["inp"], cache["bags"]
            if not weighted:
                weights = np.ones(bags.examples.size)
            elif "selection_weights" in cache:
                weights = cache["selection_weights"]
            else:
                raise RuntimeError(f"trainer {trainer} sent shard {self.shard_index} no selection weights this step")
            if "units" in cache:  # user level: distinct (unit, row) pairs, each unit's weight once
                units = cache["units"]
                per_unit = np.zeros(int(units.max()) + 1 if units.size else 0)
                per_unit[units] = weights  # the trainer sends its unit's weight for each example
                table = self.feature_table[inp.feature]
                keep = base[table] >= 0
                r, c = weighted_row_counts(units[bags.id_example][keep], base[table[keep]] + inp.local_id[keep], per_unit)
            elif self._ids_never_repeat(cache):  # every (example, row) pair distinct: sum by row groups
                keys, group = self._row_groups(cache)
                table_of, local_of = keys // self.max_rows, keys % self.max_rows
                counts_all = np.bincount(group, weights=weights[bags.id_example], minlength=keys.size)
                keep = base[table_of] >= 0
                r, c = base[table_of[keep]] + local_of[keep], counts_all[keep]
            else:
                table = self.feature_table[inp.feature]
                keep = base[table] >= 0
                r, c = weighted_row_counts(bags.id_example[keep], base[table[keep]] + inp.local_id[keep], weights)
            rows.append(r)
            counts.append(c)
        if len(rows) == 1:  # one trainer: its rows are already distinct and sorted
            return rows[0], counts[0]
        touched, inverse = unique_ints(np.concatenate(rows or [np.empty(0, np.int64)]), return_inverse=True)
        summed = np.bincount(inverse, weights=np.concatenate(counts or [np.empty(0)]), minlength=touched.size)
        return touched, summed

    def set_pooled_grad(self, bag_grads: np.ndarray, trainer: int = 0) -> None:
        """Cache per-id contributions without computing norms (nonprivate mode)."""
        self._contributions(bag_grads, trainer)

    # ---- updates --------------------------------------------------------------------------------
    def begin_update(self, step: Optional[int], lr_scale: float) -> None:
        """The updates that follow are step `step`'s (1-based; needed when averaging), at
        learning rate lr · lr_scale (trainer/config/lr_schedule.py)."""
        if step is not None:
            self.step = int(step)
        elif self.ema is not None:
            raise ValueError("with ema_decay > 0 every update must say its step")
        self._ema_current_at = None
        lr = self.lr * float(lr_scale)
        self._current_lr = lr

    def apply_rows(self, table_idx: np.ndarray, global_ids: np.ndarray, rows: np.ndarray,
                   lr_scale: float = 1.0, step: Optional[int] = None) -> None:
        """Apply the optimizer to the given rows only (update direction = `rows`, a gradient),
        with learning rate lr · lr_scale, as step `step` (for the averaged weights)."""
        self.begin_update(step, lr_scale)
        table_idx = np.asarray(table_idx, dtype=np.int64)
        local = np.asarray(global_ids, dtype=np.int64) - self.starts[table_idx]
        self._apply(table_idx, local, torch.from_numpy(np.array(rows, dtype=np.float32)))  # copy: Ray arrays are read-only
        self._caches, self._row_sum_parts, self._step_row_sums = {}, [], None

    def apply_dense_noise_update(self, step: int, noise_key: NoiseKey, std: float, table_idx, global_ids, rows,
                                 tables=None, lr_scale: float = 1.0,
                                 mix: Optional[tuple] = None) -> None:
        """DP-SGD: every row of every table in `tables` (None: all) gets G + N(0, std²) (G = 0
        for untouched rows). The noise of row r depends only on (key, step, table, r), not on
        the sharding nor on which other tables are dense. Learning rate lr · lr_scale; `step` is
        0-based (the engine's step count before the step), so this is step `step + 1`.
        Rows [c·K, (c+1)·K) of a dense table are one contiguous slice of the flat storage,
        updated in place (K = UPDATE_CHUNK): no lookup, no backward (`_apply_range`).
        `mix` = (mix key, gap in gradient units w·S/b): ModelMix (trainer/engine/modelmix.py) — each
        row starts from the secret mix of its two latest states, over a gap of lr·lr_scale times
        that, before the update (SGD only: the analysis covers w − lr·update)."""
        self.begin_update(step + 1, lr_scale)
        if mix is not None and self.optimizer != "sgd":
            raise ValueError(f"ModelMix needs the sgd embedding optimizer, this shard runs {self.optimizer!r}")
        if mix is not None and self.mix_previous is None:  # θ_{t-2} = θ_{t-1} = θ_0 at the first step
            self.mix_previous = self.flat.detach().clone()
        table_idx, global_ids = np.asarray(table_idx, dtype=np.int64), np.asarray(global_ids, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.float32)
        for t, (start, end) in enumerate(self.ranges):
            if end <= start or (tables is not None and t not in tables):
                continue
            in_table = table_idx == t
            for lo in range(start, end, UPDATE_CHUNK):
                hi = min(end, lo + UPDATE_CHUNK)
                update = row_block_normal(noise_key, "dpsgd", step, t, lo, hi, self.layout.dim, std)
                hit = np.flatnonzero(in_table & (global_ids >= lo) & (global_ids < hi))
                if hit.size:
                    update[torch.from_numpy(global_ids[hit] - lo)] += torch.from_numpy(rows[hit])
                if mix is not None:
                    self._mix_range(t, lo - start, hi - start, step, *mix)
                self._apply_range(t, lo - start, hi - start, update)
        self._caches, self._row_sum_parts, self._step_row_sums = {}, [], None

    def _mix_range(self, t: int, lo: int, hi: int, step: int, mix_key: NoiseKey, gradient_gap: float) -> None:
        """Rows [lo, hi) of table t: θ_{t-1} ← mix(θ_{t-1}, θ_{t-2}, lr·gap, α), θ_{t-2} ← θ_{t-1}
        (trainer/engine/modelmix.py); α for the table's global rows, as `row_block_uniform` draws them."""
        gap = self._current_lr * gradient_gap
        assert self.mix_previous is not None
        rows = slice(int(self.row_base[t]) + lo, int(self.row_base[t]) + hi)
        start = self.ranges[t][0]
        alpha = row_block_uniform(mix_key, "modelmix", step, t, start + lo, start + hi, self.layout.dim)
        with torch.no_grad():
            current = self.flat[rows].clone()
            self.flat[rows] = mix(current, self.mix_previous[rows], gap, alpha)
            self.mix_previous[rows] = current

    def _apply_range(self, t: int, lo: int, hi: int, update: torch.Tensor) -> None:
        """Update every row [lo, hi) (local ids) of table t by update [hi - lo, D]: the same
        optimizer as `_apply` (the formulas tests/test_shard_storage.py pins against FBGEMM),
        in place on a contiguous slice of the flat storage."""
        rows = slice(int(self.row_base[t]) + lo, int(self.row_base[t]) + hi)
        if self.ema is not None:
            self._ema_catch_up(rows, self.step - 1)
        self._update_weights(rows, update)
        if self.ema is not None:
            self._ema_catch_up(rows, self.step)

    def _apply(self, tables: np.ndarray, local: np.ndarray, update: torch.Tensor) -> None:
        """Update rows (tables[i], local[i]) — each at most once — by update[i], every table at once."""
        if local.size == 0:
            return
        flat_ids = torch.from_numpy(self.row_base[tables] + local).to(self.flat.device)
        if self.ema is not None:  # the old weight held through the previous step
            self._ema_catch_up(flat_ids, self.step - 1)
        self._update_weights(flat_ids, update)
        if self.ema is not None:  # and the new one at this step
            self._ema_catch_up(flat_ids, self.step)

    def _ema_catch_up(self, flat_ids, through: int) -> None:
        """Bring the EMA of rows `flat_ids` (indices or a slice) through step `through`, their
        weights having been constant since each row's ema_through: β^n·ema + (1-β^n)·w."""
        assert self.ema is not None
        n = through - self.ema_through[flat_ids]
        if bool((n < 0).any()):
            raise RuntimeError(f"a row updated twice in step {self.step}: the average would be wrong")
        factor = torch.pow(self.ema_decay, n.double()).float().unsqueeze(-1)
        with torch.no_grad():
            self.ema[flat_ids] = factor * self.ema[flat_ids] + (1 - factor) * self.flat[flat_ids]
        self.ema_through[flat_ids] = through

    def averaged_weights_flat(self) -> torch.Tensor:
        """Every row's EMA of its iterates through the last step applied ([R, D], brought up to
        date in place once per step); the weights themselves when averaging is off."""
        if self.ema is None:
            return self.flat
        if self._ema_current_at != self.step:
            self._ema_catch_up(slice(None), self.step)
            self._ema_current_at = self.step
        return self.ema

    def averaged_weights(self) -> list:
        """`averaged_weights_flat` as one view per table."""
        flat = self.averaged_weights_flat()
        return [flat[base: base + end - start] for base, (start, end) in zip(self.row_base, self.ranges)]

    def _update_weights(self, rows, update: torch.Tensor) -> None:
        """One optimizer step on rows `rows` of the flat storage (a slice, or distinct indices)
        by `update` [rows, D] at the current learning rate, in place. SGD: w -= lr·g.
        Adagrad is FBGEMM's EXACT_ROWWISE_ADAGRAD (its accumulator, in the TBE's own state):
        acc += mean(g²); w -= lr·g/(√acc + eps). Adam is lazy: moments and the step count
        advance only for the rows updated. (The TBE's fused backward would do the same for
        SGD and Adagrad at the cost of a lookup and a backward pass over the rows.)"""
        update = update.to(self.flat.device, torch.float32)
        lr = self._current_lr
        with torch.no_grad():
            if self.optimizer == "sgd":
                self.flat[rows] -= lr * update
            elif self.optimizer == "adagrad":
                state = self._adagrad_state()
                acc = state[rows] + update.pow(2).mean(1)
                state[rows] = acc
                self.flat[rows] -= lr * update / (acc.sqrt() + self.eps).unsqueeze(1)
            else:
                assert self.adam_state is not None
                st = self.adam_state
                b1, b2 = self.adam_betas
                m = st["m"][rows].mul_(b1).add_(update, alpha=1 - b1)
                v = st["v"][rows].mul_(b2).addcmul_(update, update, value=1 - b2)
                steps = st["t"][rows] + 1
                st["m"][rows], st["v"][rows], st["t"][rows] = m, v, steps
                bc1 = (1 - b1 ** steps.double()).float().unsqueeze(1)
                bc2 = (1 - b2 ** steps.double()).float().unsqueeze(1)
                self.flat[rows] -= lr * (m / bc1) / ((v / bc2).sqrt() + self.eps)

    # ---- state --------------------------------------------------------------------------------
    def _per_table(self, flat: torch.Tensor) -> list:
        """Copies of a flat per-row tensor's rows, one array per table (the checkpoint format)."""
        return [flat[base: base + end - start].detach().cpu().numpy().copy()
                for base, (start, end) in zip(self.row_base, self.ranges)]

    def _load_per_table(self, flat: torch.Tensor, saved: list) -> None:
        for base, (start, end), s in zip(self.row_base, self.ranges, saved):
            flat[base: base + end - start].copy_(torch.from_numpy(np.array(s)))

    def _adagrad_state(self) -> torch.Tensor:
        """EXACT_ROWWISE_ADAGRAD's per-row accumulator, every table back to back."""
        return self.tbe.momentum1_dev if self.flat.is_cuda else self.tbe.momentum1_host

    def state_dict(self) -> dict:
        state: dict[str, Any] = {"weights": self._per_table(self.flat)}
        if self.optimizer == "adagrad":
            state["adagrad"] = self._per_table(self._adagrad_state())
        if self.adam_state is not None:
            state["adam"] = [dict(zip(self.adam_state, vals))
                             for vals in zip(*(self._per_table(v) for v in self.adam_state.values()))]
        state["step"] = self.step
        if self.ema is not None:  # through `step` for every row: the whole averaging state
            state["averaged_weights"] = self._per_table(self.averaged_weights_flat())
        if self.mix_previous is not None:  # ModelMix's θ_{t-2} (a released state)
            state["mix_previous"] = self._per_table(self.mix_previous)
        return state

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self._load_per_table(self.flat, state["weights"])
            if self.optimizer == "adagrad":
                self._load_per_table(self._adagrad_state(), state["adagrad"])
            if self.adam_state is not None:
                for k, v in self.adam_state.items():
                    self._load_per_table(v, [saved[k] for saved in state["adam"]])
            self.step = int(state.get("step", 0))
            self.mix_previous = None
            if "mix_previous" in state:
                self.mix_previous = self.flat.detach().clone()
                self._load_per_table(self.mix_previous, state["mix_previous"])
            if self.ema is not None:
                if "averaged_weights" not in state:
                    raise ValueError("the checkpoint has no averaged weights but train.ema_decay > 0: "
                                     "resume with the checkpoint's train.ema_decay")
                self._load_per_table(self.ema, state["averaged_weights"])
                self.ema_through.fill_(self.step)
                self._ema_current_at = self.step
