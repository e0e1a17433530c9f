"""ModelMix (seed B, Alg 1) in the engine: the secret mix of the two latest states (train.modelmix).

Privacy assumption (accounting/modelmix.py states the threat model in full): add/remove one
example, Poisson sampling; what is released is every state θ_t. Each step starts not from
θ_{t-1} but from θ̄ = θ_{t-2} + α⊙(θ_{t-1} − θ_{t-2}) with α ~ U[0, 1]^d fresh, secret and never
stored, after pushing every coordinate pair whose gap is below τ apart symmetrically about its
midpoint to gap exactly τ; the gradients are taken at the published θ_{t-1}; then
θ_t = θ̄ − lr·(clipped sum/b + noise). Per coordinate θ̄ is uniform on an interval of public
endpoints and width ≥ τ, so in units of the update's ℓ2 sensitivity lr·S/b (S = min(S1, 2·S2·b),
`selection.noise.step_sensitivity`) a step is the additive mechanism G + N(0, σ²) + U(0, w):
ModelMixDpEvent(σ, w, 1) with w = τ/(lr·S/b). The engine sets τ per block of coordinates from
that block's learning rate (tables: train.lr, dense parameters: train.dense_lr, times the
schedule) and this step's S, so every coordinate is mixed over w sensitivities exactly.

Where it applies: `dpsgd` mode only, where every table and every dense parameter is noised and
mixed every step (the config refuses the rest). In `sparse` mode the selected rows are not
mixed, and one example's clipped gradient can put its whole norm on them, so no amplification
could be claimed for the step — never claim it for coordinates that were not mixed.
Refined clipping (Alg 2, privacy.mix_coordinates = k > 1): after the ℓ2 clip to S1 every
coordinate of each example's gradient is clamped to ±S1/√k — on the shards per (example, row)
(`ShardGradients._clamped_row_sums64`) and on the trainers per dense parameter (the per-example
reference, `PerExampleGradients.clamped_sum`: ghost clipping never forms the coordinates) — and
the step is ModelMixDpEvent(σ, w, k) (Cor 4.1). Slower: per-example dense gradients.

α is counter-based (`trainer.engine.layout.row_block_uniform`): the draw for (step, block, coordinates) is a function of
the run's secret mix key only, so a shard that is restored and replays released steps mixes
the same way; the key itself is secret (trainer/engine/randomness.py) and never checkpointed in a
secret run.
"""

from __future__ import annotations

import torch


def enforce_gap(current: torch.Tensor, previous: torch.Tensor, gap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(θ'_{t-1}, θ'_{t-2}): every coordinate whose |θ_{t-1} − θ_{t-2}| < `gap` pushed apart
    symmetrically about its midpoint to distance exactly `gap` (θ_{t-1} the upper one when they
    are equal); the others unchanged. New tensors."""
    diff = current - previous
    short = diff.abs() < gap
    mid = 0.5 * (current + previous)
    half = 0.5 * gap * torch.where(diff < 0, -1.0, 1.0).to(current.dtype)
    return torch.where(short, mid + half, current), torch.where(short, mid - half, previous)


def mix(current: torch.Tensor, previous: torch.Tensor, gap: float, alpha: torch.Tensor) -> torch.Tensor:
    """θ̄ = θ'_{t-2} + α⊙(θ'_{t-1} − θ'_{t-2}) after `enforce_gap` (Alg 1); `alpha` ~ U[0, 1]
    elementwise, secret. `gap` = 0 is the broken variant the audits catch (no enforced gap)."""
    if not gap >= 0:
        raise ValueError(f"the ModelMix gap must be >= 0, got {gap!r}")
    upper, lower = enforce_gap(current, previous, gap)
    return lower + alpha.to(current.dtype) * (upper - lower)


__all__ = ["enforce_gap", "mix"]
