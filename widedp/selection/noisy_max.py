"""Report-noisy-max top-k (peeling), Laplace or Gumbel noise, sparse in the vocabulary.

Privacy assumption: add/remove-one neighbours; `sensitivity` Δ bounds the ℓ∞ change of the
utility vector. Each of the k rounds adds fresh noise to every remaining row and reports the
argmax.
- Laplace: noise Lap(2Δ/ε) per round, each round pure ε-DP for non-monotone utilities
  (Dwork & Roth 2014, §3.3). Emits `NoisyMaxTopKDpEvent(ε, k)`.
- Gumbel: noise Gumbel(2Δ/ε); report-noisy-max with Gumbel noise *is* the exponential
  mechanism, and peeling with fresh Gumbels is the one-shot Gumbel top-k, so this delegates to
  `exponential_top_k` and emits its event.
"""

from __future__ import annotations

import numpy as np

from widedp.accounting.events import NoisyMaxTopKDpEvent
from widedp.selection._sparse import (
    check_count,
    check_positive,
    check_sparse_input,
    sample_untouched,
    top_log_uniforms,
)
from widedp.selection.exponential import exponential_top_k
from widedp.selection.result import Selection


def _laplace_from_log_uniform(log_u: float, scale: float) -> float:
    """Laplace(0, scale) quantile of U given log U (accurate for U close to 1)."""
    if log_u > np.log(0.5):
        return -scale * (np.log(2.0) + np.log(-np.expm1(log_u)))
    return scale * (np.log(2.0) + log_u)


def noisy_max_top_k(
    touched_ids,
    scores,
    num_rows: int,
    k: int,
    epsilon_per_draw: float,
    sensitivity: float,
    rng: np.random.Generator,
    noise: str = "laplace",
) -> Selection:
    """k rounds of report-noisy-max without replacement.

    Laplace cost is O(k·m): every round draws fresh noise for the m remaining touched rows;
    the maximum of the remaining untouched rows' noise is one order statistic (O(1)), and if
    it wins, the row is a uniformly random not-yet-chosen untouched row.
    """
    if noise == "gumbel":
        return exponential_top_k(touched_ids, scores, num_rows, k, epsilon_per_draw, sensitivity, rng)
    if noise != "laplace":
        raise ValueError(f"noise must be 'laplace' or 'gumbel', got {noise!r}")
    sparse = check_sparse_input(touched_ids, scores, num_rows)
    k = check_count("k", k, sparse.num_rows)
    epsilon_per_draw = check_positive("epsilon_per_draw", epsilon_per_draw)
    sensitivity = check_positive("sensitivity", sensitivity)
    scale = 2.0 * sensitivity / epsilon_per_draw

    remaining = np.ones(sparse.ids.size, dtype=bool)
    excluded = sparse.ids  # touched rows + untouched rows already chosen (sorted)
    n_untouched_left = sparse.num_rows - sparse.ids.size
    chosen: list[int] = []
    for _ in range(k):
        live = np.flatnonzero(remaining)
        best_touched, best_value = -1, -np.inf
        if live.size:
            noisy = sparse.scores[live] + rng.laplace(0.0, scale, size=live.size)
            j = int(np.argmax(noisy))
            best_touched, best_value = int(live[j]), float(noisy[j])
        untouched_max = -np.inf
        if n_untouched_left > 0:
            untouched_max = _laplace_from_log_uniform(float(top_log_uniforms(n_untouched_left, 1, rng)[0]), scale)
        if untouched_max > best_value:
            row = int(sample_untouched(sparse.num_rows, excluded, 1, rng)[0])
            excluded = np.insert(excluded, np.searchsorted(excluded, row), row)
            n_untouched_left -= 1
        else:
            row = int(sparse.ids[best_touched])
            remaining[best_touched] = False
        chosen.append(row)
    return Selection(np.sort(np.asarray(chosen, dtype=np.int64)), NoisyMaxTopKDpEvent(epsilon_per_draw=epsilon_per_draw, k=k))
