"""`em`: exponential-mechanism top-k (selection.exponential) on min(‖G_r‖, S0)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from accounting.events import ExponentialTopKDpEvent
from selection.exponential import exponential_top_k
from selection.registry import BudgetInputs, Selector, param, register_selector


@dataclasses.dataclass(frozen=True)
class EmParams:
    epsilon_per_draw: float = param(config="selection_epsilon", cli="selection_epsilon", budget=True, record=True)
    k: int = param(config="k", cli="k", record=True)  # rows per step
    score_clip: float = param(0.1, config="score_clip")  # S0


@register_selector("em")
class ExponentialSelector(Selector):
    Params: ClassVar[type] = EmParams  # em-count (a subclass) has its own fields
    event_class = ExponentialTopKDpEvent
    rho_per_eps2 = 1.0 / 8.0  # ρ = k·ε''²/8 (ε''-bounded range per draw)

    def event(self, params):
        return self.event_class(params.epsilon_per_draw, params.k)

    def select(self, context, params, rng):
        scores, sensitivity = context.score_sensitivity(params.score_clip)
        return exponential_top_k(context.touched_ids, scores, context.num_rows, params.k, params.epsilon_per_draw,
                                 sensitivity, rng)

    def check_budget_inputs(self, inputs: BudgetInputs) -> None:
        if not (isinstance(inputs.k, int) and inputs.k >= 1):
            raise ValueError(f"selection {self.name!r} needs k >= 1 (rows per step), got {inputs.k}")

    def from_budget(self, rho, inputs):
        assert inputs.k is not None
        return self.Params(epsilon_per_draw=math.sqrt(rho / (self.rho_per_eps2 * inputs.k)), k=inputs.k)
