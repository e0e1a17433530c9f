"""Learning-rate schedules: the multiplier of `train.lr` and `train.dense_lr` at each step.

A schedule is a function of the step index and the run's planned steps only — public, so it
costs no privacy (it is part of the training algorithm, not a function of the data). Registered
by name like the selectors (`@register_lr_schedule("name")`, a name once); `train.lr_schedule`
picks one. The multiplier of step t (0-based) of T:
  constant  1
  linear    1 - t/T            (decays to 1/T at the last step)
  cosine    (1 + cos(π t/T))/2 (the same end points, flatter at both ends)
"""

from __future__ import annotations

import math
from typing import Callable

LrSchedule = Callable[[int, int], float]

LR_SCHEDULES: dict[str, LrSchedule] = {}


def register_lr_schedule(name: str) -> Callable[[LrSchedule], LrSchedule]:
    def register(fn: LrSchedule) -> LrSchedule:
        if name in LR_SCHEDULES:
            raise ValueError(f"lr schedule {name!r} is already registered ({LR_SCHEDULES[name].__name__})")
        LR_SCHEDULES[name] = fn
        return fn

    return register


def lr_multiplier(name: str, step: int, total_steps: int) -> float:
    """The multiplier of step `step` (0-based) of a run planned for `total_steps` steps."""
    if name not in LR_SCHEDULES:
        raise ValueError(f"train.lr_schedule must be one of {sorted(LR_SCHEDULES)}, got {name!r}")
    return LR_SCHEDULES[name](min(step, total_steps - 1), max(total_steps, 1))


@register_lr_schedule("constant")
def constant(step: int, total: int) -> float:
    return 1.0


@register_lr_schedule("linear")
def linear(step: int, total: int) -> float:
    return 1.0 - step / total


@register_lr_schedule("cosine")
def cosine(step: int, total: int) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * step / total))
