"""Sparse sampling primitives shared by the selectors.

Untouched rows all have score 0, so they are exchangeable: what a selector needs from them is
(a) the top order statistics of their i.i.d. noise and (b) which distinct untouched ids those
are — uniformly random, since the rows are exchangeable. Both are sampled in O(k), never O(p).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy import special


class SparseScores(NamedTuple):
    """Validated sparse input: unique touched ids (sorted ascending) and their scores."""

    ids: np.ndarray  # int64, sorted, unique, in [0, num_rows)
    scores: np.ndarray  # float64, same length
    num_rows: int


def check_sparse_input(touched_ids, scores, num_rows, *, name: str = "scores") -> SparseScores:
    """Validate and canonicalize (sort by id) a sparse score vector.

    Raises ValueError naming the offending parameter: non-integer or out-of-range ids,
    duplicate ids, non-finite scores, length mismatch, bad `num_rows`.
    """
    if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 1:
        raise ValueError(f"num_rows must be an integer >= 1, got {num_rows!r}")
    num_rows = int(num_rows)
    ids = np.asarray(touched_ids)
    if ids.ndim != 1:
        raise ValueError(f"touched_ids must be 1-D, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"touched_ids must be integers, got dtype {ids.dtype}")
    ids = ids.astype(np.int64, copy=False)
    vals = np.asarray(scores, dtype=np.float64)
    if vals.shape != ids.shape:
        raise ValueError(f"{name} has shape {vals.shape} but touched_ids has shape {ids.shape}")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            raise ValueError(f"touched_ids contains row {bad} outside [0, num_rows={num_rows})")
        bad_pos = np.flatnonzero(~np.isfinite(vals))
        if bad_pos.size:
            raise ValueError(f"{name}[{bad_pos[0]}] (row {ids[bad_pos[0]]}) is not finite: {vals[bad_pos[0]]}")
    order = np.argsort(ids, kind="stable")
    ids, vals = ids[order], vals[order]
    if ids.size > 1:
        dup = np.flatnonzero(ids[1:] == ids[:-1])
        if dup.size:
            raise ValueError(f"touched_ids contains row {ids[dup[0]]} more than once; sum its scores first")
    return SparseScores(ids, vals, num_rows)


def check_positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return value


def check_count(name: str, value, upper: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if not 1 <= value <= upper:
        raise ValueError(f"{name} must be in [1, {upper}], got {value}")
    return value


def complement_ids(ranks: np.ndarray, touched_sorted: np.ndarray) -> np.ndarray:
    """Map ranks within the untouched rows (0-based, ascending id order) to row ids.

    With sorted touched ids t_0 < t_1 < ..., the untouched row of rank r is
    r + #{i : t_i - i <= r}; one searchsorted, O(len(ranks) · log m).
    """
    ranks = np.asarray(ranks, dtype=np.int64)
    if touched_sorted.size == 0:
        return ranks
    shifted = touched_sorted - np.arange(touched_sorted.size, dtype=np.int64)
    return ranks + np.searchsorted(shifted, ranks, side="right")


def sample_untouched(num_rows: int, touched_sorted: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` distinct untouched row ids, uniformly at random (without replacement), in
    uniformly random order (a random ordered sample: any prefix is a uniform subset).

    O(count) expected for count ≪ num_rows (numpy's Floyd sampling), independent of num_rows.
    """
    available = num_rows - touched_sorted.size
    if count > available:
        raise ValueError(f"cannot sample {count} untouched rows: only {available} exist")
    if count == 0:
        return np.empty(0, dtype=np.int64)
    ranks = rng.choice(available, size=count, replace=False, shuffle=True)  # complement_ids keeps the order
    return complement_ids(ranks, touched_sorted)


def top_log_uniforms(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """log of the k largest of n i.i.d. Uniform(0,1), in decreasing order, in O(k).

    Rényi's representation: U_(n) = V_1^{1/n}, U_(n-i) = U_(n-i+1) · V_{i+1}^{1/(n-i)} with
    V_i i.i.d. uniform, i.e. log U_(n-i) = -Σ_{j<=i} E_j / (n - j), E_j ~ Exp(1).
    Working in log space keeps 1 - U accurate when n is 10^10.
    """
    k = min(int(k), int(n))
    if k <= 0:
        return np.empty(0)
    exps = rng.standard_exponential(k)
    denom = n - np.arange(k, dtype=np.float64)
    return -np.cumsum(exps / denom)


def gumbel_from_log_uniform(log_u: np.ndarray) -> np.ndarray:
    """Standard Gumbel quantile of U given log U: G = -log(-log U)."""
    return -np.log(-log_u)


def gaussian_from_log_uniform(log_u: np.ndarray) -> np.ndarray:
    """Standard normal quantile of U given log U, accurate in the upper tail.

    Φ⁻¹(U) = -Φ⁻¹(1 - U) with 1 - U = -expm1(log U) computed without cancellation.
    """
    return -special.ndtri(-np.expm1(log_u))


def top_k_merge(touched_noisy: np.ndarray, untouched_noisy: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """Indices (into touched_noisy) of touched rows in the top-k of the union, and how many
    untouched values made it into the top-k. Ties have probability zero (continuous noise)."""
    merged = np.concatenate([touched_noisy, untouched_noisy])
    if k >= merged.size:
        top = np.arange(merged.size)
    else:
        top = np.argpartition(-merged, k - 1)[:k]
    m = touched_noisy.size
    touched_idx = np.sort(top[top < m])
    return touched_idx, int(np.count_nonzero(top >= m))


def unique_ints(values: np.ndarray, *, return_inverse: bool = False, upper: int | None = None):
    """np.unique for 1-D non-negative integer arrays: the sorted distinct values (and, with
    `return_inverse`, each value's index among them), identical to np.unique's result.

    numpy ≥ 2.3 answers np.unique of integers with a hash table that is several times slower
    than one sort at the sizes of a step (10^4–10^6 ids). With `upper` (every value < upper)
    and upper not much larger than the input, a mark-and-cumsum pass replaces the sort."""
    values = np.asarray(values).reshape(-1)
    if upper is not None and upper <= 4 * values.size + 4096:
        marked = np.zeros(int(upper), dtype=bool)
        marked[values] = True
        distinct = np.flatnonzero(marked).astype(values.dtype, copy=False)
        if not return_inverse:
            return distinct
        position = np.cumsum(marked, dtype=np.int64) - 1
        return distinct, position[values]
    if not return_inverse:
        ordered = np.sort(values)
        keep = np.empty(ordered.size, dtype=bool)
        keep[:1] = True
        np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
        return ordered[keep]
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    first = np.empty(ordered.size, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(values.size, dtype=np.int64)
    inverse[order] = np.cumsum(first) - 1
    return ordered[first], inverse
