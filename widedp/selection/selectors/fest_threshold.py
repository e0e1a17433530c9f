"""`fest-threshold`: DP-FEST's fixed frequent rows plus per-step Gaussian thresholding (AdaFEST).

Privacy assumption: add/remove-one neighbours. Two mechanisms, each already audited alone:
  once, before training: DP-FEST's noisy row frequencies over the whole training set
    (selection.fest: each example counts ≤ L distinct rows, sensitivity √L), top-k kept —
    `GaussianDpEvent(fest σ)`, charged once before the selection is used;
  every step: Gaussian thresholding of the batch's contribution counts (selection.threshold:
    per-example vector of ℓ2 norm ≤ C1) — `GaussianDpEvent(σ_sel)`, composed with the step's
    gradient noise inside the Poisson-sampled step as for `threshold`.
The step's selection is the union of the fixed rows and the rows whose noisy count passes τ:
post-processing of the two outputs, so the events above are the whole cost.

Why: on heavy-tailed data most of a batch's gradient mass sits on a few thousand frequent
rows. Thresholding alone must set τ far above the noise (tens of examples per row at
b = 1024) and so drops much of that mass every step; the fixed rows get their signal every
step as DP-SGD does, at a one-time cost, and the threshold adds the rows that are frequent in
this batch but not overall.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from widedp.accounting.events import GaussianDpEvent
from widedp.selection.fest import fest_top_k
from widedp.selection.registry import param, register_selector
from widedp.selection.result import Selection
from widedp.selection.selectors.threshold import ThresholdParams, ThresholdSelector


@dataclasses.dataclass(frozen=True)
class FestThresholdParams(ThresholdParams):
    fest_noise_multiplier: float = param(5.0, config="fest_noise_multiplier", cli="fest_sigma")  # one-time σ
    k: int = param(0, config="k")  # fixed rows (DP-FEST's top-k)
    max_rows_per_example: int = param(32, config="fest_max_rows_per_example")  # L


@register_selector("fest-threshold")
class FestThresholdSelector(ThresholdSelector):
    Params = FestThresholdParams

    def select(self, context, params, rng):
        if context.fixed_rows is None:
            raise RuntimeError("fest-threshold: the one-time selection has not run (Engine.prepare_fest)")
        passed = super().select(context, params, rng)
        return Selection(np.union1d(context.fixed_rows, passed.ids), passed.event)

    def merge(self, parts, params, fixed_rows):
        if fixed_rows is None:
            raise RuntimeError("fest-threshold: the one-time selection has not run (Engine.prepare_fest)")
        passed = super().merge(parts, params, fixed_rows)
        return Selection(np.union1d(fixed_rows, passed.ids), passed.event)

    def one_time_event(self, params):
        return GaussianDpEvent(params.fest_noise_multiplier)

    def one_time_select(self, offsets, ids, num_rows, params, rng):
        return fest_top_k(offsets, ids, num_rows, params.k, params.fest_noise_multiplier,
                          params.max_rows_per_example, rng)
