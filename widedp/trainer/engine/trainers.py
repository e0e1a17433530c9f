"""The data-parallel trainers' group: the protocol the engine drives (`TrainerGroup`) and its
in-process placement (`InProcessTrainers`: one after another in the coordinator's process);
trainer/cluster/ray_trainers.py places them as Ray actors. Every placement runs
`trainer.engine.trainer_role.TrainerRole.step_part` on the same inputs, so the placement changes
where the work runs, never what it computes (tests/test_cluster.py checks N trainers on Ray
against the in-process engine).

A run builds the group and hands the engine a factory for it (`TrainerGroupFactory`): the engine
never imports the cluster.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Sequence

import numpy as np

from widedp.trainer.engine.trainer_role import TrainerOptions, TrainerPart, TrainerRole, UnitSample


class ClipChooser(Protocol):
    """This step's S1 from every trainer's counts of norms above `candidates` (summed):
    the engine's DP-STAT (trainer/engine/adaptive_clip.py)."""

    candidates: np.ndarray

    def __call__(self, counts: np.ndarray) -> float: ...


class TrainerGroup:
    """N trainers: `parts(samples, dense_state)` runs every trainer's share of a step."""

    num_trainers: int
    restarts: int = 0  # trainer actors replaced after a death (a placement with actors counts them)

    def parts(self, samples: Sequence[np.ndarray], dense_state: Optional[dict],
              select: Optional[list] = None, chooser: Optional[ClipChooser] = None) -> list[TrainerPart]:
        """`select`: per shard, the `ShardSelect` of a step whose selection runs with the row
        sums (one trainer; `TrainerRole.step_part`). `chooser`: S1 is chosen this step from
        every trainer's norm counts — each trainer's share runs in two halves around it
        (`begin_part`, `finish_part`), and `select` gets that S1."""
        raise NotImplementedError

    def example_rows(self) -> list[tuple[np.ndarray, np.ndarray]]:
        raise NotImplementedError

    def sample(self) -> list:
        """A partitioned data set: every trainer's Poisson sample of its own parts
        (`TrainerRole.draw_sample`), in trainer order."""
        raise NotImplementedError

    def sampler_states(self) -> list:
        """A partitioned data set: every trainer's sampler state (reproducible checkpoints)."""
        raise NotImplementedError

    def load_sampler_states(self, states: list) -> None:
        raise NotImplementedError

    def score_histograms(self, dense_params: dict, averaged: bool, batch_size: int, bins: int, clip: float,
                         unit_weighted: bool) -> list:
        """A partitioned data set: every trainer's exact recalibration counts over its own parts
        (`TrainerRole.score_histogram`), in trainer order."""
        raise NotImplementedError

    @property
    def needs_dense_state(self) -> bool:
        """Whether the trainers hold replicas that must be sent the dense parameters."""
        return False

    def shard_bytes(self) -> list[tuple[int, int]]:
        """Per trainer: (bytes sent to, received from) the shards so far."""
        raise NotImplementedError

    def restore_lost(self) -> list[int]:
        """Restore the trainers that died (an actor placement); returns their indices."""
        return []

    @property
    def in_process(self) -> bool:
        """Whether the trainers share the coordinator's model and shard group."""
        return False

    def shutdown(self) -> None:
        pass


class InProcessTrainers(TrainerGroup):
    """The trainers run one after another in the coordinator's process, sharing its model
    and its shard group (the protocol, without the parallelism)."""

    def __init__(self, roles: list[TrainerRole]):
        self.roles = roles
        self.num_trainers = len(roles)

    @property
    def in_process(self) -> bool:
        return True

    def parts(self, samples, dense_state, select=None, chooser=None):
        if chooser is None:
            return [role.step_part(idx, select=select) for role, idx in zip(self.roles, samples)]
        counts = [role.begin_part(idx, None, chooser.candidates) for role, idx in zip(self.roles, samples)]
        clip = chooser(np.sum(counts, axis=0))
        return [role.finish_part(clip, _with_clip(select, clip)) for role in self.roles]

    def example_rows(self):
        return [role.example_rows() for role in self.roles]

    def sample(self):
        return [role.draw_sample() for role in self.roles]

    def sampler_states(self):
        return [role.sampler_state() for role in self.roles]

    def load_sampler_states(self, states):
        if len(states) != len(self.roles):
            raise ValueError(f"sampler states of {len(states)} trainers, this run has {len(self.roles)}")
        for role, state in zip(self.roles, states):
            role.load_sampler_state(state)

    def score_histograms(self, *args):
        return [role.score_histogram(*args) for role in self.roles]

    def shard_bytes(self):
        return [role.shard_bytes() for role in self.roles]


def _with_clip(select: Optional[list], clip: float) -> Optional[list]:
    """The shards' fused-selection arguments with this step's S1."""
    return None if select is None else [dataclasses.replace(s, clip_norm=clip) for s in select]


class TrainerGroupFactory(Protocol):
    """How a run places the trainers: called by the engine with what each trainer needs."""

    def __call__(self, model, layout, train_set, shards, options: TrainerOptions) -> TrainerGroup: ...


def in_process_trainers(model, layout, train_set, shards, options: TrainerOptions) -> TrainerGroup:
    """The default placement: the trainers in the coordinator's process."""
    return InProcessTrainers([TrainerRole(i, model, layout, trainer_data(train_set, i), shards, options)
                              for i in range(options.num_trainers)])


def trainer_data(train_set, trainer: int, restart: int = 0):
    """What trainer `trainer` is handed: its own `TrainerShare` of a partitioned data set
    (trainer/data/format/partitioned.py `TrainerShares`), else the training split itself (the
    trainer then reads its part of each step's sample, drawn by the coordinator)."""
    return train_set.share(trainer, restart) if getattr(train_set, "partitioned_shares", False) else train_set


class TrainerSampling:
    """The engine's sampler when the trainers sample their own parts: `sample()` is every
    trainer's sample (a list, trainer order); the state is every trainer's sampler state."""

    def __init__(self, trainers: TrainerGroup, num_examples: int, num_units: int, sample_rate: float):
        self.trainers, self.num_examples, self.sample_rate = trainers, int(num_examples), float(sample_rate)
        self.num_units = int(num_units)

    def sample(self) -> list:
        return self.trainers.sample()

    def state_dict(self) -> dict:
        return {"trainers": self.trainers.sampler_states(), "num_examples": self.num_examples,
                "sample_rate": self.sample_rate}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_examples") != self.num_examples or state.get("sample_rate") != self.sample_rate:
            raise ValueError(f"sampler state is for n={state.get('num_examples')}, q={state.get('sample_rate')}, "
                             f"this run has n={self.num_examples}, q={self.sample_rate}")
        self.trainers.load_sampler_states(state["trainers"])


def make_trainers(factory: TrainerGroupFactory, *, model, layout, train_set, shards, mode: str, plan, selects: bool,
                  options, expected_batch_size: float, dense_tables: tuple) -> TrainerGroup:
    """The engine's trainers, placed by `factory`, with the options of its plan (S1, refined
    clipping, whether counts are reduced at the shards for a selector that counts there)."""
    from widedp.selection.registry import get_selector

    selector = get_selector(plan.selection) if plan is not None and selects else None
    counts_on_shards = options.selection_on_shards and selector is not None and selector.shard_statistic == "counts"
    trainer_options = TrainerOptions(
        mode=mode, clip_norm=plan.clip_norm if plan is not None and mode != "nonprivate" else None,
        expected_batch_size=expected_batch_size, num_trainers=options.num_trainers,
        # refined clipping clamps every per-example coordinate: the per-example reference has them
        dense_grad_method="per_example" if plan is not None and plan.mix_coordinates > 1 else options.dense_grad_method,
        coordinate_clip=plan.mix_coordinates if plan is not None else 1,
        reduce_at_shards=options.num_trainers > 1 or bool(getattr(factory, "reduces_at_shards", False)),
        contribution_clip=plan.selection_params.contribution_clip if counts_on_shards and plan is not None else None,
        dense_tables=dense_tables, norms_on_trainer=options.norms_on_trainer)
    return factory(model, layout, train_set, shards, trainer_options)


def trainer_samples(idx: np.ndarray, trainer_bounds: np.ndarray, example_units: Optional[np.ndarray],
                    unit_bounds: Optional[np.ndarray], num_trainers: int) -> list:
    """Each trainer's part of the step's sample (sorted dataset indices in its partition);
    at user level a `UnitSample` per trainer (its units' examples, units numbered within)."""
    if example_units is None:
        cut = np.searchsorted(idx, trainer_bounds)
        return [idx[cut[i]: cut[i + 1]] for i in range(num_trainers)]
    assert unit_bounds is not None
    units = example_units[idx]
    owner = np.searchsorted(unit_bounds, units, side="right") - 1
    samples = []
    for i in range(num_trainers):
        mine = owner == i
        uniq, local = np.unique(units[mine], return_inverse=True)
        samples.append(UnitSample(idx[mine], local.astype(np.int64).reshape(-1), int(uniq.size)))
    return samples


def partition(n: int, num_trainers: int, example_units: Optional[np.ndarray], plan=None):
    """(trainer bounds, example units, number of units, unit bounds): trainer i owns examples
    [⌊i·n/N⌋, ⌊(i+1)·n/N⌋), or at user level (`example_units`: a unit index per example) the
    units [⌊i·U/N⌋, ⌊(i+1)·U/N⌋) with all their examples."""
    N = num_trainers
    bounds = np.array([(i * n) // N for i in range(N + 1)], dtype=np.int64)
    if example_units is None:
        return bounds, None, n, None  # example level: every example is its own unit
    units = np.asarray(example_units)
    if units.shape != (n,) or not np.issubdtype(units.dtype, np.integer) or (n and units.min() < 0):
        raise ValueError(f"example_units must hold a unit index >= 0 for each of the {n} training examples")
    if plan is not None and plan.mix_coordinates > 1:
        raise ValueError("refined clipping (privacy.mix_coordinates > 1) clamps each example's coordinates: "
                         "it has no user-level form (privacy.unit = \"user\")")
    U = int(units.max()) + 1 if n else 0
    return bounds, units.astype(np.int64), U, np.array([(i * U) // N for i in range(N + 1)], dtype=np.int64)
