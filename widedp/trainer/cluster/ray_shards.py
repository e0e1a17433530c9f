"""Shards as Ray actors (`RayShardGroup`): placement in a placement group, ordinary calls or one
compiled Ray graph per step (the data plane), and the recovery of a lost actor by replaying the
released updates since the last checkpoint. Implements the engine's shard group
(trainer/engine/shard_group.py).
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence


from widedp.trainer.cluster.compiled_wait import COMPILED_WAITS, set_compiled_wait_here_and_on
from widedp.trainer.engine.layout import ShardLayout
from widedp.trainer.engine.shard import MUTATING, EmbeddingShard, owned
from widedp.trainer.engine.shard_group import ShardCall, ShardGroup, ShardLostError, StepInterrupted, _nbytes


PLACEMENT_TIMEOUT_S = 60.0
_UNIT = 10_000  # Ray accounts resources in 1/10000 units


class ClusterResourceError(ValueError):
    """The Ray cluster's nodes cannot hold the shards (a ValueError: `widedp` prints one line, exit 2)."""


def check_placement(nodes: list, bundle: dict, num_shards: int, strategy: str = "SPREAD") -> None:
    """Fail now, with the numbers, if the alive nodes (`ray.nodes()`) can never hold `num_shards`
    bundles under `strategy` — instead of waiting for a placement group that cannot be placed.
    Counts node totals (not what other jobs use now): bundles per node = min over resources of
    floor(node total / bundle need)."""
    totals = [n.get("Resources", {}) for n in nodes if n.get("Alive", n.get("alive", True))]

    def fits(res: dict) -> int:
        counts = [int(round(res.get(k, 0.0) * _UNIT)) // int(round(v * _UNIT)) for k, v in bundle.items() if v > 0]
        return min(counts) if counts else num_shards

    per_node = [fits(r) for r in totals]
    have = {k: sum(r.get(k, 0.0) for r in totals) for k in bundle}
    need = {k: v * num_shards for k, v in bundle.items()}
    shape = " + ".join(f"{v:g} {k}" for k, v in bundle.items())
    sizes = ", ".join(f"{r.get('CPU', 0):g} CPU" + (f"/{r.get('GPU', 0):g} GPU" if "GPU" in bundle else "")
                      for r in totals) or "none"
    advice = "lower cluster.num_shards or cluster.cpus_per_shard / cluster.gpus_per_shard, or add worker nodes"
    if any(have[k] < need[k] - 1e-9 for k in bundle):
        lacking = ", ".join(f"{need[k]:g} {k} but the cluster has {have[k]:g}" for k in bundle if have[k] < need[k] - 1e-9)
        raise ClusterResourceError(
            f"the Ray cluster is too small: {num_shards} shards × ({shape}) need {lacking} "
            f"(alive nodes: {sizes}); {advice}")
    if strategy == "STRICT_SPREAD":
        usable = sum(1 for c in per_node if c >= 1)
        ok, what = usable >= num_shards, f"{num_shards} distinct nodes with {shape} each, found {usable}"
    elif strategy == "STRICT_PACK":
        ok, what = any(c >= num_shards for c in per_node), f"one node with {num_shards} × ({shape})"
    else:
        ok, what = sum(per_node) >= num_shards, f"{num_shards} × ({shape}) on whole nodes, room for {sum(per_node)}"
    if not ok:
        raise ClusterResourceError(
            f"the Ray cluster cannot place the shards ({strategy}): needs {what} (alive nodes: {sizes}); {advice}")


#: cluster.data_plane: "calls" (one Ray actor call per shard per round) or "compiled" (the
#: rounds of a step through one compiled Ray graph, `RayShardGroup._compile_graph`).
DATA_PLANES = ("calls", "compiled")
#: The methods the compiled plane carries: a step's rounds. The rest (state_dict, checkpoint
#: loads, pings, averaged weights) are rare and may be large: ordinary calls, which an actor
#: runs on its main thread while the graph's thread waits between executions.
COMPILED_METHODS = frozenset({
    "lookup", "set_pooled_grad", "example_sq_norms", "unit_sq_norms", "clipped_row_sums", "add_clipped_row_sums",
    "reduced_row_sums", "select_rows", "apply_rows", "apply_dense_noise_update", "discard_step"})
COMPILED_GET_TIMEOUT_S = 3600  # a round's answers (Ray's default, 10 s, is short for large batches)
COMPILED_BUFFER_BYTES = 4 << 20  # initial channel size; Ray grows a channel for a larger message


class RayShardGroup(ShardGroup):
    """Shards as Ray actors, `cpus_per_shard` CPUs (and `gpus_per_shard` GPUs) each.

    A lost actor is replaced without touching the others and without re-running any private
    step: the group keeps each shard's state from the last `state_dict` call (the checkpoint's)
    and every state-changing call since then, with its exact arguments — the *released*
    updates of the steps since the checkpoint (noisy rows; DP-SGD's noise key, std and clipped
    rows) — plus the current step's cache-filling calls. A replacement loads that state, replays
    those calls (post-processing of what was already released and charged: nothing new is
    computed from the data, so nothing is charged again) and then answers the call that failed.
    The restored shard equals the lost one exactly, so the run continues as if uninterrupted.
    Up to `max_restarts` attempts per failure; another death during them raises ShardLostError
    naming the shard and the call. `max_restarts = 0`: no log is kept and a death raises.
    The actors (and their placement group) belong to the driver: they end with it, SIGKILL
    included (`ray_runtime.ACTOR_OPTIONS`)."""

    def __init__(self, layout: ShardLayout, cpus_per_shard: float = 1.0, gpus_per_shard: float = 0.0,
                 placement_strategy: str = "SPREAD", max_restarts: int = 1, data_plane: str = "calls",
                 compiled_wait: str = "backoff", fold_write_back: bool = True, unawaited_write_back: bool = False, **shard_kwargs):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from widedp.trainer.cluster.ray_runtime import ACTOR_OPTIONS

        super().__init__(layout, fold_write_back)
        bundle = {"CPU": cpus_per_shard}
        if gpus_per_shard:
            bundle["GPU"] = gpus_per_shard
        check_placement(ray.nodes(), bundle, layout.num_shards, placement_strategy)
        self._pg = placement_group([bundle] * layout.num_shards, strategy=placement_strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self._pg)
            free = ray.available_resources()
            raise ClusterResourceError(
                f"could not place {layout.num_shards} shards with {bundle} each ({placement_strategy}) within "
                f"{PLACEMENT_TIMEOUT_S:g} s although the cluster's nodes are large enough: other jobs hold the "
                f"resources (free now: {free.get('CPU', 0):g} CPUs, {free.get('GPU', 0):g} GPUs)")
        actor_cls = ray.remote(EmbeddingShard)

        def make_actor(s: int):
            return actor_cls.options(
                **ACTOR_OPTIONS, num_cpus=cpus_per_shard, num_gpus=gpus_per_shard or 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=s),
            ).remote(layout, s, **shard_kwargs)

        if max_restarts < 0:
            raise ValueError(f"cluster.max_actor_restarts must be >= 0, got {max_restarts}")
        if data_plane not in DATA_PLANES:
            raise ValueError(f"cluster.data_plane must be one of {DATA_PLANES}, got {data_plane!r}")
        if compiled_wait not in COMPILED_WAITS:
            raise ValueError(f"cluster.compiled_wait must be one of {COMPILED_WAITS}, got {compiled_wait!r}")
        self.data_plane = data_plane
        self.compiled_wait = compiled_wait
        self._graph: Any = None  # the compiled dispatch graph (data_plane = "compiled"), built on first use
        self.graphs_compiled = 0  # 1 + one per rebuild after a lost actor
        self._call_id = 0
        self._make_actor = make_actor
        self.actors = [make_actor(s) for s in range(layout.num_shards)]
        self.max_restarts = int(max_restarts)
        self.restarts = 0  # actors replaced so far
        self._snapshot: Optional[list] = None  # each shard's state at the last state_dict call
        self._log: list[tuple[str, Sequence[tuple]]] = []  # calls since then (see the class docstring)
        # releases sent without waiting (trainer actors, folded write-back): per release, each
        # shard's ObjectRef; `_unhanded` not yet given to the trainers, `_unawaited` not yet checked
        self._unawaited: list[list] = []
        self._unhanded: list[list] = []
        self.unawaited_write_back = bool(unawaited_write_back)  # cluster.unawaited_write_back
        # (`direct_callers`, ShardGroup: trainer actors call the shards directly, trainer/engine/trainers.py:
        # a shard lost during a step's cache-filling call is restored and the step redone, StepInterrupted.)
        self._ray = ray
        self._sent_timings: Optional[list] = None  # `record_call_timings` (benchmarks only)

    def record_call_timings(self, on: bool) -> dict:
        """Start (`on`) or stop recording when each round was sent and answered here and when each
        shard ran its part (`EmbeddingShard.record_call_timings`); returns and forgets what was
        recorded: {"sent": [(call_id, method, plane, sent, answered)], "shards": [per shard:
        [(call_id, method, start, end, cpu_s)]]}, times on the machine's monotonic clock
        (comparable only where the driver and the shards share a machine). Benchmarks only:
        times of calls, which depend on the batch's sizes as every run's step times do."""
        shards = self._ray.get([actor.record_call_timings.remote(on) for actor in self.actors])
        sent, self._sent_timings = self._sent_timings or [], ([] if on else None)
        return {"sent": sent, "shards": shards}

    def _call_after(self, before, method, per_shard_args):
        return self._call(method, per_shard_args, before)

    def _release_unawaited(self, method, per_shard_args):
        """Folded write-back with trainer actors (docs/DESIGN.md §2.2): the update is logged
        (an actor lost before or while applying it is rebuilt with it), sent to every shard,
        and not waited for here. The trainers' next lookups name its answers as arguments
        (`take_releases`, `EmbeddingShard.after`), so Ray starts each lookup only once its
        shard has applied the update; this group's own later calls follow it anyway (Ray runs
        one caller's calls to an actor in the order sent). Its answers are checked, and an
        error it raised surfaces, at this group's next call (`_check_releases`). Only with
        `unawaited_write_back` (cluster.unawaited_write_back); else False: a round of its own."""
        if not self.unawaited_write_back:
            return False
        self._call_id += 1
        self._remember(method, per_shard_args, [])
        refs = [actor.dispatch.remote((self._call_id, method, tuple(args), False))
                for actor, args in zip(self.actors, per_shard_args)]
        self._unawaited.append(refs)
        self._unhanded.append(refs)
        sent = sum(_nbytes(list(a)) for a in per_shard_args)
        self.bytes_to_shards += sent
        if self._observers:
            record = ShardCall(method, sent, 0, 0.0)
            for observer in list(self._observers):
                observer(record)
        return True

    def take_releases(self):
        handed, self._unhanded = self._unhanded, []
        if not handed:
            return None
        return [[refs[s] for refs in handed] for s in range(self.layout.num_shards)]

    def _check_releases(self) -> None:
        """Wait for the unawaited releases (done by now when a trainer's lookup followed them)
        and raise what a shard method raised; a lost actor is left to the call that finds it."""
        from ray.exceptions import RayActorError

        sent, self._unawaited = self._unawaited, []
        for refs in sent:
            for ref in refs:
                try:
                    self._ray.get(ref)
                except RayActorError:
                    pass  # the log holds the update: the replacement actor gets it (`_rebuild`)

    def _call(self, method, per_shard_args, before: Sequence[tuple[str, list]] = ()):
        """One round: each shard runs the deferred calls `before` (`ShardGroup.defer`) and then
        `method`, as one request. The deferred calls are logged first, so an actor lost in this
        round is rebuilt with them applied and then answers `method` alone."""
        from ray.exceptions import RayActorError

        if self._unawaited:
            self._check_releases()
        self._call_id += 1
        for deferred, args in before:
            self._remember(deferred, args, [])
        per_shard_before = [tuple((deferred, tuple(args[s])) for deferred, args in before)
                            for s in range(len(per_shard_args))]
        sent = time.perf_counter() if self._sent_timings is not None else 0.0
        if self.data_plane == "compiled" and method in COMPILED_METHODS and not self.direct_callers:
            answers = self._compiled_call([(self._call_id, method, tuple(args), True, pre)
                                           for args, pre in zip(per_shard_args, per_shard_before)])
            if answers is not None:
                if self._sent_timings is not None:
                    self._sent_timings.append((self._call_id, method, "compiled", sent, time.perf_counter()))
                self._remember(method, per_shard_args, answers)
                return answers
        elif self.direct_callers:
            self._teardown_graph()  # trainer actors call the shards themselves: ordinary calls only
        # Ordinary actor calls (also the compiled plane's fallback: the same call id, so a shard
        # that already ran this call answers it again without running it twice).
        refs = [actor.dispatch.remote((self._call_id, method, tuple(args), False, pre))
                for actor, args, pre in zip(self.actors, per_shard_args, per_shard_before)]
        results: list = [None] * len(refs)
        lost: list[tuple[int, Exception]] = []
        for s, ref in enumerate(refs):
            try:
                results[s] = self._ray.get(ref)
            except RayActorError as died:  # the actor died; an exception raised by the method propagates
                lost.append((s, died))
        if lost and self.direct_callers and method not in MUTATING:
            # This step's cache-filling calls came from the trainers, not through this group,
            # so they are not in the log: restore the released state and redo the step.
            for s, cause in lost:
                self._restore(s, cause, method)
            raise StepInterrupted(f"shard {lost[0][0]} (Ray actor) died during {method!r}; restored")
        for s, cause in lost:
            results[s] = self._replace(s, method, per_shard_args[s], cause)
        if self._sent_timings is not None:
            self._sent_timings.append((self._call_id, method, "calls", sent, time.perf_counter()))
        self._remember(method, per_shard_args, results)
        return results

    def _compiled_call(self, requests: list) -> Optional[list]:
        """The call through the compiled dispatch graph (built on first use): one execution,
        every shard's answer copied out of the channel. None when the graph broke (a lost
        actor closes its channels): it is torn down and the caller re-sends the same requests
        as ordinary calls, which replace the lost actor (and recompile on the next call). An
        exception raised by a shard method propagates as with ordinary calls."""
        from ray.exceptions import RayActorError, RayChannelError

        try:
            if self._graph is None:
                self._graph = self._compile_graph()
            refs = self._graph.execute(*requests)
            return [owned(self._ray.get(ref, timeout=COMPILED_GET_TIMEOUT_S)) for ref in refs]
        except (RayChannelError, RayActorError):
            self._teardown_graph()
            return None

    def _compile_graph(self):
        """InputNode → every shard's `dispatch(request_s)` → MultiOutputNode, compiled: each call
        of the compiled plane is one execution whatever the method (an actor takes part in one
        compiled graph at a time, so one graph carries every per-step method). The channel
        waits follow `compiled_wait` in this process and every shard's (process-wide: the last
        group built in a process sets the driver's)."""
        from ray.dag import InputNode, MultiOutputNode

        # How this process and each shard's wait on the channels (trainer/cluster/compiled_wait.py);
        # set again at every build, so a replacement actor gets it too.
        set_compiled_wait_here_and_on(self.actors, self.compiled_wait, self._ray)
        with InputNode() as requests:
            graph = MultiOutputNode([actor.dispatch.bind(requests[s]) for s, actor in enumerate(self.actors)])
        compiled = graph.experimental_compile(_submit_timeout=COMPILED_GET_TIMEOUT_S,
                                              _buffer_size_bytes=COMPILED_BUFFER_BYTES)
        self.graphs_compiled += 1
        return compiled

    def _teardown_graph(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            try:
                graph.teardown()
            except Exception:  # a graph whose actor died may fail to tear down cleanly: it is gone either way
                pass

    def restore_lost(self, during: str = "the step") -> list[int]:
        """Restore every shard actor that no longer answers to the state after the last
        released step (checkpoint + the released updates since). Returns their indices."""
        from ray.exceptions import RayActorError

        # A ping follows every call this group sent the shard (one caller's calls run in order),
        # so once it answers, the unawaited releases have run there; a replaced actor gets them
        # from the log. The step is redone without waiting for them again.
        self._unhanded = []
        self._check_releases()
        dead = []
        for s, actor in enumerate(self.actors):
            try:
                self._ray.get(actor.ping.remote())
            except RayActorError as err:
                dead.append(s)
                self._restore(s, err, during)
        return dead

    def _restore(self, s: int, err: Exception, during: str) -> None:
        """A new actor for shard s at the state after the last released step (no step cache)."""
        self._rebuild(s, err, during, replay_step=False, method="ping", args=())

    def _rebuild(self, s: int, err: Exception, during: str, *, replay_step: bool, method: str, args: tuple):
        """A new actor for shard s: the snapshot, then the logged calls (the state-changing ones,
        plus with `replay_step` the current step's cache-filling ones), then `method(*args)`,
        whose answer is returned. Up to max_restarts attempts; then ShardLostError."""
        from ray.exceptions import RayActorError

        last: Exception = err
        self._teardown_graph()  # it holds the lost actor: rebuilt with the new one on the next call
        for _ in range(self.max_restarts):
            try:
                self._ray.kill(self.actors[s])  # type: ignore[arg-type]
            except Exception:  # already gone
                pass
            actor = self._make_actor(s)
            self.actors[s] = actor
            try:
                if self._snapshot is not None:
                    self._ray.get(actor.call.remote("load_state_dict", self._snapshot[s]))
                for logged, per_shard in self._log:
                    if replay_step or logged in MUTATING:
                        self._ray.get(actor.call.remote(logged, *per_shard[s]))
                result = self._ray.get(actor.call.remote(method, *args))
            except RayActorError as again:
                last = again
                continue
            self.restarts += 1
            return result
        raise ShardLostError(
            f"shard {s} (Ray actor) died during {during!r}"
            + (f" and again while being restored ({self.max_restarts} restart(s) tried)" if self.max_restarts
               else " (cluster.max_actor_restarts = 0)") + f": {last}")

    def _remember(self, method: str, per_shard_args: Sequence[tuple], results: list) -> None:
        if not self.max_restarts:
            return
        if method == "state_dict":
            self._snapshot, self._log = results, []
        elif method in MUTATING:  # the previous step's cache-filling calls are no longer needed
            self._log = [entry for entry in self._log if entry[0] in MUTATING]
            self._log.append((method, per_shard_args))
        else:
            self._log.append((method, per_shard_args))

    def _replace(self, s: int, method: str, args: tuple, err: Exception):
        """A new actor for shard s, brought to the lost one's state, answering `method(*args)`."""
        return self._rebuild(s, err, method, replay_step=True, method=method, args=args)

    def shutdown(self) -> None:
        self._teardown_graph()
        for actor in self.actors:
            self._ray.kill(actor)  # type: ignore[arg-type]  # ray's stubs type ray.remote(cls) as the class
        self._ray.util.remove_placement_group(self._pg)
