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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def moment_sums(u: np.ndarray) -> np.ndarray:
    """[S1_1, S2_1, …, S1_F, S2_F]: the per-column sums of u and u² over the rows of u [n, F]
    (what one chunk adds to the release's sum vector)."""
    return np.stack([u.sum(axis=0), np.square(u).sum(axis=0)], axis=1).reshape(-1)


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


__all__ = ["ClipRange", "VAR_FLOOR", "mean_and_std", "moment_sums", "noisy_moment_sums", "normalized", "sensitivity"]
