"""Plain text -> widedp cbow data set (word2vec CBOW with negative sampling).

Rules (exactly what the converter does):

* the text is decoded as UTF-8 (invalid bytes: DataError naming the line) and lowercased; tokens are maximal runs of alphanumeric
  characters (regex ``[^\\W_]+``: Unicode letters and digits; everything else, ``_``
  included, separates tokens);
* each line (ended by ``\n``) is a sentence: context windows never cross a line break, so
  every training example comes from one line;
* vocabulary, private (default): chosen by Gaussian partition selection
  (``selection.partition``) with one *line* as the unit of privacy (add/remove one line):
  each line counts its first ``vocab_max_words_per_line`` (m) distinct words once each (a word
  repeated on a line counts once; later new words on a long line are not counted), every
  counted word gets N(0, (σ·√m)²) noise (σ = ``vocab_noise_multiplier``), and the words whose
  noisy count exceeds τ = 1 + σ√m·Φ̄⁻¹(``vocab_unseen_delta``/m) are candidates (a word only one
  line has passes with probability ≤ ``vocab_unseen_delta``). The vocabulary is the ``vocab``
  candidates with the largest noisy counts; id 0 has the largest. The noise comes from fresh
  OS entropy (ChaCha20 keyed with 256 fresh bits, `selection.keyed_random`), never from ``seed``; ``vocab_noise_seed`` fixes it
  for reproducible tests, and the data set then says that the vocabulary's ε holds only while
  that seed stays secret. The mechanism's event
  (``GaussianPartitionSelectionDpEvent``) is written to dataset.json's ``privacy_events``; the
  trainer charges it before the first step. Since an example lies within one line, a corpus
  with one example's line added or removed is a neighbour for this mechanism. Lines are the
  documents: a corpus that is one giant line (like text8) selects nothing useful;
* too small a private vocabulary is an error (``SmallVocabularyError``, a DataError: the CLI
  prints one line and exits 2), and nothing is written: fewer than half of ``vocab`` words
  passed (and always when none did). Why half: ``vocab`` is a maximum, so a few words short is
  normal (the selection keeps only words with ≈ τ lines or more), but a vocabulary under half
  of it means the corpus is far below what the mechanism needs — its few words (one or two on
  a 300-line corpus at ``vocab`` 100) make a useless model, and it is almost always a mistake,
  not a choice. The message says how many words passed, what was asked, that a word needs ≈ τ
  distinct lines to pass with probability 1/2, how many non-empty lines the corpus has, and a
  corpus size that would do (a Zipf estimate: ``_needed_lines``).
  ``allow_small_vocab=True`` (``--allow-small-vocab``) keeps any non-empty vocabulary. Privacy
  of the refusal: the numbers it prints are post-processing of the same selection (the count
  of survivors, their noisy counts) except the line count, which like ``num_examples`` is a
  size treated as public. Nothing is charged anywhere, since no data set exists for a run to
  charge; but the corpus *was* used once: a rerun on it (smaller ``vocab``, the flag) selects
  again with fresh noise, and only the rerun's event lands in its dataset.json — count the
  refused selection too if you report what the corpus has spent;
* vocabulary, public (``vocab_file``): the words of that file (one per line, ``word`` or
  ``word \\t ...``; lowercased; each must be one token; blank lines skipped; duplicates are an
  error), in file order, the first ``vocab`` of them if ``vocab`` is given. It must not be
  derived from the private text; nothing is charged and no privacy event is written;
* tokens outside the vocabulary are dropped *before* windowing (as word2vec does), so
  windows span over them. The table size is the number of words in the vocabulary (<= vocab);
* ``DIR/vocab.tsv`` lists the vocabulary by id: ``word \\t noisy_count`` (the noisy line count,
  rounded — never an exact count) for a private vocabulary, just ``word`` for a public one;
* one example per remaining token position that has at least one in-vocabulary context word
  within ±window in its sentence: ``context`` = the context ids in text order (left then
  right), ``target`` = the token's id;
* ``negatives`` are drawn i.i.d. from weights raised to 0.75, by inverse CDF on
  ``numpy.random.default_rng(seed)`` uniforms in example order (independent of chunking). The
  weights are the noisy counts (floored at ``NEGATIVE_WEIGHT_FLOOR``; post-processing of the
  private selection) for a private vocabulary; for a public file, its second column if every
  line has a positive number there, else 1/(rank+1) by file order (Zipf, as for a file listed
  by decreasing frequency). So given the vocabulary the draws do not depend on the text. As
  in word2vec, a negative may equal the target or a context word.

dataset.json and vocab.tsv hold no exact statistic of the text except ``num_examples``
(treated as public, as in every DP-SGD library); the table size is the private vocabulary's
size (post-processing of the selection).

Both passes stream the file (lines are read in bounded pieces, so one huge line is fine).
"""

from __future__ import annotations

import codecs
import math
import os
import re
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from widedp.selection.keyed_random import KEY_BITS, NoiseKey

from widedp.trainer.data.errors import DataError
from widedp.trainer.data.format.meta import PRIVACY_EVENTS_KEY, DatasetMeta, cbow_meta, privacy_event_entry
from widedp.trainer.data.format.writer import DatasetWriter, cbow_table

_TOKEN = re.compile(r"[^\W_]+")
_TRAILING_TOKEN = re.compile(r"[^\W_]+$")
_PIECE_CHARS = 1 << 20  # longest piece of a line handled at once
UNIGRAM_POWER = 0.75


def _pieces(path: Path) -> Iterator[tuple[list[str], bool]]:
    """(tokens, sentence_ends) for consecutive pieces of the file; a token never straddles
    two pieces; the last piece of each line has sentence_ends=True."""
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise DataError(f"{path}: cannot open: {exc.strerror or exc}") from None
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    line_no = 1
    with fh:
        carry = ""
        while True:
            raw = fh.readline(_PIECE_CHARS)
            try:
                piece = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}: line {line_no}: not valid UTF-8 ({exc.reason})") from None
            if not raw:
                if carry:
                    yield _TOKEN.findall(carry), True
                return
            ends = raw.endswith(b"\n")
            text = (carry + piece).lower()
            carry = ""
            if ends:
                line_no += 1
            else:
                m = _TRAILING_TOKEN.search(text)
                if m is not None:  # the last token may continue in the next piece
                    carry, text = text[m.start():], text[:m.start()]
            yield _TOKEN.findall(text), ends


def cbow_examples(ids: np.ndarray, sent: np.ndarray, lo: int, hi: int, window: int):
    """CBOW examples for positions [lo, hi) of a token stream.

    ``ids``/``sent``: token ids and sentence ids (context stays within a sentence). Returns
    (ctx_lengths, ctx_values, targets) for the positions with >= 1 context word, in order.
    """
    n = len(ids)
    pos = np.arange(lo, hi, dtype=np.int64)
    offs = np.concatenate([np.arange(-window, 0), np.arange(1, window + 1)])
    j = pos[:, None] + offs[None, :]
    inside = (j >= 0) & (j < n)
    jc = np.clip(j, 0, max(n - 1, 0))
    valid = inside & (sent[jc] == sent[pos][:, None])
    lengths = valid.sum(axis=1)
    keep = lengths > 0
    values = ids[jc[keep]][valid[keep]]  # row-major: text order within each example
    return lengths[keep].astype(np.int64), values.astype(np.int64), ids[pos[keep]].astype(np.int64)


class NegativeSampler:
    """i.i.d. draws from weights**power by inverse CDF of the rng's uniforms (in order)."""

    def __init__(self, weights: np.ndarray, power: float, rng: np.random.Generator):
        w = np.asarray(weights, dtype=np.float64) ** power
        self._cdf = np.cumsum(w / w.sum())
        self._rng = rng

    def draw(self, n: int, k: int) -> np.ndarray:
        u = self._rng.random((n, k))
        return np.minimum(np.searchsorted(self._cdf, u, side="right"), len(self._cdf) - 1).astype(np.int64)


NEGATIVE_WEIGHT_FLOOR = 1.0  # lower bound on a noisy count used as a negative-sampling weight
DEFAULT_VOCAB_NOISE_MULTIPLIER = 4.0
DEFAULT_VOCAB_MAX_WORDS_PER_LINE = 32
# δ of the event "a word of one line only enters the vocabulary": far below any sensible
# target δ (1e-5 .. 1e-7 for 10^5 .. 10^7 examples), and cheap: τ grows like √log(1/δ).
DEFAULT_VOCAB_UNSEEN_DELTA = 1e-9


def _line_documents(path: Path, max_words: int, lines_with_words: list) -> Iterator[list[str]]:
    """Each non-empty line's first ``max_words`` distinct tokens, in order — all that partition
    selection reads of a line (so a huge line costs O(max_words) memory).
    ``lines_with_words[0]`` counts the lines yielded."""
    distinct: dict = {}
    for tokens, ends in _pieces(path):
        if len(distinct) < max_words:
            for token in tokens:
                if token not in distinct:
                    distinct[token] = None
                    if len(distinct) == max_words:
                        break
        if ends:
            if distinct:
                lines_with_words[0] += 1
                yield list(distinct)
            distinct = {}


def read_public_vocab(vocab_file, vocab: Optional[int]) -> tuple[list[str], np.ndarray, str]:
    """(words, negative-sampling weights, where the weights come from) of a public vocabulary
    file (module docstring); DataError naming the file and line."""
    path = Path(os.fspath(vocab_file))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: vocabulary file not found") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: vocabulary file is not valid UTF-8 ({exc.reason})") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read vocabulary file: {exc.strerror or exc}") from None
    words: list[str] = []
    second: list[Optional[float]] = []
    line_of: dict[str, int] = {}
    for line_no, line in enumerate(text.split("\n"), start=1):
        fields = line.rstrip("\r").split("\t")
        word = fields[0].strip().lower()
        if not word and len(fields) == 1:
            continue  # blank line
        if not _TOKEN.fullmatch(word):
            raise DataError(f"{path}: line {line_no}: {fields[0]!r} is not one word (the converter's "
                            f"tokens are runs of letters and digits)")
        if word in line_of:
            raise DataError(f"{path}: line {line_no}: {word!r} repeats line {line_of[word]}")
        line_of[word] = line_no
        words.append(word)
        try:
            value = float(fields[1]) if len(fields) > 1 else None
        except ValueError:
            value = None
        second.append(value if value is not None and math.isfinite(value) and value > 0 else None)
        if vocab is not None and len(words) == vocab:
            break
    if not words:
        raise DataError(f"{path}: vocabulary file has no words")
    if all(v is not None for v in second):
        return words, np.array(second, dtype=np.float64), "second column of the file"
    return words, 1.0 / np.arange(1, len(words) + 1, dtype=np.float64), "1/(rank+1) by file order"


class SmallVocabularyError(DataError):
    """Too few words passed the private vocabulary selection (module docstring: the rule, and
    what the numbers reveal). Attributes: ``selected`` (words that passed), ``requested``
    (``vocab``), ``threshold`` (τ), ``lines`` (non-empty lines of the corpus), ``needed_lines``
    (the Zipf estimate of a corpus that would do)."""

    def __init__(self, path, selected: int, requested: int, threshold: float, lines: int, needed_lines: int):
        self.selected, self.requested, self.threshold = selected, requested, threshold
        self.lines, self.needed_lines = lines, needed_lines
        need = math.ceil(threshold)
        what = ("no word passed the private vocabulary selection" if selected == 0 else
                f"private vocabulary too small: {selected} word{'s' * (selected != 1)} passed the selection, "
                f"--vocab asked {requested} (at least half is required)")
        super().__init__(
            f"{path}: {what}; a word needs ≈ {need} occurrences in distinct lines to pass (with probability 1/2); "
            f"this corpus has {lines} line{'s' * (lines != 1)} — use a corpus of ≳ {needed_lines} lines (one "
            f"sentence or document per line), a smaller --vocab, a smaller --vocab-noise-multiplier (a larger ε), or "
            f"a public --vocab-file" + ("" if selected == 0 else f"; --allow-small-vocab keeps the {selected}")
            + "; nothing was written")


def _needed_lines(noisy_counts: np.ndarray, threshold: float, vocab: int, lines: int, max_words: int) -> int:
    """A corpus size (lines) at which about ``vocab`` words pass: a rule of thumb, printed as ≳.

    Zipf's law for line counts: the r-th most common word is in ≈ C/r lines, and C grows in
    proportion to the corpus. The ``vocab``-th word passes with probability ≈ 1/2 at C/vocab = τ.
    C is estimated from the released noisy counts c_r (post-processing): max_r r·c_r, and at
    most ``lines`` when nothing passed (no word is on more lines than there are). Scaling the
    corpus by τ·vocab/C gives the estimate; it is never below the pigeonhole bound
    ⌈vocab·τ/max_words⌉ (each line counts at most ``max_words`` words) nor below lines + 1.
    Top words are on nearly every line, so the law overstates the need when only the first few
    words passed, which errs on the side of enough. Measured on a Zipf text (2,000 words, 8-19
    per line) at ``vocab`` 100: 300, 1,000 and 3,000 lines gave estimates of 18,000, 9,300 and
    8,700 lines (1, 9 and 31 words passed); 8,600 lines then gave 96 words.
    """
    counts = np.sort(np.asarray(noisy_counts, dtype=np.float64))[::-1]
    c = max(float(np.max(counts * np.arange(1, len(counts) + 1))) if len(counts) else float(lines), 1.0)
    estimate = lines * threshold * vocab / c
    floor = max(vocab * threshold / max_words, lines + 1)
    needed = max(estimate, floor)
    digits = max(int(math.floor(math.log10(needed))) - 1, 0)  # two significant digits, rounded up
    return int(math.ceil(needed / 10 ** digits) * 10 ** digits)


def _noise_rng(vocab_noise_seed: Optional[int]) -> np.random.Generator:
    """The vocabulary selection's generator: ChaCha20 keyed with 256 fresh bits from the OS (a
    one-time draw, so the cryptographic generator costs nothing), or Philox keyed with
    `vocab_noise_seed` (tests: reproducible, ε holds only while it stays secret)."""
    if vocab_noise_seed is None:
        return NoiseKey.fresh(secure=True).generator()
    return NoiseKey(int(vocab_noise_seed) % (1 << KEY_BITS)).generator()


def vocab_noise_for(target_epsilon: float, share: float, delta: float,
                    unseen_delta: float = DEFAULT_VOCAB_UNSEEN_DELTA) -> float:
    """The vocabulary's noise multiplier sized to the training ε the user intends: the least σ
    whose selection event alone (`GaussianPartitionSelectionDpEvent(σ, unseen_delta)`) spends at
    most `share` · `target_epsilon` at `delta` (default accountant). Public inputs only.

    Args:
        target_epsilon: the ε the data set is meant to be trained at (> 0).
        share: the part of it the vocabulary may take, in (0, 1).
        delta: the δ that share is computed at; it must exceed `unseen_delta`.
    Returns:
        σ (the `vocab_noise_multiplier` of `convert_text`).
    """
    from widedp.accounting import UnreachableTargetError, calibrate
    from widedp.accounting.events import GaussianPartitionSelectionDpEvent

    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target epsilon must be finite and > 0, got {target_epsilon}")
    if not (0 < share < 1):
        raise ValueError(f"the vocabulary's budget share must be in (0, 1), got {share}")
    if not (unseen_delta < delta < 1):
        raise ValueError(f"the vocabulary's δ ({delta:g}) must exceed its unseen-word δ ({unseen_delta:g})")
    try:
        return float(calibrate(lambda s: GaussianPartitionSelectionDpEvent(s, unseen_delta), share * target_epsilon,
                               delta))
    except UnreachableTargetError as exc:
        raise ValueError(f"no vocabulary noise spends only {share:g} of ε = {target_epsilon:g} at δ = {delta:g}: "
                         f"{exc}") from None


def convert_text(input_txt, out_dir, *, vocab: Optional[int] = None, window: int = 4,
                 negatives: int = 8, seed: int = 0,
                 vocab_noise_multiplier: float = DEFAULT_VOCAB_NOISE_MULTIPLIER,
                 vocab_max_words_per_line: int = DEFAULT_VOCAB_MAX_WORDS_PER_LINE,
                 vocab_unseen_delta: float = DEFAULT_VOCAB_UNSEEN_DELTA,
                 vocab_file=None, vocab_noise_seed: Optional[int] = None,
                 allow_small_vocab: bool = False, chunk_tokens: int = 1 << 18) -> DatasetMeta:
    """Convert a plain text file to a cbow data set in ``out_dir`` (see module docstring).

    ``vocab`` (maximum vocabulary size) is required unless ``vocab_file`` is given. Without
    ``vocab_file`` the vocabulary is selected privately (its event lands in the meta's
    ``privacy_events``); ``vocab_noise_seed`` makes that selection reproducible (tests only).
    A private vocabulary of fewer than ``vocab``/2 words raises ``SmallVocabularyError``
    unless ``allow_small_vocab`` (one of no words always does); nothing is written then.
    """
    from widedp.selection.partition import check_unseen_delta, gaussian_partition_selection

    if vocab is None and vocab_file is None:
        raise ValueError("vocab (the maximum vocabulary size) is required unless vocab_file is given")
    for name, value, low in (("vocab", vocab, 1), ("window", window, 1), ("negatives", negatives, 1),
                             ("vocab_max_words_per_line", vocab_max_words_per_line, 1)):
        if name == "vocab" and value is None:
            continue
        assert value is not None  # only vocab may be None (vocab_file given)
        if isinstance(value, bool) or int(value) != value or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value}")
    if not (isinstance(vocab_noise_multiplier, (int, float)) and math.isfinite(vocab_noise_multiplier)
            and vocab_noise_multiplier > 0):
        raise ValueError(f"vocab_noise_multiplier must be finite and > 0, got {vocab_noise_multiplier}")
    check_unseen_delta(vocab_unseen_delta)
    if vocab_noise_seed is not None and (isinstance(vocab_noise_seed, bool) or vocab_noise_seed < 0
                                         or int(vocab_noise_seed) != vocab_noise_seed):
        raise ValueError(f"vocab_noise_seed must be an integer >= 0, got {vocab_noise_seed}")
    path = Path(os.fspath(input_txt))

    privacy_events = []
    if vocab_file is not None:
        words, weights, weights_from = read_public_vocab(vocab_file, vocab)
        vocab_tsv = "".join(f"{w}\n" for w in words)
        vocabulary = {"method": "public_file", "path": str(vocab_file), "size": len(words),
                      "negative_weights": weights_from}
    else:
        assert vocab is not None  # checked above: vocab is required without vocab_file
        lines_with_words = [0]
        selected = gaussian_partition_selection(
            _line_documents(path, int(vocab_max_words_per_line), lines_with_words),
            noise_multiplier=float(vocab_noise_multiplier),
            max_keys_per_document=int(vocab_max_words_per_line),
            unseen_delta=float(vocab_unseen_delta), rng=_noise_rng(vocab_noise_seed))
        if lines_with_words[0] == 0:
            raise DataError(f"{path}: no words (empty file?)")
        words = list(selected.keys[:vocab])
        if not words or (2 * len(words) < vocab and not allow_small_vocab):
            raise SmallVocabularyError(path, len(words), int(vocab), selected.threshold, lines_with_words[0],
                                       _needed_lines(selected.noisy_counts, selected.threshold, int(vocab),
                                                     lines_with_words[0], int(vocab_max_words_per_line)))
        noisy = selected.noisy_counts[:vocab]
        weights = np.maximum(noisy, NEGATIVE_WEIGHT_FLOOR)
        vocab_tsv = "".join(f"{w}\t{int(round(c))}\n" for w, c in zip(words, noisy))
        vocabulary = {
            "method": "gaussian_partition_selection", "unit_of_privacy": "one line",
            "noise_multiplier": float(vocab_noise_multiplier),
            "max_words_per_line": int(vocab_max_words_per_line),
            "unseen_delta": float(vocab_unseen_delta), "threshold": selected.threshold,
            "size": len(words), "noise_seed": vocab_noise_seed,
            "counts": "vocab.tsv: noisy line counts (lines counting the word among their first "
                      "max_words_per_line distinct words, plus Gaussian noise), rounded",
        }
        description = (f"private vocabulary of {path.name}: Gaussian partition selection over lines "
                       f"(noise multiplier {float(vocab_noise_multiplier)}, at most "
                       f"{int(vocab_max_words_per_line)} words per line, unseen-word delta "
                       f"{float(vocab_unseen_delta):g})")
        if vocab_noise_seed is not None:
            # The seed value stays in dataset.json (private data) only; the description travels
            # into run summaries and exports, so it names the mode, never the value.
            note = ("reproducible mode: the vocabulary noise came from --vocab-noise-seed (recorded in "
                    "dataset.json); the vocabulary's epsilon holds only while that seed stays secret")
            vocabulary["note"] = note
            description += f"; {note}"
        privacy_events.append(privacy_event_entry(description, selected.event))
    index = {w: i for i, w in enumerate(words)}
    neg = NegativeSampler(weights, UNIGRAM_POWER, np.random.default_rng(seed))

    with DatasetWriter(out_dir) as writer:
        rows = 0
        buf_ids: list[np.ndarray] = []
        buf_sent: list[np.ndarray] = []
        buffered = 0
        ids_arr = np.zeros(0, dtype=np.int64)
        sent_arr = np.zeros(0, dtype=np.int64)
        emit_from = 0  # first position of ids_arr not yet emitted
        sentence = 0
        open_start: Optional[int] = None  # where the (unfinished) last sentence starts

        def flush(final: bool) -> None:
            nonlocal ids_arr, sent_arr, emit_from, buf_ids, buf_sent, buffered, rows, open_start
            if buf_ids:
                ids_arr = np.concatenate([ids_arr] + buf_ids)
                sent_arr = np.concatenate([sent_arr] + buf_sent)
                buf_ids, buf_sent, buffered = [], [], 0
            n = len(ids_arr)
            if final or open_start is None:
                emit_to = n
            else:  # positions of the open sentence need `window` tokens to their right
                emit_to = max(open_start, min(n, n - window))
                emit_to = max(emit_to, emit_from)
            if emit_to > emit_from:
                lengths, values, targets = cbow_examples(ids_arr, sent_arr, emit_from, emit_to, window)
                if len(targets):
                    writer.write(cbow_table(lengths, values, targets, neg.draw(len(targets), negatives)))
                    rows += len(targets)
            keep = n if (final or open_start is None) else max(open_start, emit_to - window)
            ids_arr, sent_arr = ids_arr[keep:], sent_arr[keep:]
            emit_from = emit_to - keep
            if open_start is not None:
                open_start -= keep

        for tokens, ends in _pieces(path):
            ids = np.fromiter((index.get(t, -1) for t in tokens), dtype=np.int64, count=len(tokens))
            ids = ids[ids >= 0]
            if len(ids):
                if open_start is None:
                    open_start = len(ids_arr) + buffered
                buf_ids.append(ids)
                buf_sent.append(np.full(len(ids), sentence, dtype=np.int64))
                buffered += len(ids)
            if ends:
                sentence += 1
                open_start = None
            if buffered >= chunk_tokens:
                flush(False)
        flush(True)
        if rows == 0:
            raise DataError(f"{path}: no CBOW examples (no in-vocabulary word has an "
                            f"in-vocabulary context word within ±{window} on its line)")
        meta = cbow_meta(rows, len(words), negatives, extra={
            "source": f"text {path}", "vocab_requested": None if vocab is None else int(vocab),
            "window": int(window), "negatives_per_example": int(negatives), "seed": seed,
            "unigram_power": UNIGRAM_POWER, "vocab_file": "vocab.tsv", "vocabulary": vocabulary,
            PRIVACY_EVENTS_KEY: privacy_events,
        })
        writer.add_file("vocab.tsv", vocab_tsv)
        writer.commit(meta)
    return meta
