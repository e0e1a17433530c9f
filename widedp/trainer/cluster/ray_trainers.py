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
from widedp.trainer.engine.trainer_role import TrainerOptions, TrainerRole
from widedp.trainer.engine.trainers import TrainerGroup, _with_clip


class TrainerActorLost(StepInterrupted):
    """A trainer actor, or a shard actor a trainer was calling, died during the step."""


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


def _is_actor_death(err: BaseException) -> bool:
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(err, RayActorError):
        return True
    return isinstance(err, RayTaskError) and isinstance(getattr(err, "cause", None), RayActorError)


class RayTrainers(TrainerGroup):
    """N trainer actors, `cpus_per_trainer` CPUs each, spread over the cluster's nodes; owned by
    the driver, they end with it (`ray_runtime.ACTOR_OPTIONS`)."""

    def __init__(self, model, layout, train_set, shards, options: TrainerOptions, *, cpus_per_trainer: float = 1.0):
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
        if chooser is None:
            refs = [actor.step_part.remote(idx, dense_state, select, releases) for actor, idx in zip(self.actors, samples)]
            return self._gather(refs, "step_part")
        counts = self._gather([actor.begin_part.remote(idx, dense_state, chooser.candidates, releases)
                               for actor, idx in zip(self.actors, samples)], "begin_part")
        clip = chooser(np.sum(counts, axis=0))
        return self._gather([actor.finish_part.remote(clip, _with_clip(select, clip)) for actor in self.actors],
                            "finish_part")

    def example_rows(self):
        return self._gather([actor.example_rows.remote() for actor in self.actors], "example_rows")

    def sample(self):
        return self._gather([actor.draw_sample.remote() for actor in self.actors], "draw_sample")

    def sampler_states(self):
        return self._gather([actor.sampler_state.remote() for actor in self.actors], "sampler_state")

    def load_sampler_states(self, states):
        if len(states) != len(self.actors):
            raise ValueError(f"sampler states of {len(states)} trainers, this run has {len(self.actors)}")
        self._gather([actor.load_sampler_state.remote(s) for actor, s in zip(self.actors, states)],
                     "load_sampler_state")

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
                if not _is_actor_death(err):
                    raise
                cause = getattr(err, "cause", None)
                what = (f"a shard actor that trainer {i} was calling died during {method!r}"
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

    def __init__(self, cpus_per_trainer: float = 1.0):
        self.cpus_per_trainer = cpus_per_trainer

    def __call__(self, model, layout, train_set, shards, options: TrainerOptions) -> TrainerGroup:
        if not hasattr(shards, "actors"):
            raise ValueError("trainer actors need the shards on Ray (cluster.backend = \"ray\")")
        shards.direct_callers = True
        return RayTrainers(model, layout, train_set, shards, options, cpus_per_trainer=self.cpus_per_trainer)


__all__ = ["DirectShardGroup", "RayTrainers", "TrainerActorLost", "ray_trainer_factory"]
