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

Bulk Gaussian and uniform values (`standard_normals`, `uniforms`, `GaussianStream`: the gradient
noise, DP-SGD's rows, ModelMix's α) come from the key's AES-CTR keystream (AES-128 under a fast
key, AES-256 under a secure one: a cryptographic generator in both families), word-addressable
through the counter, so a shard draws rows [start, end) of a table without the rows before them,
and converted with vectorized torch arithmetic (about what torch's own `normal` cost, RESULTS
"Noise generators"):
- fast: Box–Muller in float32, one word per pair of values: u1 = (a + 1)/2^40 from 40 bits, θ from
  the other 24. The values stop at |z| ≤ √(2·40·ln 2) ≈ 7.45: an output beyond it has probability
  0 under the mechanism, and the mass a neighbour's shift of Δ ≤ σ-units moves across that edge is
  at most P(Z > 7.45 − Δ/σ_noise) per released coordinate, 5.6e-11 at σ = 1 (torch's float32
  `normal`, with 24-bit uniforms, stopped at 5.77: 1e-6 per coordinate at σ = 1, which the δ of a
  long run does not absorb — the reason for 40 bits);
- secure: Box–Muller in float64 on 53-bit uniforms, and each released value the sum of 4 normals
  halved (the 4-draw Gaussian of Opacus's `secure_mode`, against the floating-point attacks on one
  sample: Holohan & Braghin 2021).

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


# ---- the keystream, and the values made from it -------------------------------------------------

_AES_BLOCK_WORDS = 2  # one 16-byte AES block: two 64-bit words
_CHUNK_WORDS = 1 << 16  # converted in L2-sized chunks: each torch pass stays in cache
_BUFFER_VALUES = 1 << 12  # a GaussianStream makes small draws' values this many at a time
_RADIUS_BITS, _ANGLE_BITS = 40, 24  # fast Box–Muller: u1 from 40 bits (|z| ≤ 7.45), θ from 24
_TWO_PI = 6.283185307179586


def keystream_words(key: NoiseKey, start: int, count: int) -> np.ndarray:
    """Words [start, start + count) (uint64, little-endian) of `key`'s keystream: AES in counter
    mode keyed with all of the key — AES-128 for a fast key (its 128 bits), AES-256 for a secure
    one — over counter blocks start // 2, start // 2 + 1, ... (128-bit big-endian; OpenSSL
    through `cryptography`, AES-NI where the CPU has it). A function of (key, start, count) only."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    if start < 0 or count < 0:
        raise ValueError(f"keystream words need start, count >= 0, got {start}, {count}")
    first, skip = divmod(int(start), _AES_BLOCK_WORDS)
    total = skip + int(count)
    total += total % _AES_BLOCK_WORDS
    encryptor = Cipher(algorithms.AES(int(key.key).to_bytes(key.key_bytes, "little")),
                       modes.CTR(first.to_bytes(16, "big"))).encryptor()
    out = np.empty(total + _AES_BLOCK_WORDS, dtype="<u8")  # update_into wants 15 spare bytes
    buf = out.view(np.uint8).data  # a writable memoryview of the words
    zeros = memoryview(bytes(8 * min(total, _CHUNK_WORDS)))
    for lo in range(0, total, _CHUNK_WORDS):  # the keystream: the encryption of zeros
        n = min(_CHUNK_WORDS, total - lo)
        encryptor.update_into(zeros[: 8 * n], buf[8 * lo: 8 * (lo + n) + 15])
    return out[skip: skip + count].astype(np.uint64, copy=False)


def _fast_pairs(w: torch.Tensor, out: torch.Tensor) -> None:
    """Box–Muller, float32: word → (r cos θ, r sin θ) into out[:, 0], out[:, 1]; r from the word's
    top 40 bits, u1 = (a + 1)/2^40 ∈ (0, 1], θ = 2π·b/2^24 from its low 24 bits."""
    r = (w >> _ANGLE_BITS).bitwise_and_((1 << _RADIUS_BITS) - 1).add_(1).float()
    r.mul_(2.0 ** -_RADIUS_BITS).log_().mul_(-2.0).sqrt_()
    theta = w.bitwise_and((1 << _ANGLE_BITS) - 1).float().mul_(_TWO_PI * 2.0 ** -_ANGLE_BITS)
    torch.mul(r, torch.cos(theta), out=out[:, 0])
    torch.mul(r, theta.sin_(), out=out[:, 1])


def _secure_values(w: torch.Tensor) -> torch.Tensor:
    """Four words per value, float64: two Box–Muller pairs (u1 from 53 bits, |z| ≤ 8.57; θ from 53
    bits) give 4 normals; the value is their sum halved (the 4-draw Gaussian, variance 1)."""
    u = (w >> 11).bitwise_and_((1 << 53) - 1).add_(1).double().mul_(2.0 ** -53).view(-1, 2)
    r = u[:, 0].log().mul_(-2.0).sqrt_()
    theta = u[:, 1].mul(_TWO_PI)
    pair_sums = (r * theta.cos()).add_(r.mul_(theta.sin_()))
    return pair_sums.view(-1, 2).sum(dim=1).mul_(0.5)


def standard_normals(key: NoiseKey, start: int, count: int) -> torch.Tensor:
    """Values [start, start + count) of `key`'s standard normal stream, addressable by value:
    fast keys give float32 values, value i from keystream word i // 2 (`_fast_pairs`); secure keys
    give float64 4-draw values, value i from words [4i, 4i + 4) (`_secure_values`). So a shard draws
    rows [start, end) of a table without the rows before them, and the values do not depend on how
    a range is split."""
    if start < 0 or count < 0:
        raise ValueError(f"stream values need start, count >= 0, got {start}, {count}")
    if key.secure:
        return _secure_values(torch.from_numpy(keystream_words(key, 4 * start, 4 * count).view(np.int64)))
    first = start // 2
    words = torch.from_numpy(keystream_words(key, first, (start + count + 1) // 2 - first).view(np.int64))
    pairs = torch.empty((words.numel(), 2), dtype=torch.float32)
    for lo in range(0, words.numel(), _CHUNK_WORDS):
        _fast_pairs(words[lo: lo + _CHUNK_WORDS], pairs[lo: lo + _CHUNK_WORDS])
    return pairs.view(-1)[start - 2 * first: start - 2 * first + count]


#: `interval_normals`' AES input block (128 bits, big-endian): row (64) | start (24) | end (24) | j (16).
_INTERVAL_BITS, _BLOCK_INDEX_BITS = 24, 16


def interval_normals(key: NoiseKey, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, dim: int) -> torch.Tensor:
    """Standard normal values [N, dim] (float32), point i's a function of (key, rows[i],
    starts[i], ends[i]) alone: AES (128-bit key fast, 256-bit secure) of the distinct 128-bit
    blocks row | start | end | j (j = 0, 1, ... the block's index within the point), converted as
    `standard_normals` converts its keystream (fast: one word per pair of float32 values;
    secure: four words per 4-draw float64 value). AES is a pseudorandom permutation, so distinct
    blocks give independent-looking words: distinct (row, start, end) give independent values,
    and the same point gives the same values however many others are drawn with it (lazy
    DP-SGD noise: a row's pending steps [start, end) of one table, trainer/engine/shard_update.py).
    The key must not also key a `standard_normals` stream (its counter blocks could coincide
    with these): derive one for it. Needs 0 <= start < end < 2^24, rows >= 0."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    rows, starts, ends = (np.asarray(a, dtype=np.int64).ravel() for a in (rows, starts, ends))
    n, dim = rows.size, int(dim)
    if not (starts.size == n and ends.size == n):
        raise ValueError(f"interval_normals needs one start and end per row, got {n} rows, {starts.size} starts, "
                         f"{ends.size} ends")
    words_per_point = 4 * dim if key.secure else (dim + 1) // 2
    blocks = (words_per_point + _AES_BLOCK_WORDS - 1) // _AES_BLOCK_WORDS
    if dim < 1 or blocks > (1 << _BLOCK_INDEX_BITS):
        raise ValueError(f"interval_normals: dim {dim} outside 1..{(1 << _BLOCK_INDEX_BITS) * (1 if key.secure else 4) // (2 if key.secure else 1)}")
    if n == 0:
        return torch.zeros((0, dim), dtype=torch.float32)
    if rows.min() < 0 or starts.min() < 0 or (ends <= starts).any() or ends.max() >= (1 << _INTERVAL_BITS):
        raise ValueError("interval_normals needs rows >= 0 and 0 <= start < end < 2^24")
    block = np.empty((n, blocks, 2), dtype=">u8")
    block[:, :, 0] = rows.astype(np.uint64)[:, None]
    low = (starts.astype(np.uint64) << np.uint64(_INTERVAL_BITS + _BLOCK_INDEX_BITS)) \
        | (ends.astype(np.uint64) << np.uint64(_BLOCK_INDEX_BITS))
    block[:, :, 1] = low[:, None] | np.arange(blocks, dtype=np.uint64)[None, :]
    encryptor = Cipher(algorithms.AES(int(key.key).to_bytes(key.key_bytes, "little")), modes.ECB()).encryptor()
    cipher = np.frombuffer(encryptor.update(block.tobytes()) + encryptor.finalize(), dtype="<u8")
    words = torch.from_numpy(cipher.astype(np.int64).reshape(n, blocks * _AES_BLOCK_WORDS)[:, :words_per_point].copy())
    if key.secure:
        return _secure_values(words.reshape(-1)).view(n, dim).to(torch.float32)
    pairs = torch.empty((words.numel(), 2), dtype=torch.float32)
    flat = words.reshape(-1)
    for lo in range(0, flat.numel(), _CHUNK_WORDS):
        _fast_pairs(flat[lo: lo + _CHUNK_WORDS], pairs[lo: lo + _CHUNK_WORDS])
    return pairs.view(n, 2 * words_per_point)[:, :dim]


def uniforms(key: NoiseKey, start: int, count: int) -> torch.Tensor:
    """Values [start, start + count) of `key`'s U[0, 1) stream: float32 from the top 24 bits of
    keystream word i."""
    w = torch.from_numpy(keystream_words(key, start, count).view(np.int64))
    return (w >> 40).bitwise_and_(0xFFFFFF).float().mul_(2.0 ** -24)


class GaussianStream:
    """A sequential source of standard normals over one key's stream (`standard_normals`): each
    draw takes the next values. Its state is how many values it has handed out (`state_dict`), so
    a reproducible run resumes it exactly; a secret run never stores it (trainer/engine/randomness.py)."""

    def __init__(self, key: NoiseKey):
        self.key = key
        self.position = 0
        self._buffer_start, self._buffer = 0, torch.empty(0)

    @property
    def secure(self) -> bool:
        return self.key.secure

    def standard_normal(self, count: int) -> torch.Tensor:
        """The next `count` values (a new tensor). Small draws are served from values made
        _BUFFER_VALUES at a time — the same values, since they are addressed by position."""
        start, self.position = self.position, self.position + count
        if count >= _BUFFER_VALUES:
            return standard_normals(self.key, start, count)
        offset = start - self._buffer_start
        if offset < 0 or offset + count > self._buffer.numel():
            self._buffer_start, self._buffer, offset = start, standard_normals(self.key, start, _BUFFER_VALUES), 0
        return self._buffer[offset: offset + count].clone()

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self._buffer_start, self._buffer = 0, torch.empty(0)

    def __repr__(self) -> str:
        return f"GaussianStream({'secure' if self.key.secure else 'fast'}, position={self.position})"
