"""`em`: exponential-mechanism top-k (selection.exponential) on min(‖G_r‖, S0).

On the shards (selection.partitioned): each shard returns its top-min(k, p_s) candidates of
scale·u_r + Gumbel_r over its own rows, with the same utilities and scale as `select`; `merge`
keeps the k largest — the same selected set in distribution, and the same event.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Optional

import numpy as np

from widedp.accounting.events import ExponentialTopKDpEvent
from widedp.selection._sparse import check_positive
from widedp.selection.exponential import exponential_scale, exponential_top_k
from widedp.selection.partitioned import ShardCandidates, gumbel_top_k_candidates, merge_top_k
from widedp.selection.registry import BudgetInputs, Selector, norm_utilities, param, register_selector
from widedp.selection.result import Selection


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

    # ---- on the shards (selection.partitioned) ---------------------------------------------------
    shard_statistic: ClassVar[Optional[str]] = "norms"

    def shard_utilities(self, scores: np.ndarray, params, clip_norm: Optional[float],
                        expected_batch_size: Optional[float]) -> tuple[np.ndarray, float]:
        """(utilities, sensitivity) of a shard's rows from its statistic: `select`'s, from the
        norms ‖G_r‖ (min(‖G_r‖, S0), min(S1/b, S0))."""
        if clip_norm is None or expected_batch_size is None:
            raise ValueError(f"selection {self.name!r} on the shards needs clip_norm and expected_batch_size "
                             "(its sensitivity is min(S1/b, S0))")
        clip_norm = check_positive("clip_norm", clip_norm)
        expected_batch_size = check_positive("expected_batch_size", expected_batch_size)
        return norm_utilities(scores, params.score_clip, clip_norm, expected_batch_size)

    def shard_select(self, touched, scores, num_rows, params, rng, *, clip_norm=None,
                     expected_batch_size=None) -> ShardCandidates:
        utilities, sensitivity = self.shard_utilities(np.asarray(scores, dtype=np.float64), params, clip_norm,
                                                      expected_batch_size)
        return gumbel_top_k_candidates(touched, utilities, num_rows, params.k,
                                       exponential_scale(params.epsilon_per_draw, sensitivity), rng)

    def merge(self, parts, params, fixed_rows):
        return Selection(merge_top_k(parts, params.k), self.event(params))

    # ---- calibration ----------------------------------------------------------------------------
    def check_budget_inputs(self, inputs: BudgetInputs) -> None:
        if not (isinstance(inputs.k, int) and inputs.k >= 1):
            raise ValueError(f"selection {self.name!r} needs k >= 1 (rows per step), got {inputs.k}")

    def from_budget(self, rho, inputs):
        assert inputs.k is not None
        return self.Params(epsilon_per_draw=math.sqrt(rho / (self.rho_per_eps2 * inputs.k)), k=inputs.k)
