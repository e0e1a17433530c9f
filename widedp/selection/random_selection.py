"""Random (data-independent) row selection: the privacy-free baseline of seed Fig 1f.

Privacy assumption: none needed — the output does not depend on the data, so it costs
nothing under any neighbouring relation. Emits `NoOpDpEvent`.
"""

from __future__ import annotations

import numpy as np

from widedp.accounting.events import NoOpDpEvent
from widedp.selection._sparse import check_count, sample_untouched
from widedp.selection.result import Selection


def random_rows(num_rows: int, k: int, rng: np.random.Generator) -> Selection:
    """k distinct rows of [0, num_rows), uniformly at random, in O(k)."""
    if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 1:
        raise ValueError(f"num_rows must be an integer >= 1, got {num_rows!r}")
    k = check_count("k", k, int(num_rows))
    ids = np.sort(sample_untouched(int(num_rows), np.empty(0, dtype=np.int64), k, rng))
    return Selection(ids, NoOpDpEvent())
