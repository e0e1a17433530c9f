"""The coordinator: one step of seed Algorithm 3 (at row granularity) over sharded tables.

Privacy assumption: add/remove-one neighbouring datasets, Poisson sampling at rate q = b/n,
sums normalized by the expected batch size b (docs/DESIGN.md §1). One step (docs/DESIGN.md §2):
  sample → route ids → shards: partial pooled embeddings of their bags → coordinator: dense
  forward/backward (dense per-example norms by ghost norms, trainer/dense_grads.py) → per-example
  squared norms over unique rows (from the ids and pooled-output gradients, trainer/example_norms.py;
  or on the shards) → clip factors min(1, S1/‖g_j‖) over embeddings + dense → shards: clipped
  row sums → selection over the whole vocabulary → S2 clip
  → Gaussian noise on selected rows and dense params → ledger.record(event) → release: (ids,
  noisy rows) of selected rows to the shards, dense optimizer step.
Modes: `nonprivate` (no clip/noise, touched rows updated), `dpsgd` (every row and dense param
noised), `sparse` (the above with a selector). In `sparse` mode a public per-table policy
(trainer/table_policy.py) may make some tables dense: their rows are noised and updated every
step as in `dpsgd` (same noise stream, so an all-dense sparse engine equals `dpsgd`), and the
selection runs over the rows of the other tables only.

User level (`example_units` given; privacy.unit = "user"): the neighbouring relation is
add/remove one unit (user) with all of its examples. The sampler samples units (Poisson at rate
q = b/U, at most a public number of examples each: trainer/data/sampler.py
`UnitPoissonSampler`), b is the expected number of units per step, and every per-example
quantity of the step above becomes per unit: the clip factor c_u = min(1, S1/‖Σ_{j∈u} g_j‖)
(norms of the unit's summed gradient: `EmbeddingShard.unit_sq_norms` and
`DenseGradients.group_sq_norms`), the selectors' contribution weights and counts (distinct
(unit, row) pairs), DP-STAT's counts and DP-FEST's one-time counts (a unit's first L distinct
rows over all its examples). Σ_j c_{u(j)} g_j is then the sum of the units' clipped gradients,
so each unit moves G by at most S1 and the step's events are unchanged with n = U.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from widedp.accounting import PrivacyLedger
from widedp.accounting import events as ev
from widedp.accounting.calibration import sampled_step_event
from widedp.selection import NoisyStep, noisy_step
from widedp.selection._sparse import unique_ints
from widedp.selection.registry import SelectionContext, Selector, get_selector, is_selector
from widedp.selection.result import Selection
from widedp.trainer.adaptive_clip import AdaptiveClip
from widedp.trainer.dense_grads import DenseGradients, dense_gradients
from widedp.trainer.layout import ShardLayout, row_block_uniform
from widedp.trainer.modelmix import mix
from widedp.trainer.models import DenseModel
from widedp.trainer.randomness import PrivacyRandomness
from widedp.trainer.shard import ShardSelect
from widedp.trainer.shard_group import ShardLostError, StepInterrupted
from widedp.trainer.step_noise import step_noise_event
from widedp.trainer.table_policy import SparseVocabulary
from widedp.trainer.trainer_group import InProcessTrainers, RayTrainers, TrainerGroup
from widedp.trainer.trainer_role import (PhaseClock, TrainerOptions, TrainerPart, TrainerRole, UnitSample,
                                         example_global_rows, pooled_lookup, rows_by_unit)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PrivacyPlan:
    """Everything the step needs to know about privacy, fixed before training starts."""

    noise_multiplier: float  # σ of the gradient noise (std = σ · sensitivity)
    clip_norm: Optional[float]  # S1 (None: chosen each step by `adaptive_clip`)
    second_clip_norm: Optional[float]  # S2
    selection: str  # a registered selector's name (selection.registry), or "none" (DP-SGD)
    selection_params: Any = None  # that selector's Params (None for "none")
    adaptive_clip: Optional[AdaptiveClip] = None  # privacy.clip_norm = "adaptive" (trainer/adaptive_clip.py)
    mix_width: float = 0.0  # train.modelmix: the enforced gap in update sensitivities (0: no mixing)
    mix_coordinates: int = 1  # ModelMix's refined clipping k: each clipped coordinate clamped to S1/√k

    def __post_init__(self):
        if (self.clip_norm is None) == (self.adaptive_clip is None):
            raise ValueError("a privacy plan has either a fixed clip_norm or an adaptive_clip, not both or neither")
        if self.mix_coordinates != 1 and (self.mix_width <= 0 or self.second_clip_norm is not None):
            raise ValueError("refined clipping (mix_coordinates > 1) needs ModelMix (mix_width > 0) and no second clip")

    @property
    def selector(self) -> Optional[Selector]:
        return get_selector(self.selection) if is_selector(self.selection) else None

    def noise_event(self, clip_event: Optional[ev.DpEvent] = None) -> ev.DpEvent:
        """The step's noise event (trainer/step_noise.py); `clip_event`: the DP-STAT that ran
        (default: the planned one)."""
        if self.adaptive_clip is not None and clip_event is None:
            clip_event = self.adaptive_clip.event
        return step_noise_event(self.noise_multiplier, clip_event, self.mix_width, self.mix_coordinates)


@dataclasses.dataclass
class StepStats:
    step: int
    batch_size: int
    loss: float
    rows_touched: int
    rows_selected: int
    # ε spent after this step, or a function computing it (`PrivacyLedger.epsilon_snapshot`: the
    # ledger as it was after this step): read `epsilon`, computed on first read only — an
    # accountant call costs up to ~1 s (PLD), so only the steps whose ε is shown pay for it.
    spent: Union[float, Callable[[], float]]
    phases: dict = dataclasses.field(default_factory=dict)  # seconds per phase of this step
    trainer_cpu_s: tuple = ()  # CPU seconds of each trainer's share of this step (its own process)
    clip_norm: Optional[float] = None  # this step's S1
    adaptive_clip: bool = False  # S1 was DP-STAT's choice (privacy.clip_norm = "adaptive")

    @property
    def epsilon(self) -> float:
        """ε spent after this step (exact: the run's accountant on the ledger after this step)."""
        if callable(self.spent):
            self.spent = float(self.spent())
        return self.spent

    @property
    def epsilon_if_computed(self) -> Optional[float]:
        """`epsilon` if it was already computed (or given), else None — never computes it."""
        return None if callable(self.spent) else self.spent


@dataclasses.dataclass(frozen=True)
class RowSums:
    """G on the touched rows: table index, row id within the table, clipped sum / b, global id."""

    tables: np.ndarray
    row_ids: np.ndarray
    grads: np.ndarray  # float64 [m, D]
    global_ids: np.ndarray

    def subset(self, mask: np.ndarray) -> "RowSums":
        return RowSums(self.tables[mask], self.row_ids[mask], self.grads[mask], self.global_ids[mask])


class Engine:
    def __init__(self, model: DenseModel, layout: ShardLayout, shards, train_set, sampler, *, mode: str,
                 expected_batch_size: float, sample_rate: float, plan: Optional[PrivacyPlan], ledger: Optional[PrivacyLedger],
                 target_epsilon: float, dense_optimizer: torch.optim.Optimizer,
                 randomness: Optional[PrivacyRandomness] = None, secure_mode: bool = False,
                 persist_ledger: Optional[Callable[[PrivacyLedger], None]] = None,
                 dense_tables: tuple[int, ...] = (), ema_decay: float = 0.0, dense_grad_method: str = "auto",
                 num_trainers: int = 1, selection_on_shards: bool = False, trainer_actors: bool = False,
                 cpus_per_trainer: float = 1.0, fuse_selection: bool = True, norms_on_trainer: bool = True,
                 example_units: Optional[np.ndarray] = None, group_size: int = 1):
        """`dense_tables`: in `sparse` mode, the indices of the tables noised densely every step
        (trainer/table_policy.py); `dpsgd` noises every table, `nonprivate` none. `ema_decay`
        β > 0: evaluate (and checkpoint for export) the exponential moving average of the
        iterates, ema_t = β·ema_{t-1} + (1-β)·w_t — post-processing of the released iterates,
        free in privacy. The shards must be built with the same β (they average the tables).
        `num_trainers` N: the data-parallel split of docs/DESIGN.md §2.2, run in this process.
        Trainer i owns examples [⌊i·n/N⌋, ⌊(i+1)·n/N⌋) and takes its part of each step's Poisson
        sample (one sampler, so the union is the global sample exactly); it does the lookup,
        the dense part and the clip factors of its own examples, its clipped row sums are
        reduced at the shards that own the rows, and the dense clipped sums are added here.
        `selection_on_shards`: a selector that can (`Selector.shard_statistic`) selects on the
        shards, each over its own rows with its own stream, merged here (the same distribution
        as the selection over the whole vocabulary here, which is the reference path). With one
        trainer and `fuse_selection`, each shard selects in the call that makes its row sums
        and returns only the rows the step can use (`_shard_selects`); otherwise in a call of
        its own after them (the reference for the fused call). `norms_on_trainer`: each trainer
        computes its examples' embedding-gradient norms from the ids and pooled-output gradients
        (trainer/example_norms.py) and sends the pooled gradients with the clip factors; else the
        shards compute them in a round of their own (the reference; user level always).
        `trainer_actors`: the N trainers run as Ray actors (trainer/trainer_group.py,
        `cpus_per_trainer` CPUs each) that call the shard actors directly — the shards must be
        a RayShardGroup; otherwise they run here, one after another.
        `example_units`: user level (module docstring) — the dense unit index 0..U-1 of every
        training example (trainer/data/sampler.py `unit_indices`); the sampler must sample
        those units (`UnitPoissonSampler`), `expected_batch_size` and `sample_rate` are in units,
        and trainer i owns units [⌊i·U/N⌋, ⌊(i+1)·U/N⌋) with all their examples.
        `group_size` k > 1: user-level DP by example sampling (privacy.user_sampling =
        "examples"): the training set holds at most k examples per user and the step is the
        example-level one, but every event charged is accounted for a group of k
        (`accounted`: `GroupDpEvent`)."""
        self.model, self.layout, self.shards = model, layout, shards
        self.dense_grad_method = dense_grad_method  # trainer/dense_grads.py: auto, ghost or per_example
        self.train_set, self.sampler = train_set, sampler
        self.mode, self.b, self.q = mode, float(expected_batch_size), float(sample_rate)
        self.plan, self.ledger, self.target_epsilon = plan, ledger, target_epsilon
        # The run's planned number of steps (train.steps), if the driver told (`plan_steps`):
        # what the budget check certifies at once (`would_exceed_budget`).
        self.planned_steps: Optional[int] = None
        self._budget_limit: Optional[int] = None  # step_count past which certifying found no room
        # If set, called with the ledger after each charge, before the release it pays for (`widedp
        # train`: ledger.json and the run's journal, trainer/run_records.py `LedgerStore`).
        self.persist_ledger = persist_ledger
        self.dense_optimizer = dense_optimizer
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
        if group_size > 1 and example_units is not None:
            raise ValueError("group_size > 1 accounts example-level steps for groups: not with example_units")
        self.group_size = group_size
        self._dense_base_lrs = [group["lr"] for group in dense_optimizer.param_groups]
        # This step's learning rates are the configured ones times lr_scale (set by the run loop
        # from train.lr_schedule: a function of the step count only, so public).
        self.lr_scale = 1.0
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        self.ema_decay = float(ema_decay)
        self.dense_ema: Optional[dict] = (
            {n: p.detach().clone() for n, p in model.named_parameters()} if self.ema_decay > 0 else None)
        self.secure_mode = secure_mode
        # Secret by default (trainer/randomness.py): a caller that passes nothing gets fresh OS entropy.
        self.randomness = PrivacyRandomness.fresh(secure=secure_mode) if randomness is None else randomness
        if secure_mode and self.randomness.reproducible:
            raise ValueError("privacy.secure_mode needs secret randomness: unset privacy.reproducible")
        if secure_mode and not self.randomness.secure:
            raise ValueError("privacy.secure_mode needs cryptographic generators: PrivacyRandomness.fresh(secure=True)")
        self.selection_rng = self.randomness.selection_rng()
        self.noise_gen = self.randomness.noise_generator()
        self.dpsgd_noise_key = self.randomness.dpsgd_noise_key()
        self.shard_selection_key = self.randomness.shard_selection_key()
        self.clip_rng = self.randomness.clip_rng()
        self.mix_key = self.randomness.mix_key()  # ModelMix's α (train.modelmix; trainer/modelmix.py)
        self._mix_previous: Optional[dict] = None  # ModelMix: the dense parameters' θ_{t-2}
        if plan is not None and plan.mix_width > 0 and mode != "dpsgd":
            raise ValueError(f"ModelMix needs mode 'dpsgd' (every coordinate mixed), got {mode!r}")
        # This step's S1: the plan's, or DP-STAT's choice and event (privacy.clip_norm = "adaptive").
        self.step_clip: Optional[float] = plan.clip_norm if plan is not None else None
        self._clip_event: Optional[ev.DpEvent] = None
        self.selection_on_shards = bool(selection_on_shards)
        self.fuse_selection = bool(fuse_selection)
        self.norms_on_trainer = bool(norms_on_trainer)
        self._keep_rows: Optional[tuple] = None  # (fixed rows it was made from, per-shard global ids)
        self.step_count = 0
        self.recalibrated_at: Optional[int] = None  # the step after which train.recalibrate last ran
        # the logit layer before that recalibration folded (a, b) into it (trainer/recalibration.py)
        self.pre_recalibration: Optional[dict] = None
        self.table_offsets = layout.table_offsets
        all_tables = tuple(range(len(layout.tables)))
        if any(t not in all_tables for t in dense_tables):
            raise ValueError(f"dense_tables {tuple(dense_tables)} must be table indices in {all_tables}")
        self.dense_tables = {"dpsgd": all_tables, "nonprivate": ()}.get(mode, tuple(sorted(set(dense_tables))))
        self.dense_table_rows = sum(layout.tables[t].num_rows for t in self.dense_tables)
        self.sparse_vocabulary = SparseVocabulary(np.array([t.num_rows for t in layout.tables]), self.dense_tables)
        # A step selects privately only when some table is sparse (no sparse table: DP-SGD).
        self.selects = mode == "sparse" and self.sparse_vocabulary.num_rows > 0
        self.fixed_rows: Optional[np.ndarray] = None  # DP-FEST's one-time selection (compact sparse ids)
        if isinstance(num_trainers, bool) or not isinstance(num_trainers, int) or num_trainers < 1:
            raise ValueError(f"num_trainers must be an integer >= 1, got {num_trainers!r}")
        self.num_trainers = num_trainers
        n = len(train_set)
        self.trainer_bounds = np.array([(i * n) // num_trainers for i in range(num_trainers + 1)], dtype=np.int64)
        self.example_units: Optional[np.ndarray] = None
        self.num_units = n  # example level: every example is its own unit
        if example_units is not None:
            units = np.asarray(example_units)
            if units.shape != (n,) or not np.issubdtype(units.dtype, np.integer) or (n and units.min() < 0):
                raise ValueError(f"example_units must hold a unit index >= 0 for each of the {n} training examples")
            if plan is not None and plan.mix_coordinates > 1:
                raise ValueError("refined clipping (privacy.mix_coordinates > 1) clamps each example's coordinates: "
                                 "it has no user-level form (privacy.unit = \"user\")")
            self.example_units = units.astype(np.int64)
            self.num_units = int(units.max()) + 1 if n else 0
            U = self.num_units
            self.unit_bounds = np.array([(i * U) // num_trainers for i in range(num_trainers + 1)], dtype=np.int64)
        self._event = self._step_event()
        self.trainers = self._make_trainers(trainer_actors, cpus_per_trainer)
        self.step_restarts = 0  # steps redone after a lost actor (trainer actors)

    @property
    def private_plan(self) -> PrivacyPlan:
        """The plan of a private run; the private phases only run when there is one."""
        if self.plan is None:
            raise RuntimeError("a private step phase ran without a privacy plan (mode nonprivate)")
        return self.plan

    # ---- privacy events ----------------------------------------------------------------------
    def _selection_event(self) -> Optional[ev.DpEvent]:
        """The per-step selection event: the registered selector's `event(params)`."""
        return get_selector(self.private_plan.selection).event(self.private_plan.selection_params)

    def _step_event(self) -> Optional[ev.DpEvent]:
        if self.mode == "nonprivate":
            return None
        sel = self._selection_event() if self.selects else None
        return self.accounted(sampled_step_event(self.q, self.private_plan.noise_event(), sel))

    def accounted(self, event: ev.DpEvent) -> ev.DpEvent:
        """`event` as this run charges it: for a group of `group_size` examples (k > 1), else itself."""
        return ev.grouped(event, self.group_size)

    @property
    def step_event(self) -> Optional[ev.DpEvent]:
        return self._event

    def needs_one_time_selection(self) -> bool:
        """Whether the plan's selector selects once before training (DP-FEST)."""
        sel = self.plan.selector if self.plan is not None and self.selects else None
        return sel is not None and sel.one_time_event(self.private_plan.selection_params) is not None

    def prepare_fest(self, feature_rows: Callable[[str], tuple[np.ndarray, np.ndarray]]) -> None:
        """A one-time selection (DP-FEST): charge the selector's one-time event, then fix the
        trainable rows for all steps (over the sparse tables' rows, as compact ids)."""
        p = self.private_plan
        selector = get_selector(p.selection)
        event = selector.one_time_event(p.selection_params)
        if event is None:
            raise ValueError(f"selection {p.selection!r} has no one-time selection")
        n = len(self.train_set)
        # One example's global rows across all features: concatenate per-feature jagged rows
        # (at user level then regrouped per unit: each unit counts its first L distinct rows).
        per_feature = [(f, *feature_rows(f.name)) for f in self.layout.features]
        lengths = sum(np.diff(off) for _, off, _ in per_feature)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = np.empty(offsets[-1], dtype=np.int64)
        cursor = offsets[:-1].copy()
        for f, off, vals in per_feature:
            t = self.layout.table_index(f.table)
            counts = np.diff(off)
            example = np.repeat(np.arange(n), counts)
            within = np.arange(vals.size) - np.repeat(off[:-1], counts)
            ids[cursor[example] + within] = vals + self.table_offsets[t]
            cursor += counts
        if self.example_units is not None:
            offsets, ids = rows_by_unit(offsets, ids, self.example_units, self.num_units)
        offsets, compact = self.sparse_vocabulary.restrict(offsets, ids)  # only the sparse tables' rows compete
        self.charge(event)  # before the selection is used
        sel = selector.one_time_select(offsets, compact, self.sparse_vocabulary.num_rows, p.selection_params,
                                       self.selection_rng)
        if sel.event != event:
            raise RuntimeError(f"the one-time selection ran {sel.event!r} but {event!r} was charged")
        self.fixed_rows = sel.ids

    def charge(self, event: ev.DpEvent, whole_unit: bool = False) -> None:
        """Record a one-time event (DP-FEST, a private vocabulary) and persist the ledger,
        before anything that depends on that mechanism's output is used. `whole_unit`: the
        event already bounds a whole user (per-user data statistics): charged as it is, not
        for a group (`accounted`)."""
        if self.ledger is None:
            raise RuntimeError("charge() needs a privacy ledger (a nonprivate run has none)")
        self.ledger.record(event if whole_unit else self.accounted(event))
        if self.persist_ledger is not None:
            self.persist_ledger(self.ledger)

    # ---- one step ---------------------------------------------------------------------------------
    def plan_steps(self, total_steps: int) -> None:
        """Tell the budget check the run's planned number of steps (train.steps, counted from
        step 0 as `step_count` is): it then certifies the remaining steps in one accountant call
        (`would_exceed_budget`). Optional: without it the check certifies in growing chunks."""
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
            raise ValueError(f"total_steps must be an integer >= 0, got {total_steps!r}")
        self.planned_steps = total_steps

    #: Without `plan_steps`: the least number of steps certified at once.
    BUDGET_CHUNK = 64

    def would_exceed_budget(self) -> bool:
        """Whether one more step would spend past the target ε (then the step is not taken).

        The ledger answers for free while a certificate covers the step (accounting/ledger.py:
        ε(ledger + n steps) ≤ target computed once covers each of those n steps, as ε only
        grows with composition). Without one, this certifies the steps still planned
        (`plan_steps`; else a chunk of max(BUDGET_CHUNK, step_count) steps), or as many of them
        as fit (bisection, ~log2 n accountant calls), so a run costs a few accountant calls in
        all instead of one per step; when not even one more step fits, the ledger computes the
        answer as before (raising the accountant's error, if its bound does not hold)."""
        event, ledger = self._event, self.ledger
        if event is None or ledger is None:
            return False
        if ledger.certified(event, self.target_epsilon):
            return False
        if self._budget_limit is None or self.step_count < self._budget_limit:
            if self.planned_steps is not None and self.planned_steps > self.step_count:
                wanted = self.planned_steps - self.step_count
            else:
                wanted = max(self.BUDGET_CHUNK, self.step_count)
            fits = ledger.certify_most(event, wanted, self.target_epsilon)
            if fits < wanted:  # a hint only (the ledger decides below): no need to search again there
                self._budget_limit = self.step_count + fits
            if fits > 0:
                return False
        return ledger.would_exceed(event, self.target_epsilon)

    def dense_gradients(self, pooled: torch.Tensor, dense: torch.Tensor, labels: torch.Tensor) -> DenseGradients:
        """Pass 1 of the dense part (trainer/dense_grads.py): per-example losses, pooled-output
        gradients [B,F,D] and squared dense-gradient norms; `clipped_sum(factors)` is pass 2."""
        return dense_gradients(self.model, pooled, dense, labels, self.dense_grad_method)

    def step(self) -> Optional[StepStats]:
        """One step of docs/DESIGN.md §2; None (and nothing spent) if it would exceed the target ε.

        The ledger records the event composed from what the selector and the noise step
        *returned*; it must equal the event budgeted in advance (`step_event`)."""
        try:
            return self._step()
        except ShardLostError as err:
            raise ShardLostError(f"step {self.step_count + 1}: {err}") from err

    def _step(self) -> Optional[StepStats]:
        if self.would_exceed_budget():
            return None
        clock = PhaseClock()
        idx = self.sampler.sample()
        B = int(idx.size)
        clock.mark("sample")
        samples = self._trainer_samples(idx)
        limit = getattr(self.shards, "max_restarts", 0)
        attempts, lost = 0, None
        while True:
            try:
                if lost is not None:
                    self._recover(lost)
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

    def _recover(self, lost: StepInterrupted) -> None:
        """Restore every lost shard and trainer actor, forget the step's partial state."""
        step = self.step_count + 1
        shards = self.shards.restore_lost(f"step {step}")
        trainers = self.trainers.restore_lost() if isinstance(self.trainers, RayTrainers) else []
        self.shards.broadcast("discard_step")
        self.step_restarts += 1
        log.warning("step %d: %s; restored shard(s) %s and trainer(s) %s, redoing the step", step, lost,
                    shards or "none", trainers or "none")

    def _step_from(self, samples: list, B: int, clock: PhaseClock) -> StepStats:
        dense_state = None
        if self.trainers.needs_dense_state:
            dense_state = {n: t.detach().clone() for n, t in self.model.state_dict().items()}
        select = self._shard_selects()
        parts = self._trainer_parts(samples, dense_state, clock, select, self._clip_chooser())
        dense_grads = parts[0].dense_sum
        for part in parts[1:]:
            dense_grads = {n: dense_grads[n] + g for n, g in part.dense_sum.items()}
        rows = self._reduced_row_sums(parts)
        clock.mark("row_sums")
        dense_part = rows.subset(np.isin(rows.tables, self.dense_tables))
        fused = parts[0].row_sums if select is not None else None  # per shard: (..., selection part, touched)
        selection = self._select(rows, [s[3] for s in fused] if fused is not None else None)
        selected, delta_rows = self._restrict_to_selection(rows, selection)
        clock.mark("selection")
        noisy = self._clip_and_noise(delta_rows, dense_grads, torch.from_numpy(dense_part.grads))
        clock.mark("clip_and_noise")
        self._record(selection, noisy)  # ledger first: a crash after this can only over-count
        clock.mark("ledger")
        if noisy is None:  # nonprivate: the touched rows, unclipped and un-noised
            self._release_rows(selected, delta_rows.float())
        else:
            self._release_rows(selected, noisy.rows)
            self._release_dense_tables(noisy.shard_rows, noisy.std, dense_part, self._mix_gap(noisy))
        clock.mark("write_back")
        self._dense_update(noisy.dense if noisy is not None else dense_grads, self._mix_gap(noisy))
        clock.mark("dense_update")
        self.step_count += 1
        # ε of the ledger as it is now, computed only if someone reads `StepStats.epsilon`.
        spent = self.ledger.epsilon_snapshot() if noisy is not None and self.ledger is not None else 0.0
        losses = torch.cat([part.losses for part in parts])
        touched = sum(s[4] for s in fused) if fused is not None else int(rows.global_ids.size)
        return StepStats(self.step_count, B, float(losses.mean()) if B else float("nan"), touched,
                         int(selected.size) + self.dense_table_rows, spent, clock.phases,
                         tuple(part.cpu_seconds for part in parts), self.step_clip, self._clip_event is not None)

    # ---- the phases of one step ---------------------------------------------------------------------
    def _make_trainers(self, actors: bool, cpus_per_trainer: float) -> TrainerGroup:
        p = self.plan
        selector = get_selector(p.selection) if p is not None and self.selects else None
        counts_on_shards = self.selection_on_shards and selector is not None and selector.shard_statistic == "counts"
        options = TrainerOptions(
            mode=self.mode, clip_norm=p.clip_norm if p is not None and self.mode != "nonprivate" else None,
            expected_batch_size=self.b, num_trainers=self.num_trainers,
            # refined clipping clamps every per-example coordinate: the per-example reference has them
            dense_grad_method="per_example" if p is not None and p.mix_coordinates > 1 else self.dense_grad_method,
            coordinate_clip=p.mix_coordinates if p is not None else 1,
            reduce_at_shards=self.num_trainers > 1 or actors,
            contribution_clip=p.selection_params.contribution_clip if counts_on_shards and p is not None else None,
            dense_tables=self.dense_tables, norms_on_trainer=self.norms_on_trainer)
        if actors:
            if not hasattr(self.shards, "actors"):
                raise ValueError("trainer actors need the shards on Ray (cluster.backend = \"ray\")")
            self.shards.direct_callers = True
            return RayTrainers(self.model, self.layout, self.train_set, self.shards, options,
                               cpus_per_trainer=cpus_per_trainer)
        return InProcessTrainers([TrainerRole(i, self.model, self.layout, self.train_set, self.shards, options)
                                  for i in range(self.num_trainers)])

    def _trainer_samples(self, idx: np.ndarray) -> list:
        """Each trainer's part of the step's sample (sorted dataset indices in its partition);
        at user level a `UnitSample` per trainer (its units' examples, units numbered within)."""
        if self.example_units is None:
            cut = np.searchsorted(idx, self.trainer_bounds)
            return [idx[cut[i]: cut[i + 1]] for i in range(self.num_trainers)]
        units = self.example_units[idx]
        owner = np.searchsorted(self.unit_bounds, units, side="right") - 1
        samples = []
        for i in range(self.num_trainers):
            mine = owner == i
            uniq, local = np.unique(units[mine], return_inverse=True)
            samples.append(UnitSample(idx[mine], local.astype(np.int64).reshape(-1), int(uniq.size)))
        return samples

    def _shard_selects(self) -> Optional[list]:
        """Per shard, the `ShardSelect` of this step when the selection runs in the row-sum
        call (one trainer, a selector with a shard statistic, `fuse_selection`); else None.
        `keep_rows`: the shard's DP-FEST fixed rows (global flat ids), which are selected here
        whatever the shards pick, so their sums must come back too."""
        if not (self.fuse_selection and self.selects and self.selection_on_shards and self.num_trainers == 1):
            return None
        p = self.private_plan
        if get_selector(p.selection).shard_statistic is None:
            return None
        if self._keep_rows is None or self._keep_rows[0] is not self.fixed_rows:
            per_shard = [np.empty(0, np.int64)] * self.layout.num_shards
            if self.fixed_rows is not None:
                flat = self.sparse_vocabulary.to_global(self.fixed_rows)
                t = np.searchsorted(self.table_offsets, flat, side="right") - 1
                owner = self.layout.owner(t, flat - self.table_offsets[t])
                per_shard = [np.sort(flat[owner == s]) for s in range(self.layout.num_shards)]
            self._keep_rows = (self.fixed_rows, per_shard)
        return [ShardSelect(p.selection, p.selection_params, tuple(self.dense_tables), self.shard_selection_key,
                            self.step_count, p.clip_norm, self.b, keep)  # adaptive S1: set when chosen
                for keep in self._keep_rows[1]]

    def _clip_chooser(self) -> Optional["_DpStatChooser"]:
        """This step's DP-STAT (privacy.clip_norm = "adaptive"), else None (S1 fixed)."""
        plan = self.plan
        if plan is None or plan.adaptive_clip is None:
            return None
        return _DpStatChooser(self, plan.adaptive_clip)

    def _trainer_parts(self, samples: list, dense_state: Optional[dict], clock: PhaseClock,
                       select: Optional[list] = None, chooser: Optional["_DpStatChooser"] = None) -> list[TrainerPart]:
        """Every trainer's share of the step (trainer/trainer_role.py): lookup, dense
        forward/backward, clip factors, clipped row sums (left at the shards when N > 1 or on
        Ray) and the dense clipped sum. In-process the trainers' phases add up; on Ray they
        overlap, so the slowest trainer's phases count and the rest of the wait is "trainers"."""
        parts = self.trainers.parts(samples, dense_state, select, chooser)
        if isinstance(self.trainers, InProcessTrainers):
            for part in parts:
                clock.absorb(part.phases)
        else:
            names = {n for part in parts for n in part.phases}
            clock.absorb({n: max(part.phases.get(n, 0.0) for part in parts) for n in names})
            clock.mark("trainers")
        return parts

    @property
    def _bags(self) -> dict[int, list]:
        """This step's ShardBags per shard, per in-process trainer (training lookups)."""
        assert isinstance(self.trainers, InProcessTrainers)
        return {role.index: role.bags for role in self.trainers.roles}

    def _lookup(self, batch, B: int, example_ids=None, averaged: bool = False) -> np.ndarray:
        """Pooled embeddings [B, F, D] from the coordinator (evaluation; the training lookups
        are the trainers')."""
        return pooled_lookup(self.layout, self.shards, batch, B, example_ids, averaged)[0]

    def _reduced_row_sums(self, parts: list[TrainerPart]) -> "RowSums":
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

    def _restrict_to_selection(self, rows: "RowSums", selection: Optional[Selection]):
        """(selected global ids sorted, Δ = G ⊙ M on them); no selection (DP-SGD, every table
        dense): no rows. The rows of dense tables are not here (`dense_part` of the step)."""
        if selection is None:
            return np.empty(0, np.int64), torch.zeros((0, self.layout.dim), dtype=torch.float64)
        selected = unique_ints(np.asarray(selection.ids, dtype=np.int64))
        delta = np.zeros((selected.size, self.layout.dim))
        if selected.size:  # SVT / thresholding may legitimately select nothing
            pos = np.searchsorted(selected, rows.global_ids)
            hit = (pos < selected.size) & (selected[np.minimum(pos, selected.size - 1)] == rows.global_ids)
            delta[pos[hit]] = rows.grads[hit]
        return selected, torch.from_numpy(delta)

    def _clip_and_noise(self, delta_rows: torch.Tensor, dense_grads: dict, dense_table_rows: torch.Tensor
                        ) -> Optional[NoisyStep]:
        """The audited Gaussian step (`selection.noisy_step`) over one vector: the selected rows
        (noised here), the dense parameters (noised here) and the touched rows of the dense
        tables (scaled here, noised on the shards with the same std); None in non-private mode."""
        if self.mode == "nonprivate":
            return None
        p = self.private_plan
        return noisy_step(delta_rows, dense_grads, p.noise_multiplier, self._clip(), self.b, p.second_clip_norm,
                          self.noise_gen, secure=self.secure_mode,
                          shard_noised=dense_table_rows if self.dense_tables else None)

    def _record(self, selection: Optional[Selection], noisy: Optional[NoisyStep]) -> None:
        """Compose the step's event from the events the mechanisms returned, check it is the one
        budgeted, record and persist it — before anything is released."""
        if noisy is None:
            return
        noise = self._ran_noise_event(noisy.event)
        ran = sampled_step_event(self.q, noise, None if selection is None else selection.event)
        if self.accounted(ran) != self._event:
            raise RuntimeError(f"the step ran {ran!r} but the budget was checked for {self._event!r}; "
                               "nothing was recorded or released")
        self.charge(ran)

    def _step_lr_scale(self) -> float:
        """This step's learning-rate multiplier: the schedule's, times S_ref/S1 when an adaptive
        S1 normalizes the update (privacy.adaptive_clip_lr_reference; public post-processing of
        DP-STAT's output), so the step moves as far as one at the reference S1 would."""
        p = self.plan
        if p is None or p.adaptive_clip is None or p.adaptive_clip.lr_reference is None:
            return self.lr_scale
        return self.lr_scale * p.adaptive_clip.lr_reference / self._clip()

    def _clip(self) -> float:
        """This step's S1 (private phases only)."""
        if self.step_clip is None:
            raise RuntimeError("a private step phase ran before this step's S1 was set")
        return self.step_clip

    def _ran_noise_event(self, gaussian: ev.DpEvent) -> ev.DpEvent:
        """The noise event this step ran: the Gaussian `noisy_step` returned (as ModelMix's
        with the gap the mixing enforced, train.modelmix), after this step's DP-STAT."""
        noise = gaussian
        if self.private_plan.mix_width > 0:
            assert isinstance(gaussian, ev.GaussianDpEvent)
            noise = step_noise_event(gaussian.noise_multiplier, None, self.private_plan.mix_width,
                                     self.private_plan.mix_coordinates)
        return noise if self._clip_event is None else ev.ComposedDpEvent([self._clip_event, noise])

    def _mix_gap(self, noisy: Optional[NoisyStep]) -> Optional[float]:
        """ModelMix's enforced gap in gradient units, w·S with S this step's ℓ2 sensitivity
        (noise std / σ); each block of parameters multiplies it by its learning rate. None:
        no mixing."""
        p = self.plan
        if noisy is None or p is None or p.mix_width <= 0:
            return None
        return p.mix_width * noisy.std / p.noise_multiplier

    def _dense_update(self, grads: dict, mix_gap: Optional[float] = None) -> None:
        for n, p in self.model.named_parameters():
            p.grad = grads[n].view_as(p).to(p.dtype)
        for group, base in zip(self.dense_optimizer.param_groups, self._dense_base_lrs):
            group["lr"] = base * self._step_lr_scale()
        if mix_gap is not None:
            self._mix_dense(mix_gap)
        self.dense_optimizer.step()
        self.dense_optimizer.zero_grad(set_to_none=True)
        if self.dense_ema is not None:
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    self.dense_ema[n].mul_(self.ema_decay).add_(p.detach(), alpha=1 - self.ema_decay)

    def _mix_dense(self, gradient_gap: float) -> None:
        """ModelMix on the dense parameters (trainer/modelmix.py): each parameter starts the
        update from the secret mix of its two latest states over a gap of lr·gradient_gap; α of
        parameter i at step t from the counter-based stream (mix key, "modelmix-dense", t, i)."""
        if not isinstance(self.dense_optimizer, torch.optim.SGD) or any(
                g.get("momentum", 0) or g.get("weight_decay", 0) for g in self.dense_optimizer.param_groups):
            raise ValueError("ModelMix needs plain SGD for the dense parameters (no momentum, no weight decay)")
        lr_of = {id(p): g["lr"] for g in self.dense_optimizer.param_groups for p in g["params"]}
        if self._mix_previous is None:  # θ_{t-2} = θ_{t-1} = θ_0 at the first step
            self._mix_previous = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        with torch.no_grad():
            for i, (n, p) in enumerate(self.model.named_parameters()):
                if not p.numel():
                    continue
                if id(p) not in lr_of:
                    raise ValueError(f"ModelMix: dense parameter {n!r} is not updated by the dense optimizer, "
                                     "so it would not be noised and mixed")
                alpha = row_block_uniform(self.mix_key, "modelmix-dense", self.step_count, i, 0, p.numel(), 1)
                current = p.detach().clone()
                p.copy_(mix(current, self._mix_previous[n], lr_of[id(p)] * gradient_gap, alpha.view_as(p)))
                self._mix_previous[n] = current

    def _release_dense_tables(self, values: Optional[torch.Tensor], std: float, part: "RowSums",
                              mix_gap: Optional[float] = None) -> None:
        """Dense tables (every table in DP-SGD): the clipped touched rows plus the noise std —
        each shard noises and updates every row it owns of those tables."""
        if not self.dense_tables:
            return
        assert values is not None
        update = values.numpy()
        owner = self.layout.owner(part.tables, part.row_ids)
        self.shards.defer("apply_dense_noise_update", [
            (self.step_count, self.dpsgd_noise_key, std, part.tables[owner == s], part.row_ids[owner == s],
             update[owner == s], self.dense_tables, self._step_lr_scale(),
             None if mix_gap is None else (self.mix_key, mix_gap))
            for s in range(self.layout.num_shards)])

    def _release_rows(self, selected: np.ndarray, update: torch.Tensor) -> None:
        """Send the update of the selected rows (global ids) to the shards that own them."""
        if self.dense_tables and not selected.size:
            return  # nothing selected: the dense-table release clears the shards' step cache
        values = update.numpy()
        t = np.searchsorted(self.table_offsets, selected, side="right") - 1
        local_ids = selected - self.table_offsets[t]
        owner = self.layout.owner(t, local_ids)
        self.shards.defer("apply_rows", [(t[owner == s], local_ids[owner == s], values[owner == s], self._step_lr_scale(),
                                         self.step_count + 1) for s in range(self.layout.num_shards)])

    # ---- selection ------------------------------------------------------------------------------
    def _select(self, rows: "RowSums", shard_parts: Optional[list] = None) -> Optional[Selection]:
        """The step's selection over every row of the sparse tables (its global ids and the
        event the selector returned). Non-private: every touched row, no event; no sparse table
        (DP-SGD): None. The selector sees the sparse tables' rows as one compact id space.
        `shard_parts`: the shards' parts of the selection, made with their row sums."""
        if self.mode == "nonprivate":
            return Selection(unique_ints(rows.global_ids), ev.NoOpDpEvent())
        if not self.selects:
            return None
        p, rng, vocab = self.private_plan, self.selection_rng, self.sparse_vocabulary
        if self.selection_on_shards and get_selector(p.selection).shard_statistic is not None:
            return self._select_on_shards(shard_parts)
        keep, touched = vocab.to_compact(rows.global_ids)
        context = SelectionContext(
            num_rows=vocab.num_rows, touched_ids=touched, row_norms=np.linalg.norm(rows.grads[keep], axis=1),
            clip_norm=self._clip(), expected_batch_size=self.b,
            example_rows=lambda: vocab.restrict(*self._batch_global_rows()), fixed_rows=self.fixed_rows)
        sel = get_selector(p.selection).select(context, p.selection_params, rng)
        return Selection(vocab.to_global(sel.ids), sel.event)

    def _select_on_shards(self, parts: Optional[list] = None) -> Selection:
        """Each shard selects among its own rows of the sparse tables (`EmbeddingShard.select_rows`:
        thresholding, or its top-k candidates) and the selector merges the parts (the union, or
        the exact top-k of the candidates). For contribution counts the trainers sent each
        shard the weights of their examples there, computed from all of each example's rows."""
        p, vocab = self.private_plan, self.sparse_vocabulary
        selector = get_selector(p.selection)
        if parts is None:
            parts = self.shards.broadcast("select_rows", p.selection, p.selection_params, self.dense_tables,
                                          self.shard_selection_key, self.step_count, self.step_clip, self.b)
        fixed = None if self.fixed_rows is None else vocab.to_global(self.fixed_rows)
        sel = selector.merge(parts, p.selection_params, fixed)
        return Selection(sel.ids, sel.event)

    def _batch_global_rows(self):
        """(offsets, global row ids) per example over the trainers' batches, in trainer order."""
        parts = self.trainers.example_rows()
        shifts = np.cumsum([0] + [int(off[-1]) for off, _ in parts[:-1]])
        offsets = np.concatenate([[0]] + [off[1:] + shift for (off, _), shift in zip(parts, shifts)])
        return offsets.astype(np.int64), np.concatenate([ids for _, ids in parts])

    def _example_global_rows(self, batch, B):
        """(offsets, global row ids) per example across all features (for threshold counts)."""
        return example_global_rows(self.layout, batch, B)

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

    # ---- evaluation & state ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, dataset, batch_size: int, averaged: Optional[bool] = None) -> dict:
        """The model's metrics on `dataset`: with `averaged` (default: when ema_decay > 0) the
        averaged tables and dense parameters, else the last iterate."""
        outputs = self.outputs(dataset, batch_size, averaged)
        return {} if outputs is None else self.model.metrics(*outputs)

    def released_dense_params(self, averaged: Optional[bool] = None) -> dict:
        """The dense parameters evaluated and exported: the averaged ones (ema_decay > 0, the
        default there) or the last iterate's."""
        averaged = self.dense_ema is not None if averaged is None else averaged
        if averaged and self.dense_ema is None:
            raise ValueError("averaged evaluation needs ema_decay > 0")
        return (self.dense_ema if averaged else None) or dict(self.model.named_parameters())

    @torch.no_grad()
    def outputs(self, dataset, batch_size: int, averaged: Optional[bool] = None
                ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(model outputs, labels) over `dataset` with the released parameters (see `evaluate`);
        None for an empty dataset."""
        averaged = self.dense_ema is not None if averaged is None else averaged
        dense_params = self.released_dense_params(averaged)
        outputs, labels = [], []
        for batch in dataset.iter_batches(batch_size):
            pooled = torch.from_numpy(self._lookup(batch, batch.size, averaged=averaged))
            outputs.append(torch.func.functional_call(self.model, dense_params, (pooled, batch.dense)))
            labels.append(batch.labels)
        if not outputs:
            return None
        return torch.cat(outputs), torch.cat(labels)

    def state_dict(self) -> dict:
        """Everything a resumed run needs. Generator states only in reproducible mode: a secret
        run's randomness never reaches disk (a resumed secret run draws a fresh root)."""
        state = {
            "step": self.step_count,
            # Copies: a checkpoint held in memory must not change as training continues.
            "model": copy.deepcopy(self.model.state_dict()),
            "dense_optimizer": copy.deepcopy(self.dense_optimizer.state_dict()),
            "shards": self.shards.broadcast("state_dict"),
            "ledger": self.ledger.state_dict() if self.ledger is not None else None,
            "fixed_rows": self.fixed_rows,
            "reproducible": self.randomness.reproducible,
            "recalibrated_at": self.recalibrated_at,
        }
        if self.pre_recalibration is not None:
            state["pre_recalibration"] = {n: v.clone() for n, v in self.pre_recalibration.items()}
        if self._mix_previous is not None:  # ModelMix's θ_{t-2} of the dense parameters (a released state)
            state["mix_previous"] = {n: v.clone() for n, v in self._mix_previous.items()}
        if self.dense_ema is not None:
            # the released model, with the averaged dense parameters (the shards' states carry
            # the averaged tables as "averaged_weights"); also all a resume needs of the average
            state["averaged_model"] = {**copy.deepcopy(self.model.state_dict()),
                                       **{n: v.clone() for n, v in self.dense_ema.items()}}
        if self.randomness.reproducible:
            state["rng"] = {
                "sampler": self.sampler.state_dict(),
                "selection_rng": self.selection_rng.bit_generator.state,
                "noise_gen": self.noise_gen.state_dict(),
                "clip_rng": self.clip_rng.bit_generator.state,
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint. Generator states are reused only when both the checkpoint and
        this engine are reproducible (bit-identical replay); otherwise this engine keeps its
        fresh secret streams, so replayed steps get fresh noise (and are charged again)."""
        self.step_count = state["step"]
        self.model.load_state_dict(state["model"])
        self.dense_optimizer.load_state_dict(state["dense_optimizer"])
        self.shards.call("load_state_dict", [(s,) for s in state["shards"]])
        rng = state.get("rng")
        if rng is not None and self.randomness.reproducible:
            if not isinstance(rng.get("noise_gen"), dict):
                raise ValueError("the checkpoint's generator states are torch generator states (an older widedp, "
                                 "32-bit seeds): its reproducible replay cannot continue; start a new run")
            # The counter-based keys (DP-SGD rows, shard selection, ModelMix) derive from the root
            # again; the sequential generators continue from their states.
            self.sampler.load_state_dict(rng["sampler"])
            self.selection_rng.bit_generator.state = rng["selection_rng"]
            self.noise_gen.load_state_dict(rng["noise_gen"])
            self.clip_rng.bit_generator.state = rng["clip_rng"]
        if self.ledger is not None and state["ledger"] is not None:
            self.ledger.load_state_dict(state["ledger"])
        self._budget_limit = None
        self.fixed_rows = state["fixed_rows"]
        self.recalibrated_at = state.get("recalibrated_at")
        saved = state.get("pre_recalibration")
        self.pre_recalibration = None if saved is None else {n: v.clone() for n, v in saved.items()}
        previous = state.get("mix_previous")
        self._mix_previous = None if previous is None else {n: v.clone() for n, v in previous.items()}
        if self.dense_ema is not None:
            if "averaged_model" not in state:
                raise ValueError("the checkpoint has no averaged parameters but train.ema_decay > 0: "
                                 "resume with the checkpoint's train.ema_decay")
            self.dense_ema = {n: state["averaged_model"][n].clone() for n in self.dense_ema}


class _DpStatChooser:
    """One step's DP-STAT at the coordinator: the trainers' summed counts of norms above the
    candidates, noised from the engine's secret clip stream; sets the engine's `step_clip`
    and the event that ran (trainer/adaptive_clip.py)."""

    def __init__(self, engine: Engine, adaptive: AdaptiveClip):
        self.engine, self.adaptive = engine, adaptive
        self.candidates = adaptive.candidates

    def __call__(self, counts: np.ndarray) -> float:
        clip, event = self.adaptive.choose(counts, self.engine.clip_rng)
        self.engine.step_clip, self.engine._clip_event = clip, event
        return clip
