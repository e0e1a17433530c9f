"""Gaussian thresholding over the whole vocabulary (DP-AdaFEST), sparse in the vocabulary.

Privacy assumption: add/remove-one neighbours. Each example contributes a vector over rows
with ℓ2 norm ≤ `clip_norm` (C1) — `contribution_counts` builds such vectors from an example's
ids. The noisy count vector counts + N(0, (σ·C1)² I_p) over **all** p rows is a Gaussian
mechanism with noise multiplier σ; the selection {r : noisy_r ≥ τ} is post-processing of it.
Emits `GaussianDpEvent(σ)`. When the gradient noise σ_g is applied to the same batch, the
step accounts as one Gaussian with σ_eff⁻² = σ⁻² + σ_g⁻² (see accounting.events).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from widedp.accounting.events import GaussianDpEvent
from widedp.selection._sparse import check_positive, check_sparse_input, sample_untouched, unique_ints
from widedp.selection.result import Selection


def contribution_counts(offsets, ids, clip_norm: float, num_rows: int | None = None):
    """Per-row sums of per-example contribution vectors with ℓ2 norm ≤ clip_norm.

    Jagged input (KeyedJaggedTensor layout): example j's ids are ids[offsets[j]:offsets[j+1]].
    Each example's *distinct* rows get weight min(1, C1/√n_j) (n_j = its number of distinct
    rows), so its vector's ℓ2 norm is min(√n_j, C1) ≤ C1. Returns (unique row ids, counts).
    """
    clip_norm = check_positive("clip_norm", clip_norm)
    offsets = np.asarray(offsets, dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64)
    if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or offsets[-1] != ids.size or np.any(np.diff(offsets) < 0):
        raise ValueError("offsets must be non-decreasing, start at 0 and end at len(ids)")
    if num_rows is not None and ids.size and (ids.min() < 0 or ids.max() >= num_rows):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ValueError(f"ids contains row {bad} outside [0, num_rows={num_rows})")
    example = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    pair_example, pair_row = _distinct_pairs(example, ids)
    weight = _weights_of(pair_example, offsets.size - 1, clip_norm)
    return _counts_of(pair_example, pair_row, weight)


def contribution_weights(offsets, ids, clip_norm: float) -> np.ndarray:
    """min(1, C1/√n_j) per example (n_j = example j's number of distinct rows, jagged input as
    in `contribution_counts`): the weight of each of its distinct rows in the counts. Where rows
    are counted apart from the examples (on the shards that own them), each must be given the
    weight computed from *all* of the example's rows, or the ℓ2 bound C1 does not hold."""
    offsets = np.asarray(offsets, dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64)
    example = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    return _weights_of(_distinct_pairs(example, ids)[0], offsets.size - 1, clip_norm)


def weighted_row_counts(example, ids, weights) -> tuple[np.ndarray, np.ndarray]:
    """(unique rows, Σ_j weights[j] over the distinct (example j, row) pairs among (example[i],
    ids[i])): the counts of `contribution_counts` for whichever rows are given."""
    pair_example, pair_row = _distinct_pairs(np.asarray(example, dtype=np.int64), np.asarray(ids, dtype=np.int64))
    return _counts_of(pair_example, pair_row, np.asarray(weights, dtype=np.float64))


def _distinct_pairs(example: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (example, row) pairs, sorted by row then example, as two arrays. One int64
    key per pair (row·(max example + 1) + example) when it fits, which sorts far faster than pairs."""
    if ids.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    stride = int(example.max()) + 1
    if ids.min() >= 0 and example.min() >= 0 and (int(ids.max()) + 1) * stride < 2**62:
        key = unique_ints(ids * stride + example)
        return key % stride, key // stride
    pairs = np.unique(np.stack([ids, example]), axis=1)
    return pairs[1], pairs[0]


def _weights_of(pair_example: np.ndarray, num_examples: int, clip_norm: float) -> np.ndarray:
    distinct_per_example = np.bincount(pair_example, minlength=num_examples)
    return np.minimum(1.0, clip_norm / np.sqrt(np.maximum(distinct_per_example, 1)))


def _counts_of(pair_example: np.ndarray, pair_row: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # pair_row is sorted (`_distinct_pairs`): each run of equal rows is one row's pairs.
    first = np.empty(pair_row.size, dtype=bool)
    first[:1] = True
    np.not_equal(pair_row[1:], pair_row[:-1], out=first[1:])
    rows, inverse = pair_row[first], np.cumsum(first) - 1
    counts = np.bincount(inverse, weights=weights[pair_example], minlength=rows.size).astype(np.float64)
    return rows, counts


def gaussian_threshold(
    touched_ids,
    counts,
    num_rows: int,
    threshold: float,
    noise_multiplier: float,
    clip_norm: float,
    rng: np.random.Generator,
) -> Selection:
    """Select {r : counts_r + N(0, (σ·C1)²) ≥ τ} over all num_rows rows.

    Untouched rows (count 0) pass independently with probability π = Φ̄(τ/(σ·C1)), so the
    number of false positives is Binomial(p - m, π) and which ones is a uniform subset of the
    untouched rows: exact, with no cap, O(m + #selected) and safe for p up to 2^62.
    """
    sparse = check_sparse_input(touched_ids, counts, num_rows, name="counts")
    noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
    clip_norm = check_positive("clip_norm", clip_norm)
    if not math.isfinite(threshold):
        raise ValueError(f"threshold must be finite, got {threshold}")
    std = noise_multiplier * clip_norm
    passed = sparse.scores + rng.normal(0.0, std, size=sparse.ids.size) >= threshold
    false_positive_prob = float(special.ndtr(-threshold / std))
    n_untouched = sparse.num_rows - sparse.ids.size
    n_false_positives = int(rng.binomial(n_untouched, false_positive_prob)) if n_untouched else 0
    false_positives = sample_untouched(sparse.num_rows, sparse.ids, n_false_positives, rng)
    ids = np.sort(np.concatenate([sparse.ids[passed], false_positives]))
    return Selection(ids, GaussianDpEvent(noise_multiplier))


def merge_disjoint(parts) -> np.ndarray:
    """The sorted union of per-shard selections (global ids), which must be disjoint: each
    shard selects among its own rows only."""
    ids = np.sort(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts] or [np.empty(0, np.int64)]))
    if ids.size > 1 and np.any(ids[1:] == ids[:-1]):
        row = int(ids[1:][ids[1:] == ids[:-1]][0])
        raise ValueError(f"row {row} was selected by more than one shard: the shards' rows must be disjoint")
    return ids
