"""Exponential-mechanism top-k selection (seed Alg 4), sparse in the vocabulary.

Privacy assumption: add/remove-one neighbouring datasets. The caller supplies utilities u_r
for the touched rows (untouched rows have utility 0) and `sensitivity` Δ, an upper bound on
max_r |u_r(D) - u_r(D')| over neighbours. In Algorithm 3 the utility of row r is
min(‖ĝ_r‖₂, S0) (the paper clips each coordinate's score to S0), so Δ = min(S1/b, S0).
Emits `ExponentialTopKDpEvent(epsilon_per_draw, k)`. The sparse Gumbel top-k itself
(`gumbel_top_k`) is shared with `selection.partitioned`, which computes it on the shards.
"""

from __future__ import annotations

import math

import numpy as np

from widedp.accounting.events import ExponentialTopKDpEvent
from widedp.selection._sparse import (
    SparseScores,
    check_count,
    check_positive,
    check_sparse_input,
    gumbel_from_log_uniform,
    sample_untouched,
    top_k_merge,
    top_log_uniforms,
)
from widedp.selection.result import Selection


def exponential_top_k(
    touched_ids,
    scores,
    num_rows: int,
    k: int,
    epsilon_per_draw: float,
    sensitivity: float,
    rng: np.random.Generator,
) -> Selection:
    """Select k distinct rows of [0, num_rows) by peeling exponential mechanism.

    Distribution: k draws without replacement, each picking a remaining row r with probability
    ∝ exp(epsilon_per_draw · u_r / (2·sensitivity)). Implemented as the one-shot Gumbel top-k
    (identical distribution of the selected set): the top-k of u_r·ε/(2Δ) + Gumbel_r over all
    rows. The num_rows - m untouched rows share u = 0, so only the k largest of their Gumbels
    can matter: those are sampled as order statistics (Rényi representation) and their ids as a
    uniform k-subset of the untouched rows. Expected cost O(m + k), independent of num_rows.
    """
    sparse = check_sparse_input(touched_ids, scores, num_rows)
    k = check_count("k", k, sparse.num_rows)
    scale = exponential_scale(epsilon_per_draw, sensitivity)
    ids, _ = gumbel_top_k(sparse, k, scale, rng)
    return Selection(np.sort(ids), ExponentialTopKDpEvent(epsilon_per_draw=epsilon_per_draw, k=k))


def exponential_scale(epsilon_per_draw: float, sensitivity: float) -> float:
    """ε''/(2Δ): the factor on the utilities in the Gumbel top-k of the exponential mechanism
    (each draw picks r with probability ∝ exp(ε''·u_r/(2Δ))). Validates both arguments."""
    epsilon_per_draw = check_positive("epsilon_per_draw", epsilon_per_draw)
    sensitivity = check_positive("sensitivity", sensitivity)
    return epsilon_per_draw / (2.0 * sensitivity)


def gumbel_top_k(sparse: SparseScores, k: int, scale: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(ids, noisy values) of the k rows of [0, num_rows) with the largest scale·u_r + Gumbel_r
    (untouched rows: u = 0), aligned, in no particular order; 1 <= k <= num_rows.

    The touched rows' noisy values are drawn directly; of the untouched rows only the k largest
    Gumbels can matter, sampled as order statistics (decreasing), and those among the top k are
    a prefix of them. Their ids are a uniformly random ordered sample of distinct untouched rows,
    assigned in that random order to the decreasing values: the untouched rows are exchangeable,
    so the (id, value) pairs have the joint law of the dense computation (which row holds the
    j-th largest untouched value is uniform over the rows not holding a larger one). Expected
    cost O(m + k), independent of num_rows.
    """
    touched_noisy = scale * sparse.scores + rng.gumbel(size=sparse.ids.size)
    n_untouched = sparse.num_rows - sparse.ids.size
    untouched_noisy = gumbel_from_log_uniform(top_log_uniforms(n_untouched, k, rng))
    touched_idx, n_from_untouched = top_k_merge(touched_noisy, untouched_noisy, k)
    chosen_untouched = sample_untouched(sparse.num_rows, sparse.ids, n_from_untouched, rng)
    ids = np.concatenate([sparse.ids[touched_idx], chosen_untouched])
    noisy = np.concatenate([touched_noisy[touched_idx], untouched_noisy[:n_from_untouched]])
    return ids, noisy


def k_from_fraction(gamma: float, num_rows: int) -> int:
    """k = ⌊γ·p⌋ as in seed Alg 4; raises if it is 0 (nothing would be selected)."""
    gamma = check_positive("gamma", gamma)
    if gamma > 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    k = math.floor(gamma * num_rows)
    if k < 1:
        raise ValueError(f"gamma={gamma} selects floor(gamma*num_rows)=0 of {num_rows} rows; raise gamma")
    return k


def paper_epsilon_per_draw(epsilon: float, delta: float, k: int) -> float:
    """Seed Alg 4's per-draw budget ε'' = ε' / √(2k·log(1/δ')).

    Note (math correction): by advanced composition (Dwork-Rothblum-Vadhan 2010) k draws of
    ε''-DP are (ε''√(2k log(1/δ')) + kε''(e^ε'' - 1), δ')-DP; Alg 4 drops the second term, so
    this ε'' yields slightly more than ε'. Our accountants never use ε' from this formula:
    they compose the recorded ε'' directly (see `accounting.paper.advanced_composition`).
    """
    epsilon = check_positive("epsilon", epsilon)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return epsilon / math.sqrt(2 * k * math.log(1 / delta))
