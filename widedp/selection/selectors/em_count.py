"""`em-count`: exponential-mechanism top-k (selection.exponential) on example counts.

Privacy assumption: add/remove-one neighbouring datasets. The utility of row r is the number
of the batch's examples that touch r (each example counts a row once, however often its ids
repeat it), so one example moves every row's utility by at most 1: sensitivity Δ = 1, a count,
independent of S1, b and the gradient. `em`'s utility min(‖G_r‖, S0) has Δ = min(S1/b, S0),
so a row's score advantage over an untouched row is worth a fraction of a nat per draw at
realistic k (issue 10); here a row touched by c examples is ahead by c·ε''/2 nats. Same event
(`ExponentialTopKDpEvent(ε'', k)`) and accounting as `em`: only the utility changes. On the
shards as `em` (selection.partitioned), each shard counting its own rows' examples
("example_counts"), sensitivity 1.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from widedp.selection.exponential import exponential_top_k
from widedp.selection.fest import truncated_row_counts
from widedp.selection.registry import param, register_selector
from widedp.selection.result import Selection
from widedp.selection.selectors.em import ExponentialSelector

#: One example changes each row's count by at most this (add/remove-one).
COUNT_SENSITIVITY = 1.0


@dataclasses.dataclass(frozen=True)
class EmCountParams:
    epsilon_per_draw: float = param(config="selection_epsilon", cli="selection_epsilon", budget=True, record=True)
    k: int = param(config="k", cli="k", record=True)  # rows per step


def example_counts(context) -> tuple[np.ndarray, np.ndarray]:
    """(rows the batch touches, how many of its examples touch each): sensitivity 1 per row."""
    assert context.example_rows is not None, "count utilities need the batch's per-example rows"
    offsets, ids = context.example_rows()
    return truncated_row_counts(offsets, ids, context.num_rows, max(1, int(np.asarray(ids).size)))


class CountUtility:
    """Selector mixin: `select` runs `count_mechanism` on the example counts, sensitivity 1."""

    count_mechanism: Callable[..., Selection]

    def select(self, context, params, rng):
        rows, counts = example_counts(context)
        return self.count_mechanism(rows, counts, context.num_rows, params.k, params.epsilon_per_draw,
                                    COUNT_SENSITIVITY, rng)


@register_selector("em-count")
class ExponentialCountSelector(CountUtility, ExponentialSelector):
    Params = EmCountParams
    count_mechanism = staticmethod(exponential_top_k)

    # On the shards: `em`'s shard_select and merge on the example counts of the shard's rows
    # (unit weight per distinct (example, row) pair, as `example_counts`), sensitivity 1.
    shard_statistic = "example_counts"

    def shard_utilities(self, scores, params, clip_norm=None, expected_batch_size=None):
        return np.asarray(scores, dtype=np.float64), COUNT_SENSITIVITY
