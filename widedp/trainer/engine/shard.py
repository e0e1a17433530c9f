"""One embedding shard: local compute over the rows it owns (no Ray here; trainer/cluster/
runs it as an actor).

A shard is four parts, each in its own module: its rows (`ShardStorage`, one FBGEMM
table-batched embedding holding all of the shard's tables: trainer/engine/shard_storage.py), a
step's gradients over them (`ShardGradients`: partial pooled embeddings, per-example partial
squared gradient norms over the *unique* rows of each example — an id repeated in a bag, or
used by several features of one table, contributes the *sum* of its gradients, the
per-example gradient of that row — and clipped per-row gradient sums: shard_rows.py), the
step's selection where the rows live (`ShardSelection`: shard_select.py) and the write-back of
released rows (`ShardUpdates`: the same SGD / row-wise Adagrad as FBGEMM's fused backward,
pinned against it in tests/test_shard_storage.py, lazy Adam, DP-SGD's dense update, ModelMix,
the average of the iterates: shard_update.py).

`EmbeddingShard` puts them together and is what a shard group calls: every call is
`call(method, *args)` with a method of `SHARD_CALLS` (`dispatch` and `after` carry the same
calls over Ray's data plane).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from widedp.trainer.engine.layout import ShardInput, ShardLayout
from widedp.trainer.engine.shard_rows import ShardGradients
from widedp.trainer.engine.shard_select import ShardSelect, ShardSelection
from widedp.trainer.engine.shard_storage import ShardStorage
from widedp.trainer.engine.shard_update import ShardUpdates
from widedp.trainer.names import OPTIMIZERS  # noqa: F401  (the one list: config checks it before torch loads)

# The calls a shard answers (`EmbeddingShard.call`); those that change a shard's state for good
# (the others fill its per-step cache, or read).
SHARD_CALLS = frozenset({
    "lookup", "example_sq_norms", "unit_sq_norms", "set_pooled_grad", "clipped_row_sums",
    "add_clipped_row_sums", "reduced_row_sums", "select_rows", "apply_rows", "apply_dense_noise_update",
    "averaged_weights", "state_dict", "load_state_dict", "discard_step", "flush_pending", "ping",
})
MUTATING = frozenset({"apply_rows", "apply_dense_noise_update", "load_state_dict", "flush_pending"})


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
    """Shard `shard_index`'s rows of every table of `layout` and the calls on them.

    Args:
        layout: the tables, features and row ranges of every shard.
        shard_index: which shard this is.
        optimizer, lr, adam_betas, eps, ema_decay, lazy_noise: the write-back's settings (`ShardUpdates`).
        seed, init_std: the rows' public initialisation (`ShardStorage`).

    Attributes: `storage`, `gradients`, `selection`, `updates` (the four parts: see the
    module docstring)."""

    def __init__(self, layout: ShardLayout, shard_index: int, optimizer: str = "sgd", lr: float = 0.1,
                 seed: int = 0, init_std: float = 0.01, adam_betas: Sequence[float] = (0.9, 0.999),
                 eps: float = 1e-8, ema_decay: float = 0.0, lazy_noise: bool = False):
        from widedp.trainer.engine.memory import keep_freed_memory

        keep_freed_memory()  # as the coordinator: a shard actor's per-step buffers stay in its heap
        if optimizer not in OPTIMIZERS:  # before the TBE is built
            raise ValueError(f"embedding optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        self.storage = ShardStorage(layout, shard_index, optimizer, lr, eps, seed, init_std)
        self.updates = ShardUpdates(self.storage, optimizer, lr, adam_betas, eps, ema_decay, lazy_noise)
        self.gradients = ShardGradients(self.storage)
        self.selection = ShardSelection(self.storage, self.gradients)
        self.shard_index = shard_index
        self._last_call_id: int = -1  # the last `dispatch` call run, and its answer
        self._last_answer: Any = None
        self._call_timings: Optional[list] = None  # `record_call_timings` (benchmarks only)
        g, u = self.gradients, self.updates
        self._calls: dict[str, Callable] = {
            "lookup": self._lookup, "example_sq_norms": g.example_sq_norms, "unit_sq_norms": g.unit_sq_norms,
            "set_pooled_grad": g.set_pooled_grad, "clipped_row_sums": self._clipped_row_sums,
            "add_clipped_row_sums": g.add_clipped_row_sums, "reduced_row_sums": g.reduced_row_sums,
            "select_rows": self.selection.select_rows, "apply_rows": self._apply_rows,
            "apply_dense_noise_update": self._apply_dense_noise_update, "averaged_weights": u.averaged_weights,
            "state_dict": u.state_dict, "load_state_dict": u.load_state_dict, "discard_step": g.discard,
            "flush_pending": self._flush_pending, "ping": self.ping,
        }
        assert set(self._calls) == SHARD_CALLS

    def call(self, method: str, *args, **kwargs):
        """`method(*args, **kwargs)` for a method of `SHARD_CALLS`; ValueError naming any other."""
        handler = self._calls.get(method)
        if handler is None:
            raise ValueError(f"shard {self.shard_index}: no shard call {method!r} (the calls: {sorted(SHARD_CALLS)})")
        return handler(*args, **kwargs)

    def ping(self) -> int:
        return self.shard_index

    def after(self, method: str, args: tuple, *released):
        """`call(method, *args)`, called by a trainer actor with the coordinator's unawaited
        write-back calls to this shard as `released` (their answers: Ray resolves ObjectRef
        arguments before the call starts, so the update is applied before this runs)."""
        return self.call(method, *args)

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
            self.call(deferred, *(owned(deferred_args) if from_channel else deferred_args))
        answer = self.call(method, *(owned(args) if from_channel else args))
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

    # ---- calls that span the parts ------------------------------------------------------------
    def _lookup(self, inp: ShardInput, batch_size: int, averaged: bool = False, trainer: int = 0) -> np.ndarray:
        """`ShardGradients.lookup`; with `averaged`, from the averaged weights (evaluation only:
        no gradient cache is kept)."""
        table = self.updates.averaged_weights_flat() if averaged else None
        if not self.updates.lazy_noise or averaged:
            return self.gradients.lookup(inp, batch_size, trainer, averaged_table=table)
        # lazy DP-SGD noise: the rows read hold their pending noise while the TBE reads them; the
        # step's write-back stores it (the same draws: shard_update.py's module docstring)
        st = self.storage
        self.gradients._check_ids(inp, batch_size)  # before the ids index the pending state
        with self.updates.with_pending_noise(st.row_base[st.feature_table[inp.feature]] + inp.local_id):
            return self.gradients.lookup(inp, batch_size, trainer, ids_checked=True)

    def _flush_pending(self) -> int:
        """Store every row's pending DP-SGD noise (before an evaluation or any release that
        reads the rows); returns how many rows received some (0 without lazy noise)."""
        return self.updates.flush()

    def _clipped_row_sums(self, factors: np.ndarray, trainer: int = 0, selection_weights=None,
                          select: Optional[ShardSelect] = None, coordinate_bound: Optional[float] = None,
                          bag_grads: Optional[np.ndarray] = None):
        """`ShardGradients.clipped_row_sums`. With `select` (one trainer: these sums are the step's
        whole G here), this shard's selection runs in the same call and only the rows the
        coordinator can use come back (`ShardSelection.rows_for_coordinator`), as (tables,
        global ids, sums, part, touched: how many rows were touched here)."""
        rows = self.gradients.clipped_row_sums(factors, trainer, selection_weights, coordinate_bound, bag_grads)
        if select is None:
            return rows
        return (*self.selection.rows_for_coordinator(select, *rows), int(rows[0].size))

    def _apply_rows(self, *args, **kwargs) -> None:
        """`ShardUpdates.apply_rows`; the step's caches are emptied (the step is over)."""
        self.updates.apply_rows(*args, **kwargs)
        self.gradients.discard()

    def _apply_dense_noise_update(self, *args, **kwargs) -> None:
        """`ShardUpdates.apply_dense_noise_update`; the step's caches are emptied."""
        self.updates.apply_dense_noise_update(*args, **kwargs)
        self.gradients.discard()
