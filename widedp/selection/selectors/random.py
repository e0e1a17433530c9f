"""`random`: k uniformly random rows per step (selection.random_selection); costs nothing."""

from __future__ import annotations

import dataclasses

from widedp.accounting.events import NoOpDpEvent
from widedp.selection.random_selection import random_rows
from widedp.selection.registry import Selector, param, register_selector


@dataclasses.dataclass(frozen=True)
class RandomParams:
    k: int = param(0, config="k")  # rows per step (0: unset; `select` refuses it)


@register_selector("random")
class RandomSelector(Selector):
    Params = RandomParams
    spends_per_step = False

    def event(self, params):
        return NoOpDpEvent()

    def select(self, context, params, rng):
        return random_rows(context.num_rows, params.k, rng)
