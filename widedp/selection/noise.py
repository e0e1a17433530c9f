"""The Gaussian step of seed Alg 3 on the selected rows: second clip and masked noise.

Privacy assumption: add/remove-one neighbours, Poisson batches normalized by the *expected*
batch size b. With per-example gradients clipped to S1 in ℓ2, G = Σ_j ĝ_j / b changes by at
most S1/b; masking with a fixed selection M and projecting onto the S2-ball are both
1-Lipschitz, and two points of the S2-ball are at most 2·S2 apart, so the ℓ2 sensitivity of
Δ̂ = clip_S2(G ⊙ M) is min(S1/b, 2·S2). (The seed paper's later text uses min(S1/b, S2); its
arXiv version keeps the factor 2 — the factor 2 is correct for add/remove: we keep it.)
Noise N(0, (σ·sensitivity)²) on the selected rows only gives `GaussianDpEvent(σ)`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

import torch

from widedp.accounting.events import GaussianDpEvent
from widedp.selection.keyed_random import GaussianStream, NoiseKey


def step_sensitivity(clip_norm: float, expected_batch_size: float, second_clip_norm: Optional[float]) -> float:
    """ℓ2 sensitivity of the clipped, masked, second-clipped aggregate: min(S1/b, 2·S2)."""
    if clip_norm <= 0 or expected_batch_size <= 0:
        raise ValueError(f"clip_norm and expected_batch_size must be > 0, got {clip_norm}, {expected_batch_size}")
    s = clip_norm / expected_batch_size
    if second_clip_norm is not None:
        if second_clip_norm <= 0:
            raise ValueError(f"second_clip_norm must be > 0, got {second_clip_norm}")
        s = min(s, 2.0 * second_clip_norm)
    return s


def secure_generator() -> GaussianStream:
    """A cryptographic Gaussian stream (AES-256-CTR, `selection.keyed_random`) keyed with 256 fresh
    bits from the OS CSPRNG: no seed to leak, nothing to reproduce."""
    return GaussianStream(NoiseKey.fresh(secure=True))


def gaussian_noise(shape, std: float, generator: GaussianStream, dtype=torch.float32, device="cpu",
                   secure: bool = False) -> torch.Tensor:
    """N(0, std²) noise: the next values of a keyed Gaussian stream (`selection.keyed_random`:
    AES-CTR keyed with 128 bits, or 256 in secure mode) times std — never a torch
    generator, whose CPU seed keeps 32 bits. A secure stream's values are the 4-draw Gaussian
    (sum of 4 normals halved, same variance), which defeats the floating-point attacks on a single
    Gaussian sample (Holohan & Braghin 2021, as in Opacus `secure_mode`); `secure=True` demands
    such a stream. Drawn on the CPU and moved to `device`."""
    if std < 0 or not math.isfinite(std):
        raise ValueError(f"noise std must be finite and >= 0, got {std}")
    if not isinstance(generator, GaussianStream):
        raise TypeError(f"privacy noise needs a keyed GaussianStream (selection.keyed_random), "
                        f"got {type(generator).__name__}")
    if secure and not generator.secure:
        raise ValueError("secure noise needs a secure (AES-256) stream: GaussianStream(NoiseKey(..., secure=True))")
    z = generator.standard_normal(math.prod(shape)).view(shape)
    z = z.mul_(std) if z.dtype == dtype else (z * std).to(dtype)
    return z if device == "cpu" else z.to(device)


@dataclasses.dataclass(frozen=True)
class NoisyStep:
    """What the Gaussian step released: the noisy selected rows (or, when the rows are noised
    elsewhere — DP-SGD's shards draw every row's noise themselves — the clipped rows with
    `rows_noised=False`), the noisy dense gradients, the noise std and the event."""

    rows: torch.Tensor
    dense: dict
    std: float
    rows_noised: bool
    event: GaussianDpEvent
    shard_rows: Optional[torch.Tensor] = None  # `shard_noised` after the S2 clip, not noised here


def noisy_step(
    rows: torch.Tensor,
    dense: Mapping[str, torch.Tensor],
    noise_multiplier: float,
    clip_norm: float,
    expected_batch_size: float,
    second_clip_norm: Optional[float],
    generator: GaussianStream,
    secure: bool = False,
    noise_rows: bool = True,
    shard_noised: Optional[torch.Tensor] = None,
) -> NoisyStep:
    """Alg 3 lines 9-11 over one vector: the selected rows Δ = G ⊙ M and every dense gradient.

    Add/remove-one neighbours: the whole vector (rows and dense parameters) is projected onto
    the S2-ball together (`second_clip_norm`), so its ℓ2 sensitivity is min(S1/b, 2·S2)
    (module docstring); N(0, (σ·sensitivity)²) is added to the selected rows (unless
    `noise_rows=False`: the caller noises them with the same std) and to every dense gradient.
    `shard_noised`: further rows of the same vector that the caller noises itself with the
    returned std (the rows of densely noised tables, which the shards noise every row of, as
    in DP-SGD): they count in the S2 norm and are scaled with the rest, but get no noise here
    (`NoisyStep.shard_rows`). Inputs may be float64; outputs are float32. Draw order (part
    of the contract: the reference implementation reproduces it): the rows as one [k, D] draw,
    then each dense gradient in mapping order. Returns a `NoisyStep` whose `event` is
    `GaussianDpEvent(σ)`.
    """
    if noise_multiplier < 0 or not math.isfinite(noise_multiplier):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier}")
    std = noise_multiplier * step_sensitivity(clip_norm, expected_batch_size, second_clip_norm)
    scale = 1.0
    if second_clip_norm is not None:
        total = math.sqrt(float((rows.double() ** 2).sum()) + sum(float((g.double() ** 2).sum()) for g in dense.values())
                          + (float((shard_noised.double() ** 2).sum()) if shard_noised is not None else 0.0))
        scale = min(1.0, second_clip_norm / total) if total > 0 else 1.0
    out_rows = (rows * scale).float()
    if noise_rows:
        out_rows = out_rows + gaussian_noise(out_rows.shape, std, generator, secure=secure)
    out_dense = {}
    for name, g in dense.items():
        g = (g * scale).float()
        out_dense[name] = g + gaussian_noise(g.shape, std, generator, secure=secure)
    shard_rows = (shard_noised * scale).float() if shard_noised is not None else None
    return NoisyStep(out_rows, out_dense, std, noise_rows, GaussianDpEvent(noise_multiplier), shard_rows)


def noisy_selected_rows(
    selected_rows: torch.Tensor,
    noise_multiplier: float,
    clip_norm: float,
    expected_batch_size: float,
    second_clip_norm: Optional[float],
    generator: GaussianStream,
    secure: bool = False,
) -> tuple[torch.Tensor, GaussianDpEvent]:
    """Alg 3 lines 9-11 on the rows in M only (no dense parameters): `noisy_step` with an empty
    dense part. `selected_rows` is G restricted to the selected rows ([k, D]). Returns the
    noisy rows and the event `GaussianDpEvent(σ)` (noise std / ℓ2 sensitivity = σ).
    """
    step = noisy_step(selected_rows, {}, noise_multiplier, clip_norm, expected_batch_size, second_clip_norm,
                      generator, secure)
    return step.rows.to(selected_rows.dtype), step.event
