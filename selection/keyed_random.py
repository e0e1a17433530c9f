"""Keyed generators: where every random draw a privacy guarantee relies on comes from.

Privacy assumption: a mechanism's guarantee holds only against an adversary who cannot predict
its random draws. So each draw comes from a generator whose whole state is a function of a
secret key of at least 128 bits, and nothing narrower sits between that key and the generator:
no `torch.Generator.manual_seed` (torch's CPU generator keeps only 32 bits of its seed, so its
2^32 states can be searched on a laptop), no 64-bit seed.

Two generator families, both numpy `Generator`s (so every sampler — Gaussian, Gumbel, binomial,
choice — draws from the keyed bits):
- fast (default): Philox-4x64-10 with its full 128-bit key (`numpy.random.Philox(key=...)`),
  a counter-based generator (Salmon et al. 2011);
- secure (`privacy.secure_mode`): the ChaCha20 stream cipher's keystream with a 256-bit key
  (`randomgen.ChaCha(rounds=20)`), a cryptographic generator: its output does not reveal its key
  or later outputs to any known attack, which Philox does not claim.

Gaussian values are numpy's ziggurat (`Generator.standard_normal`: exact tails by the
exponential-tail method, where a float32 Box–Muller stops near 5.7σ) over the keyed bits, float32
in the fast family; the secure family releases the sum of 4 float64 draws halved (the 4-draw
Gaussian of Opacus's `secure_mode`, against the floating-point attacks on one sample: Holohan &
Braghin 2021). `standard_normals(key, start, count)` addresses a key's stream by value: values
[i·BLOCK_VALUES, (i+1)·BLOCK_VALUES) come from the generator of `key.derive("block", i)`, so a
shard draws rows [start, end) of a table without the rows before them (whole blocks: at most
BLOCK_VALUES values more), blocks fill in parallel threads, and the result does not depend on how
the values are split.

Addressing: `NoiseKey.generator(*address)` keys a generator with PRF(key, address), the PRF being
keyed BLAKE2b (RFC 7693, a PRF for keys up to 64 bytes), so the draw for (domain, step, table,
block) is a function of the secret and its address alone: a shard can draw its own rows' part,
a replayed step redraws the same values, and distinct addresses give independent streams.
Derived keys are 128 bits (fast) or 256 bits (secure); their secret entropy is the root's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
from typing import Union

import numpy as np
import torch

#: Bits of secret every privacy generator is keyed with (at least).
KEY_BITS = 128
_FAST_KEY_BYTES = 16  # Philox-4x64's key: 2 x 64 bits
_SECURE_KEY_BYTES = 32  # ChaCha20's key: 256 bits

Address = Union[int, str]


@dataclasses.dataclass(frozen=True)
class NoiseKey:
    """A secret key (an integer below 2^256, repr hidden) and the generator family it drives.

    `secure=False`: Philox-4x64-10 keyed with the key's low 128 bits (a fast key must fit them:
    nothing is dropped). `secure=True`: ChaCha20 (20 rounds) keyed with all 256 bits.
    """

    key: int = dataclasses.field(repr=False)
    secure: bool = False

    def __post_init__(self):
        if not isinstance(self.key, (int, np.integer)) or isinstance(self.key, bool) or self.key < 0:
            raise ValueError(f"a noise key must be a non-negative integer, got {type(self.key).__name__}")
        limit = 8 * (_SECURE_KEY_BYTES if self.secure else _FAST_KEY_BYTES)
        if int(self.key) >> limit:
            raise ValueError(f"a {'secure' if self.secure else 'fast'} noise key has at most {limit} bits")

    @classmethod
    def fresh(cls, secure: bool = False) -> "NoiseKey":
        """A new key from the OS CSPRNG (`secrets`): 128 bits fast, 256 bits secure."""
        return cls(secrets.randbits(8 * (_SECURE_KEY_BYTES if secure else _FAST_KEY_BYTES)), secure)

    @property
    def key_bytes(self) -> int:
        return _SECURE_KEY_BYTES if self.secure else _FAST_KEY_BYTES

    def derive(self, *address: Address) -> "NoiseKey":
        """The key of `address`'s stream: keyed BLAKE2b of the address under this key, as wide
        as this family's key (so flipping any key bit changes every derived key)."""
        message = json.dumps(["widedp-noise-key", *[_address_part(a) for a in address]]).encode()
        digest = hashlib.blake2b(message, key=int(self.key).to_bytes(_SECURE_KEY_BYTES, "little"),
                                 digest_size=self.key_bytes).digest()
        return NoiseKey(int.from_bytes(digest, "little"), self.secure)

    def generator(self, *address: Address) -> np.random.Generator:
        """A numpy Generator keyed with this key (no address) or with `derive(*address)`."""
        key = self.derive(*address).key if address else int(self.key)
        if self.secure:
            from randomgen import ChaCha

            return np.random.Generator(ChaCha(key=key, counter=0, rounds=20))
        return np.random.Generator(np.random.Philox(key=key))


def _address_part(part: Address) -> Address:
    if isinstance(part, (bool, float)) or not isinstance(part, (int, np.integer, str)):
        raise TypeError(f"a stream address holds ints and strings, got {part!r}")
    return int(part) if isinstance(part, (int, np.integer)) else part


def generator_family(rng: np.random.Generator) -> str:
    """"fast" (Philox), "secure" (ChaCha20) or the name of another bit generator."""
    name = type(rng.bit_generator).__name__
    return {"Philox": "fast", "ChaCha": "secure"}.get(name, name)


# ---- addressable values, and a sequential Gaussian stream ---------------------------------------

#: Values per independently keyed block of an addressable stream (1024 rows of dimension 16).
BLOCK_VALUES = 1 << 14
_PARALLEL_BLOCKS = 8  # fill this many blocks or more in threads (numpy's fills release the GIL)


def _normal_fill(rng: np.random.Generator, out: np.ndarray, secure: bool) -> None:
    """Standard normals into `out` (float32 fast; float64 4-draw secure)."""
    if not secure:
        rng.standard_normal(out=out, dtype=np.float32)
        return
    draws = rng.standard_normal((4, out.size))
    np.multiply(draws.sum(axis=0), 0.5, out=out)


def _uniform_fill(rng: np.random.Generator, out: np.ndarray, secure: bool) -> None:
    rng.random(out=out, dtype=np.float32)


def _addressed(key: NoiseKey, start: int, count: int, dtype, fill) -> torch.Tensor:
    """Values [start, start + count) of the stream whose block i comes from `key.derive("block", i)`."""
    if start < 0 or count < 0:
        raise ValueError(f"stream values need start, count >= 0, got {start}, {count}")
    first, last = start // BLOCK_VALUES, -(-(start + count) // BLOCK_VALUES)
    out = np.empty((last - first) * BLOCK_VALUES, dtype=dtype)

    def block(i: int) -> None:
        lo = (i - first) * BLOCK_VALUES
        fill(key.generator("block", i), out[lo: lo + BLOCK_VALUES], key.secure)

    blocks = range(first, last)
    workers = torch.get_num_threads()
    if len(blocks) >= _PARALLEL_BLOCKS and workers > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(block, blocks))
    else:
        for i in blocks:
            block(i)
    skip = start - first * BLOCK_VALUES
    return torch.from_numpy(out[skip: skip + count])


def standard_normals(key: NoiseKey, start: int, count: int) -> torch.Tensor:
    """Values [start, start + count) of `key`'s addressable standard normal stream (module
    docstring): float32 for a fast key, float64 4-draw values for a secure one."""
    return _addressed(key, start, count, np.float64 if key.secure else np.float32, _normal_fill)


def uniforms(key: NoiseKey, start: int, count: int) -> torch.Tensor:
    """Values [start, start + count) of `key`'s addressable U[0, 1) stream (float32)."""
    return _addressed(key, start, count, np.float32, _uniform_fill)


class GaussianStream:
    """A sequential source of standard normals from one key's generator (`NoiseKey.generator()`):
    each draw takes the next values (float32 ziggurat; secure keys: float64 4-draw values). Its
    state is the bit generator's (`state_dict`), so a reproducible run resumes it exactly; a
    secret run never stores it (trainer/randomness.py)."""

    def __init__(self, key: NoiseKey):
        self.key = key
        self._rng = key.generator()

    @property
    def secure(self) -> bool:
        return self.key.secure

    def standard_normal(self, count: int) -> torch.Tensor:
        out = np.empty(count, dtype=np.float64 if self.secure else np.float32)
        _normal_fill(self._rng, out, self.secure)
        return torch.from_numpy(out)

    def state_dict(self) -> dict:
        return {"bit_generator": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self._rng.bit_generator.state = state["bit_generator"]

    def __repr__(self) -> str:
        return f"GaussianStream({'secure' if self.key.secure else 'fast'})"
