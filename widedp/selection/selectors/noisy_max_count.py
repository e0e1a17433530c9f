"""`noisy-max-count`: Laplace report-noisy-max top-k (selection.noisy_max) on example counts.

Privacy assumption: add/remove-one neighbours; the utility is `em-count`'s (how many of the
batch's examples touch the row, sensitivity 1). Same event (`NoisyMaxTopKDpEvent(ε, k)`) and
accounting as `noisy-max`: only the utility changes.
"""

from __future__ import annotations

import dataclasses

from widedp.selection.noisy_max import noisy_max_top_k
from widedp.selection.registry import register_selector
from widedp.selection.selectors.em_count import CountUtility, EmCountParams
from widedp.selection.selectors.noisy_max import NoisyMaxSelector


@dataclasses.dataclass(frozen=True)
class NoisyMaxCountParams(EmCountParams):
    """Same fields as em-count: ε per round (pure ε-DP), k rounds."""


@register_selector("noisy-max-count")
class NoisyMaxCountSelector(CountUtility, NoisyMaxSelector):
    Params = NoisyMaxCountParams
    count_mechanism = staticmethod(noisy_max_top_k)
