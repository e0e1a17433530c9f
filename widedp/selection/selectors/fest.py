"""`fest`: DP-FEST (selection.fest): private top-k row frequencies once, before training; then
the same rows every step (a no-op per step, the one-time Gaussian is charged up front)."""

from __future__ import annotations

import dataclasses

from widedp.accounting.events import GaussianDpEvent, NoOpDpEvent
from widedp.selection.fest import fest_top_k
from widedp.selection.registry import Selector, param, register_selector
from widedp.selection.result import Selection


@dataclasses.dataclass(frozen=True)
class FestParams:
    noise_multiplier: float = param(config="fest_noise_multiplier", cli="fest_sigma")  # σ of the one-time counts
    k: int = param(0, config="k")  # rows kept
    max_rows_per_example: int = param(32, config="fest_max_rows_per_example")  # L


@register_selector("fest")
class FestSelector(Selector):
    Params = FestParams
    spends_per_step = False

    def event(self, params):
        return NoOpDpEvent()  # data independent per step: the rows were fixed once

    def select(self, context, params, rng):
        if context.fixed_rows is None:
            raise RuntimeError("fest: the one-time selection has not run (Engine.prepare_fest)")
        return Selection(context.fixed_rows, NoOpDpEvent())

    def one_time_event(self, params):
        return GaussianDpEvent(params.noise_multiplier)

    def one_time_select(self, offsets, ids, num_rows, params, rng):
        return fest_top_k(offsets, ids, num_rows, params.k, params.noise_multiplier, params.max_rows_per_example, rng)
