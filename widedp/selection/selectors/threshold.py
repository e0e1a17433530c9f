"""`threshold`: Gaussian thresholding of per-example contribution counts (selection.threshold)."""

from __future__ import annotations

import dataclasses
import math

from widedp.accounting.events import GaussianDpEvent
from widedp.selection.registry import Selector, param, register_selector
from widedp.selection.result import Selection
from widedp.selection.threshold import contribution_counts, gaussian_threshold, merge_disjoint


@dataclasses.dataclass(frozen=True)
class ThresholdParams:
    noise_multiplier: float = param(config="selection_sigma", cli="selection_sigma", budget=True, record=True)
    threshold: float = param(0.0, config="threshold")  # τ on the counts (privacy.threshold = "auto": the auto rule)
    contribution_clip: float = param(1.0, config="contribution_clip")  # C1


@register_selector("threshold")
class ThresholdSelector(Selector):
    Params = ThresholdParams

    def event(self, params):
        return GaussianDpEvent(params.noise_multiplier)

    def select(self, context, params, rng):
        assert context.example_rows is not None, "threshold selection needs the batch's per-example rows"
        offsets, ids = context.example_rows()
        count_ids, counts = contribution_counts(offsets, ids, params.contribution_clip, context.num_rows)
        return gaussian_threshold(count_ids, counts, context.num_rows, params.threshold, params.noise_multiplier,
                                  params.contribution_clip, rng)

    # Every row passes or not independently of the others, so thresholding each shard's rows with
    # its own stream and taking the union is the same mechanism (same output distribution).
    shard_statistic = "counts"

    def shard_select(self, touched, scores, num_rows, params, rng, *, clip_norm=None, expected_batch_size=None):
        # clip_norm, expected_batch_size: not needed (the counts' sensitivity is C1, a parameter)
        return gaussian_threshold(touched, scores, num_rows, params.threshold, params.noise_multiplier,
                                  params.contribution_clip, rng).ids

    def merge(self, parts, params, fixed_rows):
        return Selection(merge_disjoint(parts), GaussianDpEvent(params.noise_multiplier))

    def from_budget(self, rho, inputs):
        return self.Params(noise_multiplier=1.0 / math.sqrt(2.0 * rho))  # ρ = 1/(2σ_sel²)

    def auto_threshold(self, params, *, k, num_rows, clip_norm, batch_size, false_positive_rows=None):
        """τ = σ_sel·C1·Φ̄⁻¹(m/p): about m of the p rows pass on noise alone, where m is the
        run's false-positive budget (`false_positive_rows`: privacy.false_positive_ratio times
        the most rows a batch can touch) or, without one, k."""
        from scipy import stats

        budget, name = (k, "k") if false_positive_rows is None else (false_positive_rows, "m")
        frac = min(0.5, budget / num_rows)
        value = params.noise_multiplier * params.contribution_clip * float(stats.norm.isf(frac))
        rule = (f"τ = σ_sel·C1·Φ̄⁻¹({name}/p) = {params.noise_multiplier:.3g}·{params.contribution_clip:g}"
                f"·Φ̄⁻¹({budget:.4g}/{num_rows})")
        return float(max(value, 1e-12)), rule
