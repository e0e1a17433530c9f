"""The dense parameters' update: the dense optimizer at this step's learning rate, the exponential
moving average of the iterates (`train.ema_decay`) and ModelMix's mixing of the two latest states
(`train.modelmix`, trainer/engine/modelmix.py).

Privacy assumption: the gradient handed to `step` is already clipped and noised (the step's
Gaussian: trainer/engine/noise_stage.py); what happens here is post-processing of a released
update, except ModelMix's mixing weights α, which are secret (their stream is the run's
"modelmix" key) — ModelMix's ε holds only while they stay secret.
"""

from __future__ import annotations

from typing import Optional

import torch

from widedp.selection.keyed_random import NoiseKey
from widedp.trainer.engine.layout import row_block_uniform
from widedp.trainer.engine.modelmix import mix


class DenseUpdater:
    """The dense optimizer, the average of the iterates and ModelMix's previous state."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema_decay: float = 0.0,
                 mix_key: Optional[NoiseKey] = None):
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        self.model, self.optimizer, self.mix_key = model, optimizer, mix_key
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.ema_decay = float(ema_decay)
        self.ema: Optional[dict] = (
            {n: p.detach().clone() for n, p in model.named_parameters()} if self.ema_decay > 0 else None)
        self.mix_previous: Optional[dict] = None  # ModelMix: the dense parameters' θ_{t-2}

    def step(self, grads: dict, lr_scale: float, step_count: int, mix_gap: Optional[float] = None) -> None:
        """One update with `grads` (by parameter name) at the configured rates × `lr_scale`;
        with `mix_gap`, ModelMix first (step `step_count`'s mixing weights)."""
        for n, p in self.model.named_parameters():
            p.grad = grads[n].view_as(p).to(p.dtype)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * lr_scale
        if mix_gap is not None:
            self._mix(mix_gap, step_count)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    self.ema[n].mul_(self.ema_decay).add_(p.detach(), alpha=1 - self.ema_decay)

    def _mix(self, gradient_gap: float, step_count: int) -> None:
        """ModelMix on the dense parameters (trainer/engine/modelmix.py): each parameter starts the
        update from the secret mix of its two latest states over a gap of lr·gradient_gap; α of
        parameter i at step t from the counter-based stream (mix key, "modelmix-dense", t, i)."""
        if self.mix_key is None:
            raise RuntimeError("ModelMix needs the run's mixing key")
        if not isinstance(self.optimizer, torch.optim.SGD) or any(
                g.get("momentum", 0) or g.get("weight_decay", 0) for g in self.optimizer.param_groups):
            raise ValueError("ModelMix needs plain SGD for the dense parameters (no momentum, no weight decay)")
        lr_of = {id(p): g["lr"] for g in self.optimizer.param_groups for p in g["params"]}
        if self.mix_previous is None:  # θ_{t-2} = θ_{t-1} = θ_0 at the first step
            self.mix_previous = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        with torch.no_grad():
            for i, (n, p) in enumerate(self.model.named_parameters()):
                if not p.numel():
                    continue
                if id(p) not in lr_of:
                    raise ValueError(f"ModelMix: dense parameter {n!r} is not updated by the dense optimizer, "
                                     "so it would not be noised and mixed")
                alpha = row_block_uniform(self.mix_key, "modelmix-dense", step_count, i, 0, p.numel(), 1)
                current = p.detach().clone()
                p.copy_(mix(current, self.mix_previous[n], lr_of[id(p)] * gradient_gap, alpha.view_as(p)))
                self.mix_previous[n] = current

    def released_params(self, averaged: Optional[bool] = None) -> dict:
        """The dense parameters evaluated and exported: the averaged ones (ema_decay > 0, the
        default there) or the last iterate's."""
        averaged = self.ema is not None if averaged is None else averaged
        if averaged and self.ema is None:
            raise ValueError("averaged evaluation needs ema_decay > 0")
        return (self.ema if averaged else None) or dict(self.model.named_parameters())
