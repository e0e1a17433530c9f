"""Where the randomness that the privacy guarantee relies on comes from (docs/THREAT_MODEL.md).

Privacy assumption: the guarantee of a run (Poisson subsampling amplification, selection,
Gaussian noise) holds only against an adversary who does not know the random choices. So
every such choice — which examples a step samples, the selection's noise, the gradient
noise, DP-SGD's per-row noise — derives from one **root secret** drawn from the OS CSPRNG
(`secrets`) when the run starts, never from a config value. `train.seed` and `data.seed`
fix initialization and data splits only (public choices).

Derivation: the root is a 128-bit integer; each consumer gets its own key, keyed BLAKE2b of
its domain name under the root (`selection.keyed_random.NoiseKey.derive`), and draws from a
generator keyed with all of it (`selection/keyed_random.py`): Gaussian noise from the key's
AES-CTR keystream (AES-128; AES-256 in secure mode), numpy's samplers from Philox-4x64-10 with the
128-bit key (ChaCha20 with 256 bits in secure mode, so every stream below is cryptographic). Domains: "sampler", "selection", "noise" (selected rows and dense
parameters), "dpsgd" (per-row noise, counter-based per (step, table, block)), "shard-selection"
(shard s at step t), "clip" (DP-STAT's count noise, adaptive S1), "modelmix" (ModelMix's α).
Distinct domains give independent streams, so no draw in one is a function of another, and no
draw can be reproduced from fewer than the root's 128 bits (never `torch.manual_seed`, which
keeps 32 bits).

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

from widedp.selection.keyed_random import KEY_BITS, GaussianStream, NoiseKey

DOMAINS = ("sampler", "selection", "noise", "dpsgd", "shard-selection", "clip", "modelmix", "recalibration",
           "user-trim")


@dataclasses.dataclass(frozen=True)
class PrivacyRandomness:
    """The root of a run's secret randomness and the independent keyed streams derived from it."""

    root: int = dataclasses.field(repr=False)  # never printed: repr hides it
    reproducible: bool = False
    secure: bool = False  # every stream a cryptographic generator (AES-256-CTR, ChaCha20)

    def __post_init__(self):
        if self.secure and self.reproducible:
            raise ValueError("secure randomness needs a secret root: privacy.secure_mode and "
                             "privacy.reproducible exclude each other")

    @classmethod
    def fresh(cls, secure: bool = False) -> "PrivacyRandomness":
        """A new secret root of 128 bits from the OS CSPRNG (the default for every run)."""
        return cls(secrets.randbits(KEY_BITS), reproducible=False, secure=secure)

    @classmethod
    def from_seed(cls, seed: int) -> "PrivacyRandomness":
        """A public, reproducible root (tests, debugging): ε holds only while `seed` is secret."""
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0 or int(seed) >> KEY_BITS:
            raise ValueError(f"privacy.noise_seed must be an integer in [0, 2^{KEY_BITS}), got {seed!r}")
        return cls(int(seed), reproducible=True)

    def key(self, domain: str) -> NoiseKey:
        """The key of one consumer's stream: PRF(root, domain), 128 bits (256 in secure mode)."""
        if domain not in DOMAINS:
            raise ValueError(f"unknown randomness domain {domain!r}; known: {', '.join(DOMAINS)}")
        return NoiseKey(self.root, self.secure).derive(domain)

    def sampler_rng(self) -> np.random.Generator:
        """Generator of the Poisson sampler (which examples each step uses)."""
        return self.key("sampler").generator()

    def selection_rng(self) -> np.random.Generator:
        """Generator for private row selection (EM/SVT/noisy-max/threshold/FEST/random)."""
        return self.key("selection").generator()

    def noise_generator(self) -> GaussianStream:
        """The Gaussian stream of the noise on selected rows and dense parameters."""
        return GaussianStream(self.key("noise"))

    def dpsgd_noise_key(self) -> NoiseKey:
        """Key of DP-SGD's counter-based per-row noise (`layout.row_block_normal`)."""
        return self.key("dpsgd")

    def shard_selection_key(self) -> NoiseKey:
        """Key of the selection on the shards: shard s at step t draws from
        `key.generator(t, s)` (`ShardSelection.select_rows`)."""
        return self.key("shard-selection")

    def clip_rng(self) -> np.random.Generator:
        """Generator of DP-STAT's count noise (privacy.clip_norm = "adaptive")."""
        return self.key("clip").generator()

    def recalibration_rng(self, step: int) -> np.random.Generator:
        """Generator of the recalibration histogram's noise after step `step`
        (trainer/engine/recalibration.py): its own stream per step, so a run recalibrated again after
        more steps draws fresh noise."""
        return self.key("recalibration").generator(int(step))

    def mix_key(self) -> NoiseKey:
        """Key of ModelMix's mixing weights α (train.modelmix): counter-based per
        (step, table, rows) on the shards, so a replayed step mixes the same way."""
        return self.key("modelmix")

    def user_trim_rng(self) -> np.random.Generator:
        """Generator of which examples each user keeps (privacy.user_sampling = "examples",
        trainer/data/sampler.py `trimmed_positions`)."""
        return self.key("user-trim").generator()

    def describe(self) -> str:
        """One line for summaries and privacy reports (never the root itself)."""
        if self.reproducible:
            return ("reproducible: sampling, selection and noise come from privacy.noise_seed; "
                    "the reported ε holds only while that seed stays secret")
        generator = ("AES-256-CTR and ChaCha20" if self.secure else "AES-128-CTR and Philox-4x64-10")
        return (f"secret: sampling, selection and noise come from fresh OS entropy (a {KEY_BITS}-bit root, "
                f"not stored anywhere) through {generator} generators keyed with all of it")
