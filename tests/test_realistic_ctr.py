"""widedp.trainer.data.synthetic.realistic.synth_criteo_like: Criteo-like planted-truth ctr data (format,
determinism, Zipf marginals, hashing, the planted model and its Bayes AUC, argument checks)."""

import math
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from widedp.trainer.data import auc, expected_auc, open_dataset, read_meta, synth_ctr
from widedp.trainer.data.synthetic import realistic
from widedp.trainer.data.synthetic.realistic import (CRITEO_KAGGLE_CARDINALITIES, criteo_like_block, criteo_like_hash,
                                    criteo_like_probabilities, criteo_like_raw_ids,
                                    criteo_like_raw_pmf, synth_criteo_like)

N = 20_000
HASH = 4096  # small: 14 of the 26 Criteo features are hashed (with collisions)


def _ctr_arrays(directory):
    t = pq.read_table(Path(directory) / "data.parquet")
    labels = t.column("label").to_numpy()
    dense = np.asarray(t.column("dense").combine_chunks().flatten()).reshape(t.num_rows, -1)
    cats = np.stack([t.column(f"cat_{i}").to_numpy() for i in range(26)], axis=1)
    return labels, dense, cats


def _auc_se(a: float, n_pos: float, n_neg: float) -> float:
    """Hanley & McNeil (1982) standard error of an empirical AUC."""
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    return math.sqrt((a * (1 - a) + (n_pos - 1) * (q1 - a * a) + (n_neg - 1) * (q2 - a * a)) / (n_pos * n_neg))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("criteo_like") / "ds"
    meta = synth_criteo_like(d, num_examples=N, hash_size=HASH, seed=3)
    labels, dense, cats = _ctr_arrays(d)
    raw = criteo_like_raw_ids(meta)
    return d, meta, labels, dense, cats, raw


def test_cardinalities_are_criteo_kaggle():
    assert list(CRITEO_KAGGLE_CARDINALITIES) == [
        1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def test_deterministic_in_seed_and_independent_of_chunking(tmp_path, monkeypatch):
    n = realistic.BLOCK_ROWS + 4_000  # crosses an RNG block boundary
    kw = dict(hash_size=HASH, seed=7)
    synth_criteo_like(tmp_path / "a", num_examples=n, **kw)
    monkeypatch.setattr(realistic, "WRITE_ROWS", 7_777)  # row groups straddle the RNG blocks
    synth_criteo_like(tmp_path / "b", num_examples=n, **kw)
    monkeypatch.undo()
    synth_criteo_like(tmp_path / "c", num_examples=N, **kw)  # a shorter file: a prefix
    synth_criteo_like(tmp_path / "d", num_examples=N, hash_size=HASH, seed=8)
    fa, fb = (pq.ParquetFile(tmp_path / x / "data.parquet") for x in "ab")
    assert fa.metadata.num_row_groups == 2 and fb.metadata.num_row_groups == -(-n // 7_777)
    ta, tb, tc, td = (pq.read_table(tmp_path / x / "data.parquet") for x in "abcd")
    assert ta.equals(tb) and read_meta(tmp_path / "a") == read_meta(tmp_path / "b")
    assert ta.slice(0, N).equals(tc)
    assert not tc.equals(td)
    ma, mc = read_meta(tmp_path / "a"), read_meta(tmp_path / "c")
    for key in ("bias", "dense_weights", "theta_scales", "zipf_exponents", "hash_keys", "cross_pairs"):
        assert ma.extra[key] == mc.extra[key]  # the model does not depend on num_examples
    # every block regenerates from dataset.json alone, including the partial last one
    labels, dense, cats = _ctr_arrays(tmp_path / "a")
    for block in (0, 1):
        blk = criteo_like_block(ma, block)
        rows = slice(blk.start, blk.start + len(blk.labels))
        assert np.array_equal(blk.ids, cats[rows]) and np.array_equal(blk.dense, dense[rows])
        assert np.array_equal(blk.labels, labels[rows])
    assert blk.start == realistic.BLOCK_ROWS and len(blk.labels) == 4_000


def test_format_table_sizes_and_ids_in_range(data):
    d, meta, labels, dense, cats, raw = data
    assert meta.kind == "ctr" and meta.num_examples == N and meta.num_dense == 13
    assert meta.features == [f"cat_{i}" for i in range(26)]
    assert meta.extra["generator"] == "synth_criteo_like"
    want = [min(c, HASH) for c in CRITEO_KAGGLE_CARDINALITIES]
    assert [meta.table_sizes[f"t_{i}"] for i in range(26)] == want
    assert read_meta(d) == meta
    assert cats.dtype == np.int64 and np.all(cats >= 0) and np.all(cats < np.array(want))
    assert set(np.unique(labels)) == {0.0, 1.0}
    assert dense.dtype == np.float32 and np.all(np.isfinite(dense)) and np.all(dense >= 0)
    assert 0.05 < np.mean(dense == 0) < 0.6  # log counts: many zeros, as Criteo's log(1 + I)
    train, test = open_dataset(d, test_fraction=0.1, seed=0, cache=False)
    assert len(train) + len(test) == N and len(test) == N // 10
    # the ids are the documented function of the raw ids; small features are bijections,
    # hashed ones collide
    assert np.all(raw >= 0) and np.all(raw < np.array(CRITEO_KAGGLE_CARDINALITIES))
    for f, card in enumerate(CRITEO_KAGGLE_CARDINALITIES):
        assert np.array_equal(criteo_like_hash(meta, f, raw[:, f]), cats[:, f])
        pairs = np.unique(np.stack([raw[:, f], cats[:, f]]), axis=1)
        if card <= HASH:
            assert len(np.unique(pairs[0])) == len(np.unique(pairs[1])) == pairs.shape[1]
            everything = np.arange(card)
            assert len(np.unique(criteo_like_hash(meta, f, everything))) == card
        else:
            assert len(np.unique(pairs[0])) == pairs.shape[1]  # raw -> id is a function
    big = int(np.argmax(CRITEO_KAGGLE_CARDINALITIES))
    assert len(np.unique(raw[:, big])) > len(np.unique(cats[:, big]))  # collisions happened


def test_zipf_marginals_of_raw_ids(data):
    _, meta, _, _, cats, raw = data
    lo, hi = meta.extra["zipf_exponent_range"]
    assert (lo, hi) == (1.05, 1.4)
    a = np.array(meta.extra["zipf_exponents"])
    assert np.all((a >= lo) & (a <= hi)) and a.std() > 0.05
    checked = 0
    for f, card in enumerate(CRITEO_KAGGLE_CARDINALITIES):
        ranks = np.arange(min(card, 5))
        p = criteo_like_raw_pmf(meta, f, ranks)
        if card <= 5:
            assert p.sum() == pytest.approx(1.0)
        counts = np.array([np.sum(raw[:, f] == r) for r in ranks])
        se = np.sqrt(N * p * (1 - p))
        assert np.all(np.abs(counts - N * p) <= 5 * se), (f, counts, N * p)
        assert counts[0] == counts.max()
        checked += len(ranks)
        if card > 4096:  # beyond the exact head the Zipf helper samples a closed-form tail
            z = realistic._zipf(card, float(a[f]))
            want = z.tail_mass / z.total
            got = np.mean(raw[:, f] >= 4096)
            assert abs(got - want) <= 5 * math.sqrt(want * (1 - want) / N), (f, got, want)
        # hashing only merges raw ids: the hottest raw id's row is at least as frequent
        hot_row = criteo_like_hash(meta, f, np.array([0]))[0]
        assert np.sum(cats[:, f] == hot_row) >= counts[0]
    assert checked > 100


def test_bayes_auc_is_reproduced_from_regenerated_raw_ids(data):
    _, meta, labels, dense, cats, raw = data
    p = criteo_like_probabilities(meta, dense, raw)  # the file's dense + regenerated raw ids
    assert expected_auc(p) == pytest.approx(meta.bayes_auc, abs=1e-12)
    pc = np.clip(p, 1e-300, 1 - 1e-16)
    entropy = -(pc * np.log(pc) + (1 - pc) * np.log1p(-pc))
    assert entropy.mean() == pytest.approx(meta.extra["bayes_logloss"], rel=1e-12)
    assert meta.extra["expected_positive_rate"] == pytest.approx(p.mean(), rel=1e-12)
    assert meta.extra["positive_rate"] == pytest.approx(labels.mean())
    # the labels are Bernoulli(p): positives and AUC within sampling error of their expectations
    assert abs(labels.sum() - p.sum()) <= 5 * math.sqrt(np.sum(p * (1 - p)))
    n_pos, n_neg = labels.sum(), N - labels.sum()
    se = _auc_se(meta.bayes_auc, n_pos, n_neg)
    assert abs(auc(p, labels) - meta.bayes_auc) <= 4 * se, (auc(p, labels), meta.bayes_auc, se)
    # defaults land in Criteo's range (Bayes AUC and rate do not depend on hash_size)
    assert 0.76 < meta.bayes_auc < 0.84 and abs(p.mean() - 0.25) < 0.02
    assert meta.extra["bias_calibrated_to"] == 0.25


def test_a_model_on_hashed_ids_does_not_beat_bayes(data):
    """A naive-Bayes model on the hashed ids + binned dense, fit on one half, scored on the
    other: it finds real signal but stays below the planted model's AUC on the same rows."""
    _, meta, labels, dense, cats, raw = data
    half = N // 2
    tr, te = slice(0, half), slice(half, N)
    prior = labels[tr].mean()
    base = math.log(prior / (1 - prior))
    score = np.zeros(N - half)
    cols = [cats[:, f] for f in range(26)] + [np.round(dense[:, j] * 2).astype(np.int64) for j in range(13)]
    for col in cols:
        size = int(col.max()) + 1
        pos = np.bincount(col[tr], weights=labels[tr], minlength=size)
        cnt = np.bincount(col[tr], minlength=size)
        rate = (pos + 20 * prior) / (cnt + 20)  # shrunk per-row click rate
        score += np.log(rate / (1 - rate))[col[te]] - base
    p_true = criteo_like_probabilities(meta, dense[te], raw[te])
    n_pos = labels[te].sum()
    se = _auc_se(meta.bayes_auc, n_pos, len(p_true) - n_pos)
    learned, bayes = auc(score, labels[te]), auc(p_true, labels[te])
    assert 0.6 < learned < bayes - 2 * se, (learned, bayes, se)


def test_bias_override_and_no_signal(tmp_path):
    d = tmp_path / "ds"
    meta = synth_criteo_like(d, num_examples=2_000, hash_size=HASH, seed=1, theta_scale=0.0,
                             cross_scale=0.0, dense_scale=0.0, bias=-1.0)
    assert meta.extra["bias"] == -1.0 and "bias_calibrated_to" not in meta.extra
    assert meta.bayes_auc == pytest.approx(0.5)
    assert meta.extra["expected_positive_rate"] == pytest.approx(1 / (1 + math.e))
    cards = [3] * 13 + [50_000] * 13
    meta = synth_criteo_like(tmp_path / "small", num_examples=2_000, hash_size=1000, seed=1,
                             cardinalities=cards, num_crosses=0)
    assert list(meta.table_sizes.values()) == [3] * 13 + [1000] * 13
    assert meta.extra["cross_pairs"] == []


def test_planted_functions_refuse_other_data_sets(tmp_path):
    meta = synth_ctr(tmp_path / "ctr", num_examples=100, table_sizes=10)
    for call in (lambda: criteo_like_block(meta, 0), lambda: criteo_like_raw_ids(meta),
                 lambda: criteo_like_probabilities(meta, np.zeros((1, 13), np.float32), np.zeros((1, 26), int))):
        with pytest.raises(ValueError, match="synth_criteo_like"):
            call()


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_examples=0), "num_examples"),
    (dict(num_examples=2.5), "num_examples"),
    (dict(num_examples=True), "num_examples"),
    (dict(hash_size=0), "hash_size"),
    (dict(hash_size=2 ** 33), "hash_size"),
    (dict(hash_size="big"), "hash_size"),
    (dict(seed=-1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(cardinalities=[10] * 25), "cardinalities"),
    (dict(cardinalities=[10] * 25 + [0]), "cardinalities[25]"),
    (dict(zipf_exponents=(1.4, 1.05)), "zipf_exponents[1]"),
    (dict(zipf_exponents=1.1), "zipf_exponents"),
    (dict(theta_scale=-0.1), "theta_scale"),
    (dict(theta_scale=float("nan")), "theta_scale"),
    (dict(scale_decay=1.5), "scale_decay"),
    (dict(num_crosses=-1), "num_crosses"),
    (dict(num_crosses=10 ** 6), "num_crosses"),
    (dict(cross_scale=float("inf")), "cross_scale"),
    (dict(dense_scale=-1.0), "dense_scale"),
    (dict(positive_rate=0.0), "positive_rate"),
    (dict(positive_rate=1.0), "positive_rate"),
    (dict(bias=float("inf")), "bias"),
])
def test_bad_parameters_raise_value_error_naming_them(tmp_path, kwargs, name):
    out = tmp_path / "never"
    args = dict(num_examples=100, hash_size=HASH) | kwargs
    with pytest.raises(ValueError, match=re.escape(name)):
        synth_criteo_like(out, **args)
    assert not out.exists()
