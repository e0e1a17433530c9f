"""Synthetic data sets with planted ground truth (deterministic in their parameters and seed).

``synth_ctr``: a known logistic model over Zipf-distributed ids, so the Bayes-optimal AUC is
known. For example i with dense x_i (13 × N(0,1), float32) and ids id_{i,f} (f < 26)::

    rank_{i,f} ~ Zipf(table_size_f, zipf_exponent)           (rank 0 the most frequent)
    id_{i,f}   = (multiplier_f * rank_{i,f} + offset_f) mod table_size_f   (a permutation:
                 hot ids are spread over the table, not all near 0)
    θ_f[id]    = theta_scale * hash_normal(splitmix64(feature_key_f + id))  (N(0, s²) per
                 (feature, id), computed on demand from a counter-based hash: no table)
    logit_i    = bias + w · x_i + Σ_f θ_f[id_{i,f}],   p_i = sigmoid(logit_i)
    label_i    ~ Bernoulli(p_i)

``dataset.json`` stores every parameter needed to recompute p_i from a row (w, bias,
multipliers, offsets, feature keys): see ``ctr_planted_logits``. ``bayes_auc`` is
``expected_auc(p)`` over the whole file (positives weighted p_i, negatives 1 - p_i, pairs
i != j); ``bayes_logloss`` is the mean binary entropy of p_i (the Bayes scorer's expected
log loss).

``synth_text``: a Zipf language with planted topics, emitted as cbow examples. Word w belongs
to topic ``w % num_topics`` with within-topic rank ``w // num_topics``. Each sentence
(``sentence_length`` tokens) picks a topic uniformly; each token is, with probability
``topic_mix``, drawn from that topic's Zipf distribution over its words, else from a global
Zipf over all ids (rank = id). Examples are every position of every sentence (context =
the ±window neighbours inside the sentence, text order); the last sentence is cut to give
exactly ``num_examples``. Negatives are i.i.d. from the generator's exact unigram marginal
raised to 0.75 (``text_unigram``); as in word2vec they may equal the target.

Randomness is drawn per fixed-size block from ``SeedSequence([seed, stream, block])``, so the
output does not depend on chunking and blocks could be generated in parallel.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence, Union, cast

import numpy as np

from widedp.trainer.data._util import Zipf, expected_auc, hash_normal, splitmix64
from widedp.trainer.data.format.meta import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE, DatasetMeta, cbow_meta, ctr_meta
from widedp.trainer.data.convert.text import UNIGRAM_POWER, NegativeSampler, cbow_examples
from widedp.trainer.data.format.writer import DatasetWriter, cbow_table, ctr_table

CTR_BLOCK = 1 << 16  # rows per RNG block / row group
TEXT_BLOCK = 1 << 12  # sentences per RNG block
MAX_TABLE = 1 << 32
_S_BLOCK, _S_PERM, _S_W, _S_KEY, _S_NEG = 1, 2, 3, 4, 5


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or int(seed) != seed or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    return int(seed)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


@lru_cache(maxsize=8)
def _zipf(size: int, exponent: float) -> Zipf:
    return Zipf(size, exponent)


# ---- CTR -----------------------------------------------------------------------------------

def synth_ctr(out_dir, *, num_examples: int, table_sizes: Union[int, Sequence[int]] = 100_000,
              zipf_exponent: float = 1.1, seed: int = 0, theta_scale: float = 0.25,
              dense_scale: float = 1.0, bias: float = -1.5) -> DatasetMeta:
    """Write a planted-truth ctr data set (26 Zipf categorical features, 13 N(0,1) dense).

    ``table_sizes``: one int for all 26 tables or 26 ints (each in [1, 2**32]).
    ``theta_scale``: std s of the per-id effects θ; ``dense_scale``: ‖w‖ scale (w ~
    N(0, dense_scale²/13) per coordinate); ``bias``: the logit's intercept.
    """
    seed = _check_seed(seed)
    if int(num_examples) != num_examples or num_examples < 1:
        raise ValueError(f"num_examples must be an integer >= 1, got {num_examples}")
    if np.isscalar(table_sizes):
        sizes = [int(cast(int, table_sizes))] * CRITEO_NUM_SPARSE
    else:
        sizes = [int(t) for t in cast(Sequence[int], table_sizes)]
    if len(sizes) != CRITEO_NUM_SPARSE:
        raise ValueError(f"table_sizes needs {CRITEO_NUM_SPARSE} values (or one), got {len(sizes)}")
    if any(t < 1 or t > MAX_TABLE for t in sizes):
        raise ValueError(f"table sizes must be in [1, 2**32], got {sizes}")
    if not (zipf_exponent >= 0 and math.isfinite(zipf_exponent)):
        raise ValueError(f"zipf_exponent must be finite and >= 0, got {zipf_exponent}")
    for name, v in (("theta_scale", theta_scale), ("dense_scale", dense_scale), ("bias", bias)):
        if not math.isfinite(v) or (name != "bias" and v < 0):
            raise ValueError(f"{name} must be finite{' and >= 0' if name != 'bias' else ''}, got {v}")

    prng = _rng(seed, _S_PERM)
    multipliers, offsets = [], []
    for t in sizes:
        m = 1
        if t > 2:
            while True:
                m = int(prng.integers(1, t))
                if math.gcd(m, t) == 1:
                    break
        multipliers.append(m)
        offsets.append(int(prng.integers(0, t)))
    w = _rng(seed, _S_W).normal(0.0, dense_scale / math.sqrt(CRITEO_NUM_DENSE), CRITEO_NUM_DENSE)
    kr = _rng(seed, _S_KEY)
    feature_keys = [int(k) for k in kr.integers(0, 2 ** 63, size=CRITEO_NUM_SPARSE, dtype=np.int64)]
    params = {
        "generator": "synth_ctr", "seed": seed, "zipf_exponent": float(zipf_exponent),
        "theta_scale": float(theta_scale), "dense_scale": float(dense_scale), "bias": float(bias),
        "dense_weights": [float(x) for x in w], "rank_multipliers": multipliers,
        "rank_offsets": offsets, "feature_keys": feature_keys, "block_rows": CTR_BLOCK,
    }

    zipfs = {t: Zipf(t, float(zipf_exponent)) for t in set(sizes)}
    probs = np.empty(num_examples, dtype=np.float64)
    positives = 0
    with DatasetWriter(out_dir) as writer:
        for block, start in enumerate(range(0, num_examples, CTR_BLOCK)):
            b = min(CTR_BLOCK, num_examples - start)
            rng = _rng(seed, _S_BLOCK, block)
            u = rng.random((CRITEO_NUM_SPARSE, b))
            ids = np.empty((b, CRITEO_NUM_SPARSE), dtype=np.int64)
            for f, t in enumerate(sizes):
                ranks = zipfs[t].sample(u[f])
                ids[:, f] = _rank_to_id(ranks, multipliers[f], offsets[f], t)
            dense = rng.standard_normal((b, CRITEO_NUM_DENSE), dtype=np.float32)
            logit = _logits(params, dense, ids)
            p = _sigmoid(logit)
            labels = (rng.random(b) < p).astype(np.float32)
            probs[start:start + b] = p
            positives += int(labels.sum())
            writer.write(ctr_table(labels, dense, ids))
        pc = np.clip(probs, 1e-300, 1 - 1e-16)
        entropy = -(pc * np.log(pc) + (1 - pc) * np.log1p(-pc))
        extra = {"source": f"synth ctr seed={seed}", **params,
                 "positive_rate": positives / num_examples,
                 "expected_positive_rate": float(probs.mean()),
                 "bayes_logloss": float(entropy.mean())}
        meta = ctr_meta(num_examples, sizes, bayes_auc=expected_auc(probs), extra=extra)
        writer.commit(meta)
    return meta


def _rank_to_id(ranks: np.ndarray, multiplier: int, offset: int, size: int) -> np.ndarray:
    r = ranks.astype(np.uint64)
    return ((r * np.uint64(multiplier) + np.uint64(offset)) % np.uint64(size)).astype(np.int64)


def _theta(params: dict, feature: int, ids: np.ndarray) -> np.ndarray:
    keys = np.asarray(ids, dtype=np.int64).astype(np.uint64) + np.uint64(params["feature_keys"][feature])
    return params["theta_scale"] * hash_normal(splitmix64(keys))


def _logits(params: dict, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
    logit = params["bias"] + np.asarray(dense, dtype=np.float64) @ np.asarray(params["dense_weights"])
    for f in range(ids.shape[1]):
        logit += _theta(params, f, ids[:, f])
    return logit


def _ctr_params(meta: DatasetMeta) -> dict:
    if meta.kind != "ctr" or meta.extra.get("generator") != "synth_ctr":
        raise ValueError("not a synth_ctr data set (no planted model in dataset.json)")
    return meta.extra


def ctr_planted_theta(meta: DatasetMeta, feature: int, ids: np.ndarray) -> np.ndarray:
    """The true per-id effects θ_feature[ids] of a synth_ctr data set."""
    return _theta(_ctr_params(meta), feature, np.asarray(ids))


def ctr_planted_logits(meta: DatasetMeta, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """True logits (float64) for rows given as dense [B, 13] (float32) and ids [B, 26]."""
    return _logits(_ctr_params(meta), np.asarray(dense, dtype=np.float32), np.asarray(ids))


def ctr_planted_probabilities(meta: DatasetMeta, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return _sigmoid(ctr_planted_logits(meta, dense, ids))


def ctr_rank_to_id(meta: DatasetMeta, feature: int, ranks: np.ndarray) -> np.ndarray:
    """Id of the rank-r most frequent row of table ``feature`` (rank 0 = hottest)."""
    p = _ctr_params(meta)
    return _rank_to_id(np.asarray(ranks), p["rank_multipliers"][feature], p["rank_offsets"][feature],
                       meta.table_sizes[f"t_{feature}"])


def ctr_id_probabilities(meta: DatasetMeta, feature: int) -> np.ndarray:
    """Exact marginal P(id) of every row of table ``feature`` (length table_size)."""
    p = _ctr_params(meta)
    size = meta.table_sizes[f"t_{feature}"]
    ranks = np.arange(size)
    out = np.empty(size)
    out[ctr_rank_to_id(meta, feature, ranks)] = _zipf(size, float(p["zipf_exponent"])).pmf(ranks)
    return out


# ---- text ----------------------------------------------------------------------------------

def synth_text(out_dir, *, num_examples: int, vocab: int, seed: int = 0, num_topics: int = 10,
               zipf_exponent: float = 1.0, topic_mix: float = 0.8, sentence_length: int = 12,
               window: int = 4, negatives: int = 8) -> DatasetMeta:
    """Write a planted-topic cbow data set (see module docstring)."""
    seed = _check_seed(seed)
    for name, v, low in (("num_examples", num_examples, 1), ("vocab", vocab, 2),
                         ("num_topics", num_topics, 1), ("sentence_length", sentence_length, 2),
                         ("window", window, 1), ("negatives", negatives, 1)):
        if int(v) != v or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v}")
    if num_topics > vocab:
        raise ValueError(f"num_topics ({num_topics}) must be <= vocab ({vocab})")
    if not (0.0 <= topic_mix <= 1.0):
        raise ValueError(f"topic_mix must be in [0, 1], got {topic_mix}")
    if not (zipf_exponent >= 0 and math.isfinite(zipf_exponent)):
        raise ValueError(f"zipf_exponent must be finite and >= 0, got {zipf_exponent}")
    params = {"generator": "synth_text", "seed": seed, "num_topics": int(num_topics),
              "zipf_exponent": float(zipf_exponent), "topic_mix": float(topic_mix),
              "sentence_length": int(sentence_length), "window": int(window),
              "negatives_per_example": int(negatives), "unigram_power": UNIGRAM_POWER,
              "topic_of_word": "id % num_topics", "sentences_per_block": TEXT_BLOCK}
    k, L = int(num_topics), int(sentence_length)
    unigram = _text_unigram(vocab, k, zipf_exponent, topic_mix)
    neg = NegativeSampler(unigram, UNIGRAM_POWER, _rng(seed, _S_NEG))
    topic_sizes = [(vocab - t + k - 1) // k for t in range(k)]
    global_zipf = Zipf(vocab, float(zipf_exponent))
    topic_zipfs = {size: Zipf(size, float(zipf_exponent)) for size in set(topic_sizes)}
    sentences_needed = -(-num_examples // L)
    rows = 0
    with DatasetWriter(out_dir) as writer:
        for block, start in enumerate(range(0, sentences_needed, TEXT_BLOCK)):
            s = min(TEXT_BLOCK, sentences_needed - start)
            rng = _rng(seed, _S_BLOCK, block)
            topics = rng.integers(0, k, size=s)
            from_topic = rng.random((s, L)) < topic_mix
            u = rng.random((s, L))
            words = global_zipf.sample(u)  # background: rank == id
            tsize = np.array(topic_sizes)[topics]
            for size in set(topic_sizes):
                rows_t = tsize == size
                ranks = topic_zipfs[size].sample(u[rows_t])
                tw = ranks * k + topics[rows_t][:, None]
                words[rows_t] = np.where(from_topic[rows_t], tw, words[rows_t])
            ids = words.reshape(-1).astype(np.int64)
            sent = np.repeat(np.arange(s, dtype=np.int64), L)
            take = min(s * L, num_examples - rows)
            lengths, values, targets = cbow_examples(ids, sent, 0, take, window)
            writer.write(cbow_table(lengths, values, targets, neg.draw(len(targets), negatives)))
            rows += len(targets)
        meta = cbow_meta(rows, vocab, negatives, extra={"source": f"synth text seed={seed}", **params})
        writer.commit(meta)
    return meta


def _text_unigram(vocab: int, k: int, exponent: float, mix: float) -> np.ndarray:
    ids = np.arange(vocab)
    topic, rank = ids % k, ids // k
    p = (1 - mix) * _zipf(vocab, float(exponent)).pmf(ids)
    for t in range(k):
        size = (vocab - t + k - 1) // k
        sel = topic == t
        p[sel] += mix / k * _zipf(size, float(exponent)).pmf(rank[sel])
    return p


def text_unigram(meta: DatasetMeta) -> np.ndarray:
    """Exact unigram distribution of a synth_text data set's generator."""
    e = meta.extra
    if e.get("generator") != "synth_text":
        raise ValueError("not a synth_text data set")
    return _text_unigram(meta.table_sizes["input"], e["num_topics"], e["zipf_exponent"], e["topic_mix"])


def text_planted_topics(meta: DatasetMeta) -> np.ndarray:
    """Topic of every word id of a synth_text data set."""
    if meta.extra.get("generator") != "synth_text":
        raise ValueError("not a synth_text data set")
    return np.arange(meta.table_sizes["input"]) % meta.extra["num_topics"]
