"""A built run and the one training loop every driver uses (`widedp train`, the benchmarks,
the Fig 1 script).

`Run` holds what `trainer.run.train.build_run` assembles (config, engine, splits, metadata, the
resolved privacy plan); `Run.run(steps, callbacks)` steps the engine until it has taken
`steps` steps in all or the budget refuses a step, and hands each step to the callbacks.
Callbacks only observe: what a callback writes is governed by docs/THREAT_MODEL.md (the
train command's recorder enforces it; benchmarks may record debug statistics of their own).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional, Protocol, Sequence

from widedp.accounting.events import GaussianDpEvent
from widedp.trainer.config import Config
from widedp.trainer.engine import Engine, StepStats
from widedp.trainer.config.lr_schedule import lr_multiplier
from widedp.trainer.config.planning import PrivacyInfo
from widedp.trainer.engine.recalibration import BINS, recalibrate_engine, undo_recalibration

log = logging.getLogger(__name__)


class StepCallback(Protocol):
    def on_step(self, engine: Engine, stats: StepStats, seconds: float) -> Optional[bool]:
        """After each released step (`seconds`: its wall time). Return True to stop the loop."""


@dataclasses.dataclass(frozen=True)
class LoopResult:
    """How a `Run.run` call ended: steps taken in this call, whether the budget refused a step
    (the engine never takes a step past the target ε), wall seconds of the loop."""

    steps_taken: int
    stopped_by_budget: bool
    stopped_by_callback: bool
    elapsed_s: float


@dataclasses.dataclass
class Run:
    """One training run, built by `trainer.run.train.build_run(cfg)`; close it (or use `with`) to
    release the shards (Ray actors)."""

    config: Config
    engine: Engine
    train_set: Any
    test_set: Any
    meta: Any  # trainer.data.DatasetMeta
    privacy: PrivacyInfo
    validation_set: Any = None  # held out of the training data (data.validation_fraction > 0)

    def run(self, steps: int, callbacks: Sequence[StepCallback] = ()) -> LoopResult:
        """Step until `engine.step_count == steps`, the budget refuses a step, or a callback
        asks to stop; each callback's `on_step` sees every step in order. A plan with a one-time
        selection (DP-FEST) that has not run yet runs it first (`prepare`)."""
        self.prepare()
        engine = self.engine
        engine.budget.plan_steps(steps)  # the budget is certified for the planned steps once (accounting/ledger.py)
        if engine.step_count < steps:
            undo_recalibration(engine)  # go on from the training iterate, not the recalibrated release
        start = time.perf_counter()
        taken, by_budget, by_callback = 0, False, False
        while engine.step_count < steps:
            engine.lr_scale = lr_multiplier(self.config.train.lr_schedule, engine.step_count, self.config.train.steps)
            t0 = time.perf_counter()
            stats = engine.step()
            if stats is None:
                by_budget = True
                break
            seconds = time.perf_counter() - t0
            taken += 1
            stop = [bool(cb.on_step(engine, stats, seconds)) for cb in callbacks]
            if any(stop):
                by_callback = True
                break
        return LoopResult(taken, by_budget, by_callback, time.perf_counter() - start)

    def prepare(self) -> None:
        """Charge and make the plan's one-time selection (DP-FEST's fixed rows) unless it has
        already been made (a new `widedp train` run does it in its start-up, a resumed run
        restores it from the checkpoint); nothing for other plans."""
        if self.engine.needs_one_time_selection() and self.engine.fixed_rows is None:
            self.engine.prepare_fest(self.train_set.feature_rows)

    def recalibrate(self) -> Optional[dict]:
        """train.recalibrate's release (trainer/engine/recalibration.py) after the last step of a private
        run of a binary model, unless it already ran after this step; None when the plan has no
        recalibration, it already ran, or it would spend past privacy.target_epsilon (then the
        model is released as trained, with a warning)."""
        plan = self.privacy.recalibration
        engine = self.engine
        if plan is None or engine.ledger is None or engine.step_count == 0 or engine.recalibrated_at == engine.step_count:
            return None
        event = engine.budget.accounted(GaussianDpEvent(plan["noise_multiplier"]))
        if engine.ledger.would_exceed(event, self.config.privacy.target_epsilon):
            log.warning("train.recalibrate skipped: its release (σ = %.4g) would spend past privacy.target_epsilon = "
                        "%g; the model is released as trained", plan["noise_multiplier"],
                        self.config.privacy.target_epsilon)
            return None
        return recalibrate_engine(engine, self.train_set, plan["noise_multiplier"], self.config.train.eval_batch_size,
                                  bins=plan.get("bins", BINS))

    def evaluate(self, split: Any = None) -> dict:
        """Metrics on `split` (default: the test split) with the config's eval batch size."""
        return self.engine.evaluate(self.test_set if split is None else split, self.config.train.eval_batch_size)

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
