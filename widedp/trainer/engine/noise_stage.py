"""The step's clip norm and Gaussian noise (docs/DESIGN.md §1 steps 1 and 4): this step's S1 —
fixed, or chosen privately by DP-STAT (`privacy.clip_norm = "adaptive"`) from the trainers'
counts —, the S2 clip and the noise on the selected rows, the dense parameters and the touched
rows of the dense tables (`selection.noisy_step`, the one audited path), and the event the
noise ran.

Privacy assumption: sums are normalized by the expected batch size b; the noise std is σ times
the sensitivity `noisy_step` derives (min(S1/b, 2·S2) with a second clip); DP-STAT's counts are
noised from the run's secret clip stream and charged with the step.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from widedp.accounting import events as ev
from widedp.selection import NoisyStep, noisy_step
from widedp.selection.keyed_random import GaussianStream
from widedp.trainer.engine.adaptive_clip import AdaptiveClip
from widedp.trainer.engine.plan import PrivacyPlan
from widedp.trainer.engine.step_noise import step_noise_event


class NoiseStage:
    """One engine's clip norm and noise (private modes; a non-private step skips both)."""

    def __init__(self, *, mode: str, plan: Optional[PrivacyPlan], expected_batch_size: float,
                 noise_gen: GaussianStream, clip_rng: np.random.Generator, secure: bool, noise_dense_tables: bool):
        self.mode, self.plan, self.b = mode, plan, float(expected_batch_size)
        self.noise_gen, self.clip_rng, self.secure = noise_gen, clip_rng, secure
        self.noise_dense_tables = noise_dense_tables
        # This step's S1: the plan's, or DP-STAT's choice and event (privacy.clip_norm = "adaptive").
        self.step_clip: Optional[float] = plan.clip_norm if plan is not None else None
        self.clip_event: Optional[ev.DpEvent] = None

    def clip(self) -> float:
        """This step's S1 (private phases only)."""
        if self.step_clip is None:
            raise RuntimeError("a private step phase ran before this step's S1 was set")
        return self.step_clip

    def chooser(self) -> Optional["DpStatChooser"]:
        """This step's DP-STAT (privacy.clip_norm = "adaptive"), else None (S1 fixed)."""
        if self.plan is None or self.plan.adaptive_clip is None:
            return None
        return DpStatChooser(self, self.plan.adaptive_clip)

    def noise(self, delta_rows: torch.Tensor, dense_grads: dict, dense_table_rows: torch.Tensor) -> Optional[NoisyStep]:
        """The audited Gaussian step (`selection.noisy_step`) over one vector: the selected rows
        (noised here), the dense parameters (noised here) and the touched rows of the dense
        tables (scaled here, noised on the shards with the same std); None in non-private mode."""
        if self.mode == "nonprivate":
            return None
        p = self.plan
        assert p is not None
        return noisy_step(delta_rows, dense_grads, p.noise_multiplier, self.clip(), self.b, p.second_clip_norm,
                          self.noise_gen, secure=self.secure,
                          shard_noised=dense_table_rows if self.noise_dense_tables else None)

    def ran_event(self, gaussian: ev.DpEvent) -> ev.DpEvent:
        """The noise event this step ran: the Gaussian `noisy_step` returned (as ModelMix's
        with the gap the mixing enforced, train.modelmix), after this step's DP-STAT."""
        p = self.plan
        assert p is not None
        noise = gaussian
        if p.mix_width > 0:
            assert isinstance(gaussian, ev.GaussianDpEvent)
            noise = step_noise_event(gaussian.noise_multiplier, None, p.mix_width, p.mix_coordinates)
        return noise if self.clip_event is None else ev.ComposedDpEvent([self.clip_event, noise])

    def mix_gap(self, noisy: Optional[NoisyStep]) -> Optional[float]:
        """ModelMix's enforced gap in gradient units, w·S with S this step's ℓ2 sensitivity
        (noise std / σ); each block of parameters multiplies it by its learning rate. None:
        no mixing."""
        p = self.plan
        if noisy is None or p is None or p.mix_width <= 0:
            return None
        return p.mix_width * noisy.std / p.noise_multiplier

    def lr_multiplier(self) -> float:
        """S_ref/S1 when an adaptive S1 normalizes the update (privacy.adaptive_clip_lr_reference;
        public post-processing of DP-STAT's output), so the step moves as far as one at the
        reference S1 would; else 1."""
        p = self.plan
        if p is None or p.adaptive_clip is None or p.adaptive_clip.lr_reference is None:
            return 1.0
        return p.adaptive_clip.lr_reference / self.clip()


class DpStatChooser:
    """One step's DP-STAT at the coordinator: the trainers' summed counts of norms above the
    candidates, noised from the engine's secret clip stream; sets the stage's `step_clip`
    and the event that ran (trainer/engine/adaptive_clip.py)."""

    def __init__(self, stage: NoiseStage, adaptive: AdaptiveClip):
        self.stage, self.adaptive = stage, adaptive
        self.candidates = adaptive.candidates

    def __call__(self, counts: np.ndarray) -> float:
        clip, event = self.adaptive.choose(counts, self.stage.clip_rng)
        self.stage.step_clip, self.stage.clip_event = clip, event
        return clip
