"""What a step is told and what it reports: the privacy plan fixed before training
(`PrivacyPlan`), the step's event as the ledger charges it (`step_event_of`), a step's outcome
(`StepStats`) and G on the touched rows (`RowSums`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

import numpy as np

from widedp.accounting import events as ev
from widedp.accounting.calibration import sampled_step_event
from widedp.selection.registry import Selector, get_selector, is_selector
from widedp.trainer.engine.adaptive_clip import AdaptiveClip
from widedp.trainer.engine.step_noise import step_noise_event


@dataclasses.dataclass
class PrivacyPlan:
    """Everything the step needs to know about privacy, fixed before training starts."""

    noise_multiplier: float  # σ of the gradient noise (std = σ · sensitivity)
    clip_norm: Optional[float]  # S1 (None: chosen each step by `adaptive_clip`)
    second_clip_norm: Optional[float]  # S2
    selection: str  # a registered selector's name (selection.registry), or "none" (DP-SGD)
    selection_params: Any = None  # that selector's Params (None for "none")
    adaptive_clip: Optional[AdaptiveClip] = None  # privacy.clip_norm = "adaptive" (trainer/engine/adaptive_clip.py)
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
        """The step's noise event (trainer/engine/step_noise.py); `clip_event`: the DP-STAT that ran
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


def step_event_of(mode: str, sample_rate: float, plan: Optional[PrivacyPlan], selects: bool,
                  group_size: int = 1) -> Optional[ev.DpEvent]:
    """The event one step charges, as the engine budgets it before the step runs: the Poisson
    sampled noise event (with DP-STAT, ModelMix) composed with the selector's per-step event when
    the step selects, accounted for a group of `group_size` (user level by example sampling);
    None for a non-private step."""
    if mode == "nonprivate":
        return None
    if plan is None:
        raise RuntimeError("a private step needs a privacy plan")
    sel = get_selector(plan.selection).event(plan.selection_params) if selects else None
    return ev.grouped(sampled_step_event(sample_rate, plan.noise_event(), sel), group_size)
