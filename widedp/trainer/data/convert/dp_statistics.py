"""Differentially private standardization statistics (mean and std) of clipped dense columns.

Privacy assumption: add/remove-one-example neighbours; every value a column contributes lies
in its PUBLIC clip range [lo, hi] (the schema's `clip` transform, applied right before
`standardize`); the number of training examples n is public (as everywhere in widedp: the
summary's caveat). The release is one Gaussian mechanism, `GaussianDpEvent(σ)` (σ the noise
multiplier relative to the ℓ2 sensitivity below), which the converter records in dataset.json's
`privacy_events` so that training charges it before its first step.

Mechanism. Each column j is centred and scaled by its clip range, u = (x − c_j) / m_j with
c_j = (lo + hi)/2 and m_j = (hi − lo)/2, so u ∈ [−1, 1]. One example contributes the vector
(u_1, u_1², …, u_F, u_F²) to the sums (S1_j = Σ u, S2_j = Σ u²); its ℓ2 norm is at most
√(Σ_j (u_j² + u_j⁴)) ≤ √(2F) (|u| ≤ 1), the sensitivity Δ of the sum vector under add/remove
one. The release adds independent N(0, (σΔ)²) to each of the 2F sums (the Gaussian mechanism
of noise multiplier σ). Everything after is post-processing: mean_j = c_j + m_j·S̃1_j/n,
var_j = m_j²·max(S̃2_j/n − (S̃1_j/n)², VAR_FLOOR), std_j = √var_j.

The noise comes from the caller's generator: fresh OS entropy in the converter
(`NoiseKey.fresh(secure=True)`), a fixed key only in tests. tests/test_dp_statistics.py audits
the release (the worst-case neighbour moves the sums by Δ along (1, 1, …, 1); the optimal
half-space event at the claimed ε) and catches a variant that forgets the squares' part of Δ.

Per user (a data set with a privacy-unit column). Each user u with m_u training examples adds
the MEAN of their examples' vectors, i.e. every example is weighted 1/m_u (`UnitCounts`,
`moment_sums(u, weights)`), and the post-processing divides by the number of users U (public,
as n is at user level) instead of n: mean and std of the users' average values.

* Add/remove one user: the user's mean vector has coordinates u ∈ [−1, 1] and u² ∈ [0, 1],
  so its norm is ≤ √(2F) = Δ, the same Δ and the same `GaussianDpEvent(σ)` as above, now for
  a user however many examples they have.
* Add/remove one example x of a user (the release is also example-level DP with the SAME event,
  not through group privacy): a new user moves the sums by their mean, ≤ Δ; a user with
  m − 1 ≥ 1 other examples O changes from mean(O) to (v_x + (m − 1)·mean(O))/m, a move of
  (v_x − mean(O))/m, whose coordinates differ by ≤ 2 (u) and ≤ 1 (u²): norm ≤ √(5F)/m ≤
  √(5F)/2 < √(2F). So example-level training may charge it as it is.

tests/test_dp_statistics.py audits the per-user release with a user whose every example sits at
the top of the ranges and catches a variant that weights each example 1 (the per-example sums
under a user-level claim), and checks the example-level bound on every example of a data set
with the adversarial m = 2 case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

#: Floor of the normalized variance (in units of the clip half-range squared): a column whose
#: noisy variance is not positive gets std = 1e-3 · m_j instead of a division by ~0.
VAR_FLOOR = 1e-6


@dataclass(frozen=True)
class ClipRange:
    lo: float
    hi: float

    @property
    def center(self) -> float:
        return 0.5 * (self.lo + self.hi)

    @property
    def half_width(self) -> float:
        return 0.5 * (self.hi - self.lo)


def _centers_and_half_widths(ranges: list[ClipRange]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([r.center for r in ranges]), np.array([r.half_width for r in ranges])


def normalized(values: np.ndarray, ranges: list[ClipRange]) -> np.ndarray:
    """u = (x − c)/m per column of `values` [n, F] (each x already clipped to its range);
    a column of zero width (lo == hi) has u = 0: it carries no information."""
    center, half = _centers_and_half_widths(ranges)
    safe = np.where(half > 0, half, 1.0)
    u = (np.asarray(values, dtype=np.float64) - center) / safe
    return np.where(half > 0, np.clip(u, -1.0, 1.0), 0.0)


def moment_sums(u: np.ndarray, weights: Optional[np.ndarray] = None) -> np.ndarray:
    """[S1_1, S2_1, …, S1_F, S2_F]: the per-column sums of u and u² over the rows of u [n, F]
    (what one chunk adds to the release's sum vector); with `weights` [n] the weighted sums
    Σ w·u and Σ w·u² (per user: w = 1/m_u, `UnitCounts.weights`)."""
    if weights is None:
        return np.stack([u.sum(axis=0), np.square(u).sum(axis=0)], axis=1).reshape(-1)
    w = np.asarray(weights, dtype=np.float64)[:, None]
    return np.stack([(w * u).sum(axis=0), (w * np.square(u)).sum(axis=0)], axis=1).reshape(-1)


class UnitCounts:
    """Training examples per unit (user id, int64), counted chunk by chunk.

    Memory: 16 bytes per distinct unit (sorted ids and counts), plus each chunk's own uniques
    until they are merged (merges happen once the pending uniques outnumber the units merged so
    far, so the total merging work stays O(U log U) amortized over the chunks)."""

    def __init__(self) -> None:
        self._ids = np.empty(0, dtype=np.int64)
        self._counts = np.empty(0, dtype=np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_size = 0

    def add(self, units: np.ndarray) -> None:
        ids, counts = np.unique(np.asarray(units, dtype=np.int64), return_counts=True)
        self._pending.append((ids, counts.astype(np.int64)))
        self._pending_size += ids.size
        if self._pending_size > max(self._ids.size, 1 << 16):
            self._merge()

    def _merge(self) -> None:
        if not self._pending:
            return
        ids = np.concatenate([self._ids] + [i for i, _ in self._pending])
        counts = np.concatenate([self._counts] + [c for _, c in self._pending])
        self._ids, inverse = np.unique(ids, return_inverse=True)
        self._counts = np.bincount(inverse, weights=counts, minlength=self._ids.size).astype(np.int64)
        self._pending, self._pending_size = [], 0

    @property
    def num_units(self) -> int:
        self._merge()
        return int(self._ids.size)

    @property
    def num_examples(self) -> int:
        self._merge()
        return int(self._counts.sum())

    def weights(self, units: np.ndarray) -> np.ndarray:
        """1/m_u for each example's unit (every unit must have been counted)."""
        self._merge()
        units = np.asarray(units, dtype=np.int64)
        at = np.searchsorted(self._ids, units)
        found = (at < self._ids.size) & (self._ids[np.minimum(at, max(self._ids.size - 1, 0))] == units) \
            if self._ids.size else np.zeros(units.shape, dtype=bool)
        if not found.all():
            raise ValueError(f"unit {int(units[~found][0])} was not counted")
        return 1.0 / self._counts[at]


def sensitivity(num_columns: int) -> float:
    """ℓ2 sensitivity of the sum vector under add/remove one example: √(2F)."""
    return math.sqrt(2.0 * num_columns)


def noisy_moment_sums(sums: np.ndarray, noise_multiplier: float, rng: np.random.Generator) -> np.ndarray:
    """The Gaussian mechanism on the 2F moment sums: each plus N(0, (σ·√(2F))²). Its event is
    `GaussianDpEvent(noise_multiplier)` (add/remove one; module docstring)."""
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be finite and > 0, got {noise_multiplier}")
    sums = np.asarray(sums, dtype=np.float64)
    scale = noise_multiplier * sensitivity(sums.size // 2)
    return sums + rng.normal(0.0, scale, size=sums.shape)


def mean_and_std(noisy_sums: np.ndarray, n: int, ranges: list[ClipRange]) -> tuple[np.ndarray, np.ndarray]:
    """Post-processing of the noisy sums into each column's mean and std in the data's units."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    s = np.asarray(noisy_sums, dtype=np.float64).reshape(-1, 2) / n
    center, half = _centers_and_half_widths(ranges)
    mean = center + half * s[:, 0]
    var = np.maximum(s[:, 1] - np.square(s[:, 0]), VAR_FLOOR)
    std = np.where(half > 0, half * np.sqrt(var), 1.0)
    return mean, std


__all__ = ["ClipRange", "UnitCounts", "VAR_FLOOR", "mean_and_std", "moment_sums", "noisy_moment_sums", "normalized", "sensitivity"]
