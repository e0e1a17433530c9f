"""The engine: one step of seed Algorithm 3 (at row granularity) over sharded tables, as a short
pipeline of stages (docs/DESIGN.md §2):

    budget check → sample → trainers' parts (lookup, dense forward/backward, clip factors,
    clipped row sums: trainer/engine/trainer_role.py) → G on the touched rows → selection
    (trainer/engine/selection_stage.py) → S2 clip and noise (trainer/engine/noise_stage.py)
    → the event charged and persisted (trainer/engine/budget.py) → release to the shards
    (trainer/engine/release_stage.py) → dense update (trainer/engine/dense_update.py).

Privacy assumption: add/remove-one neighbouring datasets (one unit with all of its examples at
user level), Poisson sampling at rate q = b/n, sums normalized by the expected batch size b; the
ledger records the event composed from what the selector and the noise step *returned*, which
must equal the event budgeted in advance, before anything of the step is released.

Modes: `nonprivate` (no clip/noise, touched rows updated), `dpsgd` (every row and dense param
noised), `sparse` (the above with a selector). In `sparse` mode a public per-table policy
(trainer/config/table_policy.py) may make some tables dense: their rows are noised and updated
every step as in `dpsgd` (same noise stream, so an all-dense sparse engine equals `dpsgd`), and
the selection runs over the rows of the other tables only.

User level (`example_units` given; privacy.unit = "user"): the neighbouring relation is
add/remove one unit (user) with all of its examples. The sampler samples units (Poisson at rate
q = b/U, at most a public number of examples each: trainer/data/sampler.py
`UnitPoissonSampler`), b is the expected number of units per step, and every per-example
quantity of the step above becomes per unit: the clip factor c_u = min(1, S1/‖Σ_{j∈u} g_j‖)
(norms of the unit's summed gradient: `ShardGradients.unit_sq_norms` and
`DenseGradients.group_sq_norms`), the selectors' contribution weights and counts (distinct
(unit, row) pairs), DP-STAT's counts and DP-FEST's one-time counts (a unit's first L distinct
rows over all its examples). Σ_j c_{u(j)} g_j is then the sum of the units' clipped gradients,
so each unit moves G by at most S1 and the step's events are unchanged with n = U.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import numpy as np
import torch

from widedp.accounting import PrivacyLedger
from widedp.accounting import events as ev
from widedp.accounting.calibration import sampled_step_event
from widedp.selection.result import Selection
from widedp.trainer.engine import checkpoint, evaluation
from widedp.trainer.engine.budget import PrivacyBudget
from widedp.trainer.engine.dense_update import DenseUpdater
from widedp.trainer.engine.layout import ShardLayout
from widedp.trainer.engine.noise_stage import NoiseStage
from widedp.trainer.engine.plan import PrivacyPlan, RowSums, StepStats, step_event_of
from widedp.trainer.engine.randomness import PrivacyRandomness
from widedp.trainer.engine.release_stage import release_dense_tables, release_rows
from widedp.trainer.engine.selection_stage import RowSelection
from widedp.trainer.engine.shard_group import ShardLostError, StepInterrupted
from widedp.trainer.engine.trainer_role import PhaseClock, TrainerPart
from widedp.trainer.engine.trainers import (InProcessTrainers, TrainerGroupFactory, TrainerSampling, in_process_trainers,
                                            make_trainers, partition, trainer_samples)
from widedp.trainer.engine.vocabulary import SparseVocabulary
from widedp.trainer.models import DenseModel

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How a step is computed and placed — each choice gives the same distribution of what the
    step releases (the reference paths are tested against the fast ones).

    `dense_grad_method`: trainer/engine/dense_grads.py (auto, ghost or per_example).
    `num_trainers` N: the data-parallel split of docs/DESIGN.md §2.2; trainer i owns examples
    [⌊i·n/N⌋, ⌊(i+1)·n/N⌋) (units, at user level) and takes its part of each step's Poisson
    sample (one sampler, so the union is the global sample exactly); with a partitioned
    training set (`train_set.partitioned`, trainer/data/partitioned_training.py) trainer i reads
    its own parts and samples them itself (independent streams per part: the union is again the
    global Poisson sample); with the trainers on Ray the coordinator holds no example.
    `selection_on_shards`: a selector that can (`Selector.shard_statistic`) selects on the
    shards, each over its own rows with its own stream, merged exactly; with one trainer and
    `fuse_selection`, each shard selects in the call that makes its row sums.
    `norms_on_trainer`: each trainer computes its examples' embedding-gradient norms from the
    ids and pooled-output gradients (trainer/engine/example_norms.py); else the shards do, in a
    round of their own (the reference; user level always).
    `trainer_group`: where the trainers run (trainer/engine/trainers.py): in this process by
    default; a run on Ray may pass trainer/cluster/ray_trainers.py's `ray_trainer_factory`."""

    dense_grad_method: str = "auto"
    num_trainers: int = 1
    selection_on_shards: bool = False
    fuse_selection: bool = True
    norms_on_trainer: bool = True
    trainer_group: Optional[TrainerGroupFactory] = None

    def __post_init__(self):
        if isinstance(self.num_trainers, bool) or not isinstance(self.num_trainers, int) or self.num_trainers < 1:
            raise ValueError(f"num_trainers must be an integer >= 1, got {self.num_trainers!r}")


@dataclasses.dataclass
class EnginePrivacy:
    """A private engine's plan, ledger and target: `group_size` k > 1 is user-level DP by
    example sampling (privacy.user_sampling = "examples": the training set holds at most k
    examples per user and the step is the example-level one, but every event is accounted for a
    group of k); `persist_ledger` is called after each charge, before the release it pays for
    (`widedp train`: trainer/run/records.py `LedgerStore`)."""

    plan: PrivacyPlan
    ledger: PrivacyLedger
    target_epsilon: float
    secure_mode: bool = False
    group_size: int = 1
    persist_ledger: Optional[Callable[[PrivacyLedger], None]] = None


class Engine:
    """The step over a dense model, sharded tables, a training set and its sampler.

    `dense_tables`: in `sparse` mode, the indices of the tables noised densely every step
    (trainer/config/table_policy.py); `dpsgd` noises every table, `nonprivate` none. `ema_decay`
    β > 0: evaluate (and checkpoint for export) the exponential moving average of the iterates —
    post-processing of the released iterates, free in privacy; the shards must be built with the
    same β. `example_units`: user level — the dense unit index 0..U-1 of every training example
    (trainer/data/sampler.py `unit_indices`); the sampler samples those units, and
    `expected_batch_size` and `sample_rate` are in units."""

    def __init__(self, model: DenseModel, layout: ShardLayout, shards, train_set, sampler, *, mode: str,
                 expected_batch_size: float, sample_rate: float, dense_optimizer: torch.optim.Optimizer,
                 privacy: Optional[EnginePrivacy] = None, randomness: Optional[PrivacyRandomness] = None,
                 options: EngineOptions = EngineOptions(), dense_tables: tuple[int, ...] = (), ema_decay: float = 0.0,
                 example_units: Optional[np.ndarray] = None):
        if (privacy is None) != (mode == "nonprivate"):
            raise ValueError(f"mode {mode!r} {'needs' if privacy is None else 'takes no'} privacy plan and ledger")
        self.model, self.layout, self.shards, self.train_set, self.sampler = model, layout, shards, train_set, sampler
        self.mode, self.b, self.q, self.options = mode, float(expected_batch_size), float(sample_rate), options
        self.plan = privacy.plan if privacy is not None else None
        self.ledger = privacy.ledger if privacy is not None else None
        self.secure_mode = privacy.secure_mode if privacy is not None else False
        group_size = privacy.group_size if privacy is not None else 1
        if group_size > 1 and example_units is not None:
            raise ValueError("group_size > 1 accounts example-level steps for groups: not with example_units")
        self.budget = PrivacyBudget(self.ledger, privacy.target_epsilon if privacy is not None else float("inf"),
                                    group_size, privacy.persist_ledger if privacy is not None else None)
        # Secret by default (trainer/engine/randomness.py): a caller that passes nothing gets fresh OS entropy.
        self.randomness = PrivacyRandomness.fresh(secure=self.secure_mode) if randomness is None else randomness
        if self.secure_mode and self.randomness.reproducible:
            raise ValueError("privacy.secure_mode needs secret randomness: unset privacy.reproducible")
        if self.secure_mode and not self.randomness.secure:
            raise ValueError("privacy.secure_mode needs cryptographic generators: PrivacyRandomness.fresh(secure=True)")
        r = self.randomness
        self.selection_rng, self.noise_gen, self.clip_rng = r.selection_rng(), r.noise_generator(), r.clip_rng()
        self.dpsgd_noise_key, self.shard_selection_key, self.mix_key = r.dpsgd_noise_key(), r.shard_selection_key(), r.mix_key()
        if self.plan is not None and self.plan.mix_width > 0 and mode != "dpsgd":
            raise ValueError(f"ModelMix needs mode 'dpsgd' (every coordinate mixed), got {mode!r}")
        self.dense = DenseUpdater(model, dense_optimizer, ema_decay, self.mix_key)
        self.dense_optimizer = dense_optimizer
        # This step's learning rates are the configured ones times lr_scale (set by the run loop
        # from train.lr_schedule: a function of the step count only, so public).
        self.lr_scale = 1.0
        self.step_count, self.step_restarts = 0, 0  # steps redone after a lost actor (trainer actors)
        self.recalibrated_at: Optional[int] = None  # the step after which train.recalibrate last ran
        # the logit layer before that recalibration folded (a, b) into it (trainer/engine/recalibration.py)
        self.pre_recalibration: Optional[dict] = None
        # the released logit layer's output range, a·clip(z) + b's, and the hook that clamps it
        self.logit_range: Optional[tuple] = None
        self.logit_range_hook = None
        self.table_offsets = layout.table_offsets
        all_tables = tuple(range(len(layout.tables)))
        if any(t not in all_tables for t in dense_tables):
            raise ValueError(f"dense_tables {tuple(dense_tables)} must be table indices in {all_tables}")
        self.dense_tables = {"dpsgd": all_tables, "nonprivate": ()}.get(mode, tuple(sorted(set(dense_tables))))
        self.dense_table_rows = sum(layout.tables[t].num_rows for t in self.dense_tables)
        self.sparse_vocabulary = SparseVocabulary(np.array([t.num_rows for t in layout.tables]), self.dense_tables)
        self.num_trainers = options.num_trainers
        # A partitioned data set (trainer/data/format/partitioned.py): each trainer reads and
        # samples its own parts; this process holds the data set's shape only, never an example.
        self.partitioned = bool(getattr(train_set, "partitioned", False))
        trainer_data = train_set
        if self.partitioned:
            if sampler is not None or example_units is not None or group_size > 1:
                raise ValueError("a partitioned training set is sampled by its trainers: pass sampler=None and "
                                 "example_units=None (user level: the set's max_examples_per_unit); "
                                 "privacy.user_sampling = \"examples\" is not available for it")
            self.trainer_bounds, self.example_units, self.unit_bounds = None, None, None
            self.num_units = int(train_set.num_units) if train_set.unit_level else len(train_set)
            sampler_key = self.randomness.key("sampler")
            # a restored trainer's streams are addressed by its restart count and the step it was
            # restored in, so a later session's restarts (the counts start again at 0) never repeat one
            trainer_data = train_set.trainer_shares(
                self.num_trainers, self.q,
                lambda part, restart: sampler_key.generator("part", part, "restart", restart,
                                                            "step", self.step_count if restart else 0))
        else:
            self.trainer_bounds, self.example_units, self.num_units, self.unit_bounds = partition(
                len(train_set), self.num_trainers, example_units, self.plan)
        self.noise = NoiseStage(mode=mode, plan=self.plan, expected_batch_size=self.b, noise_gen=self.noise_gen,
                                clip_rng=self.clip_rng, secure=self.secure_mode,
                                noise_dense_tables=bool(self.dense_tables))
        self.selection = RowSelection(
            mode=mode, plan=self.plan, layout=layout, vocabulary=self.sparse_vocabulary,
            dense_tables=self.dense_tables, shards=shards, rng=self.selection_rng, shard_key=self.shard_selection_key,
            expected_batch_size=self.b, on_shards=options.selection_on_shards, fuse=options.fuse_selection,
            num_trainers=self.num_trainers, step_count=lambda: self.step_count, clip=self.noise.clip)
        self.selects = self.selection.selects
        self.budget.step_event = step_event_of(mode, self.q, self.plan, self.selects, group_size)
        self.trainers = make_trainers(options.trainer_group or in_process_trainers, model=model, layout=layout,
                                      train_set=trainer_data, shards=shards, mode=mode, plan=self.plan,
                                      selects=self.selects, options=options, expected_batch_size=self.b,
                                      dense_tables=self.dense_tables)
        self.selection.trainers = self.trainers
        if self.partitioned:
            self.sampler = TrainerSampling(self.trainers, len(train_set), self.num_units, self.q)

    # ---- what the step is told --------------------------------------------------------------------------
    @property
    def private_plan(self) -> PrivacyPlan:
        """The plan of a private run; the private phases only run when there is one."""
        if self.plan is None:
            raise RuntimeError("a private step phase ran without a privacy plan (mode nonprivate)")
        return self.plan

    @property
    def step_event(self) -> Optional[ev.DpEvent]:
        """The event one step charges (`plan.step_event_of`), budgeted before the step runs."""
        return self.budget.step_event

    @property
    def fixed_rows(self) -> Optional[np.ndarray]:
        """DP-FEST's fixed rows (compact sparse ids), None before (or without) the one-time selection."""
        return self.selection.fixed_rows

    @fixed_rows.setter
    def fixed_rows(self, rows: Optional[np.ndarray]) -> None:
        self.selection.fixed_rows = rows

    @property
    def dense_ema(self) -> Optional[dict]:
        """The averaged dense parameters (train.ema_decay > 0), else None."""
        return self.dense.ema

    def needs_one_time_selection(self) -> bool:
        """Whether the plan's selector selects once before training (DP-FEST)."""
        return self.selection.needs_one_time_selection()

    def prepare_fest(self, feature_rows: Callable[[str], tuple[np.ndarray, np.ndarray]]) -> None:
        """A one-time selection (DP-FEST): charged, then the trainable rows fixed for all steps."""
        if self.partitioned:
            raise ValueError("DP-FEST's one-time selection counts rows over the whole training set at the "
                             "coordinator: not with a partitioned data set (whose examples only the trainers read)")
        self.selection.prepare_fest(feature_rows, len(self.train_set), self.example_units, self.num_units,
                                    self.budget.charge)

    # ---- one step -------------------------------------------------------------------------------------------
    def step(self) -> Optional[StepStats]:
        """One step of docs/DESIGN.md §2; None (and nothing spent) if it would exceed the target ε."""
        try:
            return self._step()
        except ShardLostError as err:
            raise ShardLostError(f"step {self.step_count + 1}: {err}") from err

    def _step(self) -> Optional[StepStats]:
        if self.budget.would_exceed(self.step_count):
            return None
        clock = PhaseClock()
        limit = getattr(self.shards, "max_restarts", 0)
        attempts, lost, samples, B = 0, None, None, 0
        while True:
            try:
                if lost is not None:
                    self._recover(lost)
                if samples is None:  # drawn once: a redone step uses the same sample
                    samples, B = self._sample(clock)
                return self._step_from(samples, B, clock)
            except StepInterrupted as interrupted:
                # Nothing of this step was recorded or released (the ledger records after the
                # selection and the noise): restore the lost actors and redo it from its sample.
                attempts += 1
                if attempts > limit:
                    again = f"again while step {self.step_count + 1} was redone ({limit} restart(s) tried)" if lost \
                        else f"in step {self.step_count + 1} (cluster.max_actor_restarts = 0)"
                    raise ShardLostError(f"{interrupted}; an actor died {again}") from interrupted
                lost = interrupted

    def _sample(self, clock: PhaseClock) -> tuple[list, int]:
        """(each trainer's part of this step's Poisson sample, its size B)."""
        if self.partitioned:  # each trainer's Poisson sample of its own parts: their union is the step's
            samples = self.sampler.sample()
            clock.mark("sample")
            return samples, sum(int(getattr(s, "examples", s).size) for s in samples)
        idx = self.sampler.sample()
        clock.mark("sample")
        assert self.trainer_bounds is not None  # set for every data set the coordinator samples
        return trainer_samples(idx, self.trainer_bounds, self.example_units, self.unit_bounds,
                               self.num_trainers), int(idx.size)

    def _recover(self, lost: StepInterrupted) -> None:
        """Restore every lost shard and trainer actor, forget the step's partial state."""
        step = self.step_count + 1
        shards = self.shards.restore_lost(f"step {step}")
        trainers = self.trainers.restore_lost()
        self.shards.broadcast("discard_step")
        self.step_restarts += 1
        log.warning("step %d: %s; restored shard(s) %s and trainer(s) %s, redoing the step", step, lost,
                    shards or "none", trainers or "none")

    def _step_from(self, samples: list, B: int, clock: PhaseClock) -> StepStats:
        dense_state = None
        if self.trainers.needs_dense_state:
            dense_state = {n: t.detach().clone() for n, t in self.model.state_dict().items()}
        select = self.selection.shard_selects()
        parts = self._trainer_parts(samples, dense_state, clock, select)
        dense_grads = parts[0].dense_sum
        for part in parts[1:]:  # an empty dense_sum: the trainers reduced it to trainer 0's already
            dense_grads = {n: dense_grads[n] + g for n, g in part.dense_sum.items()} if part.dense_sum else dense_grads
        rows = self._reduced_row_sums(parts)
        clock.mark("row_sums")
        dense_part = rows.subset(np.isin(rows.tables, self.dense_tables))
        fused = parts[0].row_sums if select is not None else None  # per shard: (..., selection part, touched)
        selection = self.selection.select(rows, [s[3] for s in fused] if fused is not None else None)
        selected, delta_rows = self.selection.restrict(rows, selection)
        clock.mark("selection")
        noisy = self.noise.noise(delta_rows, dense_grads, torch.from_numpy(dense_part.grads))
        clock.mark("clip_and_noise")
        self._record(selection, noisy)  # ledger first: a crash after this can only over-count
        clock.mark("ledger")
        lr, mix_gap = self.lr_scale * self.noise.lr_multiplier(), self.noise.mix_gap(noisy)
        release_rows(self.shards, self.layout, selected, delta_rows.float() if noisy is None else noisy.rows, lr,
                     self.step_count + 1, self.dense_tables)
        if noisy is not None:
            release_dense_tables(self.shards, self.layout, self.dense_tables, noisy.shard_rows, noisy.std, dense_part,
                                 self.step_count, self.dpsgd_noise_key, lr,
                                 None if mix_gap is None else (self.mix_key, mix_gap))
        clock.mark("write_back")
        self.dense.step(noisy.dense if noisy is not None else dense_grads, lr, self.step_count, mix_gap)
        clock.mark("dense_update")
        self.step_count += 1
        # ε of the ledger as it is now, computed only if someone reads `StepStats.epsilon`.
        spent = self.ledger.epsilon_snapshot() if noisy is not None and self.ledger is not None else 0.0
        losses = torch.cat([part.losses for part in parts])
        touched = sum(s[4] for s in fused) if fused is not None else int(rows.global_ids.size)
        return StepStats(self.step_count, B, float(losses.mean()) if B else float("nan"), touched,
                         int(selected.size) + self.dense_table_rows, spent, clock.phases,
                         tuple(part.cpu_seconds for part in parts), self.noise.step_clip,
                         self.noise.clip_event is not None)

    def _trainer_parts(self, samples: list, dense_state: Optional[dict], clock: PhaseClock,
                       select: Optional[list] = None) -> list[TrainerPart]:
        """Every trainer's share of the step (trainer/engine/trainer_role.py): lookup, dense
        forward/backward, clip factors, clipped row sums (left at the shards when N > 1 or on
        Ray) and the dense clipped sum. In-process the trainers' phases add up; on Ray they
        overlap, so the slowest trainer's phases count and the rest of the wait is "trainers"."""
        parts = self.trainers.parts(samples, dense_state, select, self.noise.chooser())
        if isinstance(self.trainers, InProcessTrainers):
            for part in parts:
                clock.absorb(part.phases)
        else:
            names = {n for part in parts for n in part.phases}
            clock.absorb({n: max(part.phases.get(n, 0.0) for part in parts) for n in names})
            clock.mark("trainers")
        return parts

    def _reduced_row_sums(self, parts: list[TrainerPart]) -> RowSums:
        """G restricted to the touched rows: Σ_j clipped row gradients / b, from every shard
        (with N > 1 trainers or trainers on Ray, each shard's sum over the trainers' parts it
        reduced; else the shards' answer to the one trainer)."""
        if parts[0].row_sums is not None:
            sums = parts[0].row_sums
        else:
            sums = self.shards.call("reduced_row_sums", [() for _ in range(self.layout.num_shards)])
        tables = np.concatenate([s[0] for s in sums])
        row_ids = np.concatenate([s[1] for s in sums])
        grads = np.concatenate([s[2] for s in sums]).astype(np.float64) / self.b
        return RowSums(tables, row_ids, grads, self.table_offsets[tables] + row_ids)

    def _record(self, selection: Optional[Selection], noisy) -> None:
        """Compose the step's event from the events the mechanisms returned, check it is the one
        budgeted, record and persist it — before anything is released."""
        if noisy is None:
            return
        ran = sampled_step_event(self.q, self.noise.ran_event(noisy.event),
                                 None if selection is None else selection.event)
        self.budget.record_step(ran)

    # ---- evaluation, state, placement -----------------------------------------------------------------------
    def evaluate(self, dataset, batch_size: int, averaged: Optional[bool] = None) -> dict:
        """The model's metrics on `dataset` (trainer/engine/evaluation.py)."""
        return evaluation.evaluate(self, dataset, batch_size, averaged)

    def outputs(self, dataset, batch_size: int, averaged: Optional[bool] = None):
        """(model outputs, labels) over `dataset` with the released parameters."""
        return evaluation.outputs(self, dataset, batch_size, averaged)

    def store_pending_noise(self) -> None:
        """DP-SGD: every row of every shard with lazy noise receives its pending noise, in a
        logged state-changing round (an evaluation or a saved state reads the rows as released,
        and what it reports must agree with every later read: trainer/engine/shard_update.py);
        shards with eager noise answer 0. Nothing in the other modes."""
        if self.mode == "dpsgd":
            self.shards.broadcast("flush_pending")

    def state_dict(self) -> dict:
        """Everything a resumed run needs (trainer/engine/checkpoint.py)."""
        return checkpoint.engine_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint (trainer/engine/checkpoint.py)."""
        checkpoint.load_engine_state(self, state)

    def shard_traffic(self) -> tuple[int, int]:
        """(bytes sent to, received from) the shards so far by the coordinator and the trainers
        (payload arrays, as `ShardGroup` counts them)."""
        to, back = self.shards.bytes_to_shards, self.shards.bytes_from_shards
        if not isinstance(self.trainers, InProcessTrainers):  # in-process trainers use self.shards
            for t, b in self.trainers.shard_bytes():
                to, back = to + t, back + b
        return int(to), int(back)

    def shutdown(self) -> None:
        """Stop the trainer and shard actors (nothing to do in-process)."""
        self.trainers.shutdown()
        self.shards.shutdown()
