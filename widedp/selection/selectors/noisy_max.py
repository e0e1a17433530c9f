"""`noisy-max`: Laplace report-noisy-max top-k (selection.noisy_max) on min(‖G_r‖, S0)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from widedp.accounting.events import NoisyMaxTopKDpEvent
from widedp.selection.noisy_max import noisy_max_top_k
from widedp.selection.registry import Selector, register_selector
from widedp.selection.selectors.em import EmParams, ExponentialSelector


@dataclasses.dataclass(frozen=True)
class NoisyMaxParams(EmParams):
    """Same fields as em: ε per round (pure ε-DP), k rounds, S0."""


@register_selector("noisy-max")
class NoisyMaxSelector(ExponentialSelector):
    Params: ClassVar[type] = NoisyMaxParams
    event_class = NoisyMaxTopKDpEvent

    # Not on the shards (unlike em, whose shard methods this class would otherwise inherit):
    # Laplace peeling draws fresh noise over all remaining rows in each of its k rounds, so the
    # shards would need k rounds of messages with the coordinator; it runs there (`select`).
    shard_statistic = None
    shard_select = Selector.shard_select
    merge = Selector.merge

    def select(self, context, params, rng):
        scores, sensitivity = context.score_sensitivity(params.score_clip)
        return noisy_max_top_k(context.touched_ids, scores, context.num_rows, params.k, params.epsilon_per_draw,
                               sensitivity, rng)

    def from_budget(self, rho, inputs):
        assert inputs.k is not None
        return self.Params(epsilon_per_draw=math.sqrt(2.0 * rho / inputs.k), k=inputs.k)  # ρ = k·ε²/2
