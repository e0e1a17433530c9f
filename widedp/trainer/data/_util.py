"""Vectorized helpers: a stable 64-bit hash of integers and of strings, digit parsing, Zipf
sampling, weighted AUC, the expansion of input file patterns, and the directories a writer
creates (so that a failed write removes them again)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

_U = np.uint64
_GOLDEN = _U(0x9E3779B97F4A7C15)
_M1 = _U(0xBF58476D1CE4E5B9)
_M2 = _U(0x94D049BB133111EB)


def splitmix64(x) -> np.ndarray:
    """SplitMix64 finalizer (a bijection of uint64), elementwise; wraps mod 2**64."""
    z = np.array(x, dtype=np.uint64, ndmin=1, copy=True)
    z += _GOLDEN
    z ^= z >> _U(30)
    z *= _M1
    z ^= z >> _U(27)
    z *= _M2
    z ^= z >> _U(31)
    return z


def splitmix64_py(x: int) -> int:
    """Pure-Python reference of ``splitmix64`` (used by tests and docs)."""
    mask = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def hash_uniform(keys: np.ndarray) -> np.ndarray:
    """uint64 hashes -> float64 uniforms in (0, 1) (53 bits)."""
    return ((keys >> _U(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)


def hash_normal(keys: np.ndarray) -> np.ndarray:
    """Standard normals from distinct uint64 keys (Box-Muller on two derived hashes)."""
    u1 = hash_uniform(splitmix64(keys ^ _U(0x5851F42D4C957F2D)))
    u2 = hash_uniform(splitmix64(keys ^ _U(0x14057B7EF767814F)))
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def digit_lut(base: int) -> np.ndarray:
    lut = np.full(256, 255, dtype=np.uint8)
    for c in range(256):
        ch = chr(c)
        if ch.isascii() and ch.isalnum():
            v = int(ch, 36)
            if v < base:
                lut[c] = v
    return lut


def parse_digits(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray, base: int,
                 max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Parse unsigned numbers in ``base`` from byte slices of ``data``, vectorized.

    Returns (values uint64, bad bool) per slice; bad = a non-digit byte, or longer than
    ``max_len`` digits (max_len must keep values below 2**64). Empty slices give 0, not bad.
    Works digit position by digit position (from the right), so memory is O(len(starts)).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    values = np.zeros(len(lengths), dtype=np.uint64)
    bad = lengths > max_len
    if len(lengths) == 0:
        return values, bad
    last = np.asarray(starts, dtype=np.int64) + lengths - 1
    lut = digit_lut(base)
    for k in range(min(max_len, int(lengths.max()))):
        active = (lengths > k) & ~bad
        digit = lut[data[np.maximum(last - k, 0)]]
        nondigit = active & (digit == 255)
        bad |= nondigit
        use = active & ~nondigit
        values += np.where(use, digit, 0).astype(np.uint64) * np.uint64(base ** k)
    values[bad] = 0
    return values, bad


# ---- Zipf -------------------------------------------------------------------------------------

_EXACT_LIMIT = 1 << 12  # ranks sampled from exact weights; beyond, a continuous approximation


class Zipf:
    """Truncated Zipf over ranks 0..size-1: P(rank r) ∝ (r + 1) ** -exponent.

    Sampling: inverse CDF, exact (searchsorted over exact weights) for the first 2**12
    ranks; beyond, the continuous density x**-a on [H + 0.5, size + 0.5] is inverted in
    closed form and rounded (midpoint rule: the relative error of each rank's probability is
    about a(a+1)/(24 r²) < 2e-8 there). This keeps sampling cache-friendly and O(1) memory in
    the table size. ``pmf`` gives (r + 1) ** -a / total with the same normalizer.
    """

    def __init__(self, size: int, exponent: float):
        if size < 1:
            raise ValueError(f"Zipf size must be >= 1, got {size}")
        if exponent < 0:
            raise ValueError(f"Zipf exponent must be >= 0, got {exponent}")
        self.size, self.a = int(size), float(exponent)
        head = min(self.size, _EXACT_LIMIT)
        w = np.arange(1, head + 1, dtype=np.float64) ** -self.a
        self._cum = np.cumsum(w)
        self.head_mass = float(self._cum[-1])
        self.tail_mass = self._tail_integral(head + 0.5, self.size + 0.5) if self.size > head else 0.0
        self.total = self.head_mass + self.tail_mass
        self._head = head

    def _tail_integral(self, lo: float, hi: float) -> float:
        a = self.a
        if a == 1.0:
            return float(np.log(hi / lo))
        return float((hi ** (1 - a) - lo ** (1 - a)) / (1 - a))

    def pmf(self, ranks: np.ndarray) -> np.ndarray:
        return (np.asarray(ranks, dtype=np.float64) + 1.0) ** -self.a / self.total

    def sample(self, u: np.ndarray) -> np.ndarray:
        """Ranks (int64) from uniforms u in [0, 1)."""
        x = np.asarray(u, dtype=np.float64) * self.total
        ranks = np.searchsorted(self._cum, x, side="right").astype(np.int64)
        if self.tail_mass > 0:
            tail = x >= self.head_mass
            if tail.any():
                v = x[tail] - self.head_mass
                lo = self._head + 0.5
                if self.a == 1.0:
                    xs = lo * np.exp(v)
                else:
                    xs = (lo ** (1 - self.a) + (1 - self.a) * v) ** (1 / (1 - self.a))
                ranks[tail] = np.floor(xs + 0.5).astype(np.int64) - 1
        return np.clip(ranks, 0, self.size - 1)


# ---- AUC -----------------------------------------------------------------------------------

def expected_auc(p: np.ndarray) -> float:
    """AUC of the Bayes scorer: scores p_i, example i positive with weight p_i, negative with
    weight 1 - p_i, over pairs i != j, ties counted 1/2:

        Σ_{i≠j} p_i (1-p_j) ([p_i > p_j] + ½[p_i = p_j]) / Σ_{i≠j} p_i (1-p_j)

    i.e. E[#correctly ordered pos-neg pairs] / E[#pos-neg pairs] for labels ~ Bernoulli(p_i);
    independent of the label draw. O(n log n).
    """
    p = np.asarray(p, dtype=np.float64)
    s = np.sort(p)
    uniq, first = np.unique(s, return_index=True)
    pos = np.add.reduceat(s, first)  # Σ p over each tie group
    cnt = np.diff(np.append(first, len(s)))
    neg = cnt - pos  # Σ (1 - p) over each tie group
    neg_below = np.cumsum(neg) - neg
    num = float(np.sum(pos * (neg_below + 0.5 * neg)) - 0.5 * np.sum(p * (1 - p)))
    den = float(p.sum() * (1 - p).sum() - np.sum(p * (1 - p)))
    return num / den if den > 0 else float("nan")


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Empirical ROC AUC (ties 1/2), O(n log n)."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels) > 0.5
    order = np.argsort(scores, kind="mergesort")
    s, y = scores[order], labels[order]
    uniq, first = np.unique(s, return_index=True)
    pos = np.add.reduceat(y.astype(np.float64), first)
    cnt = np.diff(np.append(first, len(s)))
    neg = cnt - pos
    neg_below = np.cumsum(neg) - neg
    n_pos, n_neg = pos.sum(), neg.sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float(np.sum(pos * (neg_below + 0.5 * neg)) / (n_pos * n_neg))


# ---- stable string hashing ----------------------------------------------------------------------

_STRING_SEED = _U(0x6A09E667F3BCC909)  # fractional bits of sqrt(2): a fixed, public constant
_BYTE_SHIFTS = np.arange(8, dtype=np.uint64) * _U(8)


def hash_strings(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Stable 64-bit hashes of byte strings, vectorized (no salted ``hash()``, no per-string loop).

    ``data`` uint8 (the concatenated bytes), ``offsets`` int64 [n+1] (string i is
    ``data[offsets[i]:offsets[i+1]]``). Definition (``hash_string_py`` is the reference)::

        h = splitmix64(len(s) ^ 0x6A09E667F3BCC909)
        for each 8-byte word w of s (little-endian, the last one zero-padded): h = splitmix64(h ^ w)

    Works word position by word position over the strings that still have bytes there, so the
    total work is O(total bytes / 8) plus one numpy pass per word of the longest string.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    starts, lengths = offsets[:-1], np.diff(offsets)
    h = splitmix64(lengths.astype(np.uint64) ^ _STRING_SEED)
    active = np.arange(len(lengths), dtype=np.int64)
    k = 0
    while True:
        active = active[lengths[active] > 8 * k]
        if active.size == 0:
            return h
        pos = starts[active, None] + 8 * k + np.arange(8, dtype=np.int64)
        inside = pos < (starts[active] + lengths[active])[:, None]
        byte = np.where(inside, data[np.where(inside, pos, 0)], 0).astype(np.uint64)
        word = np.bitwise_or.reduce(byte << _BYTE_SHIFTS, axis=1)
        h[active] = splitmix64(h[active] ^ word)
        k += 1


def hash_string_py(s: bytes) -> int:
    """Pure-Python reference of ``hash_strings`` for one string."""
    h = splitmix64_py(len(s) ^ int(_STRING_SEED))
    for k in range(0, len(s), 8):
        h = splitmix64_py(h ^ int.from_bytes(s[k:k + 8].ljust(8, b"\0"), "little"))
    return h


# ---- input files ---------------------------------------------------------------------------------

def expand_inputs(patterns, what: str = "input") -> list:
    """Paths named by ``patterns`` (file names or globs), each glob's matches sorted; a pattern
    that names no existing file is an error (DataError naming it). Order: as given, then sorted
    within each glob; a file named twice is an error (its examples would be counted twice)."""
    import glob
    from pathlib import Path

    from widedp.trainer.data.errors import DataError

    if isinstance(patterns, (str, bytes)) or hasattr(patterns, "__fspath__"):
        patterns = [patterns]
    out: list = []
    for pattern in patterns:
        text = str(Path(pattern))
        if glob.has_magic(text):
            matches = sorted(p for p in glob.glob(text) if Path(p).is_file())
            if not matches:
                raise DataError(f"{text}: the pattern matches no file ({what})")
            out.extend(Path(p) for p in matches)
        else:
            out.append(Path(text))
    seen: set = set()
    for p in out:
        key = p.resolve()
        if key in seen:
            raise DataError(f"{p}: named twice among the {what} files")
        seen.add(key)
    if not out:
        raise DataError(f"no {what} file given")
    return out


def open_binary(path):
    """A binary file object over ``path``; ``.gz`` files are decompressed while read."""
    import gzip

    if str(path).endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def missing_directories(path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first (what creating
    `path` with parents makes)."""
    missing, p = [], Path(path).absolute()
    while not p.exists():
        missing.append(p)
        p = p.parent
    return missing


def remove_empty_directories(directories) -> None:
    """Remove each directory (deepest first) while it is empty; stop at the first that is not."""
    for d in directories:
        try:
            Path(d).rmdir()
        except OSError:
            break
