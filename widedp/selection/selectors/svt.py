"""`svt`: selection-only NumericSparse (selection.sparse_vector, seed Alg 1) on min(‖G_r‖, S0)."""

from __future__ import annotations

import dataclasses
import math

from widedp.accounting.calibration import svt_event
from widedp.selection.registry import BudgetInputs, Selector, param, register_selector
from widedp.selection.sparse_vector import numeric_sparse, numeric_sparse_scales


@dataclasses.dataclass(frozen=True)
class SvtParams:
    epsilon: float = param(config="selection_epsilon", cli="selection_epsilon", budget=True, record=True)  # Alg 1's ε
    delta: float = param(config="delta", cli="selection_delta", record=True)  # Alg 1's δ
    max_answers: int = param(config="k", cli="max_answers", record=True)  # c (the trainer answers ≤ k rows)
    release_values: bool = param(False, cli="svt_release_values", record=True)  # the trainer: selection only
    threshold: float = param(0.0, config="threshold")  # α on the scores (privacy.threshold = "auto": the auto rule)
    score_clip: float = param(0.1, config="score_clip")  # S0


@register_selector("svt")
class SparseVectorSelector(Selector):
    Params = SvtParams

    def event(self, params):
        return svt_event(params.epsilon, params.delta, params.max_answers, release_values=params.release_values)

    def select(self, context, params, rng):
        scores, sensitivity = context.score_sensitivity(params.score_clip)
        return numeric_sparse(context.touched_ids, scores, context.num_rows, params.threshold, params.max_answers,
                              params.epsilon, params.delta, sensitivity, rng, release_values=params.release_values)

    def check_budget_inputs(self, inputs: BudgetInputs) -> None:
        if not (isinstance(inputs.max_answers, int) and inputs.max_answers >= 1):
            raise ValueError(f"selection 'svt' needs max_answers >= 1, got {inputs.max_answers}")

    def from_budget(self, rho, inputs):
        c = inputs.max_answers
        assert c is not None
        eps_round = math.sqrt(2.0 * rho / c)  # ρ = c·ε_round²/2 (pure ε_round-DP per round)
        # ε_round = 1/b_t + 2/b_q (+ 1/b_v) = (2·0.95 + 0.05/2)·ε/unit for Alg 1's split, or
        # 2ε/unit in selection-only mode (ε1 = ε).
        unit = math.sqrt(32.0 * c * math.log(2.0 / inputs.delta))
        epsilon = eps_round * unit / ((2 * 0.95 + 0.05 / 2) if inputs.release_values else 2.0)
        return self.Params(epsilon=epsilon, delta=inputs.delta, max_answers=c, release_values=inputs.release_values)

    def auto_threshold(self, params, *, k, num_rows, clip_norm, batch_size, false_positive_rows=None):
        """α = b_q·ln(p/(2k)) for the Laplace(b_q) query noise (P(Lap(b) > α) = ½e^{−α/b})."""
        frac = min(0.5, k / num_rows)
        sensitivity = min(clip_norm / batch_size, params.score_clip)
        _, query_scale, _ = numeric_sparse_scales(params.epsilon, params.delta, k, sensitivity, False)
        value = query_scale * math.log(1.0 / (2.0 * frac)) if frac < 0.5 else 0.0
        rule = f"α = b_query·ln(p/(2k)) with Laplace query scale b_query = {query_scale:.3g}"
        return float(max(value, 1e-12)), rule
