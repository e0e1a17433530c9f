"""Exponential-mechanism top-k selected on the shards that own the rows, merged exactly.

Privacy assumption: that of `selection.exponential.exponential_top_k` — add/remove-one
neighbouring datasets, utilities u_r (untouched rows: 0) whose ℓ∞ change between neighbours is
at most the sensitivity Δ the scale ε''/(2Δ) was computed from, and each shard drawing its noise
from its own stream, independent of every other shard's (e.g. `SeedSequence(seed, (step, shard))`)
and secret. The event is `ExponentialTopKDpEvent(ε'', k)`, exactly as for `exponential_top_k`.

The mechanism. The vocabulary of p rows is partitioned across S shards; shard s owns p_s rows,
[0, p_s) in its own local ids. The exponential mechanism's top-k (k draws without replacement,
each ∝ exp(ε''·u_r/(2Δ))) is the one-shot Gumbel top-k: the k rows with the largest
scale·u_r + G_r over all p rows, G_r i.i.d. standard Gumbel. Each shard draws the G_r of its own
rows and returns its top-min(k, p_s) rows with their noisy values (`gumbel_top_k_candidates`,
sparse as `exponential_top_k`: O(m_s + k) for m_s touched rows, whatever p_s); the coordinator
keeps the k largest of the union (`merge_top_k`).

Exactness. A global winner has at most k - 1 larger noisy values in the whole vocabulary, so
fewer than k in its own shard: it is among its shard's top-min(k, p_s). Hence the top-k of the
union of the shards' candidates *is* the global top-k, draw by draw. Which process draws a row's
Gumbel does not change the joint law of the G_r (independent across rows, the shards' streams
independent), and each shard's candidates — the untouched ones included: a uniformly random
ordered sample of its untouched rows assigned to the decreasing order statistics of their
Gumbels, exchangeable rows — have the law of the dense top-min(k, p_s). So the merged set has
the distribution of `exponential_top_k` over all p rows, and the same event.

What is seen and what is released. The coordinator sees each shard's candidates *with their
noisy values*. The coordinator and the shards are processes of one run, inside the trust
boundary (docs/THREAT_MODEL.md): the noisy values are internal to the run, never released,
logged or written out. Only the merged id set is released (and used), so what the run releases is
exactly `exponential_top_k`'s output and its event covers it. Releasing the noisy values too
would be another mechanism, not accounted for here.

Pure library: numpy only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from widedp.selection._sparse import check_count, check_positive, check_sparse_input
from widedp.selection.exponential import gumbel_top_k

_MAX_K = np.iinfo(np.int64).max


@dataclasses.dataclass(frozen=True, eq=False)
class ShardCandidates:
    """One shard's top-min(k, p_s) rows: `ids` (int64, distinct) and their noisy values
    scale·u_r + G_r (`noisy`, float64, aligned). Ids are the shard's local ids until it maps
    them to global ids with `remap`. Internal to the run (module docstring): never released."""

    ids: np.ndarray
    noisy: np.ndarray

    def __post_init__(self):
        ids = np.asarray(self.ids)
        if ids.ndim != 1:
            raise ValueError(f"ShardCandidates.ids must be 1-D, got shape {ids.shape}")
        if ids.size and ids.dtype.kind not in "iu":
            raise ValueError(f"ShardCandidates.ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        noisy = np.asarray(self.noisy, dtype=np.float64)
        if noisy.shape != ids.shape:
            raise ValueError(f"ShardCandidates.noisy has shape {noisy.shape} but ids has shape {ids.shape}")
        if np.isnan(noisy).any():
            raise ValueError("ShardCandidates.noisy contains NaN")
        if ids.size > 1:
            ordered = np.sort(ids)
            if (ordered[1:] == ordered[:-1]).any():
                raise ValueError("ShardCandidates.ids contains a row more than once")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "noisy", noisy)

    def __len__(self) -> int:
        return int(self.ids.size)

    def remap(self, ids) -> ShardCandidates:
        """A copy with `ids` (aligned with `self.ids`) in place of the ids: how a shard maps
        its local ids to global ids."""
        return ShardCandidates(np.asarray(ids), self.noisy)


def gumbel_top_k_candidates(touched_ids, scores, num_rows: int, k: int, scale: float,
                            rng: np.random.Generator) -> ShardCandidates:
    """The top-min(k, num_rows) rows of [0, num_rows) by scale·u_r + Gumbel_r, with their noisy
    values (untouched rows have u = 0): one shard's candidates for `merge_top_k`.

    `touched_ids`: distinct local ids with a utility, `scores` their utilities (aligned);
    `scale` = ε''/(2Δ) (`selection.exponential.exponential_scale`). Sparse exactly as
    `exponential_top_k` (they share `selection.exponential.gumbel_top_k`): expected cost
    O(m + k), independent of num_rows. The untouched candidates are a uniformly random ordered
    sample of the untouched rows assigned to the decreasing top order statistics of their
    Gumbels. Candidates are in no particular order.
    """
    sparse = check_sparse_input(touched_ids, scores, num_rows)
    k = min(check_count("k", k, _MAX_K), sparse.num_rows)
    scale = check_positive("scale", scale)
    ids, noisy = gumbel_top_k(sparse, k, scale, rng)
    return ShardCandidates(ids, noisy)


def merge_top_k(parts: list[ShardCandidates], k: int) -> np.ndarray:
    """The k ids (global, sorted, int64) with the largest noisy values over all the shards'
    candidates: the global Gumbel top-k when each shard gave its top-min(k, p_s) (module
    docstring). `parts` must hold global ids (`ShardCandidates.remap`), disjoint across shards,
    and at least k candidates in total."""
    k = check_count("k", k, _MAX_K)
    for i, part in enumerate(parts):
        if not isinstance(part, ShardCandidates):
            raise TypeError(f"parts[{i}] is a {type(part).__name__}, not ShardCandidates")
    ids = np.concatenate([p.ids for p in parts] or [np.empty(0, np.int64)])
    noisy = np.concatenate([p.noisy for p in parts] or [np.empty(0)])
    if ids.size < k:
        raise ValueError(f"the {len(parts)} shard(s) returned {ids.size} candidates in total, fewer than k={k}: "
                         f"each shard must return its top min(k, its rows) (and the shards must own at least k rows)")
    sorted_ids = np.sort(ids)
    dup = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
    if dup.size:
        raise ValueError(f"row {int(sorted_ids[dup[0]])} is a candidate of more than one shard: map each shard's "
                         f"local ids to its own (disjoint) global ids (ShardCandidates.remap) before merging")
    top = np.arange(ids.size) if k == ids.size else np.argpartition(-noisy, k - 1)[:k]
    return np.sort(ids[top])
