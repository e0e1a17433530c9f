"""Where the randomness that the privacy guarantee relies on comes from (docs/THREAT_MODEL.md).

Privacy assumption: the guarantee of a run (Poisson subsampling amplification, selection,
Gaussian noise) holds only against an adversary who does not know the random choices. So
every such choice — which examples a step samples, the selection's noise, the gradient
noise, DP-SGD's per-row noise — derives from one **root secret** drawn from the OS CSPRNG
(`secrets`) when the run starts, never from a config value. `train.seed` and `data.seed`
fix initialization and data splits only (public choices).

Derivation: the root is a 128-bit integer; each consumer gets an independent stream through
`numpy.random.SeedSequence(root, spawn_key=(i,))`, i = 0 sampler, 1 selection, 2 gradient
noise, 3 DP-SGD per-row noise, 4 selection on the shards, 5 DP-STAT's count noise (adaptive
S1), 6 ModelMix's mixing weights. Distinct spawn keys give
statistically independent streams, so no draw in one stream is a function of another.

Reproducible mode (`privacy.reproducible = true`, root = `privacy.noise_seed`) exists for
tests and debugging: the run's ε then holds only while that seed stays secret, and the
summary and the exported privacy report say so.

Resume (docs/DESIGN.md §1 crash recovery): a secret run never stores its root or generator states
in a checkpoint; a resumed secret run draws a fresh root, so replayed steps use fresh noise
and are charged again (the ledger on disk already counts them). Only a reproducible run
checkpoints generator states, and its replay reuses them.
"""

from __future__ import annotations

import dataclasses
import secrets

import numpy as np
import torch

_SAMPLER, _SELECTION, _NOISE, _DPSGD, _SHARD_SELECTION, _CLIP, _MIX = range(7)


@dataclasses.dataclass(frozen=True)
class PrivacyRandomness:
    """The root of a run's secret randomness and the independent streams derived from it."""

    root: int = dataclasses.field(repr=False)  # never printed: repr hides it
    reproducible: bool = False

    @classmethod
    def fresh(cls) -> "PrivacyRandomness":
        """A new secret root from the OS CSPRNG (the default for every run)."""
        return cls(secrets.randbits(128), reproducible=False)

    @classmethod
    def from_seed(cls, seed: int) -> "PrivacyRandomness":
        """A public, reproducible root (tests, debugging): ε holds only while `seed` is secret."""
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"privacy.noise_seed must be an integer >= 0, got {seed!r}")
        return cls(int(seed), reproducible=True)

    def _stream(self, key: int) -> np.random.SeedSequence:
        return np.random.SeedSequence(self.root, spawn_key=(key,))

    def sampler_seed(self) -> np.random.SeedSequence:
        """Seed of the Poisson sampler's generator (which examples each step uses)."""
        return self._stream(_SAMPLER)

    def selection_rng(self) -> np.random.Generator:
        """Generator for private row selection (EM/SVT/noisy-max/threshold/FEST/random)."""
        return np.random.default_rng(self._stream(_SELECTION))

    def noise_generator(self) -> torch.Generator:
        """torch generator of the Gaussian noise on selected rows and dense parameters."""
        seed = int(self._stream(_NOISE).generate_state(1, np.uint64)[0])
        return torch.Generator().manual_seed(seed)

    def dpsgd_noise_seed(self) -> int:
        """128-bit seed of DP-SGD's counter-based per-row noise (`layout.row_block_normal`)."""
        words = self._stream(_DPSGD).generate_state(2, np.uint64)
        return int(words[0]) << 64 | int(words[1])

    def shard_selection_seed(self) -> int:
        """128-bit seed of the selection on the shards: shard s at step t draws from
        SeedSequence(seed, spawn_key=(t, s)) (`EmbeddingShard.select_rows`)."""
        words = self._stream(_SHARD_SELECTION).generate_state(2, np.uint64)
        return int(words[0]) << 64 | int(words[1])

    def clip_rng(self) -> np.random.Generator:
        """Generator of DP-STAT's count noise (privacy.clip_norm = "adaptive")."""
        return np.random.default_rng(self._stream(_CLIP))

    def mix_seed(self) -> int:
        """128-bit seed of ModelMix's mixing weights α (train.modelmix): counter-based per
        (step, table, rows) on the shards, so a replayed step mixes the same way."""
        words = self._stream(_MIX).generate_state(2, np.uint64)
        return int(words[0]) << 64 | int(words[1])

    def describe(self) -> str:
        """One line for summaries and privacy reports (never the root itself)."""
        if self.reproducible:
            return ("reproducible: sampling, selection and noise come from privacy.noise_seed; "
                    "the reported ε holds only while that seed stays secret")
        return "secret: sampling, selection and noise come from fresh OS entropy (not stored anywhere)"
