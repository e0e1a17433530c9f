"""Gaussian partition selection ("DP set union"): which keys of a private data set to release.

Privacy assumption: add/remove-one neighbours, where the unit is one *document* (a sequence of
hashable keys, e.g. one line of text). Each document contributes weight 1 to each of its first
`max_keys_per_document` (m) distinct keys, in document order, and to nothing else. That choice
depends on the document alone (deterministic per document), so adding or removing a document
changes at most m counts by 1 each: the count vector has ℓ2 sensitivity √m. A document that
repeats a key many times still adds 1 to it.

Mechanism (Korolova et al. 2009; Gopi et al. 2020; Desfontaines, Voss, Gipson & Mandayam 2022):
add N(0, (σ·√m)²) to the count of every key present in the data and keep the keys whose noisy
count exceeds a threshold τ. A key present only in the added document has count exactly 1 and
passes with probability Φ̄((τ-1)/(σ√m)); there are at most m such keys, so

    δ_unseen = m · Φ̄((τ - 1)/(σ√m))   ⇔   τ = 1 + σ√m · Φ̄⁻¹(δ_unseen / m).

On the keys both neighbours have, the output is post-processing of a Gaussian mechanism with
noise multiplier σ; releasing any other key has probability ≤ δ_unseen. The privacy event is
`GaussianPartitionSelectionDpEvent(σ, δ_unseen)` (see its docstring for the composition
argument). Keys absent from the data are never released, so no vocabulary size enters.

Randomness comes from the `numpy.random.Generator` the caller passes in; the guarantee holds
only while its seed is secret (seed it from OS entropy, e.g. `secrets.randbits(128)`).
numpy's Gaussian sampler is not hardened against floating-point attacks (Mironov 2012).
Pure library: numpy and scipy only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Iterable

import numpy as np
from scipy import special

from widedp.accounting.events import GaussianPartitionSelectionDpEvent
from widedp.selection._sparse import check_count, check_positive


@dataclasses.dataclass(frozen=True)
class PartitionSelection:
    """Released keys, by decreasing noisy count, their noisy counts, τ and the privacy event.

    Unpacks as `keys, noisy_counts, event = gaussian_partition_selection(...)`.
    """

    keys: tuple
    noisy_counts: np.ndarray  # float64, aligned with `keys`, all > threshold
    threshold: float
    event: GaussianPartitionSelectionDpEvent

    def __iter__(self):
        return iter((self.keys, self.noisy_counts, self.event))


def check_unseen_delta(unseen_delta) -> float:
    if isinstance(unseen_delta, bool) or not isinstance(unseen_delta, (int, float, np.floating)):
        raise ValueError(f"unseen_delta must be a number, got {unseen_delta!r}")
    unseen_delta = float(unseen_delta)
    if not 0 < unseen_delta < 1:
        raise ValueError(f"unseen_delta must be in (0, 1), got {unseen_delta}")
    return unseen_delta


def partition_selection_threshold(noise_multiplier: float, max_keys_per_document: int,
                                  unseen_delta: float) -> float:
    """τ = 1 + σ√m · Φ̄⁻¹(δ_unseen / m): the smallest threshold (up to one float step) with
    m · Φ̄((τ - 1)/(σ√m)) ≤ δ_unseen (checked in floating point, nudged up if rounding fails it)."""
    sigma = check_positive("noise_multiplier", noise_multiplier)
    m = check_count("max_keys_per_document", max_keys_per_document, 2 ** 31)
    unseen_delta = check_unseen_delta(unseen_delta)
    std = sigma * math.sqrt(m)
    tau = 1.0 + std * float(-special.ndtri(unseen_delta / m))
    while unseen_key_release_probability(tau, sigma, m) > unseen_delta:
        tau = float(np.nextafter(tau, math.inf))
    return tau


def unseen_key_release_probability(threshold: float, noise_multiplier: float,
                                   max_keys_per_document: int) -> float:
    """Upper bound m · Φ̄((τ - 1)/(σ√m)) on P[some key of the added document only is released]."""
    std = noise_multiplier * math.sqrt(max_keys_per_document)
    return max_keys_per_document * float(special.ndtr(-(threshold - 1.0) / std))


def bounded_key_counts(documents: Iterable[Iterable[Hashable]], max_keys_per_document: int) -> dict:
    """key -> number of documents that count it, each counting its first m distinct keys.

    A document is read only up to its m-th distinct key. Keys appear in order of first use
    (deterministic for a given input), which fixes the order of the noise draws.
    """
    m = check_count("max_keys_per_document", max_keys_per_document, 2 ** 31)
    counts: dict = {}
    for document in documents:
        if isinstance(document, (str, bytes)):
            raise TypeError("each document must be a sequence of keys, not a str/bytes "
                            "(a string would be split into characters)")
        seen: set = set()
        for key in document:
            if key in seen:
                continue
            seen.add(key)
            counts[key] = counts.get(key, 0) + 1
            if len(seen) == m:
                break
    return counts


def gaussian_partition_selection(
    documents: Iterable[Iterable[Hashable]],
    *,
    noise_multiplier: float,
    max_keys_per_document: int,
    unseen_delta: float,
    rng: np.random.Generator,
) -> PartitionSelection:
    """Release the keys whose count + N(0, (σ√m)²) exceeds τ(σ, m, δ_unseen) (module docstring).

    Neighbouring relation: add/remove one document; ℓ2 sensitivity √m (m =
    `max_keys_per_document`); noise multiplier σ = `noise_multiplier`. Returns the kept keys
    by decreasing noisy count, their noisy counts, τ and
    `GaussianPartitionSelectionDpEvent(σ, unseen_delta)`.
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    m = check_count("max_keys_per_document", max_keys_per_document, 2 ** 31)
    unseen_delta = check_unseen_delta(unseen_delta)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    threshold = partition_selection_threshold(sigma, m, unseen_delta)
    counts = bounded_key_counts(documents, m)
    keys = list(counts)
    exact = np.fromiter(counts.values(), dtype=np.float64, count=len(keys))
    noisy = exact + rng.normal(0.0, sigma * math.sqrt(m), size=len(keys))
    kept = np.flatnonzero(noisy > threshold)
    kept = kept[np.argsort(-noisy[kept], kind="stable")]
    return PartitionSelection(keys=tuple(keys[i] for i in kept), noisy_counts=noisy[kept],
                              threshold=threshold,
                              event=GaussianPartitionSelectionDpEvent(sigma, unseen_delta))
