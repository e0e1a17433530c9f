"""The data-parallel trainers as Ray actors (`RayTrainers`), each holding a replica of the dense
model (the coordinator sends the parameters after each dense update, with the next step's
sample), reading only its own examples of the training set (one shared object in the object
store), and calling the shard actors directly (`DirectShardGroup`): lookups, pooled-output
gradients, clip factors and clipped row sums go from the trainer to the shards that own the
rows and never through the coordinator. Implements the engine's trainer group
(trainer/engine/trainers.py); `ray_trainer_factory` is what a run hands the engine.

A lost actor (docs/DESIGN.md §1.8): `parts` raises `TrainerActorLost` when a trainer or a
shard it was talking to died; the engine restores the dead actors (`restore_lost` here and
`RayShardGroup.restore_lost`) and redoes the step from its sample — nothing of the step was
recorded or released yet.
"""

from __future__ import annotations

import copy
from typing import Optional

import numpy as np

from widedp.trainer.engine.shard_group import ShardGroup, StepInterrupted
from widedp.trainer.engine.trainer_role import PhaseClock, TrainerOptions, TrainerRole
from widedp.trainer.engine.trainers import TrainerGroup, _with_clip


#: Where the trainers' dense clipped sums are added: by the coordinator (N sums in, N dense
#: states out per step) or among the trainers (trainer/cluster/dense_collective.py: one of each).
DENSE_REDUCTIONS = ("coordinator", "trainers")


class TrainerActorLost(StepInterrupted):
    """A trainer actor, or a shard actor a trainer was calling, died during the step."""


class CollectivePeerLost(RuntimeError):
    """A trainer's collective with the others failed (a peer died or timed out)."""


class DirectShardGroup(ShardGroup):
    """A trainer's own handles on the shard actors (no recovery here: a death raises, and the
    coordinator restores the shard and redoes the step)."""

    def __init__(self, layout, actors: list):
        import ray

        super().__init__(layout)
        self.actors = list(actors)
        self._ray = ray
        self._releases: Optional[list] = None  # `follow`: for the next call only

    def follow(self, releases: Optional[list]) -> None:
        """The coordinator's unawaited releases (per shard, ObjectRefs of its write-back calls:
        `RayShardGroup.take_releases`) that this trainer's next call to each shard must follow."""
        self._releases = releases

    def _call(self, method, per_shard_args):
        releases, self._releases = self._releases, None
        if releases is None:
            refs = [actor.call.remote(method, *args) for actor, args in zip(self.actors, per_shard_args)]
        else:  # top-level ObjectRef arguments: Ray starts the call once they are ready (applied)
            refs = [actor.after.remote(method, tuple(args), *done)
                    for actor, args, done in zip(self.actors, per_shard_args, releases)]
        return self._ray.get(refs)


class _TrainerActor(TrainerRole):
    """A `TrainerRole` that builds its `DirectShardGroup` from shard actor handles."""

    def __init__(self, index, model, layout, train_set, shard_actors, options):
        from widedp.trainer.engine.memory import keep_freed_memory

        keep_freed_memory()  # a trainer actor's per-step buffers stay in its heap (trainer/engine/memory.py)
        super().__init__(index, model, layout, train_set, DirectShardGroup(layout, shard_actors), options)

    def set_shard_actors(self, shard_actors: list) -> None:
        """Point at the shards' current actors (the byte counters carry over)."""
        counted = self.shards.bytes_to_shards, self.shards.bytes_from_shards
        self.set_shards(DirectShardGroup(self.layout, shard_actors))
        self.shards.bytes_to_shards, self.shards.bytes_from_shards = counted

    def node(self) -> str:
        """The Ray node this trainer runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    # ---- the dense part reduced among the trainers (cluster.dense_reduction = "trainers") ---------------
    def rendezvous(self) -> tuple[str, int]:
        """(this node's IP, a free port on it): where the trainers' process group meets."""
        import ray

        from widedp.trainer.cluster.dense_collective import free_port

        address = ray.util.get_node_ip_address()
        return address, free_port(address)

    def join_collective(self, address: str, port: int, world: int) -> int:
        from widedp.trainer.cluster.dense_collective import DenseCollective

        self.collective = getattr(self, "collective", None) or DenseCollective()
        return self.collective.join(address, port, self.index, world)

    def _collective(self, what):
        """Run a collective; a peer lost during it (gloo's error or timeout) is `CollectivePeerLost`."""
        try:
            return what()
        except RuntimeError as err:
            raise CollectivePeerLost(f"trainer {self.index}: the trainers' collective failed: {err}") from None

    def set_children(self, children: list) -> None:
        """This trainer's children in the round's tree (`lead_tree`): (actor handle, the trainer
        indices of its subtree, itself first), in index order; [] for a leaf."""
        self._children = [(handle, list(subtree)) for handle, subtree in children]

    def collective_step_part(self, idx, dense_state=None, select=None, releases=None):
        """`step_part`, the dense clipped sum kept here for `reduce_dense`."""
        return self._kept(self.step_part(idx, dense_state, select, releases))

    def collective_finish_part(self, clip_norm, select=None):
        return self._kept(self.finish_part(clip_norm, select))

    def _kept(self, part):
        self._dense_sum, part.dense_sum = part.dense_sum, {}
        return part

    def reduce_dense(self) -> tuple[dict, float]:
        """(Σ over the trainers of this step's dense clipped sums at trainer 0, {} elsewhere; the
        seconds it took). Run only once every trainer's part is in, so a trainer lost before never
        leaves the others waiting in it."""
        kept, self._dense_sum = getattr(self, "_dense_sum", None), None
        if kept is None:
            raise RuntimeError(f"trainer {self.index}: reduce_dense without this step's part")
        clock = PhaseClock()
        reduced = self._collective(lambda: self.collective.reduce_sum(kept))
        clock.mark("dense_reduce")
        return reduced, clock.phases["dense_reduce"]

    def lead(self, method: str, per_trainer_args: list, reduce: bool = False) -> list:
        """Trainer 0 runs one round for the coordinator: `method` on every trainer, down a tree of
        trainers (`lead_tree`: each calls its children, which call theirs, at most
        cluster.lead_fanout each), every answer gathered back up; with `reduce`, then the dense
        sums reduced to it (`reduce_dense`, down the same tree). The coordinator makes one call
        per round whatever N, and no trainer makes more than lead_fanout. A dense state among
        the arguments (the coordinator's parameters, sent once) is put in the object store once
        for all the others. Returns the parts in trainer order."""
        import ray

        args = {i: list(a) for i, a in enumerate(per_trainer_args)}
        if method in ("collective_step_part", "begin_part") and args[0][1] is not None:
            shared = ray.put(args[0][1])
            for i in range(1, len(args)):
                args[i][1] = shared
        results = self.lead_tree(method, args)
        if reduce:
            reduced = self.reduce_tree()
            results[0].dense_sum = reduced[0][0]
            for i, part in results.items():
                part.phases["dense_reduce"] = reduced[i][1]
        return [results[i] for i in range(len(per_trainer_args))]

    def lead_tree(self, method: str, args: dict) -> dict:
        """`method` with `args[i]` on every trainer i of this subtree: the children's subtrees
        called first, then this trainer's own; {trainer index: its answer}. Every call below has
        ended before this returns or raises (none is left running into the redo of the step: a
        late row sum would be added to it), and this trainer's own error is the one raised."""
        import ray

        refs = [child.lead_tree.remote(method, {i: args[i] for i in subtree})
                for child, subtree in getattr(self, "_children", [])]

        def own():
            # arguments that came nested (to a child, in the dict) arrive as object refs where the
            # coordinator's call would have had them resolved: resolved here, one level, as Ray does
            return getattr(self, method)(*[ray.get(a) if isinstance(a, ray.ObjectRef) else a
                                           for a in args[self.index]])

        return self._with_subtrees(refs, own)

    def reduce_tree(self) -> dict:
        """`reduce_dense` on every trainer of this subtree (each enters the collective once its
        children were called, so all N do): {trainer index: (sum or {}, seconds)}."""
        return self._with_subtrees([child.reduce_tree.remote() for child, _ in getattr(self, "_children", [])],
                                   self.reduce_dense)

    def _with_subtrees(self, refs: list, own) -> dict:
        """{this trainer: `own()`, then every answer of the children's subtrees (`refs`, sent
        first)}; when `own` raises, every child's call has ended before its error is raised."""
        try:
            mine = own()
        except BaseException:
            try:
                _get_every(refs)
            except Exception:  # noqa: BLE001 — a child's failure too: ours comes first
                pass
            raise
        results = {self.index: mine}
        for below in _get_every(refs):
            results.update(below)
        return results


def lead_tree_children(num_trainers: int, fanout: int) -> list[list[int]]:
    """Per trainer i, its children in the round's tree: trainers i·f + 1 … i·f + f (f = `fanout`;
    a complete f-ary tree rooted at trainer 0, depth ⌈log_f N⌉)."""
    if fanout < 1:
        raise ValueError(f"cluster.lead_fanout must be >= 1, got {fanout}")
    return [[j for j in range(i * fanout + 1, i * fanout + fanout + 1) if j < num_trainers]
            for i in range(num_trainers)]


def lead_tree_subtree(children: list[list[int]], root: int) -> list[int]:
    """The trainers of `root`'s subtree, `root` first."""
    out, todo = [], [root]
    while todo:
        node = todo.pop(0)
        out.append(node)
        todo.extend(children[node])
    return out


def _get_every(refs: list) -> list:
    """Every ref's value, waiting for all of them (not only up to the first failure); then the
    first failure, if any, is raised."""
    import ray

    if refs:
        ray.wait(refs, num_returns=len(refs))
    values, first = [], None
    for ref in refs:
        try:
            values.append(ray.get(ref))
        except Exception as err:  # noqa: BLE001 — re-raised below, after every ref was collected
            first = first or err
            values.append(None)
    if first is not None:
        raise first
    return values


def _cause(err: BaseException) -> BaseException:
    """What a task's error was raised by: through every task that re-raised it (a trainer down
    the round's tree, `lead_tree`), the first error that is not a task's."""
    from ray.exceptions import RayTaskError

    seen = 0
    while isinstance(err, RayTaskError) and getattr(err, "cause", None) is not None and seen < 64:
        err, seen = err.cause, seen + 1
    return err


def _is_actor_death(err: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(err, RayActorError) or isinstance(_cause(err), RayActorError)


class RayTrainers(TrainerGroup):
    """N trainer actors, `cpus_per_trainer` CPUs each, spread over the cluster's nodes; owned by
    the driver, they end with it (`ray_runtime.ACTOR_OPTIONS`)."""

    def __init__(self, model, layout, train_set, shards, options: TrainerOptions, *, cpus_per_trainer: float = 1.0,
                 dense_reduction: str = "coordinator", lead_fanout: int = 8):
        import ray

        from widedp.trainer.cluster.ray_runtime import ACTOR_OPTIONS

        self._ray = ray
        self.layout, self.options, self.shards = layout, options, shards
        self.num_trainers = options.num_trainers
        self._model = model
        # A partitioned data set: each trainer gets its own share (its parts' paths and streams) and
        # opens its parts itself. Else one copy in the object store; each trainer takes its own rows.
        self._shares = train_set if getattr(train_set, "partitioned_shares", False) else None
        self._data_ref = ray.put(train_set) if self._shares is None else None
        self._restarts_of = [0] * options.num_trainers
        self._actor_cls = ray.remote(_TrainerActor).options(**ACTOR_OPTIONS, num_cpus=cpus_per_trainer,
                                                            scheduling_strategy="SPREAD")
        self.actors = [self._make(i) for i in range(self.num_trainers)]
        self.restarts = 0
        self._last_dense_state: Optional[dict] = None
        if dense_reduction not in DENSE_REDUCTIONS:
            raise ValueError(f"cluster.dense_reduction must be one of {DENSE_REDUCTIONS}, got {dense_reduction!r}")
        # the trainers reduce the dense sums among themselves (one process group of N > 1)
        self.collective = dense_reduction == "trainers" and self.num_trainers > 1
        self._tree = lead_tree_children(self.num_trainers, lead_fanout)
        self._collective_broken = False
        if self.collective:
            self._join()

    def _join(self) -> None:
        """Every trainer (re)joins one process group, meeting at trainer 0's node; trainer 0
        gets the others' handles (it leads each round: `_TrainerActor.lead`)."""
        address, port = self._ray.get(self.actors[0].rendezvous.remote())
        self._gather([actor.join_collective.remote(address, port, self.num_trainers) for actor in self.actors],
                     "join_collective")
        self._gather([actor.set_children.remote([(self.actors[j], lead_tree_subtree(self._tree, j)) for j in kids])
                      for actor, kids in zip(self.actors, self._tree)], "set_children")

    def _make(self, i: int):
        data = self._data_ref if self._shares is None else self._shares.share(i, self._restarts_of[i])
        return self._actor_cls.remote(i, copy.deepcopy(self._model), self.layout, data,
                                      self.shards.actors, self.options)

    @property
    def needs_dense_state(self) -> bool:
        return True

    def parts(self, samples, dense_state, select=None, chooser=None):
        if dense_state is not None:
            self._last_dense_state = dense_state
        # the coordinator's write-back of the last step, sent without waiting: each trainer's
        # lookup follows it at every shard (None: nothing in flight)
        releases = self.shards.take_releases()
        if self.collective:
            return self._collective_parts(samples, dense_state, select, chooser, releases)
        if chooser is None:
            refs = [actor.step_part.remote(idx, dense_state, select, releases) for actor, idx in zip(self.actors, samples)]
            return self._gather(refs, "step_part")
        counts = self._gather([actor.begin_part.remote(idx, dense_state, chooser.candidates, releases)
                               for actor, idx in zip(self.actors, samples)], "begin_part")
        clip = chooser(np.sum(counts, axis=0))
        return self._gather([actor.finish_part.remote(clip, _with_clip(select, clip)) for actor in self.actors],
                            "finish_part")

    def _collective_parts(self, samples, dense_state, select, chooser, releases):
        """The step's parts through trainer 0 (`lead`): the coordinator sends it every trainer's
        sample and the dense state once, and gets back every part, trainer 0's carrying the dense
        sum reduced among the trainers (the others' dense_sum is empty)."""
        leader = self.actors[0]
        if chooser is None:
            args = [(idx, dense_state if i == 0 else None, select, releases) for i, idx in enumerate(samples)]
            return self._gather([leader.lead.remote("collective_step_part", args, True)], "lead")[0]
        begin = [(idx, dense_state if i == 0 else None, chooser.candidates, releases) for i, idx in enumerate(samples)]
        counts = self._gather([leader.lead.remote("begin_part", begin)], "lead")[0]
        clip = chooser(np.sum(counts, axis=0))
        finish = [(clip, _with_clip(select, clip))] * self.num_trainers
        return self._gather([leader.lead.remote("collective_finish_part", finish, True)], "lead")[0]

    def sample(self):
        if self.collective:
            return self._gather([self.actors[0].lead.remote("draw_sample", [()] * self.num_trainers)], "lead")[0]
        return self._gather([actor.draw_sample.remote() for actor in self.actors], "draw_sample")

    def example_rows(self):
        return self._gather([actor.example_rows.remote() for actor in self.actors], "example_rows")

    def sampler_states(self):
        return self._gather([actor.sampler_state.remote() for actor in self.actors], "sampler_state")

    def load_sampler_states(self, states):
        if len(states) != len(self.actors):
            raise ValueError(f"sampler states of {len(states)} trainers, this run has {len(self.actors)}")
        self._gather([actor.load_sampler_state.remote(s) for actor, s in zip(self.actors, states)],
                     "load_sampler_state")

    def score_histograms(self, dense_params, *args):
        import ray

        params = ray.put(dense_params)  # once for every trainer
        return self._gather([actor.score_histogram.remote(params, *args) for actor in self.actors], "score_histogram")

    def shard_bytes(self):
        return self._gather([actor.shard_bytes.remote() for actor in self.actors], "shard_bytes")

    def nodes(self) -> list[str]:
        """The Ray node of each trainer."""
        return self._gather([actor.node.remote() for actor in self.actors], "node")

    def _gather(self, refs: list, method: str) -> list:
        """Every trainer's answer; an actor death (the trainer's own, or a shard's it was
        calling) raises TrainerActorLost naming the trainer and what died."""
        from ray.exceptions import RayActorError

        results, lost = [], None
        for i, ref in enumerate(refs):
            try:
                results.append(self._ray.get(ref))
            except Exception as err:  # noqa: BLE001 — only actor deaths are turned into TrainerActorLost
                if isinstance(_cause(err), CollectivePeerLost):
                    self._collective_broken = True
                    lost = lost or TrainerActorLost(f"trainer {i}'s collective with the other trainers failed "
                                                    f"during {method!r} (a peer was lost)")
                    results.append(None)
                    continue
                if not _is_actor_death(err):
                    raise
                cause = _cause(err)
                what = (f"trainer 0, leading the round, or a trainer or shard actor it was calling died during "
                        f"{method!r}" if method == "lead"
                        else f"a shard actor that trainer {i} was calling died during {method!r}"
                        if isinstance(cause, RayActorError) and not isinstance(err, RayActorError)
                        or "EmbeddingShard" in str(err).split("The actor is dead", 1)[0]
                        else f"trainer {i} (Ray actor) died during {method!r}")
                lost = lost or TrainerActorLost(what)
                results.append(None)
        if lost is not None:
            raise lost
        return results

    def dead_trainers(self) -> list[int]:
        """Indices of the trainer actors that no longer answer."""
        from ray.exceptions import RayActorError

        dead = []
        for i, actor in enumerate(self.actors):
            try:
                self._ray.get(actor.ping.remote())
            except RayActorError:
                dead.append(i)
        return dead

    def restore_lost(self) -> list[int]:
        """Replace every dead trainer actor by a new one holding the current dense parameters
        and point every trainer at the shards' current actors. Returns the replaced indices."""
        dead = self.dead_trainers()
        rejoin = self.collective and (bool(dead) or self._collective_broken)
        if rejoin:
            # the survivors may be waiting in a collective with the dead one: every trainer is
            # replaced (fresh sampling streams for all, the step redone from the kept samples)
            dead, self._collective_broken = list(range(self.num_trainers)), False
        for i in dead:
            try:
                self._ray.kill(self.actors[i])
            except Exception:  # noqa: BLE001 — already gone
                pass
            # a restored trainer of a partitioned data set samples from fresh streams of its own
            # (`TrainerShares.share(i, restart)`): the step is redone from the coordinator's copy
            # of its sample, and no later coin repeats one drawn before
            self._restarts_of[i] += 1
            self.actors[i] = self._make(i)
            self.restarts += 1
        self._gather([actor.set_shard_actors.remote(self.shards.actors) for actor in self.actors], "set_shard_actors")
        if rejoin:
            self._join()
        return dead

    def shutdown(self) -> None:
        for actor in self.actors:
            try:
                self._ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass




class ray_trainer_factory:  # noqa: N801  (used as a function: the engine's trainer-group factory)
    """The engine's trainer-group factory for trainer actors (`cpus_per_trainer` CPUs each); the
    shards must be a RayShardGroup (the trainers call its actors directly, and their clipped row
    sums are reduced at the shards: `reduces_at_shards`)."""

    reduces_at_shards = True

    def __init__(self, cpus_per_trainer: float = 1.0, dense_reduction: str = "coordinator", lead_fanout: int = 8):
        self.cpus_per_trainer, self.dense_reduction, self.lead_fanout = cpus_per_trainer, dense_reduction, lead_fanout

    def __call__(self, model, layout, train_set, shards, options: TrainerOptions) -> TrainerGroup:
        if not hasattr(shards, "actors"):
            raise ValueError("trainer actors need the shards on Ray (cluster.backend = \"ray\")")
        shards.direct_callers = True
        return RayTrainers(model, layout, train_set, shards, options, cpus_per_trainer=self.cpus_per_trainer,
                           dense_reduction=self.dense_reduction, lead_fanout=self.lead_fanout)


__all__ = ["DirectShardGroup", "RayTrainers", "TrainerActorLost", "ray_trainer_factory"]
