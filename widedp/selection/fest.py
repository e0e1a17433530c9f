"""DP-FEST: one-time private top-k of row frequencies over the training set.

Privacy assumption: add/remove-one neighbours over the whole training set (this runs once,
before training, on all n examples — no sampling). Each example counts each of its first
`max_rows_per_example` (L) distinct rows once (a per-example, data-independent truncation),
so one example changes at most L counts by 1: ℓ2 sensitivity √L. Noisy counts
counts + N(0, (σ√L)² I_p) over **all** p rows are a Gaussian mechanism with multiplier σ;
their top-k is post-processing. Emits `GaussianDpEvent(σ)` (compose it once into the ledger).
"""

from __future__ import annotations

import math

import numpy as np

from widedp.accounting.events import GaussianDpEvent
from widedp.selection._sparse import (
    check_count,
    check_positive,
    gaussian_from_log_uniform,
    sample_untouched,
    top_k_merge,
    top_log_uniforms,
)
from widedp.selection.result import Selection


def truncated_row_counts(offsets, ids, num_rows: int, max_rows_per_example: int):
    """(unique rows, counts): each example counts its first L distinct rows (in order) once."""
    offsets = np.asarray(offsets, dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64)
    if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or offsets[-1] != ids.size or np.any(np.diff(offsets) < 0):
        raise ValueError("offsets must be non-decreasing, start at 0 and end at len(ids)")
    if ids.size and (ids.min() < 0 or ids.max() >= num_rows):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ValueError(f"ids contains row {bad} outside [0, num_rows={num_rows})")
    if ids.size == 0:
        return np.empty(0, dtype=np.int64), np.empty(0)
    example = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    position = np.arange(ids.size)
    # First occurrence of each (example, row): sort by example, row, position.
    order = np.lexsort((position, ids, example))
    ex_s, id_s = example[order], ids[order]
    first = np.ones(ids.size, dtype=bool)
    first[1:] = (ex_s[1:] != ex_s[:-1]) | (id_s[1:] != id_s[:-1])
    keep_pos = np.sort(position[order][first])  # first occurrences, in input order
    ex_k = example[keep_pos]
    # Rank of each first occurrence within its example (input order).
    start = np.searchsorted(ex_k, ex_k, side="left")
    rank = np.arange(ex_k.size) - start
    kept_ids = ids[keep_pos][rank < max_rows_per_example]
    rows, counts = np.unique(kept_ids, return_counts=True)
    return rows, counts.astype(np.float64)


def fest_top_k(
    offsets,
    ids,
    num_rows: int,
    k: int,
    noise_multiplier: float,
    max_rows_per_example: int,
    rng: np.random.Generator,
) -> Selection:
    """Private top-k rows by frequency, over all num_rows rows, in O(nnz + k).

    The untouched rows' noisy counts are i.i.d. N(0, (σ√L)²); only their k largest can enter
    the top-k, sampled as order statistics, with ids a uniform subset of the untouched rows.
    """
    if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 1:
        raise ValueError(f"num_rows must be an integer >= 1, got {num_rows!r}")
    k = check_count("k", k, int(num_rows))
    noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
    L = check_count("max_rows_per_example", max_rows_per_example, 2**62)
    rows, counts = truncated_row_counts(offsets, ids, int(num_rows), L)
    std = noise_multiplier * math.sqrt(L)
    touched_noisy = counts + rng.normal(0.0, std, size=rows.size)
    n_untouched = int(num_rows) - rows.size
    untouched_noisy = std * gaussian_from_log_uniform(top_log_uniforms(n_untouched, k, rng))
    touched_idx, n_from_untouched = top_k_merge(touched_noisy, untouched_noisy, k)
    chosen_untouched = sample_untouched(int(num_rows), rows, n_from_untouched, rng)
    selected = np.sort(np.concatenate([rows[touched_idx], chosen_untouched]))
    return Selection(selected, GaussianDpEvent(noise_multiplier))


#: privacy.fest_noise_multiplier = "auto" (`auto_fest_noise_multiplier`): the count noise's std
#: may reach this fraction of n·L/k, ...
FEST_USEFUL_NOISE_RATIO = 0.1
#: ... and the one-time event alone may spend up to this fraction of the target ε.
FEST_BUDGET_FRACTION = 0.05


def auto_fest_noise_multiplier(n: int, max_rows_per_example: int, k: int, target_epsilon: float, delta: float,
                               accountant: str) -> tuple[float, str]:
    """DP-FEST's one-time σ from the data's public shape and the target ε: (σ, the rule in words).

    Public inputs only: n (training examples), L (`max_rows_per_example`), k, the target ε and δ.
    Each example adds ≤ L to the counts, so the k-th largest count is at most n·L/k (pigeonhole)
    and n·L/k is the scale of the counts the top-k must rank. The count noise has std σ√L:
      σ_useful     = FEST_USEFUL_NOISE_RATIO · n·√L / k   (noise std = that fraction of n·L/k)
      σ_affordable = the σ at which GaussianDpEvent(σ) alone spends FEST_BUDGET_FRACTION · ε at δ
    and σ = max(σ_useful, σ_affordable): as much noise as keeps the ranking useful when that is
    cheap (large n), and never a one-time cost above the fraction of the budget (small n or
    small ε), where the ranking gets noisier instead. The run's calibration then sizes the
    per-step noise around whatever the one-time event costs, so the total stays at the target."""
    from widedp.accounting.calibration import one_time_gaussian_sigma  # accounting imports no selection module

    n, L, k = int(n), int(max_rows_per_example), int(k)
    if n < 1 or L < 1 or k < 1:
        raise ValueError(f"auto DP-FEST σ needs n, L, k >= 1, got n = {n}, L = {L}, k = {k}")
    useful = FEST_USEFUL_NOISE_RATIO * n * math.sqrt(L) / k
    sigma, affordable = one_time_gaussian_sigma(useful, FEST_BUDGET_FRACTION * target_epsilon, delta, accountant)
    which = "count noise std = 0.1·n·L/k" if useful >= affordable else f"{FEST_BUDGET_FRACTION:g}·ε alone"
    spend = "≤" if affordable == useful else "="
    return sigma, (f"auto: max({FEST_USEFUL_NOISE_RATIO:g}·n·√L/k = {useful:.4g}, σ spending "
                   f"{FEST_BUDGET_FRACTION:g}·ε {spend} {affordable:.4g}) = {sigma:.4g} ({which})")
