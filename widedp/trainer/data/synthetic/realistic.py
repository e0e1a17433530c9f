"""A realistic Criteo-format planted-truth CTR generator: ``synth_criteo_like``.

Where ``synth_ctr`` plants a logistic model directly on table rows, this generator mimics
the *pipeline* of real Criteo Kaggle data: 26 categorical features with the published raw
vocabulary sizes and heavy-tailed popularity, hashed into embedding tables of at most
``hash_size`` rows (as ``widedp convert criteo --hash-size`` does), 13 log-count dense
features, a click model defined on the *raw* ids (so hashing collisions cost accuracy, as
they do on real data) and a ~25% positive rate. The output is an ordinary ctr data set
(``cat_0`` .. ``cat_25`` in tables ``t_0`` .. ``t_25``, 13 dense, label; see
``trainer.data.format.meta``), readable by ``open_dataset`` and trainable unchanged.

Generative model, for example i, categorical feature f < 26, dense feature j < 13::

    raw_{i,f}  ~ Zipf(card_f, a_f)        raw id = popularity rank (0 the most frequent),
                                           P(r) ∝ (r + 1) ** -a_f over r < card_f
    id_{i,f}   = (mult_f * raw + off_f) mod card_f        if card_f <= hash_size
                                           (dictionary encoding: a bijection, no collisions)
               = splitmix64(hash_key_f + raw) mod hash_size   otherwise (hashing: collisions)
    x_{i,j}    = float32(log1p(floor(exp(mu_j + sigma_j * z_{i,j})))),   z ~ N(0, 1)
                                           (log of a count, as the Criteo converter's
                                           log(1 + max(I, 0)): non-negative, many zeros)
    logit_i    = bias + w · x_i + Σ_f s_f N_f(raw_{i,f}) + Σ_k c N_k(raw_{i,f_k}, raw_{i,g_k})
    p_i        = sigmoid(logit_i),   label_i ~ Bernoulli(p_i)

with the per-id effects computed on demand from counter-based hashes (no tables):
``N_f(r) = hash_normal(splitmix64(theta_key_f + r))`` and the crossing effects
``N_k(r, q) = hash_normal(splitmix64(splitmix64(cross_key_k + r) + q))`` (all arithmetic
mod 2**64), each a standard normal per (feature, raw id) / (cross, raw pair).

Parameters drawn deterministically from ``seed`` (all stored in ``dataset.json``):

* ``card_f``: ``cardinalities`` (default ``CRITEO_KAGGLE_CARDINALITIES``); table ``t_f`` has
  ``min(card_f, hash_size)`` rows.
* ``a_f`` ~ Uniform(``zipf_exponents``) (default [1.05, 1.4]): every feature heavy-tailed,
  some more concentrated than others.
* effect scales (the "some informative, some nearly noise" rule): a seeded permutation gives
  each feature an informativeness rank k_f in 0..25 and ``s_f = theta_scale * scale_decay **
  k_f`` (defaults: 0.65 down to 0.65 * 0.85**25 ≈ 0.011).
* crosses: ``num_crosses`` distinct feature pairs (f_k, g_k) drawn among the features with
  ``card < CROSS_MAX_CARDINALITY`` (learnable by a model with feature interactions), each
  with std ``cross_scale``.
* dense: mu_j ~ U(-0.5, 3), sigma_j ~ U(0.5, 2), w_j = dense_scale / sqrt(13) * g_j / sigma_j
  with g_j ~ N(0, 1).
* ``bias``: if not given, solved (bisection) so that the mean of p over a fixed calibration
  sample of ``CALIBRATION_ROWS`` rows (its own random stream, independent of
  ``num_examples``) equals ``positive_rate`` (default 0.25, Criteo Kaggle's ~0.256).
* mult_f (coprime with card_f), off_f, hash_key_f, theta_key_f, cross_key_k.

``bayes_auc`` is ``expected_auc(p)`` over all examples and ``bayes_logloss`` the mean binary
entropy of p (the Bayes scorer's expected log loss), as for ``synth_ctr``. No model that only
sees the written (hashed) ids and the dense features can do better in expectation.

Randomness: rows are drawn per block of ``BLOCK_ROWS`` rows, each block and component (raw-id
uniforms, dense normals, label uniforms) from its own ``SeedSequence([seed, stream, block,
component])``, row-major, so the data are independent of the Parquet row-group size
(``WRITE_ROWS``) and the first n rows do not depend on ``num_examples``. The written file
only holds the hashed ids; ``criteo_like_block`` / ``criteo_like_raw_ids`` regenerate the raw
ids (and everything else) of any block from ``dataset.json``, and
``criteo_like_probabilities`` gives the true p from (dense, raw ids).

Speed: the ``Zipf`` helper samples in O(1) memory per feature (exact weights for the first
4096 ranks, a closed-form tail), so a 10^7-row vocabulary costs nothing to set up (instances
are cached per (size, exponent)); 400k examples take about 2.5 s on one core (1.3 s for
100k, of which ~0.3 s is the bias calibration).

Realism caveat: exponents >= 1.05 make the huge features more concentrated than real Criteo's
(400k rows hold ~16k-77k distinct raw values of each 2M-10M feature; at Criteo's 45.8M rows a
10^7-value feature with a = 1.05 would show ~5M distinct values, not 10.1M). Pass a lower
``zipf_exponents`` range (e.g. (0.9, 1.2)) for flatter tails.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from widedp.trainer.data._util import Zipf, expected_auc, hash_normal, splitmix64
from widedp.trainer.data.format.meta import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE, DatasetMeta, ctr_meta
from widedp.trainer.data.format.writer import DatasetWriter, ctr_table

GENERATOR = "synth_criteo_like"

# Per-feature vocabulary sizes of the 26 categorical features C1..C26 (C1 first) of the Criteo
# Kaggle Display Advertising Challenge training set (45,840,617 rows): the distinct-value
# counts DLRM's Kaggle preprocessing reports (the ``counts`` of its processed .npz) and that the
# DLRM / TorchRec Criteo Kaggle examples use as embedding-table sizes.
CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
# A second shape for the same pipeline (data.synth = "heavytail", the held-out check that the
# configs tuned on the Criteo-like set are not tuned to it): other cardinalities (more mid-sized
# features, four above the hash size), flatter Zipf tails, a lower positive rate, a steeper
# informativeness decay and more crosses (HEAVYTAIL_PARAMS).
HEAVYTAIL_CARDINALITIES = (
    7, 4737, 7745, 26, 8552, 559, 36, 2686408, 6729486, 8251, 5, 4, 2626, 8, 9, 435, 4, 68, 172, 60,
    1000000, 3000000, 120000, 450000, 15, 900,
)
HEAVYTAIL_PARAMS: dict[str, Any] = {"cardinalities": HEAVYTAIL_CARDINALITIES, "zipf_exponents": (0.9, 1.2),
                                    "theta_scale": 0.8, "scale_decay": 0.8, "num_crosses": 6, "cross_scale": 0.4,
                                    "positive_rate": 0.17}
DEFAULT_HASH_SIZE = 262_144
BLOCK_ROWS = 1 << 16  # rows per RNG block: part of the data's definition (stored in dataset.json)
WRITE_ROWS = 1 << 16  # rows per Parquet row group: does not change the data
CALIBRATION_ROWS = 1 << 16  # rows of the sample the default bias is calibrated on
CROSS_MAX_CARDINALITY = 100_000  # crossing effects only between features below this size
MAX_TABLE = 1 << 32
MAX_CARDINALITY = 1 << 53

# random streams (distinct from trainer.data.synthetic.synth's, so a shared seed gives unrelated data)
_S_BLOCK, _S_EXP, _S_SCALE, _S_KEYS, _S_PERM, _S_DENSE, _S_CROSS, _S_CALIB = range(101, 109)
_C_RAW, _C_DENSE, _C_LABEL = 0, 1, 2


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(list(key)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


@lru_cache(maxsize=64)
def _zipf(size: int, exponent: float) -> Zipf:
    return Zipf(size, exponent)  # O(4096) memory whatever the size (exact head, analytic tail)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_int(name: str, v, low: int, high: Optional[int] = None) -> int:
    if not _is_int(v) or v < low or (high is not None and v > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {rng}, got {v!r}")
    return int(v)


def _check_float(name: str, v, low: Optional[float] = None, *, open_low: bool = False,
                 high: Optional[float] = None, open_high: bool = False) -> float:
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
    x = float(v) if ok else float("nan")
    if ok and math.isfinite(x):
        ok = ((low is None or (x > low if open_low else x >= low))
              and (high is None or (x < high if open_high else x <= high)))
    else:
        ok = False
    if not ok:
        lo = "" if low is None else f"{'>' if open_low else '>='} {low}"
        hi = "" if high is None else f"{'<' if open_high else '<='} {high}"
        cond = " and ".join(c for c in (lo, hi) if c)
        raise ValueError(f"{name} must be a finite number{' ' + cond if cond else ''}, got {v!r}")
    return x


# ---- generation ----------------------------------------------------------------------------

def synth_criteo_like(out_dir, *, num_examples: int, hash_size: int = DEFAULT_HASH_SIZE,
                      seed: int = 0, cardinalities: Optional[Sequence[int]] = None,
                      zipf_exponents: tuple[float, float] = (1.05, 1.4),
                      theta_scale: float = 0.65, scale_decay: float = 0.85,
                      num_crosses: int = 4, cross_scale: float = 0.3,
                      dense_scale: float = 0.5, positive_rate: float = 0.25,
                      bias: Optional[float] = None) -> DatasetMeta:
    """Write a Criteo-like planted-truth ctr data set to ``out_dir`` (see the module docstring).

    ``hash_size``: the most rows of any table (a feature with more raw values is hashed);
    ``cardinalities``: 26 raw vocabulary sizes (default the Criteo Kaggle ones);
    ``zipf_exponents``: (low, high) range of the per-feature Zipf exponents;
    ``theta_scale`` / ``scale_decay``: effect std of the most informative feature and the
    factor per informativeness rank; ``num_crosses`` / ``cross_scale``: number and std of
    pairwise crossing effects; ``dense_scale``: scale of w · x; ``positive_rate``: target mean
    p used to calibrate the bias; ``bias``: the logit intercept (overrides ``positive_rate``).
    """
    num_examples = _check_int("num_examples", num_examples, 1)
    params = _make_params(hash_size=hash_size, seed=seed, cardinalities=cardinalities,
                          zipf_exponents=zipf_exponents, theta_scale=theta_scale,
                          scale_decay=scale_decay, num_crosses=num_crosses,
                          cross_scale=cross_scale, dense_scale=dense_scale,
                          positive_rate=positive_rate, bias=bias)
    model = _Model(params)
    probs = np.empty(num_examples, dtype=np.float64)
    positives = 0
    pending: list[tuple] = []
    pending_rows = 0
    with DatasetWriter(out_dir) as writer:
        for block, start in enumerate(range(0, num_examples, BLOCK_ROWS)):
            b = min(BLOCK_ROWS, num_examples - start)
            raw, dense, label_u = model.draw(_S_BLOCK, block, b)
            p = _sigmoid(model.logits(dense, raw))
            labels = (label_u < p).astype(np.float32)
            ids = model.hash_all(raw)
            probs[start:start + b] = p
            positives += int(labels.sum())
            pending.append((labels, dense, ids))
            pending_rows += b
            last = start + b == num_examples
            if pending_rows >= WRITE_ROWS or last:  # row groups of WRITE_ROWS rows (last: the rest)
                cols = [np.concatenate(c) for c in zip(*pending)]
                pos = 0
                while pending_rows - pos >= WRITE_ROWS or (last and pos < pending_rows):
                    writer.write(ctr_table(*(c[pos:pos + WRITE_ROWS] for c in cols)))
                    pos += WRITE_ROWS
                pending = [tuple(c[pos:] for c in cols)] if pos < pending_rows else []
                pending_rows = max(pending_rows - pos, 0)
        pc = np.clip(probs, 1e-300, 1 - 1e-16)
        entropy = -(pc * np.log(pc) + (1 - pc) * np.log1p(-pc))
        extra = {"source": f"{GENERATOR} seed={params['seed']}", **params,
                 "positive_rate": positives / num_examples,
                 "expected_positive_rate": float(probs.mean()),
                 "bayes_logloss": float(entropy.mean())}
        meta = ctr_meta(num_examples, model.sizes, bayes_auc=expected_auc(probs), extra=extra)
        writer.commit(meta)
    return meta


def _make_params(*, hash_size, seed, cardinalities, zipf_exponents, theta_scale, scale_decay,
                 num_crosses, cross_scale, dense_scale, positive_rate, bias) -> dict:
    seed = _check_int("seed", seed, 0)
    hash_size = _check_int("hash_size", hash_size, 1, MAX_TABLE)
    cards = CRITEO_KAGGLE_CARDINALITIES if cardinalities is None else cardinalities
    if isinstance(cards, (str, bytes)) or not hasattr(cards, "__len__") or len(cards) != CRITEO_NUM_SPARSE:
        raise ValueError(f"cardinalities needs {CRITEO_NUM_SPARSE} values, got {cards!r}")
    cards = [_check_int(f"cardinalities[{f}]", c, 1, MAX_CARDINALITY) for f, c in enumerate(cards)]
    try:
        lo, hi = zipf_exponents
    except (TypeError, ValueError):
        raise ValueError(f"zipf_exponents must be a (low, high) pair, got {zipf_exponents!r}") from None
    lo = _check_float("zipf_exponents[0]", lo, 0.0)
    hi = _check_float("zipf_exponents[1]", hi, lo)
    theta_scale = _check_float("theta_scale", theta_scale, 0.0)
    scale_decay = _check_float("scale_decay", scale_decay, 0.0, high=1.0)
    cross_scale = _check_float("cross_scale", cross_scale, 0.0)
    dense_scale = _check_float("dense_scale", dense_scale, 0.0)
    crossable = [f for f in range(CRITEO_NUM_SPARSE) if cards[f] < CROSS_MAX_CARDINALITY]
    max_crosses = len(crossable) * (len(crossable) - 1) // 2
    num_crosses = _check_int("num_crosses", num_crosses, 0, max_crosses)
    if bias is None:
        positive_rate = _check_float("positive_rate", positive_rate, 0.0, open_low=True,
                                     high=1.0, open_high=True)
    else:
        bias = _check_float("bias", bias)

    F, D = CRITEO_NUM_SPARSE, CRITEO_NUM_DENSE
    exponents = lo + (hi - lo) * _rng(seed, _S_EXP).random(F)
    order = _rng(seed, _S_SCALE).permutation(F)  # order[k] = the feature of informativeness rank k
    rank = np.empty(F, dtype=np.int64)
    rank[order] = np.arange(F)
    scales = theta_scale * scale_decay ** rank.astype(np.float64)
    kr = _rng(seed, _S_KEYS)
    hash_keys = kr.integers(0, 2 ** 63, size=F, dtype=np.int64)
    theta_keys = kr.integers(0, 2 ** 63, size=F, dtype=np.int64)
    cross_keys = kr.integers(0, 2 ** 63, size=num_crosses, dtype=np.int64)
    prng = _rng(seed, _S_PERM)
    multipliers, offsets = [], []
    for c in cards:
        m = 1
        if c > 2:
            while True:
                m = int(prng.integers(1, c))
                if math.gcd(m, c) == 1:
                    break
        multipliers.append(m)
        offsets.append(int(prng.integers(0, c)))
    drng = _rng(seed, _S_DENSE)
    mu = drng.uniform(-0.5, 3.0, D)
    sigma = drng.uniform(0.5, 2.0, D)
    w = dense_scale / math.sqrt(D) * drng.standard_normal(D) / sigma
    crng = _rng(seed, _S_CROSS)
    pairs: list[list[int]] = []
    while len(pairs) < num_crosses:
        f, g = sorted(int(x) for x in crng.choice(crossable, size=2, replace=False))
        if [f, g] not in pairs:
            pairs.append([f, g])
    params = {
        "generator": GENERATOR, "seed": seed, "hash_size": hash_size,
        "cardinalities": cards,
        "zipf_exponent_range": [lo, hi], "zipf_exponents": [float(a) for a in exponents],
        "theta_scale": theta_scale, "scale_decay": scale_decay,
        "informativeness_rank": [int(r) for r in rank], "theta_scales": [float(s) for s in scales],
        "cross_pairs": pairs, "cross_scale": cross_scale, "dense_scale": dense_scale,
        "dense_mu": [float(x) for x in mu], "dense_sigma": [float(x) for x in sigma],
        "dense_weights": [float(x) for x in w],
        "id_multipliers": multipliers, "id_offsets": offsets,
        "hash_keys": [int(k) for k in hash_keys], "theta_keys": [int(k) for k in theta_keys],
        "cross_keys": [int(k) for k in cross_keys],
        "block_rows": BLOCK_ROWS,
        "id_rule": ("card <= hash_size: (id_multipliers[f] * raw + id_offsets[f]) % card; "
                    "else splitmix64(hash_keys[f] + raw) % hash_size"),
        "dense_rule": "float32(log1p(floor(exp(dense_mu[j] + dense_sigma[j] * z)))), z ~ N(0,1)",
        "logit_rule": ("bias + dense_weights . x + sum_f theta_scales[f] * hash_normal(splitmix64("
                       "theta_keys[f] + raw_f)) + sum_k cross_scale * hash_normal(splitmix64("
                       "splitmix64(cross_keys[k] + raw_f_k) + raw_g_k))"),
    }
    if bias is None:
        params["bias"] = 0.0
        model = _Model(params)
        raw, dense, _ = model.draw(_S_CALIB, 0, CALIBRATION_ROWS)
        bias = _calibrate_bias(model.logits(dense, raw), positive_rate)
        params["bias_calibrated_to"] = positive_rate
        params["calibration_rows"] = CALIBRATION_ROWS
    params["bias"] = float(bias)
    return params


def _calibrate_bias(logits: np.ndarray, target: float) -> float:
    """b with mean(sigmoid(logits + b)) == target (bisection: deterministic, monotone)."""
    lo, hi = -40.0 - float(logits.max()), 40.0 - float(logits.min())
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if _sigmoid(logits + mid).mean() < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class _Model:
    """The planted model of one parameter set (arrays prepared once)."""

    def __init__(self, params: dict):
        self.p = params
        self.seed = int(params["seed"])
        self.cards = [int(c) for c in params["cardinalities"]]
        self.sizes = [min(c, int(params["hash_size"])) for c in self.cards]  # rows of t_f
        self.zipfs = [_zipf(c, float(a)) for c, a in zip(self.cards, params["zipf_exponents"])]
        self.mu = np.asarray(params["dense_mu"], dtype=np.float64)
        self.sigma = np.asarray(params["dense_sigma"], dtype=np.float64)
        self.w = np.asarray(params["dense_weights"], dtype=np.float64)
        self.scales = [float(s) for s in params["theta_scales"]]
        self.theta_keys = [np.uint64(k) for k in params["theta_keys"]]
        self.hash_keys = [np.uint64(k) for k in params["hash_keys"]]
        self.cross_keys = [np.uint64(k) for k in params["cross_keys"]]

    def draw(self, stream: int, block: int, b: int):
        """Raw ids [b, 26] int64, dense [b, 13] float32 and label uniforms [b] of one block.
        Row-major draws from per-component streams: row r does not depend on b."""
        u = _rng(self.seed, stream, block, _C_RAW).random((b, CRITEO_NUM_SPARSE))
        raw = np.empty((b, CRITEO_NUM_SPARSE), dtype=np.int64)
        for f, zipf in enumerate(self.zipfs):
            raw[:, f] = zipf.sample(u[:, f])
        z = _rng(self.seed, stream, block, _C_DENSE).standard_normal((b, CRITEO_NUM_DENSE))
        dense = np.log1p(np.floor(np.exp(self.mu + self.sigma * z))).astype(np.float32)
        label_u = _rng(self.seed, stream, block, _C_LABEL).random(b)
        return raw, dense, label_u

    def hash_ids(self, f: int, raw: np.ndarray) -> np.ndarray:
        r = np.asarray(raw, dtype=np.int64).astype(np.uint64)
        card, size = self.cards[f], self.sizes[f]
        if card <= size:
            m, o = np.uint64(self.p["id_multipliers"][f]), np.uint64(self.p["id_offsets"][f])
            return ((r * m + o) % np.uint64(card)).astype(np.int64)  # m, r < card <= 2**32
        return (splitmix64(r + self.hash_keys[f]) % np.uint64(size)).astype(np.int64)

    def hash_all(self, raw: np.ndarray) -> np.ndarray:
        ids = np.empty_like(raw)
        for f in range(raw.shape[1]):
            ids[:, f] = self.hash_ids(f, raw[:, f])
        return ids

    def theta(self, f: int, raw: np.ndarray) -> np.ndarray:
        keys = np.asarray(raw, dtype=np.int64).astype(np.uint64) + self.theta_keys[f]
        return self.scales[f] * hash_normal(splitmix64(keys))

    def cross(self, k: int, raw_f: np.ndarray, raw_g: np.ndarray) -> np.ndarray:
        h = splitmix64(np.asarray(raw_f, dtype=np.int64).astype(np.uint64) + self.cross_keys[k])
        h = splitmix64(h + np.asarray(raw_g, dtype=np.int64).astype(np.uint64))
        return self.p["cross_scale"] * hash_normal(h)

    def logits(self, dense: np.ndarray, raw: np.ndarray) -> np.ndarray:
        raw = np.asarray(raw)
        if raw.ndim != 2 or raw.shape[1] != CRITEO_NUM_SPARSE:
            raise ValueError(f"raw_ids must have shape [B, {CRITEO_NUM_SPARSE}], got {raw.shape}")
        logit = self.p["bias"] + np.asarray(dense, dtype=np.float32).astype(np.float64) @ self.w
        for f in range(CRITEO_NUM_SPARSE):
            if self.scales[f] != 0.0:
                logit += self.theta(f, raw[:, f])
        if self.p["cross_scale"] != 0.0:
            for k, (f, g) in enumerate(self.p["cross_pairs"]):
                logit += self.cross(k, raw[:, f], raw[:, g])
        return logit


# ---- planted truth of a written data set ---------------------------------------------------

class CriteoLikeBlock(NamedTuple):
    """Rows ``[start, start + len)`` of a synth_criteo_like data set, regenerated."""

    start: int
    labels: np.ndarray  # float32 [b]
    dense: np.ndarray  # float32 [b, 13]
    raw_ids: np.ndarray  # int64 [b, 26]: the raw (popularity-rank) ids
    ids: np.ndarray  # int64 [b, 26]: the table rows written to the file
    probabilities: np.ndarray  # float64 [b]: the true p


def _model(meta: DatasetMeta) -> _Model:
    if meta.kind != "ctr" or meta.extra.get("generator") != GENERATOR:
        raise ValueError(f"not a {GENERATOR} data set (no planted model in dataset.json)")
    return _Model(meta.extra)


def criteo_like_block(meta: DatasetMeta, block: int) -> CriteoLikeBlock:
    """Regenerate RNG block ``block`` (rows ``block * block_rows`` ..) from dataset.json alone."""
    m = _model(meta)
    rows = int(meta.extra["block_rows"])
    nblocks = -(-meta.num_examples // rows)
    block = _check_int("block", block, 0, nblocks - 1)
    start = block * rows
    raw, dense, label_u = m.draw(_S_BLOCK, block, min(rows, meta.num_examples - start))
    p = _sigmoid(m.logits(dense, raw))
    return CriteoLikeBlock(start, (label_u < p).astype(np.float32), dense, raw, m.hash_all(raw), p)


def criteo_like_raw_ids(meta: DatasetMeta) -> np.ndarray:
    """Raw ids [num_examples, 26] (int64) of every row, regenerated block by block."""
    rows = int(meta.extra.get("block_rows", BLOCK_ROWS))
    return np.concatenate([criteo_like_block(meta, b).raw_ids
                           for b in range(-(-meta.num_examples // rows))])


def criteo_like_logits(meta: DatasetMeta, dense: np.ndarray, raw_ids: np.ndarray) -> np.ndarray:
    """True logits (float64) for rows given as dense [B, 13] (float32) and *raw* ids [B, 26]."""
    return _model(meta).logits(dense, raw_ids)


def criteo_like_probabilities(meta: DatasetMeta, dense: np.ndarray, raw_ids: np.ndarray) -> np.ndarray:
    """True click probabilities for rows given as dense [B, 13] and raw ids [B, 26]."""
    return _sigmoid(criteo_like_logits(meta, dense, raw_ids))


def criteo_like_hash(meta: DatasetMeta, feature: int, raw_ids: np.ndarray) -> np.ndarray:
    """Table rows of feature ``feature``'s raw ids (the ids written as ``cat_<feature>``)."""
    feature = _check_int("feature", feature, 0, CRITEO_NUM_SPARSE - 1)
    return _model(meta).hash_ids(feature, raw_ids)


def criteo_like_raw_pmf(meta: DatasetMeta, feature: int, raw_ids: np.ndarray) -> np.ndarray:
    """Exact marginal P(raw id) of feature ``feature`` (raw id = popularity rank)."""
    feature = _check_int("feature", feature, 0, CRITEO_NUM_SPARSE - 1)
    m = _model(meta)
    return m.zipfs[feature].pmf(np.asarray(raw_ids))
