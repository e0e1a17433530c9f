"""Private vocabulary: Gaussian partition selection (selection/partition.py), its privacy event
and accounting, the text converter's use of it, dataset.json's privacy_events, and Criteo's
per-feature hash sizes.

The statistical audits follow tests/privacy_audit.py: neighbouring corpora differing in one
line, an event fixed in advance, Clopper-Pearson bounds; the real mechanism must stay below
its claimed ε and a deliberately broken variant must be caught above it.
"""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from scipy import special, stats

from widedp import selection
import widedp.selection.partition as partition
from widedp.accounting import events as ev
from widedp.accounting.base import UnsupportedEventError, make_accountant, split_additive_delta
from widedp.accounting.ledger import PrivacyLedger
from privacy_audit import EventCounts, epsilon_lower_bound
from widedp.selection.partition import (bounded_key_counts, gaussian_partition_selection,
                                 partition_selection_threshold, unseen_key_release_probability)
from widedp.trainer.cli import main
from widedp.trainer.data import DataError, convert_criteo, convert_text, read_meta
import widedp.trainer.data.convert.text as convert_text_mod
from widedp.trainer.data.format.meta import DatasetMeta


def fresh_rng() -> np.random.Generator:
    return np.random.default_rng(secrets.randbits(128))


def _select(documents, rng=None, **kw):
    params = dict(noise_multiplier=4.0, max_keys_per_document=32, unseen_delta=1e-9)
    params.update(kw)
    return gaussian_partition_selection(documents, rng=fresh_rng() if rng is None else rng, **params)


# ---- the selection library -------------------------------------------------------------------

def test_threshold_solves_unseen_delta():
    for sigma, m, delta in [(4.0, 32, 1e-9), (1.0, 1, 1e-6), (0.5, 7, 0.3), (10.0, 1000, 1e-12)]:
        tau = partition_selection_threshold(sigma, m, delta)
        by_hand = 1.0 + sigma * math.sqrt(m) * stats.norm.isf(delta / m)
        assert tau == pytest.approx(by_hand, rel=1e-9)
        released = m * special.ndtr(-(tau - 1.0) / (sigma * math.sqrt(m)))
        assert released <= delta and released == pytest.approx(delta, rel=1e-6)
        assert unseen_key_release_probability(tau, sigma, m) <= delta
    assert partition_selection_threshold(4.0, 32, 1e-9) == pytest.approx(148.93, abs=0.01)


def test_bounded_key_counts_first_distinct_keys_in_order():
    docs = [["a", "a", "b", "c", "d"], iter(["x", "x", "x"]), [], ("b", "a", "e", "f")]
    assert bounded_key_counts(docs, 2) == {"a": 2, "b": 2, "x": 1}
    assert list(bounded_key_counts(docs[:1] + docs[2:], 3)) == ["a", "b", "c", "e"]
    with pytest.raises(TypeError, match="not a str"):
        bounded_key_counts(["a line as one string"], 2)


@pytest.mark.parametrize("kw,needle", [
    (dict(noise_multiplier=0.0), "noise_multiplier"),
    (dict(noise_multiplier=math.inf), "noise_multiplier"),
    (dict(max_keys_per_document=0), "max_keys_per_document"),
    (dict(max_keys_per_document=2.5), "max_keys_per_document"),
    (dict(unseen_delta=0.0), "unseen_delta"),
    (dict(unseen_delta=1.0), "unseen_delta"),
])
def test_selection_rejects_bad_parameters(kw, needle):
    with pytest.raises(ValueError, match=needle):
        _select([["a"]], **kw)
    with pytest.raises(TypeError, match="rng"):
        _select([["a"]], rng=np.random.RandomState(0))


def test_selection_output_and_event():
    docs = [["common", "also"]] * 250 + [["common"]] * 250
    keys, noisy, event = result = _select(docs)
    assert keys == ("common", "also") and np.all(np.diff(noisy) <= 0) and np.all(noisy > result.threshold)
    assert event == ev.GaussianPartitionSelectionDpEvent(4.0, 1e-9)
    assert "PartitionSelection" in selection.__all__ and selection.gaussian_partition_selection is gaussian_partition_selection
    # the same generator state reproduces the same output; fresh randomness differs
    a = _select(docs, rng=np.random.default_rng(7))
    b = _select(docs, rng=np.random.default_rng(7))
    assert a.keys == b.keys and np.array_equal(a.noisy_counts, b.noisy_counts)
    assert not np.array_equal(_select(docs).noisy_counts, _select(docs).noisy_counts)


# A corpus with frequent words on many lines and rare words on one line each, among them one
# line that repeats a rare word many times and one with many distinct rare words.
RARE_CORPUS = ([["the", "cat", "sat", "on", "mat"]] * 400
               + [["zyzzyva"] * 500 + ["the"]]
               + [[f"rare{i}" for i in range(32)]])
RARE_WORDS = {"zyzzyva"} | {f"rare{i}" for i in range(32)}


def _rare_leaks(runs: int = 50) -> tuple[int, int]:
    """(runs where some rare word was released, runs where a frequent word was missing)."""
    leaks = missing = 0
    for _ in range(runs):
        keys = set(_select(RARE_CORPUS).keys)
        leaks += bool(keys & RARE_WORDS)
        missing += not {"the", "cat", "sat", "on", "mat"} <= keys
    return leaks, missing


def _count_every_occurrence(documents, max_keys_per_document):  # broken: no per-line dedup/bound
    counts: dict = {}
    for doc in documents:
        for key in doc:
            counts[key] = counts.get(key, 0) + 1
    return counts


def _threshold_without_sqrt_m(noise_multiplier, max_keys_per_document, unseen_delta):  # broken
    return 1.0 + noise_multiplier * stats.norm.isf(unseen_delta / max_keys_per_document)


def test_rare_words_never_selected_frequent_words_kept(monkeypatch):
    # each rare word has bounded count 1 and passes with probability <= 1e-9: 0 of 50 runs
    assert _rare_leaks() == (0, 0)
    # the same check catches broken variants
    with monkeypatch.context() as mp:
        mp.setattr(partition, "bounded_key_counts", _count_every_occurrence)
        leaks, _ = _rare_leaks(10)
        assert leaks == 10  # "zyzzyva" counted 500 times
    with monkeypatch.context() as mp:
        mp.setattr(partition, "partition_selection_threshold", _threshold_without_sqrt_m)
        leaks, _ = _rare_leaks(10)
        assert leaks >= 5  # each of 32 one-line words passes w.p. ~0.12


# ---- statistical privacy audits ----------------------------------------------------------------

AUDIT_TRIALS = 4000
AUDIT_DELTA = 1e-3


class _NoiseNotScaledBySqrtM(np.random.Generator):
    """Broken variant: Gaussian noise std σ instead of σ·√m (what forgetting the ℓ2
    sensitivity √m of m-key contributions does)."""

    m = 16

    def normal(self, loc=0.0, scale=1.0, size=None):
        return super().normal(loc, scale / math.sqrt(self.m), size)


def _audit(d, d_prime, event, make_rng, params) -> EventCounts:
    def run(corpus):
        return EventCounts.from_bools([event(gaussian_partition_selection(corpus, rng=make_rng(), **params))
                                       for _ in range(AUDIT_TRIALS)])
    return run(d_prime), run(d)


def test_audit_gaussian_part_of_partition_selection():
    # D: 60 lines using the same m = 16 keys; D' adds one more such line. The event "the sum of
    # the 16 released noisy counts is >= 60·16 + 10" (fixed in advance) separates the shifted
    # sums (shift 16, std σ·m = 16 for the real mechanism, 4 for the broken one).
    m, sigma = 16, 1.0
    keys = [f"k{i}" for i in range(m)]
    d = [keys] * 60
    d_prime = d + [keys]
    params = dict(noise_multiplier=sigma, max_keys_per_document=m, unseen_delta=1e-9)
    claimed = make_accountant("pld").epsilon([(ev.GaussianPartitionSelectionDpEvent(sigma, 1e-9), 1)], AUDIT_DELTA)

    def event(out):
        released = dict(zip(out.keys, out.noisy_counts))
        return all(k in released for k in keys) and sum(released[k] for k in keys) >= 60 * m + 10

    real = epsilon_lower_bound(*_audit(d, d_prime, event, fresh_rng, params), delta=AUDIT_DELTA)
    assert real.eps_lb <= claimed, (str(real), claimed)
    broken = epsilon_lower_bound(*_audit(d, d_prime, event, lambda: _NoiseNotScaledBySqrtM(
        np.random.PCG64(secrets.randbits(128))), params), delta=AUDIT_DELTA)
    assert broken.eps_lb > claimed, (str(broken), claimed)


def test_audit_unseen_keys(monkeypatch):
    # D' adds one line of 4 keys nobody else uses; event: "one of them is released". Under D it
    # never happens, so any P_D'(E) > δ already violates (ε, δ)-DP for every ε. With a large
    # unseen δ of 0.02, the real mechanism stays below the claimed δ = 0.03; τ without √m not.
    m, sigma, unseen = 4, 1.0, 0.02
    d = [["a", "b"]] * 30
    new = ["u0", "u1", "u2", "u3"]
    d_prime = d + [new]
    params = dict(noise_multiplier=sigma, max_keys_per_document=m, unseen_delta=unseen)
    claimed = make_accountant("pld").epsilon([(ev.GaussianPartitionSelectionDpEvent(sigma, unseen), 1)], 0.03)
    assert math.isfinite(claimed)

    def event(out):
        return any(k in new for k in out.keys)

    real = epsilon_lower_bound(*_audit(d, d_prime, event, fresh_rng, params), delta=0.03)
    assert real.eps_lb <= claimed, (str(real), claimed)
    monkeypatch.setattr(partition, "partition_selection_threshold", _threshold_without_sqrt_m)
    broken = epsilon_lower_bound(*_audit(d, d_prime, event, fresh_rng, params), delta=0.03)
    assert broken.eps_lb > claimed, (str(broken), claimed)


# ---- the event and the accountants -------------------------------------------------------------

PARTITION = ev.GaussianPartitionSelectionDpEvent(4.0, 1e-9)
STEP = ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(1.1))
DELTA = 1e-6


def test_event_round_trips_and_validates():
    data = json.loads(json.dumps(ev.event_to_dict(PARTITION)))
    assert data == {"type": "GaussianPartitionSelectionDpEvent", "noise_multiplier": 4.0, "unseen_delta": 1e-9}
    assert ev.event_from_dict(data) == PARTITION
    nested = ev.ComposedDpEvent([PARTITION, ev.GaussianDpEvent(2.0)])
    assert ev.event_from_dict(json.loads(json.dumps(ev.event_to_dict(nested)))) == nested
    for bad in (dict(noise_multiplier=0.0, unseen_delta=1e-9), dict(noise_multiplier=1.0, unseen_delta=0.0),
                dict(noise_multiplier=1.0, unseen_delta=1.0), dict(noise_multiplier=1.0, unseen_delta=True)):
        with pytest.raises(ValueError, match="GaussianPartitionSelectionDpEvent"):
            ev.GaussianPartitionSelectionDpEvent(**bad)
    with pytest.raises(AttributeError):
        PARTITION.unseen_delta = 0.5  # frozen


def _rdp_by_hand(delta):
    from opacus.accountants.analysis import rdp as opacus_rdp
    from widedp.accounting.rdp import DEFAULT_ORDERS

    orders = list(DEFAULT_ORDERS)
    rdp = np.asarray(orders) / (2 * 4.0 ** 2) + 1000 * np.asarray(
        opacus_rdp.compute_rdp(q=0.01, noise_multiplier=1.1, steps=1, orders=orders))
    return opacus_rdp.get_privacy_spent(orders=orders, rdp=list(rdp), delta=delta)[0]


def _pld_by_hand(delta):
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(ev.GaussianDpEvent(4.0), 1)
    acc.compose(STEP, 1000)
    return acc.get_epsilon(delta)


def _prv_by_hand(delta):
    from opacus.accountants import PRVAccountant

    acc = PRVAccountant()
    acc.history = [(4.0, 1.0, 1), (1.1, 0.01, 1000)]
    return acc.get_epsilon(delta, eps_error=0.01)


@pytest.mark.parametrize("name,by_hand", [("rdp", _rdp_by_hand), ("pld", _pld_by_hand), ("prv", _prv_by_hand)])
def test_tight_accountants_compose_gaussian_part_and_subtract_unseen_delta(name, by_hand):
    acc = make_accountant(name)
    history = [(PARTITION, 1), (STEP, 1000)]
    eps = acc.epsilon(history, DELTA)
    assert eps == pytest.approx(by_hand(DELTA - 1e-9), rel=1e-9)
    assert eps == pytest.approx(acc.epsilon([(ev.GaussianDpEvent(4.0), 1), (STEP, 1000)], DELTA - 1e-9), rel=1e-12)
    assert eps > acc.epsilon([(STEP, 1000)], DELTA)  # the vocabulary costs something
    assert acc.details(history, DELTA)["epsilon"] == eps
    acc.check(history)
    # the same event inside a top-level composition, and twice: δ's add up
    twice = [(ev.ComposedDpEvent([PARTITION, PARTITION]), 1), (STEP, 1000)]
    gauss_twice = [(ev.ComposedDpEvent([ev.GaussianDpEvent(4.0)] * 2), 1), (STEP, 1000)]
    assert acc.epsilon(twice, DELTA) == pytest.approx(acc.epsilon(gauss_twice, DELTA - 2e-9), rel=1e-12)
    assert acc.epsilon([(PARTITION, 2)], DELTA) == pytest.approx(
        acc.epsilon([(ev.GaussianDpEvent(4.0), 2)], DELTA - 2e-9), rel=1e-12)
    # nothing left for the Gaussian part: ε = inf
    assert acc.epsilon([(ev.GaussianPartitionSelectionDpEvent(4.0, 1e-3), 1)], 1e-3) == math.inf
    assert acc.epsilon([(ev.GaussianPartitionSelectionDpEvent(4.0, 1e-3), 2)], 1.5e-3) == math.inf


@pytest.mark.parametrize("name", ["rdp", "pld", "prv"])
def test_partition_event_under_subsampling_is_unsupported(name):
    acc = make_accountant(name)
    for nested in (ev.PoissonSampledDpEvent(0.1, PARTITION),
                   ev.PoissonSampledDpEvent(0.1, ev.ComposedDpEvent([ev.GaussianDpEvent(1.0), PARTITION])),
                   ev.ComposedDpEvent([ev.PoissonSampledDpEvent(0.1, PARTITION)])):
        for call in (lambda: acc.epsilon([(nested, 1)], DELTA), lambda: acc.check([(nested, 1)]),
                     lambda: acc.details([(nested, 1)], DELTA)):
            with pytest.raises(UnsupportedEventError, match="GaussianPartitionSelectionDpEvent.*PoissonSampledDpEvent"):
                call()


def test_split_additive_delta_leaves_other_events_alone():
    history = [(STEP, 3), (PARTITION, 2), (ev.SelfComposedDpEvent(PARTITION, 3), 1)]
    out, total = split_additive_delta(history, "rdp")
    assert out[0][0] is STEP and out[1] == (ev.GaussianDpEvent(4.0), 2)
    assert out[2] == (ev.SelfComposedDpEvent(ev.GaussianDpEvent(4.0), 3), 1)
    assert total == pytest.approx(5e-9)


def test_paper_accountant_says_unsupported():
    paper = make_accountant("paper")
    for history in ([(PARTITION, 1), (STEP, 1000)], [(PARTITION, 1)]):
        with pytest.raises(UnsupportedEventError):
            paper.check(history)
        with pytest.raises(UnsupportedEventError):
            paper.epsilon(history, DELTA)


def test_ledger_charges_and_persists_the_event():
    ledger = PrivacyLedger("rdp", delta=DELTA)
    ledger.record(PARTITION)
    ledger.record(STEP, 1000)
    assert ledger.epsilon() == pytest.approx(_rdp_by_hand(DELTA - 1e-9), rel=1e-9)
    state = json.loads(json.dumps(ledger.state_dict()))
    restored = PrivacyLedger("rdp", delta=DELTA)
    restored.load_state_dict(state)
    assert restored.history == ledger.history


# ---- the text converter ----------------------------------------------------------------------

COMMON = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "away", "home"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(11)
    lines = [" ".join(rng.permutation(COMMON)) for _ in range(400)]
    lines.insert(17, "zyzzyva " * 300 + "the cat")  # a rare word, repeated, on one line only
    lines.insert(99, "Quixotic the cat sat")
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def _vocab_rows(directory):
    return [line.split("\t") for line in (Path(directory) / "vocab.tsv").read_text().splitlines()]


def test_converter_private_vocabulary(tmp_path, corpus):
    meta = convert_text(corpus, tmp_path / "a", vocab=8, window=2)
    rows = _vocab_rows(tmp_path / "a")
    words = [w for w, _ in rows]
    noisy = [int(c) for _, c in rows]
    assert len(words) == 8 and set(words) <= set(COMMON) and meta.table_sizes == {"input": 8, "output": 8}
    assert noisy == sorted(noisy, reverse=True)
    exact_lines = {w: 400 + (w == "the") * 2 + (w in ("cat",)) * 2 + (w == "sat") for w in COMMON}
    exact_tokens = {w: exact_lines[w] for w in COMMON}  # each common word occurs once per line
    assert noisy != [exact_lines[w] for w in words] and noisy != [exact_tokens[w] for w in words]
    # dataset.json: the event, no exact statistics
    data = json.loads((tmp_path / "a" / "dataset.json").read_text())
    assert data["privacy_events"][0]["event"] == ev.event_to_dict(ev.GaussianPartitionSelectionDpEvent(4.0, 1e-9))
    assert not {"num_tokens", "num_in_vocab_tokens"} & set(data)
    assert data["vocabulary"]["noise_seed"] is None and "note" not in data["vocabulary"]
    ((description, event),) = read_meta(tmp_path / "a").privacy_events
    assert event == ev.GaussianPartitionSelectionDpEvent(4.0, 1e-9) and "vocabulary" in description
    assert meta.privacy_events == read_meta(tmp_path / "a").privacy_events
    # fresh randomness: another conversion has other noisy counts (and is still valid)
    convert_text(corpus, tmp_path / "b", vocab=8, window=2)
    assert _vocab_rows(tmp_path / "b") != rows
    # negatives stay in the table
    neg = np.array(pq.read_table(tmp_path / "a" / "data.parquet").column("negatives").to_pylist())
    assert neg.min() >= 0 and neg.max() < 8


def test_converter_noise_seed_reproduces_and_is_recorded(tmp_path, corpus):
    a = convert_text(corpus, tmp_path / "a", vocab=12, window=2, vocab_noise_seed=5,
                     vocab_noise_multiplier=2.0, vocab_max_words_per_line=8, vocab_unseen_delta=1e-8)
    convert_text(corpus, tmp_path / "b", vocab=12, window=2, vocab_noise_seed=5,
                 vocab_noise_multiplier=2.0, vocab_max_words_per_line=8, vocab_unseen_delta=1e-8)
    assert (tmp_path / "a" / "vocab.tsv").read_text() == (tmp_path / "b" / "vocab.tsv").read_text()
    assert pq.read_table(tmp_path / "a" / "data.parquet").equals(pq.read_table(tmp_path / "b" / "data.parquet"))
    words = [w for w, _ in _vocab_rows(tmp_path / "a")]
    assert set(words) == set(COMMON)  # only 10 words pass; zyzzyva / quixotic never do
    assert a.extra["vocabulary"]["noise_seed"] == 5 and "secret" in a.extra["vocabulary"]["note"]
    ((description, event),) = a.privacy_events
    assert event == ev.GaussianPartitionSelectionDpEvent(2.0, 1e-8) and "seed" in description
    assert a.extra["vocabulary"]["threshold"] == pytest.approx(partition_selection_threshold(2.0, 8, 1e-8))


def test_converter_public_vocab_file(tmp_path, corpus):
    vf = tmp_path / "public.txt"
    vf.write_text("the\t100\ncat\t50\nzyzzyva\t1\n")
    meta = convert_text(corpus, tmp_path / "o", vocab_file=vf, window=2)
    assert (tmp_path / "o" / "vocab.tsv").read_text() == "the\ncat\nzyzzyva\n"
    assert meta.privacy_events == [] and read_meta(tmp_path / "o").privacy_events == []
    assert meta.extra["vocabulary"]["negative_weights"] == "second column of the file"
    convert_text(corpus, tmp_path / "o2", vocab=2, vocab_file=vf, window=2)
    assert read_meta(tmp_path / "o2").table_sizes["input"] == 2
    for content, needle in [("the\nThe\n", "line 2: 'the' repeats line 1"), ("two words\n", "line 1: 'two words'"),
                            ("\n\n", "no words")]:
        vf.write_text(content)
        with pytest.raises(DataError, match=needle):
            convert_text(corpus, tmp_path / "bad", vocab_file=vf)
    with pytest.raises(DataError, match="missing.txt: vocabulary file not found"):
        convert_text(corpus, tmp_path / "bad", vocab_file=tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="vocab .* is required unless vocab_file"):
        convert_text(corpus, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def _cli(capsys, argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_convert_text_private_and_public(tmp_path, capsys, corpus):
    code, out, err = _cli(capsys, ["convert", "text", corpus, tmp_path / "p", "--vocab", "5",
                                   "--vocab-noise-seed", "3", "--vocab-max-words-per-line", "16"])
    assert code == 0, err
    result = json.loads(out)
    assert len(result["privacy_events"]) == 1 and "--vocab-noise-seed" in result["privacy_events"][0]
    assert "3" not in result["privacy_events"][0].split("noise-seed")[1][:12]  # the mode, never the value
    assert read_meta(tmp_path / "p").extra["vocabulary"]["max_words_per_line"] == 16
    (tmp_path / "v.txt").write_text("the\ncat\n")
    code, out, err = _cli(capsys, ["convert", "text", corpus, tmp_path / "q", "--vocab-file", tmp_path / "v.txt"])
    assert code == 0, err
    assert json.loads(out)["privacy_events"] == []
    for argv in (["--vocab-unseen-delta", "0"], ["--vocab-unseen-delta", "1"], ["--vocab-noise-multiplier", "0"],
                 ["--vocab-max-words-per-line", "0"], ["--vocab-noise-seed", "-1"], []):
        code, out, err = _cli(capsys, ["convert", "text", corpus, tmp_path / "x"] + argv
                              + (["--vocab", "3"] if argv else []))
        assert code == 2 and out == "" and len(err.strip().split("\n")) == 1, (argv, err)
    assert not (tmp_path / "x").exists()


# ---- too small a private vocabulary (issue 28) -------------------------------------------------
# The corpus fixture has 402 non-empty lines: its 10 COMMON words are on ≥ 400 lines each (noisy
# count 400 ± 22.6 against τ ≈ 148.9: they always pass), every other word on 1-2 lines (never).

def _zipf_corpus(path: Path, lines: int, seed: int) -> Path:
    """Lines of 8-19 words drawn from a Zipf law over 2,000 words (w0 the most common)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, 2001)
    p /= p.sum()
    path.write_text("".join(" ".join(f"w{i}" for i in rng.choice(2000, size=rng.integers(8, 20), p=p)) + "\n"
                            for _ in range(lines)))
    return path


def test_converter_refuses_a_vocabulary_under_half_of_vocab(tmp_path, corpus):
    with pytest.raises(convert_text_mod.SmallVocabularyError) as info:
        convert_text(corpus, tmp_path / "o", vocab=100, window=2)
    err = info.value
    assert isinstance(err, DataError)  # the CLI's one line, exit 2
    assert (err.selected, err.requested, err.lines) == (10, 100, 402)
    assert err.threshold == pytest.approx(partition_selection_threshold(4.0, 32, 1e-9))
    assert err.needed_lines > err.lines
    message = str(err)
    assert "\n" not in message
    for needle in ("corpus.txt: private vocabulary too small: 10 words passed the selection",
                   "--vocab asked 100", "a word needs ≈ 149 occurrences in distinct lines",
                   "this corpus has 402 lines", f"use a corpus of ≳ {err.needed_lines} lines", "a smaller --vocab",
                   "--vocab-noise-multiplier", "--allow-small-vocab keeps the 10", "nothing was written"):
        assert needle in message, needle
    assert not (tmp_path / "o").exists()  # nothing half-written
    # the rule's edge: exactly half is kept, one word fewer than half is refused
    assert convert_text(corpus, tmp_path / "half", vocab=20, window=2).table_sizes["input"] == 10
    with pytest.raises(convert_text_mod.SmallVocabularyError, match="10 words passed .* --vocab asked 21"):
        convert_text(corpus, tmp_path / "under", vocab=21, window=2)
    assert not (tmp_path / "under").exists()


def test_allow_small_vocab_keeps_it_and_records_the_charge(tmp_path, corpus):
    meta = convert_text(corpus, tmp_path / "o", vocab=100, window=2, allow_small_vocab=True)
    assert meta.table_sizes["input"] == 10 and meta.extra["vocab_requested"] == 100
    ((_, event),) = read_meta(tmp_path / "o").privacy_events  # charged by every run, as any private vocabulary
    assert event == ev.GaussianPartitionSelectionDpEvent(4.0, 1e-9)
    # no word at all stays an error, with or without the flag
    lonely = tmp_path / "lonely.txt"
    lonely.write_text("one two\nthree four\n")
    with pytest.raises(convert_text_mod.SmallVocabularyError,
                       match=r"no word passed the private vocabulary selection; .* this corpus has 2 lines") as info:
        convert_text(lonely, tmp_path / "none", vocab=5, allow_small_vocab=True)
    assert info.value.selected == 0 and "--allow-small-vocab" not in str(info.value)
    assert not (tmp_path / "none").exists()


def test_needed_lines_estimate():
    needed = convert_text_mod._needed_lines
    # nothing passed: the most common word is on at most every line, so Zipf gives τ·vocab lines
    assert needed(np.array([]), 149.0, 100, 300, 32) == 15000
    # from the released noisy counts: C = max r·c_r = 270, scaled to C' = τ·vocab: 300·149·100/270
    assert needed(np.array([270.0]), 149.0, 100, 300, 32) == 17000  # 16,556 to two digits, up
    assert needed(np.array([270.0, 200.0, 180.0]), 149.0, 100, 300, 32) == 8300  # C = 3·180 = 540: 8,278
    # never below the pigeonhole bound (vocab·τ line-word pairs, m per line) nor the corpus + 1
    assert needed(np.array([5e4, 4e4]), 149.0, 100, 300, 32) == 470  # Zipf: 56; 100·149/32 = 466
    assert needed(np.array([5e4, 4e4]), 149.0, 4, 300, 32) == 310  # 301


def test_a_corpus_of_the_estimated_size_is_large_enough(tmp_path):
    # The case: a 300-line corpus at --vocab 100 gave 1-3 words and exit 0. At --vocab 40
    # here (faster); the vocabulary noise is seeded so the test is deterministic.
    with pytest.raises(convert_text_mod.SmallVocabularyError) as info:
        convert_text(_zipf_corpus(tmp_path / "small.txt", 300, 0), tmp_path / "a", vocab=40, vocab_noise_seed=1)
    assert info.value.selected < 20
    bigger = _zipf_corpus(tmp_path / "big.txt", info.value.needed_lines, 1)
    assert convert_text(bigger, tmp_path / "b", vocab=40, vocab_noise_seed=1).table_sizes["input"] >= 20


def test_cli_small_vocab_is_one_line_exit_2(tmp_path, capsys):
    corpus300 = _zipf_corpus(tmp_path / "c300.txt", 300, 0)
    code, out, err = _cli(capsys, ["convert", "text", corpus300, tmp_path / "o", "--vocab", "100"])
    assert code == 2 and out == "" and len(err.strip().split("\n")) == 1, err
    assert "private vocabulary too small" in err and "--vocab asked 100" in err and "this corpus has 300 lines" in err
    assert not (tmp_path / "o").exists()
    code, out, err = _cli(capsys, ["convert", "text", corpus300, tmp_path / "o", "--vocab", "100", "--allow-small-vocab"])
    assert code == 0, err
    size = json.loads(out)["table_sizes"]["input"]
    assert 1 <= size < 50 and len(json.loads(out)["privacy_events"]) == 1
    (tmp_path / "v.txt").write_text("w0\nw1\n")
    code, out, err = _cli(capsys, ["convert", "text", corpus300, tmp_path / "p", "--vocab-file", tmp_path / "v.txt",
                                   "--allow-small-vocab"])
    assert code == 2 and "--allow-small-vocab applies to a private vocabulary only" in err
    assert not (tmp_path / "p").exists()


# ---- dataset.json's privacy_events -----------------------------------------------------------

def _meta_dict(**extra):
    base = DatasetMeta(kind="cbow", num_examples=3, features=["context", "target", "neg_0"],
                       feature_tables={"context": "input", "target": "output", "neg_0": "output"},
                       table_sizes={"input": 4, "output": 4},
                       pooling={"context": "mean", "target": "sum", "neg_0": "sum"}, num_dense=0).to_dict()
    return {**base, **extra}


def test_meta_privacy_events_contract():
    assert DatasetMeta.from_dict(_meta_dict()).privacy_events == []
    assert DatasetMeta.from_dict(_meta_dict(privacy_events=[])).privacy_events == []
    good = {"description": "vocab", "event": ev.event_to_dict(PARTITION)}
    assert DatasetMeta.from_dict(_meta_dict(privacy_events=[good])).privacy_events == [("vocab", PARTITION)]
    bad_cases = [
        ({"not": "a list"}, "privacy_events must be a list"),
        (["x"], r"privacy_events\[0\] must be an object"),
        ([{"description": "d"}], r"privacy_events\[0\] must be an object"),
        ([{**good, "extra": 1}], r"privacy_events\[0\] must be an object"),
        ([good, {"description": 3, "event": good["event"]}], r"privacy_events\[1\]\.description must be a string"),
        ([{"description": "d", "event": {"type": "Nope"}}], r"privacy_events\[0\]\.event is not a valid.*unknown event type"),
        ([{"description": "d", "event": {"type": "GaussianPartitionSelectionDpEvent", "noise_multiplier": 1.0}}],
         r"lacks field 'unseen_delta'"),
        ([{"description": "d", "event": {**good["event"], "unseen_delta": 2.0}}], r"unseen_delta must be a number in \(0, 1\)"),
    ]
    for value, needle in bad_cases:
        with pytest.raises(DataError, match=r"^my/dataset.json: .*" + needle):
            DatasetMeta.from_dict(_meta_dict(privacy_events=value), "my/dataset.json")


# ---- Criteo per-feature hash sizes -------------------------------------------------------------

def _splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


CRITEO = ["\t".join(["1"] + [str(i)] * 13 + [f"{(r * 977 + j * 131) & 0xffffff:x}" if (r + j) % 5 else ""
                                             for j in range(26)]) for r, i in enumerate(range(6))]
SIZES = [2 + 3 * j for j in range(26)]


def test_criteo_hash_sizes_per_feature(tmp_path):
    src = tmp_path / "c.tsv"
    src.write_text("\n".join(CRITEO) + "\n")
    meta = convert_criteo(src, tmp_path / "o", hash_sizes=SIZES, chunk_rows=4)
    assert meta.table_sizes == {f"t_{j}": SIZES[j] for j in range(26)}
    assert meta.extra["hash_sizes"] == SIZES and "hash_size" not in meta.extra
    assert read_meta(tmp_path / "o").privacy_events == []
    t = pq.read_table(tmp_path / "o" / "data.parquet")
    for r, line in enumerate(CRITEO):
        fields = line.split("\t")[14:]
        expected = [1 + _splitmix64(int(h, 16)) % (SIZES[j] - 1) if h else 0 for j, h in enumerate(fields)]
        assert [t.column(f"cat_{j}")[r].as_py() for j in range(26)] == expected
    uniform = convert_criteo(src, tmp_path / "u", hash_size=64)
    assert uniform.extra["hash_size"] == 64 and uniform.extra["hash_sizes"] == [64] * 26
    for kw, needle in [(dict(hash_sizes=SIZES[:25]), "hash_sizes needs 26 values"),
                       (dict(hash_sizes=SIZES[:3] + [1] + SIZES[4:]), r"hash_sizes\[3\] \(C4\) must be an integer >= 2"),
                       (dict(hash_sizes=SIZES, hash_size=8), "not both"),
                       (dict(hash_size=1), "hash_size must be an integer >= 2")]:
        with pytest.raises(ValueError, match=needle):
            convert_criteo(src, tmp_path / "bad", **kw)
    assert not (tmp_path / "bad").exists()


def test_cli_convert_criteo_hash_sizes(tmp_path, capsys):
    src = tmp_path / "c.tsv"
    src.write_text("\n".join(CRITEO) + "\n")
    code, out, err = _cli(capsys, ["convert", "criteo", src, tmp_path / "o", "--hash-sizes", ",".join(map(str, SIZES))])
    assert code == 0, err
    assert json.loads(out)["table_sizes"]["t_25"] == SIZES[25] and json.loads(out)["privacy_events"] == []
    for argv in (["--hash-sizes", ",".join(map(str, SIZES[:25]))], ["--hash-sizes", ",".join(["1"] + ["5"] * 25)],
                 ["--hash-sizes", ",".join(["x"] * 26)], ["--hash-size", "8", "--hash-sizes", ",".join(["5"] * 26)]):
        code, out, err = _cli(capsys, ["convert", "criteo", src, tmp_path / "x"] + argv)
        assert code == 2 and out == "" and len(err.strip().split("\n")) == 1, (argv, err)
        assert "--hash-size" in err
    assert not (tmp_path / "x").exists()


# ---- the vocabulary's noise sized to the training ε the user intends (issue 50) -----------------

def test_vocab_noise_for_a_target_spends_exactly_its_share():
    from widedp.accounting import make_accountant
    from widedp.accounting.events import GaussianPartitionSelectionDpEvent
    from widedp.trainer.data.convert.text import vocab_noise_for

    sigmas = []
    for eps in (1.0, 3.0, 8.0):
        sigma = vocab_noise_for(eps, 0.2, 1e-8, 1e-9)
        spent = make_accountant("auto").epsilon([(GaussianPartitionSelectionDpEvent(sigma, 1e-9), 1)], 1e-8)
        assert spent == pytest.approx(0.2 * eps, rel=1e-3) and spent <= 0.2 * eps * (1 + 1e-9)
        sigmas.append(sigma)
    assert sigmas[0] > sigmas[1] > sigmas[2]  # less ε, more noise
    for kw, needle in (({"target_epsilon": 0.0}, "target epsilon"), ({"share": 1.0}, "share"),
                       ({"delta": 1e-10}, "unseen-word")):
        args = {"target_epsilon": 1.0, "share": 0.2, "delta": 1e-8, **kw}
        with pytest.raises(ValueError, match=needle):
            vocab_noise_for(args["target_epsilon"], args["share"], args["delta"], 1e-9)


def test_cli_convert_text_sizes_the_vocabulary_noise_from_the_target_and_a_run_reports_its_share(
        tmp_path, capsys, corpus):
    from widedp.trainer.data.convert.text import vocab_noise_for

    code, out, err = _cli(capsys, ["convert", "text", corpus, tmp_path / "p", "--vocab", "5", "--target-epsilon", "8",
                                   "--vocab-budget-share", "0.25"])
    assert code == 0, err
    sigma = read_meta(tmp_path / "p").extra["vocabulary"]["noise_multiplier"]
    assert sigma == pytest.approx(vocab_noise_for(8.0, 0.25, 1e-8, 1e-9))
    code, out, err = _cli(capsys, ["convert", "text", corpus, tmp_path / "x", "--vocab", "5", "--target-epsilon", "8",
                                   "--vocab-noise-multiplier", "4"])
    assert code == 2 and "not both" in err and not (tmp_path / "x").exists()
    code, out, err = _cli(capsys, ["convert", "text", corpus, tmp_path / "x", "--vocab", "5", "--target-epsilon", "8",
                                   "--vocab-budget-share", "1.5"])
    assert code == 2 and "--vocab-budget-share" in err
    # a run on it says how much of its ε the vocabulary took, at the run's δ
    config = tmp_path / "c.toml"
    config.write_text(f'[data]\npath = "{tmp_path / "p"}"\n[model]\nname = "cbow"\nembedding_dim = 4\n')
    code, out, err = _cli(capsys, ["train", "--config", config, "--run-dir", tmp_path / "run", "--no-progress",
                                   "--set", "train.steps=2", "--set", "train.batch_size=32", "--set",
                                   "cluster.backend=local", "--set", "privacy.target_epsilon=8", "--set",
                                   "train.mode=dpsgd", "--set", "cluster.num_shards=1"])
    assert code == 0, err
    share = json.loads(out)["one_time_epsilon"]
    assert len(share) == 1 and "private vocabulary" in share[0]["event"]
    assert 0 < share[0]["epsilon_alone"] <= 0.25 * 8 * (1 + 1e-6)  # the run's δ is larger than 1e-8: less
