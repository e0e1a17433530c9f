"""The shard group: one interface to every shard of the tables, in this process
(`InProcessShardGroup`: tests, tiny runs) or as Ray actors (trainer/cluster/ray_shards.py).

Every call fans out to all shards and gathers their answers; every implementation counts the
bytes of the arrays sent to and received from shards the same way (payload arrays, not
framing), so summaries compare across placements. `add_observer` is the public hook for
per-method accounting (benchmarks attribute bytes, calls and wall time to shard methods with
it). `ShardLostError` and `StepInterrupted` are how a placement tells the engine that an actor
died (the engine redoes the step: trainer/engine/engine.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from widedp.trainer.engine.layout import ShardInput, ShardLayout
from widedp.trainer.engine.shard import MUTATING, SHARD_CALLS, EmbeddingShard


def _nbytes(obj: Any) -> int:
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, ShardInput):
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    if isinstance(obj, (int, float, np.integer, np.floating)):
        return 8
    return 0


@dataclasses.dataclass(frozen=True)
class ShardCall:
    """One fan-out call as an observer sees it: the shard method, payload bytes sent to and
    received from all shards, and the wall time of the call (dispatch to last answer)."""

    method: str
    bytes_to: int
    bytes_from: int
    seconds: float


CallObserver = Callable[[ShardCall], None]


class ShardGroup:
    """Base: `call(method, per_shard_args)` runs a shard method on every shard.

    `defer` queues a state-changing call (the step's write-back) to travel with the next call
    instead of making a round of its own, where `fold_write_back` is set and no trainer actor
    calls the shards directly (docs/DESIGN.md §2, "Folded write-back")."""

    def __init__(self, layout: ShardLayout, fold_write_back: bool = False):
        self.layout = layout
        self.bytes_to_shards = 0
        self.bytes_from_shards = 0
        self._observers: list[CallObserver] = []
        self.fold_write_back = bool(fold_write_back)
        # True when trainer actors call the shards themselves (set by the engine): their calls do
        # not pass through this group, so nothing may wait here for the next call.
        self.direct_callers = False
        self._pending: list[tuple[str, list]] = []  # deferred (method, per-shard args), in order

    def add_observer(self, observer: CallObserver) -> Callable[[], None]:
        """Call `observer(ShardCall)` after every call; returns a function that removes it."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer)

    @property
    def num_shards(self) -> int:
        return self.layout.num_shards

    def call(self, method: str, per_shard_args: Sequence[tuple]) -> list:
        """`method(*per_shard_args[s])` on every shard s, after any deferred calls (`defer`),
        which reach each shard in the same round; the answers in shard order. ValueError for a
        method that is not a shard call (`shard.SHARD_CALLS`), before anything is sent."""
        if method not in SHARD_CALLS:
            raise ValueError(f"no shard call {method!r} (the calls: {sorted(SHARD_CALLS)})")
        before, self._pending = self._pending, []
        deferred_bytes = [sum(_nbytes(list(a)) for a in args) for _, args in before]
        sent = sum(_nbytes(list(a)) for a in per_shard_args)
        start = time.perf_counter()
        results = self._call_after(before, method, per_shard_args) if before else self._call(method, per_shard_args)
        seconds = time.perf_counter() - start
        received = sum(_nbytes(r) for r in results)
        self.bytes_to_shards += sent + sum(deferred_bytes)
        self.bytes_from_shards += received
        if self._observers:
            # a deferred call is attributed its bytes; its time is inside the call that carried it
            records = [ShardCall(m, b, 0, 0.0) for (m, _), b in zip(before, deferred_bytes)]
            records.append(ShardCall(method, sent, received, seconds))
            for record in records:
                for observer in list(self._observers):
                    observer(record)
        return results

    def defer(self, method: str, per_shard_args: Sequence[tuple]) -> None:
        """Run the state-changing `method` (shard.MUTATING) on every shard: now, or — folded
        write-back — just before the next call reaches each shard, in that call's round.

        Folded only where `fold_write_back` is set and every shard call passes through this
        group (not with trainer actors calling the shards): then no shard answers anything, a
        lookup, an average, a checkpoint's `state_dict`, before it has applied the deferred
        update, so every answer equals the eager order's. The caller has recorded the step's
        privacy event before deferring (the ledger precedes any release either way)."""
        if method not in MUTATING:
            raise ValueError(f"only state-changing shard calls can be deferred, got {method!r}")
        if len(per_shard_args) != self.num_shards:
            raise ValueError(f"defer({method!r}): {len(per_shard_args)} argument tuples for {self.num_shards} shards")
        if self.fold_write_back and not self.direct_callers:
            self._pending.append((method, [tuple(a) for a in per_shard_args]))
        elif self.fold_write_back and self._release_unawaited(method, per_shard_args):
            pass  # sent; the trainers' next calls wait for it at the shards (`take_releases`)
        else:
            self.call(method, per_shard_args)

    def _release_unawaited(self, method: str, per_shard_args: Sequence[tuple]) -> bool:
        """Trainer actors calling directly: send the state-changing call without waiting for
        it, where the placement can make the trainers' next calls wait for it at each shard
        (`take_releases`). False here: the caller runs it as a round of its own."""
        return False

    def take_releases(self) -> Optional[list]:
        """Per shard, the unawaited releases since the last take (`_release_unawaited`) that
        the trainers' next shard calls must follow; None when there are none. Each is handed
        out once: a step redone after a lost actor runs after `restore_lost`, which waits for
        every shard to have run what this group sent it."""
        return None

    @property
    def pending_calls(self) -> tuple[str, ...]:
        """The methods deferred to the next call (`defer`), in order."""
        return tuple(m for m, _ in self._pending)

    def _call_after(self, before: list, method: str, per_shard_args: Sequence[tuple]) -> list:
        """The deferred calls `before`, then `method`. Here one call after the other; groups
        whose rounds cost (Ray) send them to each shard as one request."""
        for deferred, args in before:
            self._call(deferred, args)
        return self._call(method, per_shard_args)

    def broadcast(self, method: str, *args) -> list:
        return self.call(method, [args] * self.num_shards)

    def _call(self, method: str, per_shard_args: Sequence[tuple]) -> list:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class InProcessShardGroup(ShardGroup):
    def __init__(self, layout: ShardLayout, fold_write_back: bool = False, **shard_kwargs):
        super().__init__(layout, fold_write_back)
        self.shards = [EmbeddingShard(layout, s, **shard_kwargs) for s in range(layout.num_shards)]

    def _call(self, method, per_shard_args):
        return [shard.call(method, *args) for shard, args in zip(self.shards, per_shard_args)]


class ShardLostError(RuntimeError):
    """A shard actor died again while being restored (or restarts are off)."""


class StepInterrupted(RuntimeError):
    """An actor died before the step was recorded, and the step's state held by others (the
    trainers' calls to the shards) cannot be replayed: the lost actor has been restored to
    the state after the last released step, and the step must be redone from its sample."""


