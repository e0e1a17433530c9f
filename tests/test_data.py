"""Data layer: format round trips, validation errors, converters, planted-truth generators,
Poisson sampling, CLI."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy import stats

from widedp.trainer.cli import main
from widedp.trainer.data.format.dataset import hold_out
from widedp.trainer.data import (DataError, PoissonSampler, auc, convert_criteo, convert_text,
                          ctr_id_probabilities, ctr_planted_probabilities, ctr_rank_to_id,
                          expected_auc, open_dataset, read_meta, synth_ctr, synth_text,
                          text_planted_topics, text_unigram)

REPO = Path(__file__).resolve().parents[1]


# ---- helpers -------------------------------------------------------------------------------

def _splitmix64(x: int) -> int:  # independent reference (SplitMix64 next() with state x)
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _ctr_arrays(directory):
    t = pq.read_table(Path(directory) / "data.parquet")
    labels = t.column("label").to_numpy()
    dense = np.stack(t.column("dense").to_pylist()).astype(np.float32)
    cats = np.stack([t.column(f"cat_{i}").to_numpy() for i in range(26)], axis=1)
    return labels, dense, cats


def _cbow_rows(directory):
    t = pq.read_table(Path(directory) / "data.parquet")
    return (t.column("context").to_pylist(), t.column("target").to_pylist(),
            t.column("negatives").to_pylist())


def _kjt_lists(kjt):
    """key -> list of per-example id lists."""
    out = {}
    for key in kjt.keys():
        jt = kjt[key]
        values, lengths = jt.values().tolist(), jt.lengths().tolist()
        pos, rows = 0, []
        for n in lengths:
            rows.append(values[pos:pos + n])
            pos += n
        out[key] = rows
    return out


@pytest.fixture(scope="module")
def small_ctr(tmp_path_factory):
    d = tmp_path_factory.mktemp("ctr") / "ds"
    synth_ctr(d, num_examples=600, table_sizes=[40 + i for i in range(26)], seed=3)
    return d


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    d = tmp_path_factory.mktemp("cbow") / "ds"
    synth_text(d, num_examples=500, vocab=60, num_topics=5, seed=4)
    return d


# ---- round trips ---------------------------------------------------------------------------

def test_ctr_round_trip_take_and_iter(small_ctr):
    meta = read_meta(small_ctr)
    assert meta.kind == "ctr" and meta.num_examples == 600 and meta.num_dense == 13
    assert meta.features == [f"cat_{i}" for i in range(26)]
    assert meta.feature_tables["cat_7"] == "t_7" and meta.table_sizes["t_7"] == 47
    assert set(meta.pooling.values()) == {"sum"} and 0.5 < meta.bayes_auc < 1
    assert set(meta.max_ids_per_example().values()) == {1}  # one id per feature
    assert meta.extra["source"] == "synth ctr seed=3"
    labels, dense, cats = _ctr_arrays(small_ctr)
    train, test = open_dataset(small_ctr, test_fraction=0.25, seed=1)
    assert len(train) == 450 and len(test) == 150
    idx = np.array([5, 0, 449, 5, 17])  # any order, repeats
    b = train.take(idx)
    rows = train.rows[idx]
    assert b.size == 5 and b.indices.dtype == np.int64 and list(b.indices) == list(idx)
    assert b.sparse.keys() == meta.features and b.sparse.stride() == 5
    assert b.sparse.values().dtype.is_floating_point is False and str(b.sparse.values().dtype) == "torch.int64"
    got = _kjt_lists(b.sparse)
    for f in range(26):
        assert got[f"cat_{f}"] == [[int(v)] for v in cats[rows, f]]
    assert b.dense.dtype.is_floating_point and tuple(b.dense.shape) == (5, 13)
    np.testing.assert_array_equal(b.dense.numpy(), dense[rows])
    np.testing.assert_array_equal(b.labels.numpy(), labels[rows])
    assert str(b.labels.dtype) == "torch.float32" and str(b.dense.dtype) == "torch.float32"
    # sequential batches cover the split in order
    seen = []
    for batch in test.iter_batches(64):
        assert batch.size <= 64
        seen.extend(batch.indices.tolist())
        np.testing.assert_array_equal(batch.labels.numpy(), labels[test.rows[batch.indices]])
    assert seen == list(range(150))
    # empty batch
    e = train.take(np.array([], dtype=np.int64))
    assert e.size == 0 and tuple(e.dense.shape) == (0, 13) and tuple(e.labels.shape) == (0,)
    assert e.sparse.keys() == meta.features and e.sparse.values().numel() == 0
    with pytest.raises(IndexError):
        train.take(np.array([450]))
    # DP-FEST view
    offsets, ids = train.feature_rows("cat_3")
    np.testing.assert_array_equal(offsets, np.arange(451))
    np.testing.assert_array_equal(ids, cats[train.rows, 3])


def test_cbow_round_trip(small_text):
    meta = read_meta(small_text)
    assert meta.kind == "cbow" and meta.num_dense == 0 and meta.num_examples == 500
    assert meta.features == ["context", "target"] + [f"neg_{i}" for i in range(8)]
    assert meta.feature_tables["context"] == "input" and meta.feature_tables["neg_3"] == "output"
    assert meta.pooling["context"] == "mean" and meta.pooling["target"] == "sum"
    assert meta.table_sizes == {"input": 60, "output": 60} and meta.bayes_auc is None
    ctx, tgt, neg = _cbow_rows(small_text)
    assert all(1 <= len(c) <= 8 for c in ctx)
    # the public bound the dense-table rule reads holds for every example
    bounds = meta.max_ids_per_example()
    assert bounds == {"context": 8, "target": 1, **{f"neg_{i}": 1 for i in range(8)}}
    assert max(len(c) for c in ctx) <= bounds["context"]
    train, test = open_dataset(small_text, test_fraction=0.1, seed=0)
    idx = np.array([3, 1, 2, 400, 3])
    b = train.take(idx)
    rows = train.rows[idx]
    got = _kjt_lists(b.sparse)
    assert got["context"] == [ctx[r] for r in rows]
    assert got["target"] == [[tgt[r]] for r in rows]
    for i in range(8):
        assert got[f"neg_{i}"] == [[neg[r][i]] for r in rows]
    assert tuple(b.dense.shape) == (5, 0) and b.labels.tolist() == [0.0] * 5
    offsets, ids = test.feature_rows("context")
    flat = [v for r in test.rows for v in ctx[r]]
    assert offsets[-1] == len(flat) and ids.tolist() == flat
    assert np.diff(offsets).tolist() == [len(ctx[r]) for r in test.rows]
    e = test.take([])
    assert e.size == 0 and e.sparse.values().numel() == 0


def test_cache_is_used_invalidated_and_equivalent(tmp_path):
    d = tmp_path / "ds"
    synth_ctr(d, num_examples=300, table_sizes=30, seed=1)
    a_train, _ = open_dataset(d)
    caches = list((d / ".widedp-cache").iterdir())
    assert len(caches) == 1 and caches[0].name.startswith("v")
    b_train, _ = open_dataset(d, cache=False)
    idx = np.arange(0, len(a_train), 7)
    x, y = a_train.take(idx), b_train.take(idx)
    assert x.sparse.values().tolist() == y.sparse.values().tolist()
    assert x.dense.tolist() == y.dense.tolist() and x.labels.tolist() == y.labels.tolist()
    # no writable cache location: decoded in memory instead, same batches
    import widedp.trainer.data.format.store as store

    (d / "blocker").write_text("a file, so mkdir under it fails")
    old = store.CACHE_DIR
    store.CACHE_DIR = "blocker/cache"
    try:
        c_train, _ = open_dataset(d)
    finally:
        store.CACHE_DIR = old
    assert c_train.take(idx).sparse.values().tolist() == x.sparse.values().tolist()
    # sampler + take, as the trainer uses them
    sampler = PoissonSampler(len(a_train), 0.05, seed=0)
    for _ in range(5):
        s = sampler.sample()
        b = a_train.take(s)
        assert b.size == len(s) and b.sparse.stride() == len(s) and b.sparse.values().numel() == 26 * len(s)
    # rewriting the data invalidates the (validated) cache: the new bad row is caught
    t = pq.read_table(d / "data.parquet")
    cat = t.column("cat_2").to_numpy().copy()
    cat[11] = 30
    pq.write_table(t.set_column(t.schema.get_field_index("cat_2"), "cat_2", pa.array(cat)), d / "data.parquet")
    with pytest.raises(DataError, match=r"row 11: feature 'cat_2': id 30 outside table 't_2' of size 30"):
        open_dataset(d)


# ---- determinism and splits ----------------------------------------------------------------

def test_synth_is_deterministic_by_seed(tmp_path):
    for fn, kw in ((synth_ctr, dict(num_examples=300, table_sizes=25)),
                   (synth_text, dict(num_examples=300, vocab=40))):
        a, b, c = tmp_path / f"{fn.__name__}a", tmp_path / f"{fn.__name__}b", tmp_path / f"{fn.__name__}c"
        fn(a, seed=7, **kw)
        fn(b, seed=7, **kw)
        fn(c, seed=8, **kw)
        ta, tb, tc = (pq.read_table(x / "data.parquet") for x in (a, b, c))
        assert ta.equals(tb) and not ta.equals(tc)
        assert read_meta(a) == read_meta(b)


def test_split_is_deterministic_disjoint_and_seeded(small_ctr):
    tr1, te1 = open_dataset(small_ctr, test_fraction=0.2, seed=5)
    tr2, te2 = open_dataset(small_ctr, test_fraction=0.2, seed=5)
    tr3, te3 = open_dataset(small_ctr, test_fraction=0.2, seed=6)
    assert np.array_equal(tr1.rows, tr2.rows) and np.array_equal(te1.rows, te2.rows)
    assert not np.array_equal(te1.rows, te3.rows)
    assert len(te1) == 120 and len(tr1) == 480
    assert len(np.intersect1d(tr1.rows, te1.rows)) == 0
    assert np.array_equal(np.union1d(tr1.rows, te1.rows), np.arange(600))
    assert np.all(np.diff(tr1.rows) > 0)
    full, none = open_dataset(small_ctr, test_fraction=0.0)
    assert len(full) == 600 and len(none) == 0 and none.take([]).size == 0
    with pytest.raises(ValueError):
        open_dataset(small_ctr, test_fraction=1.0)


def test_validation_split_is_held_out_of_the_training_split_deterministically(small_ctr):
    train, test = open_dataset(small_ctr, test_fraction=0.2, seed=5)
    rest, valid = hold_out(train, 0.25, seed=5)
    again, valid_again = hold_out(train, 0.25, seed=5)
    assert np.array_equal(rest.rows, again.rows) and np.array_equal(valid.rows, valid_again.rows)
    assert len(valid) == 120 and len(rest) == 360 and rest.name == "train" and valid.name == "validation"
    assert len(np.intersect1d(rest.rows, valid.rows)) == 0 and len(np.intersect1d(valid.rows, test.rows)) == 0
    assert np.array_equal(np.union1d(rest.rows, valid.rows), train.rows)
    assert np.all(np.diff(valid.rows) > 0) and np.all(np.diff(rest.rows) > 0)
    assert not np.array_equal(hold_out(train, 0.25, seed=6)[1].rows, valid.rows)
    # a held-out example reads back the file row it refers to
    assert np.array_equal(valid.take([0]).labels.numpy(), train.take([int(np.searchsorted(train.rows, valid.rows[0]))]).labels.numpy())
    with pytest.raises(ValueError, match="validation fraction"):
        hold_out(train, 1.0)


# ---- planted truth -------------------------------------------------------------------------

def test_bayes_auc_matches_independent_weighted_mann_whitney(tmp_path):
    d = tmp_path / "ds"
    meta = synth_ctr(d, num_examples=300, table_sizes=20, seed=11)
    _, dense, cats = _ctr_arrays(d)
    p = ctr_planted_probabilities(meta, dense, cats)  # recomputed from the file's rows
    num = den = 0.0
    for i in range(len(p)):  # O(n^2), pairs i != j, ties 1/2
        w = p[i] * (1 - p)
        w[i] = 0.0
        num += np.sum(w * ((p[i] > p) + 0.5 * (p[i] == p)))
        den += np.sum(w)
    assert meta.bayes_auc == pytest.approx(num / den, abs=1e-12)
    assert expected_auc(p) == pytest.approx(num / den, abs=1e-12)
    # ties: constant scores give exactly 1/2
    assert expected_auc(np.full(10, 0.3)) == pytest.approx(0.5)


def test_bayes_auc_close_to_empirical_auc_on_large_set(tmp_path):
    d = tmp_path / "ds"
    meta = synth_ctr(d, num_examples=200_000, table_sizes=1000, seed=2)
    labels, dense, cats = _ctr_arrays(d)
    p = ctr_planted_probabilities(meta, dense, cats)
    assert expected_auc(p) == pytest.approx(meta.bayes_auc, abs=1e-12)
    emp = auc(p, labels)
    assert abs(emp - meta.bayes_auc) < 0.006, (emp, meta.bayes_auc)  # sd of AUC here ~0.0012
    assert meta.extra["positive_rate"] == pytest.approx(labels.mean())
    assert abs(labels.mean() - p.mean()) < 0.005
    assert 0.6 < meta.bayes_auc < 0.95


def test_zipf_marginal_matches(tmp_path):
    d = tmp_path / "ds"
    meta = synth_ctr(d, num_examples=60_000, table_sizes=200, zipf_exponent=1.1, seed=5)
    _, _, cats = _ctr_arrays(d)
    hottest = set()
    for f in (0, 13, 25):
        counts = np.bincount(cats[:, f], minlength=200)
        probs = ctr_id_probabilities(meta, f)
        assert probs.sum() == pytest.approx(1.0)
        expected = probs * len(cats)
        stat = np.sum((counts - expected) ** 2 / expected)
        assert stats.chi2.sf(stat, 199) > 1e-6
        hot = int(ctr_rank_to_id(meta, f, np.array([0]))[0])
        assert counts.argmax() == hot
        hottest.add(hot)
        # rank-frequency: top rank ~ 1/H(200, 1.1)
        assert counts[hot] / len(cats) == pytest.approx(1 / np.sum(np.arange(1, 201) ** -1.1), rel=0.05)
    assert len(hottest) > 1  # ranks are permuted per feature


def test_zipf_tail_approximation_for_huge_tables():
    from widedp.trainer.data._util import _EXACT_LIMIT as H, Zipf

    size, a = 3 << 22, 1.1
    z = Zipf(size, a)
    exact_tail = np.sum(np.arange(H + 1, size + 1, dtype=np.float64) ** -a)
    assert z.tail_mass == pytest.approx(exact_tail, rel=1e-9)
    u = np.random.default_rng(0).random(400_000)
    r = z.sample(u)
    assert r.min() >= 0 and r.max() < size
    for lo, hi in ((H, 2 * H), (10 * H, 100 * H), (H, size)):  # mass of rank ranges in the tail
        want = np.sum(np.arange(lo + 1, hi + 1, dtype=np.float64) ** -a) / z.total
        got = np.mean((r >= lo) & (r < hi))
        assert abs(got - want) < 6 * math.sqrt(want * (1 - want) / len(u)), (lo, hi, got, want)
    frac = np.mean(r >= H)
    want = z.tail_mass / z.total
    assert abs(frac - want) < 6 * math.sqrt(want * (1 - want) / len(u))
    assert np.mean(r == 0) == pytest.approx(1 / z.total, rel=0.03)


def test_synth_text_has_planted_topics(tmp_path):
    d = tmp_path / "ds"
    meta = synth_text(d, num_examples=20_000, vocab=200, num_topics=8, topic_mix=0.8, seed=1)
    ctx, tgt, neg = _cbow_rows(d)
    topic = text_planted_topics(meta)
    same = np.mean([np.mean(topic[c] == topic[t]) for c, t in zip(ctx[:5000], tgt[:5000])])
    assert same > 0.5  # chance level is ~1/8 (planted: 0.8^2 + small)
    neg = np.array(neg)
    assert neg.shape == (20_000, 8) and neg.min() >= 0 and neg.max() < 200
    # negatives follow unigram^0.75
    q = text_unigram(meta) ** 0.75
    q /= q.sum()
    counts = np.bincount(neg.reshape(-1), minlength=200)
    top = np.argsort(-q)[:20]
    np.testing.assert_allclose(counts[top] / neg.size, q[top], rtol=0.1)
    # targets follow the unigram
    tc = np.bincount(np.array(tgt), minlength=200) / len(tgt)
    np.testing.assert_allclose(tc[:5], text_unigram(meta)[:5], rtol=0.1)
    assert meta.extra["num_topics"] == 8 and meta.extra["window"] == 4


# ---- Criteo converter ------------------------------------------------------------------------

def _criteo_line(label, dense, cats):
    return "\t".join([label] + dense + cats)


def _expected_criteo(lines, hash_size):
    rows = []
    for line in lines:
        f = line.rstrip("\r\n").split("\t")
        dense = [np.float32(math.log1p(max(int(x), 0))) if x else np.float32(0) for x in f[1:14]]
        cats = [1 + _splitmix64(int(h, 16)) % (hash_size - 1) if h else 0 for h in f[14:]]
        rows.append((float(f[0]), dense, cats))
    return rows


CRITEO_LINES = [
    _criteo_line("1", ["5", "", "-3", "0", "10", "", "", "", "", "", "", "", "1"],
                 ["68fd1e64", "", "0", "FFFFFFFF"] + [""] * 21 + ["a"]),
    _criteo_line("0", [""] * 13, [""] * 26),
    _criteo_line("0", [str(10 ** k) for k in range(13)],
                 [f"{i:x}" for i in range(26)]),
    _criteo_line("1", ["+7"] + ["2"] * 12, ["ffffffffffffffff"] * 26),
]


def test_splitmix_reference_value():
    assert _splitmix64(0) == 0xE220A8397B1DCDAF  # SplitMix64's published first output


@pytest.mark.parametrize("chunk_rows", [1, 3, 100])
def test_criteo_converter_exact_rows(tmp_path, chunk_rows):
    src = tmp_path / "in.tsv"
    text = "\n".join(CRITEO_LINES[:3]) + "\r\n" + CRITEO_LINES[3]  # CRLF + no final newline
    src.write_bytes(text.encode())
    out = tmp_path / "out"
    meta = convert_criteo(src, out, hash_size=1000, chunk_rows=chunk_rows)
    assert meta.num_examples == 4 and meta.table_sizes == {f"t_{i}": 1000 for i in range(26)}
    assert meta.bayes_auc is None and meta.extra["source"] == f"criteo {src}"
    labels, dense, cats = _ctr_arrays(out)
    for i, (lab, d, c) in enumerate(_expected_criteo(CRITEO_LINES, 1000)):
        assert labels[i] == lab
        assert dense[i].tolist() == [float(x) for x in d]
        assert cats[i].tolist() == c
    assert dense[0, 0] == np.float32(math.log(6)) and dense[0, 2] == 0 and dense[1].sum() == 0
    assert cats[1].tolist() == [0] * 26 and cats[0, 1] == 0
    assert cats[0, 2] == 1 + 0xE220A8397B1DCDAF % 999  # hex "0"
    train, _ = open_dataset(out, test_fraction=0.0)
    assert _kjt_lists(train.take([0]).sparse)["cat_0"] == [[int(cats[0, 0])]]
    assert sorted(os.listdir(out)) == [".widedp-cache", "data.parquet", "dataset.json"]


BAD_CRITEO = [
    ("wrong field count", lambda L: L[:2] + ["\t".join(L[2].split("\t")[:-1])] + L[3:], 3, "expected 40"),
    ("non-integer dense", lambda L: L[:1] + [L[1].replace("\t\t", "\t1.5\t", 1)] + L[2:], 2, "I1"),
    ("bad hex", lambda L: L[:3] + [L[3].replace("ffffffffffffffff", "fffz", 1)], 4, "is not a hex"),
    ("too long hex", lambda L: L[:3] + [L[3].replace("ffffffffffffffff", "f" * 17, 1)], 4, "hex"),
    ("label 2", lambda L: L[:2] + ["2" + L[2][1:]] + L[3:], 3, "label '2' is not 0 or 1"),
    ("empty label", lambda L: ["" + L[0][1:]] + L[1:], 1, "label '' is not 0 or 1"),
    ("lone sign", lambda L: L[:3] + [L[3].replace("+7", "-", 1)], 4, "I1"),
    ("blank line", lambda L: L[:1] + [""] + L[1:], 2, "expected 40"),
]


@pytest.mark.parametrize("name,mutate,line,needle", BAD_CRITEO, ids=[b[0] for b in BAD_CRITEO])
@pytest.mark.parametrize("chunk_rows", [2, 100])
def test_criteo_bad_input_names_file_and_line_and_leaves_nothing(tmp_path, name, mutate, line, needle,
                                                                 chunk_rows):
    src = tmp_path / "bad.tsv"
    src.write_text("\n".join(mutate(list(CRITEO_LINES))) + "\n")
    out = tmp_path / "out"
    with pytest.raises(DataError) as err:
        convert_criteo(src, out, hash_size=100, chunk_rows=chunk_rows)
    msg = str(err.value)
    assert str(src) in msg and f"line {line} (row {line - 1})" in msg and needle in msg, msg
    assert not out.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(DataError):
        convert_criteo(src, existing, hash_size=100, chunk_rows=chunk_rows)
    assert os.listdir(existing) == []


def test_criteo_empty_and_missing_input(tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    with pytest.raises(DataError, match="empty.tsv: empty file"):
        convert_criteo(empty, tmp_path / "o1")
    with pytest.raises(DataError, match="nope.tsv: cannot open"):
        convert_criteo(tmp_path / "nope.tsv", tmp_path / "o2")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


# ---- text converter --------------------------------------------------------------------------

TEXT = "The cat sat on the mat.\nThe dog, the cat!\n\nA b\nzebra\n"
# a public vocabulary file (the private, DP-selected one is tested in test_private_vocab.py):
# the cat a b; OOV dropped before windowing; window 2
TEXT_VOCAB = "The\ncat\t7\n\na\nb\n"
TEXT_EXPECTED = [  # (context, target)
    ([1, 0], 0), ([0, 0], 1), ([0, 1], 0),  # the cat the
    ([0, 1], 0), ([0, 1], 0), ([0, 0], 1),  # the the cat
    ([3], 2), ([2], 3),  # a b ; "zebra" alone: no context -> no example
]


def test_text_converter_exact_samples(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text(TEXT)
    vf = tmp_path / "vocab.txt"
    vf.write_text(TEXT_VOCAB + "zebra\n")
    meta = convert_text(src, tmp_path / "o", vocab=4, window=2, seed=3, vocab_file=vf)
    assert meta.num_examples == len(TEXT_EXPECTED) and meta.table_sizes == {"input": 4, "output": 4}
    assert (tmp_path / "o" / "vocab.tsv").read_text() == "the\ncat\na\nb\n"
    assert meta.privacy_events == [] and read_meta(tmp_path / "o").privacy_events == []
    ctx, tgt, neg = _cbow_rows(tmp_path / "o")
    assert list(zip(ctx, tgt)) == TEXT_EXPECTED
    neg = np.array(neg)
    assert neg.shape == (8, 8) and neg.min() >= 0 and neg.max() < 4
    # negatives: deterministic by seed, different for another seed
    convert_text(src, tmp_path / "o2", vocab=4, window=2, seed=3, vocab_file=vf)
    convert_text(src, tmp_path / "o3", vocab=4, window=2, seed=4, vocab_file=vf)
    assert _cbow_rows(tmp_path / "o2")[2] == neg.tolist()
    assert _cbow_rows(tmp_path / "o3")[2] != neg.tolist()
    train, _ = open_dataset(tmp_path / "o", test_fraction=0.0)
    b = train.take(np.arange(8))
    assert _kjt_lists(b.sparse)["context"] == [c for c, _ in TEXT_EXPECTED]


def test_text_tokenization_and_streaming_are_chunk_independent(tmp_path, monkeypatch):
    import widedp.trainer.data.convert.text as text_mod

    src = tmp_path / "t.txt"
    src.write_text("Foo_bar foo, BAR2 bar2\n")
    vf = tmp_path / "vocab.txt"
    vf.write_text("bar2\nfoo\nbar\n")
    meta = convert_text(src, tmp_path / "a", vocab=10, window=1, vocab_file=vf)
    assert (tmp_path / "a" / "vocab.tsv").read_text() == "bar2\nfoo\nbar\n"
    ctx, tgt, _ = _cbow_rows(tmp_path / "a")
    assert list(zip(ctx, tgt)) == [([2], 1), ([1, 1], 2), ([2, 0], 1), ([1, 0], 0), ([0], 0)]
    assert meta.table_sizes["input"] == 3
    # a longer text, streamed in tiny pieces and tiny chunks, gives identical output
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(30)]
    lines = [" ".join(rng.choice(words, size=rng.integers(0, 25))) for _ in range(60)]
    lines.insert(10, " ".join(rng.choice(words, size=400)))  # one long line
    src.write_text("\n".join(lines))  # no final newline
    vf.write_text("".join(f"{w}\n" for w in words))
    convert_text(src, tmp_path / "ref", vocab=20, window=3, seed=1, vocab_file=vf)
    monkeypatch.setattr(text_mod, "_PIECE_CHARS", 7)
    convert_text(src, tmp_path / "small", vocab=20, window=3, seed=1, chunk_tokens=5, vocab_file=vf)
    assert pq.read_table(tmp_path / "ref" / "data.parquet").equals(
        pq.read_table(tmp_path / "small" / "data.parquet"))


def test_text_bad_inputs(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("...\n")
    with pytest.raises(DataError, match="empty.txt: no words"):
        convert_text(empty, tmp_path / "o", vocab=5)
    lonely = tmp_path / "lonely.txt"
    lonely.write_text("one\ntwo\n")
    (tmp_path / "v.txt").write_text("one\ntwo\n")
    with pytest.raises(DataError, match="lonely.txt: no CBOW examples"):
        convert_text(lonely, tmp_path / "o", vocab=5, vocab_file=tmp_path / "v.txt")
    with pytest.raises(DataError, match="lonely.txt: no word passed the private vocabulary selection"):
        convert_text(lonely, tmp_path / "o", vocab=5)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok words here\nfine\nbad \xff\xfe byte\n")
    with pytest.raises(DataError, match=r"bad.txt: line 3: not valid UTF-8"):
        convert_text(bad, tmp_path / "o", vocab=5)
    assert not (tmp_path / "o").exists()


# ---- validation of data sets -----------------------------------------------------------------

def _rewrite(directory, table, row_group_size=4):
    pq.write_table(table, Path(directory) / "data.parquet", row_group_size=row_group_size)


def _set(table, name, array):
    return table.set_column(table.schema.get_field_index(name), name, array)


def _col(table, name):
    return table.column(name).to_numpy().copy()


def _dense_with(table, row, j, value):
    d = np.stack(table.column("dense").to_pylist()).astype(np.float32)
    d[row, j] = value
    return _set(table, "dense", pa.FixedSizeListArray.from_arrays(pa.array(d.reshape(-1)), 13))


def _with_value(name, row, value, dtype):
    def f(t):
        a = _col(t, name).astype(dtype)
        a[row] = value
        return _set(t, name, pa.array(a))
    return f


CTR_CASES = [
    ("missing column", lambda t: t.drop_columns(["cat_3"]), r"missing column\(s\) cat_3"),
    ("extra column", lambda t: t.append_column("foo", pa.array(np.zeros(len(t)))), r"unexpected column\(s\) foo"),
    ("mistyped id", lambda t: _set(t, "cat_2", pa.array(_col(t, "cat_2").astype(np.int32))),
     r"column 'cat_2' has type int32, expected int64"),
    ("mistyped label", lambda t: _set(t, "label", pa.array(_col(t, "label").astype(np.float64))),
     r"column 'label' has type double"),
    ("mistyped dense", lambda t: _set(t, "dense", pa.array(t.column("dense").to_pylist(), pa.list_(pa.float32()))),
     r"column 'dense' has type list<"),
    ("id outside table", _with_value("cat_5", 7, 45, np.int64),
     r"row 7: feature 'cat_5': id 45 outside table 't_5' of size 45"),
    ("negative id", _with_value("cat_0", 9, -1, np.int64), r"row 9: feature 'cat_0': negative id -1"),
    ("nan dense", lambda t: _dense_with(t, 10, 4, np.nan), r"row 10: dense\[4\] is nan"),
    ("inf dense", lambda t: _dense_with(t, 3, 0, -np.inf), r"row 3: dense\[0\] is -inf"),
    ("nan label", _with_value("label", 5, np.nan, np.float32), r"row 5: label is nan"),
    ("label 0.5", _with_value("label", 6, 0.5, np.float32), r"row 6: label 0.5 is not 0 or 1"),
    ("null id", lambda t: _set(t, "cat_1", pa.array([None if i == 13 else 1 for i in range(len(t))], pa.int64())),
     r"row 13: column 'cat_1' is null"),
    ("zero examples", lambda t: t.slice(0, 0), r"zero examples"),
    ("row count mismatch", lambda t: t.slice(0, 20), r"has 20 rows but dataset.json says num_examples=600"),
]


@pytest.mark.parametrize("name,mutate,pattern", CTR_CASES, ids=[c[0] for c in CTR_CASES])
def test_open_dataset_rejects_bad_ctr_data(tmp_path, small_ctr, name, mutate, pattern):
    d = tmp_path / "ds"
    d.mkdir()
    (d / "dataset.json").write_text((small_ctr / "dataset.json").read_text())
    _rewrite(d, mutate(pq.read_table(small_ctr / "data.parquet")))
    with pytest.raises(DataError, match=pattern) as err:
        open_dataset(d)
    assert str(d / "data.parquet") in str(err.value)
    assert not (d / ".widedp-cache").exists() or list((d / ".widedp-cache").iterdir()) == []


def _ctx_with(t, row, ids):
    ctx = t.column("context").to_pylist()
    ctx[row] = ids
    return _set(t, "context", pa.array(ctx, pa.list_(pa.int64())))


def _neg_with(t, row, j, value):
    neg = np.array(t.column("negatives").to_pylist())
    neg[row, j] = value
    return _set(t, "negatives", pa.FixedSizeListArray.from_arrays(pa.array(neg.reshape(-1)), 8))


CBOW_CASES = [
    ("empty context", lambda t: _ctx_with(t, 17, []), r"row 17: empty context"),
    ("context out of table", lambda t: _ctx_with(t, 21, [1, 60]),
     r"row 21: feature 'context': id 60 outside table 'input' of size 60"),
    ("long context", lambda t: _ctx_with(t, 2, [1] * 9), r"row 2: context has 9 ids"),
    ("negative target", _with_value("target", 30, -5, np.int64), r"row 30: feature 'target': negative id -5"),
    ("bad negative", lambda t: _neg_with(t, 8, 3, 99), r"row 8: feature 'neg_3': id 99 outside table 'output'"),
    ("wrong negatives size", lambda t: _set(t, "negatives", pa.FixedSizeListArray.from_arrays(
        pa.array(np.zeros(len(t) * 7, dtype=np.int64)), 7)), r"column 'negatives' has type"),
]


@pytest.mark.parametrize("name,mutate,pattern", CBOW_CASES, ids=[c[0] for c in CBOW_CASES])
def test_open_dataset_rejects_bad_cbow_data(tmp_path, small_text, name, mutate, pattern):
    d = tmp_path / "ds"
    d.mkdir()
    (d / "dataset.json").write_text((small_text / "dataset.json").read_text())
    _rewrite(d, mutate(pq.read_table(small_text / "data.parquet")), row_group_size=5)
    with pytest.raises(DataError, match=pattern) as err:
        open_dataset(d)
    assert str(d / "data.parquet") in str(err.value)


def test_open_dataset_rejects_bad_files(tmp_path, small_ctr):
    d = tmp_path / "ds"
    d.mkdir()
    with pytest.raises(DataError, match=r"dataset.json: missing"):
        open_dataset(d)
    (d / "dataset.json").write_text("{not json")
    with pytest.raises(DataError, match=r"dataset.json: malformed JSON"):
        open_dataset(d)
    good = json.loads((small_ctr / "dataset.json").read_text())
    for key, value, pattern in (("kind", "images", "kind must be"), ("num_examples", -1, "num_examples"),
                                ("pooling", {}, "pooling of feature 'cat_0'")):
        (d / "dataset.json").write_text(json.dumps({**good, key: value}))
        with pytest.raises(DataError, match=pattern):
            open_dataset(d)
    (d / "dataset.json").write_text(json.dumps(good))
    with pytest.raises(DataError, match=r"data.parquet: missing"):
        open_dataset(d)
    (d / "data.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"data.parquet: empty file"):
        open_dataset(d)
    (d / "data.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(DataError, match=r"data.parquet: not a readable Parquet file"):
        open_dataset(d)


# ---- Poisson sampling ----------------------------------------------------------------------

class _FixedSize:  # broken: always round(q n) examples
    def __init__(self, n, q, seed):
        self.n, self.b, self.rng = n, round(q * n), np.random.default_rng(seed)

    def sample(self):
        return np.sort(self.rng.choice(self.n, size=self.b, replace=False))


class _Contiguous:  # broken: Binomial size, but a contiguous (wrapping) block
    def __init__(self, n, q, seed):
        self.n, self.q, self.rng = n, q, np.random.default_rng(seed)

    def sample(self):
        k = self.rng.binomial(self.n, self.q)
        return np.sort((self.rng.integers(self.n) + np.arange(k)) % self.n)


def _inclusion(sampler, n, trials):
    m = np.zeros((trials, n), dtype=bool)
    for t in range(trials):
        s = sampler.sample()
        m[t, s] = True
    return m


ALPHA = 1e-6  # false-alarm probability of each test for a correct sampler


def _joint_pvalue(m, q):
    """Chi-square goodness of fit of the whole inclusion pattern (2^n cells) vs Bernoulli(q)^n."""
    n = m.shape[1]
    codes = m.astype(np.int64) @ (1 << np.arange(n))
    counts = np.bincount(codes, minlength=1 << n)
    k = np.array([bin(c).count("1") for c in range(1 << n)])
    expected = len(m) * q ** k * (1 - q) ** (n - k)
    return stats.chi2.sf(np.sum((counts - expected) ** 2 / expected), (1 << n) - 1)


def _size_pvalue(m, q):
    n = m.shape[1]
    sizes = m.sum(axis=1)
    top = int(stats.binom.ppf(0.999, n, q))
    counts = np.bincount(np.minimum(sizes, top), minlength=top + 1)
    probs = stats.binom.pmf(np.arange(top + 1), n, q)
    probs[top] = stats.binom.sf(top - 1, n, q)
    expected = len(m) * probs
    return stats.chi2.sf(np.sum((counts - expected) ** 2 / expected), top)


def _marginal_pvalue(m, q):
    t = len(m)
    c = m.sum(axis=0)
    return stats.chi2.sf(np.sum((c - t * q) ** 2 / (t * q * (1 - q))), m.shape[1])


def _pairwise_min_pvalue_bonferroni(m, q):
    t, n = m.shape
    x = m.astype(np.int64)
    co = (x.T @ x)[np.triu_indices(n, 1)]
    p = np.minimum(1.0, 2 * np.minimum(stats.binom.cdf(co, t, q * q), stats.binom.sf(co - 1, t, q * q)))
    return p.min() * len(co)


def test_poisson_sampler_joint_distribution_is_bernoulli_product():
    n, q, trials = 6, 0.3, 40_000
    good = _inclusion(PoissonSampler(n, q, seed=1), n, trials)
    assert _joint_pvalue(good, q) > ALPHA
    assert _joint_pvalue(_inclusion(_FixedSize(n, q, 1), n, trials), q) < ALPHA
    assert _joint_pvalue(_inclusion(_Contiguous(n, q, 1), n, trials), q) < ALPHA


def test_poisson_sampler_marginals_pairs_and_sizes():
    n, q, trials = 40, 0.1, 20_000
    good = _inclusion(PoissonSampler(n, q, seed=2), n, trials)
    assert _marginal_pvalue(good, q) > ALPHA
    assert _pairwise_min_pvalue_bonferroni(good, q) > ALPHA
    assert _size_pvalue(good, q) > ALPHA
    fixed = _inclusion(_FixedSize(n, q, 2), n, trials)
    assert _size_pvalue(fixed, q) < ALPHA  # marginals are right; the size law is not
    contiguous = _inclusion(_Contiguous(n, q, 2), n, trials)
    assert _pairwise_min_pvalue_bonferroni(contiguous, q) < ALPHA


def test_poisson_sampler_output_and_resume():
    s = PoissonSampler(1000, 0.01, seed=3)
    draws = [s.sample() for _ in range(200)]
    for d in draws:
        assert d.dtype == np.int64 and np.all(np.diff(d) > 0) and (len(d) == 0 or (d[0] >= 0 and d[-1] < 1000))
    small = PoissonSampler(10, 0.05, seed=0)
    sizes = [len(small.sample()) for _ in range(50)]
    assert 0 in sizes and max(sizes) > 0  # empty samples are legal
    assert PoissonSampler(5, 1.0, seed=0).sample().tolist() == [0, 1, 2, 3, 4]
    state = json.loads(json.dumps(s.state_dict()))
    after = [s.sample() for _ in range(20)]
    r = PoissonSampler(1000, 0.01, seed=99)
    r.load_state_dict(state)
    assert all(np.array_equal(a, b) for a, b in zip(after, [r.sample() for _ in range(20)]))
    with pytest.raises(ValueError):
        PoissonSampler(999, 0.01, seed=0).load_state_dict(state)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError):
            PoissonSampler(10, bad, seed=0)


# ---- CLI -------------------------------------------------------------------------------------

def _cli(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_commands_print_one_json_object(tmp_path, capsys):
    tsv = tmp_path / "c.tsv"
    tsv.write_text("\n".join(CRITEO_LINES) + "\n")
    txt = tmp_path / "t.txt"
    txt.write_text(TEXT)
    (tmp_path / "v.txt").write_text(TEXT_VOCAB)
    runs = [
        (["synth", "ctr", str(tmp_path / "s1"), "--examples", "200", "--table-size", "30", "--seed", "2"], 200),
        (["synth", "ctr", str(tmp_path / "s2"), "--examples", "50", "--table-sizes", ",".join(["7"] * 26)], 50),
        (["synth", "text", str(tmp_path / "s3"), "--examples", "100", "--vocab", "30"], 100),
        (["convert", "criteo", str(tsv), str(tmp_path / "c"), "--hash-size", "64"], 4),
        (["convert", "text", str(txt), str(tmp_path / "t"), "--vocab", "4", "--window", "2",
          "--vocab-file", str(tmp_path / "v.txt")], 8),
    ]
    for argv, n in runs:
        code, out, err = _cli(capsys, argv)
        assert code == 0, err
        lines = out.strip().split("\n")
        assert len(lines) == 1
        result = json.loads(lines[0])
        assert result["num_examples"] == n and result["out_dir"] == argv[2 if argv[0] == "synth" else 3]
    assert json.loads(out)["kind"] == "cbow"
    code, out, _ = _cli(capsys, [*runs[0][0][:2], str(tmp_path / "s1_again"), *runs[0][0][3:]])
    assert 0.5 < json.loads(out)["bayes_auc"] < 1


@pytest.mark.parametrize("argv", [
    ["synth"],
    ["convert"],
    ["synth", "ctr", "X", "--examples", "0"],
    ["synth", "ctr", "X"],
    ["synth", "ctr", "X", "--examples", "10", "--table-sizes", "1,2,3"],
    ["synth", "ctr", "X", "--examples", "10", "--table-size", "5", "--table-sizes", "5"],
    ["synth", "text", "X", "--examples", "10", "--vocab", "5", "--topics", "9"],
    ["convert", "text", "in.txt", "X"],
    ["convert", "criteo", "in.tsv", "X", "--hash-size", "1"],
])
def test_cli_bad_arguments_exit_2(tmp_path, capsys, argv):
    argv = [str(tmp_path / a) if a in ("X", "in.txt", "in.tsv") else a for a in argv]
    code, out, err = _cli(capsys, argv)
    assert code == 2 and out == "" and len(err.strip().split("\n")) == 1
    assert not (tmp_path / "X").exists()


def test_cli_bad_data_exit_2_naming_file_and_line(tmp_path, capsys):
    tsv = tmp_path / "c.tsv"
    tsv.write_text("\n".join(CRITEO_LINES[:2] + ["0\t1"]) + "\n")
    code, out, err = _cli(capsys, ["convert", "criteo", str(tsv), str(tmp_path / "out")])
    assert code == 2 and out == "" and err.count("\n") == 1
    assert str(tsv) in err and "line 3 (row 2)" in err
    code, _, err = _cli(capsys, ["convert", "criteo", str(tmp_path / "missing.tsv"), str(tmp_path / "o")])
    assert code == 2 and "missing.tsv" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


def test_cli_import_stays_light():
    # registering the data commands (done on every `widedp` call) loads no heavy module
    code = ("import sys, argparse, widedp.trainer.cli.data as m; "
            "m.add_commands(argparse.ArgumentParser().add_subparsers()); "
            "print(sorted(x for x in ('torch', 'pyarrow', 'torchrec', 'ray', 'numpy') if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
