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

from widedp.trainer.engine.layout import ShardLayout, public_key, row_block_normal
from widedp.trainer.engine.shard_rows import ShardGradients
from widedp.trainer.engine.shard_select import ShardSelect, ShardSelection  # noqa: F401  (ShardSelect: re-exported)
from widedp.trainer.engine.shard_update import ShardUpdates

# The TBE keeps the optimizer state (Adagrad's row-wise accumulator) in its own storage; the
# updates themselves are applied in place by `_update_weights` (no TBE backward).
TBE_OPTIMIZER_STATE = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}
from widedp.trainer.names import OPTIMIZERS  # noqa: E402  (the one list: config checks it before torch loads)


def _device() -> tuple[torch.device, ComputeDevice, EmbeddingLocation]:
    if torch.cuda.is_available():  # the same code picks the CUDA build and device when present
        return torch.device("cuda"), ComputeDevice.CUDA, EmbeddingLocation.DEVICE
    return torch.device("cpu"), ComputeDevice.CPU, EmbeddingLocation.HOST




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


class EmbeddingShard(ShardGradients, ShardSelection, ShardUpdates):
    """One shard's rows of every table and its operations: storage, state and calls here; a
    step's gradients (`ShardGradients`, trainer/engine/shard_rows.py), its selection on the shard
    (`ShardSelection`, trainer/engine/shard_select.py) and the write-back (`ShardUpdates`,
    trainer/engine/shard_update.py) in their own modules."""

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

    # ---- per-example gradients ----------------------------------------------------------------
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

    # ---- updates --------------------------------------------------------------------------------
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
