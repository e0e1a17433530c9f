"""The noise part of a step's privacy event: what `calibrate` is given as σ ↦ event and what the
engine budgets and records (trainer/engine/engine.py), so the two cannot drift apart.

- the gradient noise: GaussianDpEvent(σ), or ModelMixDpEvent(σ, w, k) when train.modelmix
  mixes every noised coordinate over an enforced gap of w update sensitivities, k > 1 with the
  refined clipping (privacy.mix_coordinates; trainer/engine/modelmix.py; accounting/modelmix.py);
- preceded, with privacy.clip_norm = "adaptive", by that step's DP-STAT counts
  (trainer/engine/adaptive_clip.py), on the same Poisson sample.
The selection event, when there is one, is composed in front by `sampled_step_event`.
"""

from __future__ import annotations

from typing import Optional

from widedp.accounting import events as ev
from widedp.accounting.modelmix import ModelMixDpEvent


def step_noise_event(sigma: float, clip_event: Optional[ev.DpEvent] = None, mix_width: float = 0.0,
                     mix_coordinates: int = 1) -> ev.DpEvent:
    """The step's noise event for noise multiplier σ (see the module docstring); `mix_coordinates`
    k > 1: ModelMix with refined clipping (every coordinate clamped to S1/√k; Cor 4.1)."""
    if mix_coordinates != 1 and not mix_width > 0:
        raise ValueError("refined clipping (mix_coordinates > 1) is accounted only with ModelMix (mix_width > 0)")
    noise: ev.DpEvent = (ModelMixDpEvent(sigma, mix_width, mix_coordinates) if mix_width > 0
                         else ev.GaussianDpEvent(sigma))
    return noise if clip_event is None else ev.ComposedDpEvent([clip_event, noise])


__all__ = ["step_noise_event"]
