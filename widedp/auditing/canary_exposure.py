"""Canary exposure: how much a trained model prefers inserted secrets over random candidates.

Carlini, Liu, Erlingsson, Kos & Song, "The Secret Sharer" (USENIX Security 2019); widedp's seed
paper uses it in §6.5. A canary is a phrase drawn at random from a space of candidates (e.g. a
random number in a fixed template) and inserted n_c times into the training data; reference
phrases are drawn from the same space and never inserted. The model scores every phrase by its
log-perplexity P(c) = −Σ_i log Pr(c_i | c_<i) (`log_perplexity`, natural log; ranks do not depend
on the base).

What is assumed and what the test says. Null hypothesis: the model did not memorize the
canaries, i.e. each canary's log-perplexity is exchangeable with the references' (same
distribution, drawn independently). Under the null, with continuous scores, a canary's rank
among the N = (references + itself) candidates is uniform on 1..N, so:

* exposure = log2 N − log2 rank has mean ≈ 1/ln 2 ≈ 1.44 bits (exactly log2 N − log2(N!)/N);
  memorization pushes ranks towards 1 and exposure towards log2 N;
* the ranks of n canaries are n independent uniform draws, and `rank_uniformity_test` is
  Pearson's χ² test of their histogram against the uniform one: P[p-value < a] ≤ a
  (asymptotically: the χ² approximation, valid when every bin expects ≥ 5 ranks, which is
  enforced). `flagged` is p < 0.01 — any departure from uniformity, in either direction; the
  mean exposure says which (above ≈ 1.44 bits: canaries ranked too well).

Ties are counted against the canary: its rank is 1 + the number of references whose
log-perplexity is ≤ its own. So exposure is never overstated (a model that scores everything
alike gives every canary rank N and exposure 0, not log2 N), at the price of ranks that run
high when scores are discrete: the uniformity test assumes ties are rare, and heavily tied
scores can be flagged with a mean exposure *below* the null's.

Exposure here is the exact rank among the given references (Carlini et al.'s §4 extrapolation to
a space too large to enumerate is not done): with N − 1 references it is at most log2 N bits.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable, Sequence

import numpy as np
from scipy import special, stats

# `CanaryExposureReport.flagged` is p-value < FLAG_LEVEL.
FLAG_LEVEL = 0.01
# Pearson's χ² approximation needs at least this many expected ranks in every bin.
MIN_EXPECTED_PER_BIN = 5.0
# log_prob_fn's vector must be a log-distribution: |logsumexp| below this (float32-safe).
_NORMALIZATION_TOLERANCE = 1e-3


def _scores(name: str, values: object) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of log-perplexities, got shape {a.shape}")
    if np.isnan(a).any():
        raise ValueError(f"{name} must not contain NaN")
    return a


def _num_candidates(num_candidates: object) -> int:
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, numbers.Integral) or int(num_candidates) < 1:
        raise ValueError(f"num_candidates must be an integer >= 1, got {num_candidates!r}")
    return int(num_candidates)


def _ranks(ranks: object, num_candidates: int) -> np.ndarray:
    a = np.asarray(ranks)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"ranks must be a non-empty 1-D integer array, got dtype {a.dtype} and shape {a.shape}")
    if a.min() < 1 or a.max() > num_candidates:
        raise ValueError(f"ranks must lie in 1..num_candidates={num_candidates}, got {a.min()}..{a.max()}")
    return a.astype(np.int64)


def canary_ranks(canary_scores: Sequence[float] | np.ndarray, reference_scores: Sequence[float] | np.ndarray) -> np.ndarray:
    """Each canary's rank (1 = lowest log-perplexity) among the references plus itself.

    `canary_scores`: log-perplexities of the inserted canaries; `reference_scores`: those of
    never-inserted candidates from the same space. Other canaries do not count. Ties count
    against the canary: rank = 1 + #{references with log-perplexity ≤ the canary's} (module
    docstring). The number of candidates is len(reference_scores) + 1.
    """
    canaries = _scores("canary_scores", canary_scores)
    references = np.sort(_scores("reference_scores", reference_scores))
    return 1 + np.searchsorted(references, canaries, side="right").astype(np.int64)


def exposure(ranks: Sequence[int] | np.ndarray, num_candidates: int) -> np.ndarray:
    """log2(num_candidates) − log2(rank), per canary: from 0 (ranked last) to log2 N (ranked first).

    `ranks`: 1-based ranks (e.g. `canary_ranks`); `num_candidates` N: candidates each rank is
    taken among (references + 1 for `canary_ranks`).
    """
    n = _num_candidates(num_candidates)
    return math.log2(n) - np.log2(_ranks(ranks, n).astype(np.float64))


def _bin_sizes(num_candidates: int, bins: int) -> np.ndarray:
    """How many of the ranks 1..N fall in each of `bins` equal-width bins: rank k is in bin
    ⌊(k − 1)·bins / N⌋, so bin j holds ⌈(j + 1)N / bins⌉ − ⌈jN / bins⌉ ranks."""
    edges = [-((-j * num_candidates) // bins) for j in range(bins + 1)]  # exact ceilings
    return np.diff(np.asarray(edges, dtype=np.float64))


def rank_uniformity_test(ranks: Sequence[int] | np.ndarray, num_candidates: int, bins: int) -> tuple[float, float]:
    """Pearson's χ² of the rank histogram against the uniform distribution on 1..N.

    `ranks`: 1-based ranks of the canaries; `num_candidates` N; `bins`: equal-width bins over
    1..N (expected count of bin j: n · (ranks in bin j) / N, exact when N is not a multiple of
    `bins`). Returns (χ² statistic, p-value) with bins − 1 degrees of freedom
    (scipy.stats.chisquare). ValueError when a bin expects fewer than 5 ranks.
    """
    n_cand = _num_candidates(num_candidates)
    r = _ranks(ranks, n_cand)
    if isinstance(bins, bool) or not isinstance(bins, numbers.Integral) or not 2 <= int(bins) <= n_cand:
        raise ValueError(f"bins must be an integer in 2..num_candidates={n_cand}, got {bins!r}")
    bins = int(bins)
    if n_cand * bins >= 2**62:
        raise ValueError(f"num_candidates * bins must stay below 2**62, got {n_cand} * {bins}")
    expected = r.size * _bin_sizes(n_cand, bins) / n_cand
    if expected.min() < MIN_EXPECTED_PER_BIN:
        raise ValueError(
            f"bins={bins} expects {expected.min():.3g} ranks in some bin for {r.size} ranks; Pearson's χ² "
            f"needs >= {MIN_EXPECTED_PER_BIN:g} per bin: use fewer bins or more canaries"
        )
    observed = np.bincount((r - 1) * bins // n_cand, minlength=bins).astype(np.float64)
    result = stats.chisquare(observed, expected)
    return float(result.statistic), float(result.pvalue)


@dataclasses.dataclass(frozen=True)
class CanaryExposureReport:
    """Exposure of `canaries` distinct canaries, each inserted `insertions` times (n_c).

    `num_candidates` N (references + 1); `mean_exposure` / `median_exposure` in bits (null mean
    ≈ 1.44); `chi2`, `p_value`: `rank_uniformity_test` with `bins` bins; `flagged`: p < 0.01.
    """

    canaries: int
    insertions: int
    num_candidates: int
    bins: int
    mean_exposure: float
    median_exposure: float
    chi2: float
    p_value: float
    flagged: bool = dataclasses.field(init=False)

    def __post_init__(self):
        for name in ("canaries", "insertions", "num_candidates", "bins"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0.0 <= self.p_value <= 1.0:
            raise ValueError(f"p_value must be in [0, 1], got {self.p_value!r}")
        object.__setattr__(self, "flagged", bool(self.p_value < FLAG_LEVEL))


def exposure_report(
    canary_scores: Sequence[float] | np.ndarray,
    reference_scores: Sequence[float] | np.ndarray,
    insertions: int,
    bins: int,
) -> CanaryExposureReport:
    """Ranks, exposures and the uniformity test of `canary_scores` against `reference_scores`
    (log-perplexities, see `canary_ranks`); `insertions`: times each canary was inserted."""
    ranks = canary_ranks(canary_scores, reference_scores)
    n_cand = int(np.asarray(reference_scores).size) + 1
    exp = exposure(ranks, n_cand)
    chi2, p = rank_uniformity_test(ranks, n_cand, bins)
    return CanaryExposureReport(
        canaries=int(ranks.size), insertions=insertions, num_candidates=n_cand, bins=int(bins),
        mean_exposure=float(exp.mean()), median_exposure=float(np.median(exp)), chi2=chi2, p_value=p,
    )


def log_perplexity(log_prob_fn: Callable[[tuple[int, ...]], np.ndarray], phrase: Sequence[int]) -> float:
    """P(c) = −Σ_i log Pr(c_i | c_<i) (nats) of the token sequence `phrase`.

    `log_prob_fn(context)`: the model's log-probabilities (a 1-D vector over the vocabulary that
    sums to 1 after exp) of the next token after the tuple of token ids `context` (empty for the
    first token; a model needing a start token adds it itself). `phrase`: token ids, non-empty.
    +inf when the model gives some token probability 0.
    """
    if len(phrase) == 0 or any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in phrase):
        raise ValueError(f"phrase must be a non-empty sequence of integer token ids, got {phrase!r}")
    tokens = [int(t) for t in phrase]
    total = 0.0
    for i, token in enumerate(tokens):
        log_probs = np.asarray(log_prob_fn(tuple(tokens[:i])), dtype=np.float64)
        if log_probs.ndim != 1 or log_probs.size == 0 or np.isnan(log_probs).any() or (log_probs > _NORMALIZATION_TOLERANCE).any():
            raise ValueError(
                f"log_prob_fn must return a 1-D vector of log-probabilities (<= 0, no NaN), got shape "
                f"{log_probs.shape} after context of length {i}"
            )
        norm = float(special.logsumexp(log_probs))
        if abs(norm) > _NORMALIZATION_TOLERANCE:
            raise ValueError(
                f"log_prob_fn must return normalized log-probabilities (logsumexp = 0), got logsumexp = {norm:.4g} "
                f"after context of length {i}: logits need a log_softmax"
            )
        if not 0 <= token < log_probs.size:
            raise ValueError(f"phrase token {token} at position {i} is outside the vocabulary of size {log_probs.size}")
        total -= float(log_probs[token])
    return total
