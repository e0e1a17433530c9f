"""Adaptive S1 by DP-STAT on each step's batch (privacy.clip_norm = "adaptive"; seed C).

Privacy assumption: add/remove one example, Poisson sampling at rate q. At each step, before
the clip factors, every sampled example's whole-gradient norm ‖g_j‖ (embedding rows + dense
parameters, at the published state) is compared with the public candidates γ_i = θ·2^i,
i = 0..J. The counts a_i = |{j : ‖g_j‖ > γ_i}| each move by at most 1 when one example is added
or removed (ℓ2 sensitivity √(J+1) for the vector); each gets N(0, σ_c²) from a secret stream and
S1 is the first γ_i whose noisy count is ≤ τ = σ_c·√(2·log(2(J+1)/β)) (γ_J if none) — exactly
`adaptive_clipping.dp_stat` (seed Alg 3 / Lemma 3.10, reconstructed there), computed here from
per-trainer counts that add up to the counts of the whole sample.

Accounting: the counts and the step's mechanisms read the same Poisson sample, so the step is
PoissonSampled(q, Composed([DP-STAT, selection, Gaussian])) — an adaptive composition inside one
sampled mechanism, as the selection already is (docs/DESIGN.md §1.6). The S1 the counts pick
sets the clip factors min(1, S1/‖g_j‖), the selector's sensitivity S1/b and the noise std
σ·S1/b, so the Gaussian's noise multiplier σ — and its event — do not change with S1. DP-STAT's
event is SelfComposed(Gaussian(σ_c), J+1): calibration spends it too (`noise_event`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from widedp.accounting import events as ev
from widedp.adaptive_clipping.dp_stat import counts_above, dp_stat_event, first_below, grid, stopping_threshold


@dataclasses.dataclass(frozen=True)
class AdaptiveClip:
    """The public parameters of the per-step DP-STAT: candidates θ·2^i (i ≤ J), count noise
    std σ_c and failure probability β of the stopping width."""

    theta: float
    num_doublings: int
    count_noise: float
    beta: float = 0.05
    # S_ref: with it, each step's learning rates are multiplied by S_ref/S1 (the update has the
    # scale of a step at S1 = S_ref, whatever S1 DP-STAT picks); None: the configured rates.
    lr_reference: Optional[float] = None

    def __post_init__(self):
        for name in ("theta", "count_noise"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"AdaptiveClip.{name} must be a finite number > 0, got {value!r}")
        if isinstance(self.num_doublings, bool) or not isinstance(self.num_doublings, int) or self.num_doublings < 0:
            raise ValueError(f"AdaptiveClip.num_doublings must be an integer >= 0, got {self.num_doublings!r}")
        if self.lr_reference is not None and not (math.isfinite(self.lr_reference) and self.lr_reference > 0):
            raise ValueError(f"AdaptiveClip.lr_reference must be > 0 or None, got {self.lr_reference!r}")
        if not 0 < self.beta < 1:
            raise ValueError(f"AdaptiveClip.beta must be in (0, 1), got {self.beta!r}")

    @property
    def candidates(self) -> np.ndarray:
        return grid(self.theta, self.num_doublings)

    @property
    def threshold(self) -> float:
        """τ: the stop rule's width (data-independent)."""
        return stopping_threshold(self.count_noise, self.num_doublings, self.beta)

    @property
    def event(self) -> ev.DpEvent:
        """One step's DP-STAT: J+1 Gaussian counts of sensitivity 1."""
        return dp_stat_event(self.count_noise, self.num_doublings)

    def counts(self, sq_norms: np.ndarray) -> np.ndarray:
        """a_i over one trainer's examples, from their squared whole-gradient norms (not private:
        it never leaves the coordinator before `choose` noises the total)."""
        return counts_above(np.sqrt(np.asarray(sq_norms, dtype=np.float64)), self.candidates)

    def choose(self, counts: np.ndarray, rng: np.random.Generator) -> tuple[float, ev.DpEvent]:
        """(S1, the event that ran) from the summed counts of every trainer: a_i + N(0, σ_c²),
        the first candidate at or below τ (the last candidate if none)."""
        counts = np.asarray(counts, dtype=np.float64)
        if counts.shape != (self.num_doublings + 1,):
            raise ValueError(f"counts must have shape ({self.num_doublings + 1},), got {counts.shape}")
        index = first_below(counts + rng.normal(0.0, self.count_noise, size=counts.size), self.threshold)
        return float(self.candidates[index]), self.event


def adaptive_clip_from_config(privacy, expected_batch_size: float) -> Optional[AdaptiveClip]:
    """The run's AdaptiveClip when privacy.clip_norm = "adaptive" (count noise "auto":
    0.05·b — public), else None."""
    if privacy.clip_norm != "adaptive":
        return None
    noise = privacy.resolved("adaptive_clip_noise") or 0.05 * float(expected_batch_size)
    return AdaptiveClip(float(privacy.adaptive_clip_min), int(privacy.adaptive_clip_doublings), float(noise),
                        float(privacy.adaptive_clip_beta), privacy.adaptive_clip_lr_reference)


__all__ = ["AdaptiveClip", "adaptive_clip_from_config"]
