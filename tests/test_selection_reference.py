"""The fast sparse selectors agree in distribution with slow dense references.

`tests/reference_selectors.py` implements every selector directly from its definition, dense
over all p rows. Here each fast selector and its reference are run many times (fixed seeds)
on small vocabularies and their output distributions are compared with two-sample tests:
chi-square on the selected set (and on per-row selection frequencies, number of answers, ...)
and Kolmogorov-Smirnov on released values. Every comparison asserts p-value > ALPHA = 1e-6, so
a correct implementation fails a given comparison with probability <= 1e-6 (and, with fixed
seeds, the outcome is deterministic). The `test_comparison_rejects_*` tests run deliberately
wrong variants through the same helpers and require p-value < ALPHA: they show that each kind
of comparison can fail.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
from scipy import stats

import widedp.selection._sparse as sparse_mod
import widedp.selection.exponential as exponential_mod
import widedp.selection.fest as fest_mod
import widedp.selection.noisy_max as noisy_max_mod
import widedp.selection.threshold as threshold_mod
from widedp.accounting.events import (
    ExponentialTopKDpEvent,
    GaussianDpEvent,
    NoisyMaxTopKDpEvent,
    NoOpDpEvent,
    SparseVectorDpEvent,
)
from widedp.selection import (
    contribution_counts,
    exponential_top_k,
    fest_top_k,
    gaussian_threshold,
    noisy_max_top_k,
    numeric_sparse,
    random_rows,
    truncated_row_counts,
)
from widedp.selection.threshold import contribution_weights, merge_disjoint, weighted_row_counts

try:  # tests/ on sys.path (rootdir-relative "prepend" import mode, no tests/__init__.py)
    import reference_selectors as ref
except ImportError:  # pragma: no cover - tests/ imported as a package
    from tests import reference_selectors as ref

ALPHA = 1e-6  # false-alarm rate of each comparison
TRIALS = 20_000
MUTANT_TRIALS = 5_000  # the wrong variants below are rejected with p-values < 1e-30 even so


# ------------------------------------------------------------------------------------------
# Comparison helpers
# ------------------------------------------------------------------------------------------


def _as_rows(labels) -> np.ndarray:
    labels = np.asarray(labels)
    return labels[:, None] if labels.ndim == 1 else labels


def chi2_two_sample_pvalue(a, b, min_total: int = 10) -> float:
    """Chi-square two-sample test that labels `a` and `b` (1-D, or 2-D with one label per
    row) come from the same categorical distribution. Categories seen fewer than `min_total`
    times in both samples together are pooled into one bin (so expected cell counts are >= 5),
    and that bin is merged into the rarest other one if it is still small."""
    a, b = _as_rows(a), _as_rows(b)
    _, inverse = np.unique(np.concatenate([a, b]), axis=0, return_inverse=True)
    inverse = inverse.ravel()
    size = int(inverse.max()) + 1
    count_a = np.bincount(inverse[: len(a)], minlength=size)
    count_b = np.bincount(inverse[len(a) :], minlength=size)
    total = count_a + count_b
    big = total >= min_total
    cols_a, cols_b = list(count_a[big]), list(count_b[big])
    small_a, small_b = int(count_a[~big].sum()), int(count_b[~big].sum())
    if small_a + small_b:
        if small_a + small_b < min_total and cols_a:
            j = int(np.argmin(np.add(cols_a, cols_b)))
            cols_a[j] += small_a
            cols_b[j] += small_b
        else:
            cols_a.append(small_a)
            cols_b.append(small_b)
    if len(cols_a) < 2:
        return 1.0  # one category: both samples are constant and equal
    return float(stats.chi2_contingency(np.array([cols_a, cols_b]), correction=False).pvalue)


def ks_two_sample_pvalue(a, b) -> float:
    return float(stats.ks_2samp(np.asarray(a), np.asarray(b)).pvalue)


def set_labels(mask: np.ndarray) -> np.ndarray:
    """One label per run identifying the selected set (a packed bitmask)."""
    return np.packbits(mask, axis=1)


def distribution_pvalues(fast_mask: np.ndarray, ref_mask: np.ndarray) -> dict[str, float]:
    """p-values of: the selected set, the number selected, and each row's selection frequency."""
    out = {
        "selected set": chi2_two_sample_pvalue(set_labels(fast_mask), set_labels(ref_mask)),
        "number selected": chi2_two_sample_pvalue(fast_mask.sum(1), ref_mask.sum(1)),
    }
    for row in range(fast_mask.shape[1]):
        out[f"row {row} frequency"] = chi2_two_sample_pvalue(fast_mask[:, row], ref_mask[:, row])
    return out


def assert_pvalues_ok(pvalues: dict[str, float]) -> None:
    bad = {name: p for name, p in pvalues.items() if not p > ALPHA}
    assert not bad, f"fast path and reference differ (p-value <= {ALPHA}): {bad}"


def assert_same_distribution(fast_mask: np.ndarray, ref_mask: np.ndarray) -> None:
    assert fast_mask.shape == ref_mask.shape
    assert_pvalues_ok(distribution_pvalues(fast_mask, ref_mask))


def assert_rejected(pvalues: dict[str, float]) -> None:
    """A deliberately wrong variant must be caught by at least one comparison."""
    assert min(pvalues.values()) < ALPHA, f"wrong variant NOT detected: {pvalues}"


def check_ids(ids, num_rows: int, count: int | None = None) -> None:
    """Valid selector output: sorted, distinct int64 ids in [0, num_rows)."""
    ids = np.asarray(ids)
    assert ids.dtype == np.int64, ids.dtype
    assert ids.ndim == 1
    if count is not None:
        assert ids.size == count, (ids.size, count)
    if ids.size:
        assert ids[0] >= 0 and ids[-1] < num_rows, ids
        assert np.all(np.diff(ids) > 0), f"ids not sorted and distinct: {ids}"


def run_fast(selector, num_rows: int, seed: int, trials: int = TRIALS, count: int | None = None):
    """Run `selector(rng)` `trials` times; mask of selected rows and released values (NaN
    where none), aligned with the ids."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((trials, num_rows), dtype=bool)
    values = np.full((trials, num_rows), np.nan)
    for t in range(trials):
        sel = selector(rng)
        check_ids(sel.ids, num_rows, count)
        mask[t, sel.ids] = True
        if sel.values is not None:
            assert sel.values.shape == sel.ids.shape
            values[t, sel.ids] = sel.values
    return mask, values


def test_references_match_closed_forms():
    """The references themselves, where the distribution has a closed form: EM with k = 1 is
    softmax(ε·u/(2Δ)); thresholding selects row r with probability Φ̄((τ - u_r)/(σ·C1))."""
    u = ref.dense_scores([0, 3, 5], [2.0, -1.0, 0.5], 7)
    mask = ref.em_top_k(u, 1, 2.0, 1.0, np.random.default_rng(30), trials=TRIALS)
    prob = np.exp(u) / np.exp(u).sum()
    assert stats.chisquare(mask.sum(0), TRIALS * prob).pvalue > ALPHA
    mask = ref.gaussian_threshold(u, 0.7, 1.2, 0.5, np.random.default_rng(31), trials=TRIALS)
    prob = stats.norm.sf((0.7 - u) / 0.6)
    for row in range(u.size):
        assert stats.binomtest(int(mask[:, row].sum()), TRIALS, prob[row]).pvalue > ALPHA


# ------------------------------------------------------------------------------------------
# Exponential mechanism (and report-noisy-max with Gumbel noise, which must equal it)
# ------------------------------------------------------------------------------------------

# (name, p, touched ids, scores, k, epsilon_per_draw, sensitivity)
EM_CASES = [
    ("ends-touched", 8, [0, 3, 7], [2.0, 1.0, -1.0], 2, 2.0, 1.0),
    ("untouched-must-win", 10, [2, 5, 7], [0.0, -3.0, -0.5], 3, 2.0, 1.0),
    ("no-touched", 6, [], [], 2, 1.0, 1.0),
    ("all-touched", 5, [4, 0, 2, 1, 3], [2.0, 3.0, 0.0, 1.0, -1.0], 3, 1.0, 0.5),
    ("k=1-p=12", 12, [1, 4, 6, 9, 11], [4.0, 3.0, 2.0, 1.0, 0.5], 1, 1.0, 1.0),
    ("k=p-1", 7, [0, 6], [1.0, -1.0], 6, 2.0, 1.0),
]


@pytest.mark.parametrize("case", EM_CASES, ids=[c[0] for c in EM_CASES])
def test_exponential_matches_peeling_reference(case):
    _, p, ids, scores, k, eps, sens = case
    fast, _ = run_fast(lambda rng: exponential_top_k(ids, scores, p, k, eps, sens, rng), p, seed=1, count=k)
    dense = ref.dense_scores(ids, scores, p)
    expected = ref.em_top_k(dense, k, eps, sens, np.random.default_rng(2), trials=TRIALS)
    assert_same_distribution(fast, expected)
    _, event = exponential_top_k(ids, scores, p, k, eps, sens, np.random.default_rng(0))
    assert event == ExponentialTopKDpEvent(epsilon_per_draw=eps, k=k)


def test_gumbel_noisy_max_matches_dense_gumbel_peeling():
    """Report-noisy-max with Gumbel(2Δ/ε) noise, peeled over all rows, is the EM."""
    p, ids, scores, k, eps, sens = 9, [0, 4, 8], [1.5, -1.0, 0.5], 2, 2.0, 1.0
    fast, _ = run_fast(lambda rng: noisy_max_top_k(ids, scores, p, k, eps, sens, rng, noise="gumbel"), p, seed=3, count=k)
    dense = ref.dense_scores(ids, scores, p)
    expected = ref.report_noisy_max_top_k(dense, k, eps, sens, np.random.default_rng(4), trials=TRIALS, noise="gumbel")
    assert_same_distribution(fast, expected)


def test_comparison_rejects_em_ignoring_untouched_rows(monkeypatch):
    """Wrong variant: the untouched rows' Gumbels are never drawn, so only touched rows win."""
    monkeypatch.setattr(exponential_mod, "top_log_uniforms", lambda n, k, rng: np.empty(0))
    _, p, ids, scores, k, eps, sens = EM_CASES[1]
    fast, _ = run_fast(lambda rng: exponential_top_k(ids, scores, p, k, eps, sens, rng), p, seed=1, trials=MUTANT_TRIALS)
    expected = ref.em_top_k(ref.dense_scores(ids, scores, p), k, eps, sens, np.random.default_rng(2), trials=MUTANT_TRIALS)
    assert_rejected(distribution_pvalues(fast, expected))


def test_comparison_rejects_em_with_one_untouched_competitor(monkeypatch):
    """Subtler wrong variant: the p - m untouched rows compete as if they were a single row
    (the top order statistics of 1 uniform instead of p - m)."""
    original = exponential_mod.top_log_uniforms
    monkeypatch.setattr(exponential_mod, "top_log_uniforms", lambda n, k, rng: original(min(n, 1), k, rng))
    _, p, ids, scores, k, eps, sens = EM_CASES[0]
    fast, _ = run_fast(lambda rng: exponential_top_k(ids, scores, p, k, eps, sens, rng), p, seed=1, trials=MUTANT_TRIALS)
    expected = ref.em_top_k(ref.dense_scores(ids, scores, p), k, eps, sens, np.random.default_rng(2), trials=MUTANT_TRIALS)
    assert_rejected(distribution_pvalues(fast, expected))


def test_comparison_rejects_em_with_wrong_epsilon_scale():
    """Wrong variant: exp(ε·u/Δ) instead of exp(ε·u/(2Δ)) (fast path run with 2ε)."""
    _, p, ids, scores, k, eps, sens = EM_CASES[0]
    fast, _ = run_fast(lambda rng: exponential_top_k(ids, scores, p, k, 2 * eps, sens, rng), p, seed=1, trials=MUTANT_TRIALS)
    expected = ref.em_top_k(ref.dense_scores(ids, scores, p), k, eps, sens, np.random.default_rng(2), trials=MUTANT_TRIALS)
    assert_rejected(distribution_pvalues(fast, expected))


# ------------------------------------------------------------------------------------------
# Report-noisy-max, Laplace noise
# ------------------------------------------------------------------------------------------

NOISY_MAX_CASES = [
    ("ends-touched", 8, [0, 3, 7], [2.0, 1.0, -1.0], 2, 2.0, 1.0),
    ("untouched-must-win", 10, [2, 5, 7], [0.0, -3.0, -0.5], 3, 2.0, 1.0),
    ("no-touched", 6, [], [], 2, 1.0, 1.0),
    ("all-touched", 5, [4, 0, 2, 1, 3], [2.0, 3.0, 0.0, 1.0, -1.0], 3, 1.0, 0.5),
    ("k=1-p=12", 12, [1, 4, 6, 9, 11], [4.0, 3.0, 2.0, 1.0, 0.5], 1, 1.0, 1.0),
]


@pytest.mark.parametrize("case", NOISY_MAX_CASES, ids=[c[0] for c in NOISY_MAX_CASES])
def test_laplace_noisy_max_matches_dense_reference(case):
    _, p, ids, scores, k, eps, sens = case
    fast, _ = run_fast(lambda rng: noisy_max_top_k(ids, scores, p, k, eps, sens, rng), p, seed=5, count=k)
    dense = ref.dense_scores(ids, scores, p)
    expected = ref.report_noisy_max_top_k(dense, k, eps, sens, np.random.default_rng(6), trials=TRIALS)
    assert_same_distribution(fast, expected)
    _, event = noisy_max_top_k(ids, scores, p, k, eps, sens, np.random.default_rng(0))
    assert event == NoisyMaxTopKDpEvent(epsilon_per_draw=eps, k=k)


def test_comparison_rejects_noisy_max_with_one_untouched_competitor(monkeypatch):
    """Wrong variant: the max of the untouched rows' Laplace noise is drawn as one Laplace."""
    original = noisy_max_mod.top_log_uniforms
    monkeypatch.setattr(noisy_max_mod, "top_log_uniforms", lambda n, k, rng: original(min(n, 1), k, rng))
    _, p, ids, scores, k, eps, sens = NOISY_MAX_CASES[0]
    fast, _ = run_fast(lambda rng: noisy_max_top_k(ids, scores, p, k, eps, sens, rng), p, seed=5, trials=MUTANT_TRIALS)
    expected = ref.report_noisy_max_top_k(ref.dense_scores(ids, scores, p), k, eps, sens, np.random.default_rng(6), trials=MUTANT_TRIALS)
    assert_rejected(distribution_pvalues(fast, expected))


# ------------------------------------------------------------------------------------------
# NumericSparse (seed Alg 1)
# ------------------------------------------------------------------------------------------

SVT_EPSILON, SVT_DELTA = 1.0, 1e-5


def svt_sensitivity(max_answers: int, release_values: bool) -> float:
    """The sensitivity s that makes Alg 1's query noise Lap(2σ(ε1)) have scale exactly 1, so
    thresholds and values below are in units of the query-noise scale."""
    eps1 = 0.95 * SVT_EPSILON if release_values else SVT_EPSILON
    return eps1 / (2.0 * math.sqrt(32.0 * max_answers * math.log(2.0 / SVT_DELTA)))


# (name, p, touched ids, values, threshold α, max answers c, release_values)
SVT_CASES = [
    ("touched-0-and-last-unsorted", 8, [7, 0], [2.0, 1.5], 1.0, 2, True),
    ("no-touched", 10, [], [], 0.5, 3, True),
    ("all-touched", 6, [0, 1, 2, 3, 4, 5], [0.2, -1.0, 2.0, 0.0, 0.5, -40.0], 1.0, 2, True),
    ("middle-select-only", 12, [3, 4, 8], [2.0, -2.5, 0.3], 1.5, 1, False),
    ("zero-scores-low-threshold", 9, [1, 5], [0.0, 0.0], -1.0, 3, False),
    ("untouched-vs-negative", 10, [0, 9], [-0.2, 0.1], 0.8, 3, True),
    ("touched-last-only", 7, [6], [-30.0], 2.0, 2, True),
]


def svt_value_pvalues(fast_mask, fast_values, ref_mask, ref_values) -> dict[str, float]:
    """KS on the first released value, on all released values, and on each row's values."""
    out = {}
    has_a, has_b = fast_mask.any(1), ref_mask.any(1)
    first_a = fast_values[has_a, fast_mask[has_a].argmax(1)]
    first_b = ref_values[has_b, ref_mask[has_b].argmax(1)]
    out["first released value"] = ks_two_sample_pvalue(first_a, first_b)
    out["all released values"] = ks_two_sample_pvalue(fast_values[fast_mask], ref_values[ref_mask])
    for row in range(fast_mask.shape[1]):
        a, b = fast_values[fast_mask[:, row], row], ref_values[ref_mask[:, row], row]
        if min(a.size, b.size) >= 100:
            out[f"row {row} values"] = ks_two_sample_pvalue(a, b)
    return out


@pytest.mark.parametrize("case", SVT_CASES, ids=[c[0] for c in SVT_CASES])
def test_numeric_sparse_matches_alg1_reference(case):
    _, p, ids, values, alpha, c, release = case
    s = svt_sensitivity(c, release)

    def fast_selector(rng):
        sel = numeric_sparse(ids, values, p, alpha, c, SVT_EPSILON, SVT_DELTA, s, rng, release_values=release)
        assert sel.ids.size <= c
        assert (sel.values is not None) == release
        return sel

    fast_mask, fast_values = run_fast(fast_selector, p, seed=7)
    dense = ref.dense_scores(ids, values, p)
    ref_mask, ref_values = ref.numeric_sparse(
        dense, alpha, c, SVT_EPSILON, SVT_DELTA, s, np.random.default_rng(8), trials=TRIALS, release_values=release
    )
    pvalues = distribution_pvalues(fast_mask, ref_mask)  # includes the number of answers
    if release:
        pvalues.update(svt_value_pvalues(fast_mask, fast_values, ref_mask, ref_values))
    assert_pvalues_ok(pvalues)

    b_threshold, b_query, b_value = ref.numeric_sparse_scales(SVT_EPSILON, SVT_DELTA, c, s, release)
    assert b_query == pytest.approx(1.0)
    _, event = numeric_sparse(ids, values, p, alpha, c, SVT_EPSILON, SVT_DELTA, s, np.random.default_rng(0), release_values=release)
    assert isinstance(event, SparseVectorDpEvent)
    assert event.threshold_noise == pytest.approx(b_threshold / s)
    assert event.query_noise == pytest.approx(b_query / s)
    assert (event.value_noise is None) == (not release)
    if release:
        assert event.value_noise == pytest.approx(b_value / s)
    assert (event.max_answers, event.epsilon, event.delta) == (c, SVT_EPSILON, SVT_DELTA)


def test_numeric_sparse_many_windows_matches_reference():
    """p = 400 with 250 touched rows: the fast path scans several windows of touched rows (64,
    then 128, ...) and redraws the rest of a window after each answer."""
    p, c, alpha, trials = 400, 3, 3.0, 6_000
    setup = np.random.default_rng(123)
    ids = np.sort(setup.choice(p, size=250, replace=False))
    values = setup.choice([0.0, 0.5, -1.0, 2.0], size=ids.size)
    s = svt_sensitivity(c, True)
    fast_mask, fast_values = run_fast(
        lambda rng: numeric_sparse(ids, values, p, alpha, c, SVT_EPSILON, SVT_DELTA, s, rng), p, seed=9, trials=trials
    )
    ref_mask, ref_values = ref.numeric_sparse(
        ref.dense_scores(ids, values, p), alpha, c, SVT_EPSILON, SVT_DELTA, s, np.random.default_rng(10), trials=trials
    )
    pvalues = {"number of answers": chi2_two_sample_pvalue(fast_mask.sum(1), ref_mask.sum(1))}
    # The j-th answer's row id (-1 if fewer than j+1 answers), for j = 0, 1, 2.
    for j in range(c):
        def jth(mask):
            cum = np.cumsum(mask, axis=1)
            hit = (cum == j + 1) & mask
            return np.where(hit.any(1), hit.argmax(1), -1)

        pvalues[f"answer {j} row"] = chi2_two_sample_pvalue(jth(fast_mask), jth(ref_mask))
    pvalues["selected set"] = chi2_two_sample_pvalue(set_labels(fast_mask), set_labels(ref_mask))
    for row in range(p):
        pvalues[f"row {row} frequency"] = chi2_two_sample_pvalue(fast_mask[:, row], ref_mask[:, row])
    pvalues.update(svt_value_pvalues(fast_mask, fast_values, ref_mask, ref_values))
    assert_pvalues_ok(pvalues)


def test_comparison_rejects_numeric_sparse_without_threshold_refresh():
    """Wrong variant: α̂ is drawn once and never refreshed after an answer."""
    _, p, ids, values, alpha, c, release = SVT_CASES[1]
    s = svt_sensitivity(c, release)
    fast_mask, _ = run_fast(
        lambda rng: numeric_sparse(ids, values, p, alpha, c, SVT_EPSILON, SVT_DELTA, s, rng), p, seed=7, trials=MUTANT_TRIALS
    )
    wrong_mask, _ = ref.numeric_sparse(
        ref.dense_scores(ids, values, p), alpha, c, SVT_EPSILON, SVT_DELTA, s, np.random.default_rng(8),
        trials=MUTANT_TRIALS, refresh_threshold=False,
    )
    assert_rejected(distribution_pvalues(fast_mask, wrong_mask))


def test_comparison_rejects_numeric_sparse_skipping_untouched_rows():
    """Wrong variant: only touched rows are tested (untouched rows never answer)."""
    _, p, ids, values, alpha, c, release = SVT_CASES[0]
    s = svt_sensitivity(c, release)
    fast_mask, _ = run_fast(
        lambda rng: numeric_sparse(ids, values, p, alpha, c, SVT_EPSILON, SVT_DELTA, s, rng), p, seed=7, trials=MUTANT_TRIALS
    )
    # The wrong variant is Alg 1 run on the touched rows only (in id order), mapped back to ids.
    order = np.argsort(ids)
    touched_sorted, values_sorted = np.asarray(ids)[order], np.asarray(values)[order]
    small_mask, _ = ref.numeric_sparse(
        values_sorted, alpha, c, SVT_EPSILON, SVT_DELTA, s, np.random.default_rng(8), trials=MUTANT_TRIALS
    )
    wrong_mask = np.zeros((MUTANT_TRIALS, p), dtype=bool)
    wrong_mask[:, touched_sorted] = small_mask
    assert_rejected(distribution_pvalues(fast_mask, wrong_mask))


class _GeometricOffByOne:
    """RNG proxy whose geometric draws are one too large: turns the fast path's gap arithmetic
    into the classic off-by-one (row = gap_start + offset, and the gap's first row never
    answers)."""

    def __init__(self, rng):
        self._rng = rng

    def geometric(self, p, size=None):
        return self._rng.geometric(p, size=size) + 1

    def __getattr__(self, name):
        return getattr(self._rng, name)


def test_comparison_rejects_numeric_sparse_gap_off_by_one():
    _, p, ids, values, alpha, c, release = SVT_CASES[0]
    s = svt_sensitivity(c, release)
    fast_mask, _ = run_fast(
        lambda rng: numeric_sparse(ids, values, p, alpha, c, SVT_EPSILON, SVT_DELTA, s, _GeometricOffByOne(rng)),
        p, seed=7, trials=MUTANT_TRIALS,
    )
    ref_mask, _ = ref.numeric_sparse(
        ref.dense_scores(ids, values, p), alpha, c, SVT_EPSILON, SVT_DELTA, s, np.random.default_rng(8), trials=MUTANT_TRIALS
    )
    assert_rejected(distribution_pvalues(fast_mask, ref_mask))


def test_comparison_rejects_numeric_sparse_releasing_abs_value():
    """Wrong variant: releases |u_i| + noise instead of u_i + noise (caught by the values KS)."""
    _, p, ids, values, alpha, c, release = SVT_CASES[2]
    s = svt_sensitivity(c, release)
    fast_mask, fast_values = run_fast(lambda rng: numeric_sparse(ids, values, p, alpha, c, SVT_EPSILON, SVT_DELTA, s, rng), p, seed=7, trials=MUTANT_TRIALS)
    wrong_mask, wrong_values = ref.numeric_sparse(
        np.abs(ref.dense_scores(ids, values, p)), alpha, c, SVT_EPSILON, SVT_DELTA, s, np.random.default_rng(8), trials=MUTANT_TRIALS
    )
    pvalues = svt_value_pvalues(fast_mask, fast_values, wrong_mask, wrong_values)
    assert distribution_pvalues(fast_mask, wrong_mask)["selected set"] > ALPHA  # selection is the same
    assert_rejected(pvalues)


# ------------------------------------------------------------------------------------------
# Gaussian thresholding
# ------------------------------------------------------------------------------------------

# (name, p, touched ids, counts, threshold τ, noise multiplier σ, clip norm C1)
THRESHOLD_CASES = [
    ("ends-touched", 8, [0, 4, 7], [3.0, 1.0, 0.5], 1.5, 1.0, 1.0),
    ("no-touched", 6, [], [], 0.5, 1.0, 2.0),
    ("all-touched", 5, [0, 1, 2, 3, 4], [2.0, 0.0, 1.0, 3.0, 0.5], 1.0, 0.7, 1.5),
    ("negative-threshold", 10, [2], [-1.0], -0.3, 1.0, 1.0),
]


@pytest.mark.parametrize("case", THRESHOLD_CASES, ids=[c[0] for c in THRESHOLD_CASES])
def test_gaussian_threshold_matches_dense_reference(case):
    _, p, ids, counts, tau, sigma, clip = case
    fast, _ = run_fast(lambda rng: gaussian_threshold(ids, counts, p, tau, sigma, clip, rng), p, seed=11)
    dense = ref.dense_scores(ids, counts, p)
    expected = ref.gaussian_threshold(dense, tau, sigma, clip, np.random.default_rng(12), trials=TRIALS)
    assert_same_distribution(fast, expected)
    _, event = gaussian_threshold(ids, counts, p, tau, sigma, clip, np.random.default_rng(0))
    assert event == GaussianDpEvent(sigma)


def test_comparison_rejects_threshold_without_untouched_false_positives(monkeypatch):
    """Wrong variant: untouched rows (count 0) can never pass the threshold."""
    monkeypatch.setattr(threshold_mod, "special", types.SimpleNamespace(ndtr=lambda x: 0.0))
    _, p, ids, counts, tau, sigma, clip = THRESHOLD_CASES[0]
    fast, _ = run_fast(lambda rng: gaussian_threshold(ids, counts, p, tau, sigma, clip, rng), p, seed=11, trials=MUTANT_TRIALS)
    expected = ref.gaussian_threshold(ref.dense_scores(ids, counts, p), tau, sigma, clip, np.random.default_rng(12), trials=MUTANT_TRIALS)
    assert_rejected(distribution_pvalues(fast, expected))


# ------------------------------------------------------------------------------------------
# DP-FEST
# ------------------------------------------------------------------------------------------


def jagged(examples):
    offsets = np.concatenate([[0], np.cumsum([len(e) for e in examples])]).astype(np.int64)
    ids = np.asarray([r for e in examples for r in e], dtype=np.int64)
    return offsets, ids


# (name, p, examples, k, σ, L)
FEST_CASES = [
    ("truncation-matters", 8, [[0, 1, 1, 2, 3], [3, 3], [5, 0, 1, 2], [], [7, 7, 0]], 2, 0.5, 2),
    ("no-examples", 10, [], 3, 1.0, 1),
    ("all-touched", 5, [[0, 1, 2, 3, 4], [4, 3, 3], [2], [4, 1, 0, 2]], 3, 0.7, 3),
]


@pytest.mark.parametrize("case", FEST_CASES, ids=[c[0] for c in FEST_CASES])
def test_fest_matches_dense_reference(case):
    _, p, examples, k, sigma, L = case
    offsets, ids = jagged(examples)
    fast, _ = run_fast(lambda rng: fest_top_k(offsets, ids, p, k, sigma, L, rng), p, seed=13, count=k)
    expected = ref.fest_top_k(examples, p, k, sigma, L, np.random.default_rng(14), trials=TRIALS)
    assert_same_distribution(fast, expected)
    _, event = fest_top_k(offsets, ids, p, k, sigma, L, np.random.default_rng(0))
    assert event == GaussianDpEvent(sigma)


def test_comparison_rejects_fest_ignoring_untouched_rows(monkeypatch):
    monkeypatch.setattr(fest_mod, "top_log_uniforms", lambda n, k, rng: np.empty(0))
    _, p, examples, k, sigma, L = FEST_CASES[0]
    offsets, ids = jagged(examples)
    fast, _ = run_fast(lambda rng: fest_top_k(offsets, ids, p, k, sigma, L, rng), p, seed=13, trials=MUTANT_TRIALS)
    expected = ref.fest_top_k(examples, p, k, sigma, L, np.random.default_rng(14), trials=MUTANT_TRIALS)
    assert_rejected(distribution_pvalues(fast, expected))


def test_comparison_rejects_fest_without_truncation():
    """Wrong variant: every distinct row of an example counts (L ignored in the counts)."""
    _, p, examples, k, sigma, L = FEST_CASES[0]
    offsets, ids = jagged(examples)
    fast, _ = run_fast(lambda rng: fest_top_k(offsets, ids, p, k, sigma, L, rng), p, seed=13, trials=MUTANT_TRIALS)
    rng = np.random.default_rng(14)
    counts = ref.truncated_counts_dense(examples, p, 10**6)  # no truncation
    noisy = counts + rng.normal(0.0, sigma * math.sqrt(L), size=(MUTANT_TRIALS, p))
    wrong = np.zeros((MUTANT_TRIALS, p), dtype=bool)
    wrong[np.arange(MUTANT_TRIALS)[:, None], np.argsort(-noisy, axis=1)[:, :k]] = True
    assert_rejected(distribution_pvalues(fast, wrong))


# ------------------------------------------------------------------------------------------
# Random selection
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p,k", [(7, 3), (5, 5), (12, 1), (6, 2)])
def test_random_rows_matches_uniform_subsets(p, k):
    fast, _ = run_fast(lambda rng: random_rows(p, k, rng), p, seed=15, count=k)
    expected = ref.random_rows(p, k, np.random.default_rng(16), trials=TRIALS)
    assert_same_distribution(fast, expected)
    _, event = random_rows(p, k, np.random.default_rng(0))
    assert event == NoOpDpEvent()


def test_comparison_rejects_random_contiguous_block():
    """Wrong variant: a uniformly placed contiguous block of k rows (each row's frequency is
    not even uniform)."""
    p, k = 7, 3
    rng = np.random.default_rng(17)
    wrong = np.zeros((MUTANT_TRIALS, p), dtype=bool)
    starts = rng.integers(0, p - k + 1, size=MUTANT_TRIALS)
    for j in range(k):
        wrong[np.arange(MUTANT_TRIALS), starts + j] = True
    expected = ref.random_rows(p, k, np.random.default_rng(16), trials=MUTANT_TRIALS)
    assert_rejected(distribution_pvalues(wrong, expected))


# ------------------------------------------------------------------------------------------
# Count builders: exact equality with pure-python loops
# ------------------------------------------------------------------------------------------

COUNT_INPUTS = [
    [[0, 1, 1, 2, 3], [3, 3], [5, 0, 1, 2], [], [7, 7, 0]],
    [],
    [[]],
    [[], [], [4]],
    [[9, 9, 9, 9]],
    [[2, 1, 0, 3, 4, 5, 6], [6, 5, 4], [0]],
]


def random_examples(seed: int, n_examples: int = 200, num_rows: int = 30):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, num_rows, size=rng.integers(0, 12))) for _ in range(n_examples)]


@pytest.mark.parametrize("examples", COUNT_INPUTS + [random_examples(1), random_examples(2)])
@pytest.mark.parametrize("clip_norm", [0.5, 1.0, 1.7, 100.0])
def test_contribution_counts_equals_loop(examples, clip_norm):
    offsets, ids = jagged(examples)
    rows, counts = contribution_counts(offsets, ids, clip_norm)
    expected = ref.contribution_counts_loop(offsets, ids, clip_norm)
    assert rows.tolist() == sorted(expected)
    assert counts.tolist() == [expected[r] for r in sorted(expected)]  # exact, same summation order


@pytest.mark.parametrize("examples", COUNT_INPUTS + [random_examples(3), random_examples(4)])
@pytest.mark.parametrize("L", [1, 2, 3, 100])
def test_truncated_row_counts_equals_loop(examples, L):
    offsets, ids = jagged(examples)
    rows, counts = truncated_row_counts(offsets, ids, 40, L)
    expected = ref.truncated_row_counts_loop(offsets, ids, L)
    assert rows.tolist() == sorted(expected)
    assert counts.tolist() == [expected[r] for r in sorted(expected)]


@pytest.mark.parametrize("examples", [random_examples(5), random_examples(6, num_rows=9)])
@pytest.mark.parametrize("num_parts", [2, 3])
def test_counts_of_row_blocks_with_whole_example_weights_are_the_blocks_of_the_counts(examples, num_parts):
    """What the shards compute: each block of rows counted apart, every example weighted by all
    its rows (`contribution_weights`), gives exactly the loop's counts of those rows; weights
    taken from the block's rows only (the mistake that breaks the ℓ2 bound) do not."""
    offsets, ids = jagged(examples)
    expected = ref.contribution_counts_loop(offsets, ids, 1.5)
    weights = contribution_weights(offsets, ids, 1.5)
    example = np.repeat(np.arange(len(examples)), np.diff(offsets))
    block = np.asarray(ids) % num_parts
    got, wrong = {}, {}
    for b in range(num_parts):
        mine = block == b
        rows, counts = weighted_row_counts(example[mine], np.asarray(ids)[mine], weights)
        got.update(zip(rows.tolist(), counts.tolist()))
        keep = np.concatenate([[0], np.cumsum(np.bincount(example[mine], minlength=len(examples)))])
        rows, counts = contribution_counts(keep, np.asarray(ids)[mine], 1.5)
        wrong.update(zip(rows.tolist(), counts.tolist()))
    assert sorted(got) == sorted(expected)
    np.testing.assert_allclose([got[r] for r in sorted(expected)], [expected[r] for r in sorted(expected)], rtol=1e-12)
    assert any(abs(wrong[r] - expected[r]) > 1e-9 for r in expected)


def test_merging_shard_selections_refuses_a_row_two_shards_selected():
    assert merge_disjoint([np.array([5, 1]), np.array([], dtype=np.int64), np.array([3])]).tolist() == [1, 3, 5]
    with pytest.raises(ValueError, match="row 3 was selected by more than one shard"):
        merge_disjoint([np.array([1, 3]), np.array([3])])


def test_count_builders_reject_bad_input():
    with pytest.raises(ValueError, match="ids contains row 5"):
        contribution_counts([0, 2], [1, 5], 1.0, num_rows=5)
    with pytest.raises(ValueError, match="ids contains row -1"):
        truncated_row_counts([0, 2], [1, -1], 5, 2)
    with pytest.raises(ValueError, match="offsets"):
        truncated_row_counts([0, 3], [1, 2], 5, 2)
    with pytest.raises(ValueError, match="offsets"):
        contribution_counts([1, 2], [1, 2], 1.0)
    with pytest.raises(ValueError, match="clip_norm"):
        contribution_counts([0, 2], [1, 2], 0.0)


# ------------------------------------------------------------------------------------------
# Sparse primitives
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_rows,touched",
    [(10, []), (10, [0]), (10, [9]), (10, [0, 9]), (10, [3, 4, 5]), (10, [0, 1, 2, 3, 4, 5, 6, 7, 8]),
     (10, [1, 3, 5, 7, 9]), (50, sorted(np.random.default_rng(5).choice(50, 20, replace=False).tolist()))],
)
def test_complement_ids_equals_dense_complement(num_rows, touched):
    touched = np.asarray(touched, dtype=np.int64)
    untouched = ref.untouched_rows(num_rows, touched)
    ranks = np.arange(untouched.size)
    assert sparse_mod.complement_ids(ranks, touched).tolist() == untouched.tolist()
    shuffled = np.random.default_rng(0).permutation(ranks)
    assert sparse_mod.complement_ids(shuffled, touched).tolist() == untouched[shuffled].tolist()


def test_complement_ids_large_ids():
    touched = np.array([0, 5, 2**40, 2**62 - 2], dtype=np.int64)
    ranks = np.array([0, 3, 4, 2**40 - 3, 2**40 - 2, 2**62 - 6, 2**62 - 5], dtype=np.int64)
    expected = [1, 4, 6, 2**40 - 1, 2**40 + 1, 2**62 - 3, 2**62 - 1]
    assert sparse_mod.complement_ids(ranks, touched).tolist() == expected


@pytest.mark.parametrize("num_rows,touched,count", [(9, [0, 3, 8], 2), (6, [], 3), (7, [1, 2, 3, 4, 5], 2), (8, [7], 1)])
def test_sample_untouched_is_uniform_subset_of_untouched(num_rows, touched, count):
    touched = np.asarray(touched, dtype=np.int64)
    trials = 10_000
    rng = np.random.default_rng(18)
    fast = np.zeros((trials, num_rows), dtype=bool)
    for t in range(trials):
        out = sparse_mod.sample_untouched(num_rows, touched, count, rng)
        assert out.size == count and np.unique(out).size == count
        fast[t, out] = True
    assert not fast[:, touched].any()
    untouched = ref.untouched_rows(num_rows, touched)
    rng = np.random.default_rng(19)
    expected = np.zeros((trials, num_rows), dtype=bool)
    for t in range(trials):
        expected[t, rng.permutation(untouched)[:count]] = True
    assert_same_distribution(fast, expected)


def test_sample_untouched_edges():
    rng = np.random.default_rng(0)
    touched = np.array([1, 2], dtype=np.int64)
    assert sparse_mod.sample_untouched(4, touched, 0, rng).size == 0
    assert sorted(sparse_mod.sample_untouched(4, touched, 2, rng).tolist()) == [0, 3]
    with pytest.raises(ValueError, match="cannot sample 3 untouched rows"):
        sparse_mod.sample_untouched(4, touched, 3, rng)
    big = np.array([0, 10**12 - 1], dtype=np.int64)
    out = sparse_mod.sample_untouched(10**12, big, 50, rng)
    assert np.unique(out).size == 50 and out.min() >= 1 and out.max() <= 10**12 - 2


def test_comparison_rejects_sample_untouched_ignoring_touched(monkeypatch):
    """Wrong variant: ranks used as ids directly (touched rows not skipped)."""
    monkeypatch.setattr(sparse_mod, "complement_ids", lambda ranks, touched: np.asarray(ranks, dtype=np.int64))
    num_rows, touched, count, trials = 9, np.array([0, 3, 8]), 2, 5_000
    rng = np.random.default_rng(18)
    fast = np.zeros((trials, num_rows), dtype=bool)
    for t in range(trials):
        fast[t, sparse_mod.sample_untouched(num_rows, touched, count, rng)] = True
    rng = np.random.default_rng(19)
    expected = np.zeros((trials, num_rows), dtype=bool)
    for t in range(trials):
        expected[t, rng.permutation(ref.untouched_rows(num_rows, touched))[:count]] = True
    assert_rejected(distribution_pvalues(fast, expected))


def top_log_uniform_pvalues(fast_sampler, n: int, k: int, trials: int = 20_000) -> dict[str, float]:
    rng = np.random.default_rng(20)
    fast = np.stack([fast_sampler(n, k, rng) for _ in range(trials)])
    expected = ref.top_log_uniforms_by_sorting(n, k, np.random.default_rng(21), trials=trials)
    assert fast.shape == expected.shape
    return {f"order statistic {j}": ks_two_sample_pvalue(fast[:, j], expected[:, j]) for j in range(fast.shape[1])}


@pytest.mark.parametrize("n,k", [(1, 1), (5, 5), (30, 4), (200, 3), (3, 10)])
def test_top_log_uniforms_matches_sorted_uniforms(n, k):
    pvalues = top_log_uniform_pvalues(sparse_mod.top_log_uniforms, n, k)
    assert_pvalues_ok(pvalues)
    out = sparse_mod.top_log_uniforms(n, k, np.random.default_rng(0))
    assert out.size == min(n, k) and np.all(out <= 0) and np.all(np.diff(out) <= 0)


def test_top_log_uniforms_huge_n():
    """n = 10^10: -n·log U_(n-j) = Σ_{i<=j} E_i·n/(n-i), which is Gamma(j+1) up to 1e-9."""
    n, k, trials = 10**10, 3, 20_000
    rng = np.random.default_rng(22)
    draws = np.stack([sparse_mod.top_log_uniforms(n, k, rng) for _ in range(trials)])
    assert np.all(draws < 0) and np.all(np.diff(draws, axis=1) < 0)  # no underflow to log 1 = 0
    for j in range(k):
        assert stats.kstest(-n * draws[:, j], stats.gamma(j + 1).cdf).pvalue > ALPHA
    assert sparse_mod.top_log_uniforms(0, 3, rng).size == 0
    assert sparse_mod.top_log_uniforms(10, 0, rng).size == 0


def test_comparison_rejects_top_log_uniforms_without_decrement():
    """Wrong variant: denominators n instead of n, n-1, n-2, ... (Rényi representation broken)."""

    def wrong(n, k, rng):
        return -np.cumsum(rng.standard_exponential(min(n, k)) / n)

    assert_rejected(top_log_uniform_pvalues(wrong, 5, 4, trials=MUTANT_TRIALS))


# ------------------------------------------------------------------------------------------
# Huge vocabularies: no overflow, valid ids
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [10**10, 2**62])
def test_huge_vocabulary_outputs_are_valid(p):
    rng = np.random.default_rng(23)
    ids = np.array([0, 7, p // 2, p - 2, p - 1], dtype=np.int64)
    scores = np.array([5.0, -1.0, 200.0, 0.0, 2.0])
    for _ in range(20):
        sel = exponential_top_k(ids, scores, p, 10, 1.0, 1.0, rng)
        check_ids(sel.ids, p, 10)
        assert p // 2 in sel.ids  # utility 200/2 beats the ~log(p) <= 44 max Gumbel of the untouched rows

        check_ids(noisy_max_top_k(ids, scores, p, 4, 1.0, 1.0, rng).ids, p, 4)
        check_ids(noisy_max_top_k(ids, scores, p, 4, 1.0, 1.0, rng, noise="gumbel").ids, p, 4)

        s = svt_sensitivity(3, True)
        sel = numeric_sparse(ids, scores, p, 1.0, 3, SVT_EPSILON, SVT_DELTA, s, rng)
        check_ids(sel.ids, p, 3)  # untouched rows pass w.p. ~0.18 each: always 3 answers
        assert np.all(np.isfinite(sel.values))
        far = numeric_sparse(ids, scores, p, 60.0, 2, SVT_EPSILON, SVT_DELTA, s, rng, release_values=False)
        check_ids(far.ids, p)  # pass probability ~e^-60 per untouched row: long gaps, few answers

        # τ = 6σ: about p·1e-9 untouched false positives.
        sel = gaussian_threshold(ids, scores, p, 6.0 if p == 10**10 else 12.0, 1.0, 1.0, rng)
        check_ids(sel.ids, p)
        assert sel.ids.size < 1000

        # Row p-1 in 100 examples: count 100 beats the untouched rows' max noise (~0.71·9.3).
        offsets = np.array([0, 3, 5] + list(range(6, 104)), dtype=np.int64)
        fest_ids = np.array([p - 1, 0, p - 1, 12345, p - 1] + [p - 1] * 98)
        sel = fest_top_k(offsets, fest_ids, p, 6, 0.5, 2, rng)
        check_ids(sel.ids, p, 6)
        assert p - 1 in sel.ids

        check_ids(random_rows(p, 25, rng).ids, p, 25)


# ------------------------------------------------------------------------------------------
# Bad inputs: ValueError naming the parameter
# ------------------------------------------------------------------------------------------

_RNG = np.random.default_rng(0)
_S = svt_sensitivity(2, True)
NAN = float("nan")

BAD_INPUTS = [
    # exponential mechanism
    ("em-duplicate-id", lambda: exponential_top_k([1, 1], [0.0, 1.0], 5, 1, 1.0, 1.0, _RNG), "touched_ids"),
    ("em-id-too-large", lambda: exponential_top_k([5], [0.0], 5, 1, 1.0, 1.0, _RNG), "touched_ids"),
    ("em-negative-id", lambda: exponential_top_k([-1], [0.0], 5, 1, 1.0, 1.0, _RNG), "touched_ids"),
    ("em-nan-score", lambda: exponential_top_k([1], [NAN], 5, 1, 1.0, 1.0, _RNG), "scores"),
    ("em-k-too-large", lambda: exponential_top_k([1], [0.0], 5, 6, 1.0, 1.0, _RNG), r"^k "),
    ("em-k-zero", lambda: exponential_top_k([1], [0.0], 5, 0, 1.0, 1.0, _RNG), r"^k "),
    ("em-epsilon-zero", lambda: exponential_top_k([1], [0.0], 5, 1, 0.0, 1.0, _RNG), "epsilon_per_draw"),
    ("em-epsilon-negative", lambda: exponential_top_k([1], [0.0], 5, 1, -1.0, 1.0, _RNG), "epsilon_per_draw"),
    ("em-sensitivity-zero", lambda: exponential_top_k([1], [0.0], 5, 1, 1.0, 0.0, _RNG), "sensitivity"),
    ("em-num-rows-zero", lambda: exponential_top_k([], [], 0, 1, 1.0, 1.0, _RNG), "num_rows"),
    # report-noisy-max
    ("nm-duplicate-id", lambda: noisy_max_top_k([2, 2], [0.0, 1.0], 5, 1, 1.0, 1.0, _RNG), "touched_ids"),
    ("nm-id-too-large", lambda: noisy_max_top_k([7], [0.0], 5, 1, 1.0, 1.0, _RNG), "touched_ids"),
    ("nm-negative-id", lambda: noisy_max_top_k([-3], [0.0], 5, 1, 1.0, 1.0, _RNG), "touched_ids"),
    ("nm-nan-score", lambda: noisy_max_top_k([1], [NAN], 5, 1, 1.0, 1.0, _RNG), "scores"),
    ("nm-k-too-large", lambda: noisy_max_top_k([1], [0.0], 5, 6, 1.0, 1.0, _RNG), r"^k "),
    ("nm-k-zero", lambda: noisy_max_top_k([1], [0.0], 5, 0, 1.0, 1.0, _RNG), r"^k "),
    ("nm-epsilon-zero", lambda: noisy_max_top_k([1], [0.0], 5, 1, 0.0, 1.0, _RNG), "epsilon_per_draw"),
    ("nm-bad-noise", lambda: noisy_max_top_k([1], [0.0], 5, 1, 1.0, 1.0, _RNG, noise="normal"), "noise"),
    # NumericSparse
    ("svt-duplicate-id", lambda: numeric_sparse([1, 1], [0.0, 1.0], 5, 1.0, 2, 1.0, 1e-5, _S, _RNG), "touched_ids"),
    ("svt-id-too-large", lambda: numeric_sparse([5], [0.0], 5, 1.0, 2, 1.0, 1e-5, _S, _RNG), "touched_ids"),
    ("svt-negative-id", lambda: numeric_sparse([-1], [0.0], 5, 1.0, 2, 1.0, 1e-5, _S, _RNG), "touched_ids"),
    ("svt-nan-value", lambda: numeric_sparse([1], [NAN], 5, 1.0, 2, 1.0, 1e-5, _S, _RNG), "values"),
    ("svt-c-too-large", lambda: numeric_sparse([1], [0.0], 5, 1.0, 6, 1.0, 1e-5, _S, _RNG), "max_answers"),
    ("svt-c-zero", lambda: numeric_sparse([1], [0.0], 5, 1.0, 0, 1.0, 1e-5, _S, _RNG), "max_answers"),
    ("svt-epsilon-zero", lambda: numeric_sparse([1], [0.0], 5, 1.0, 2, 0.0, 1e-5, _S, _RNG), "epsilon"),
    ("svt-epsilon-negative", lambda: numeric_sparse([1], [0.0], 5, 1.0, 2, -2.0, 1e-5, _S, _RNG), "epsilon"),
    ("svt-delta-one", lambda: numeric_sparse([1], [0.0], 5, 1.0, 2, 1.0, 1.0, _S, _RNG), "delta"),
    ("svt-nan-threshold", lambda: numeric_sparse([1], [0.0], 5, NAN, 2, 1.0, 1e-5, _S, _RNG), "threshold"),
    # Gaussian thresholding
    ("thr-duplicate-id", lambda: gaussian_threshold([3, 3], [1.0, 1.0], 5, 1.0, 1.0, 1.0, _RNG), "touched_ids"),
    ("thr-id-too-large", lambda: gaussian_threshold([5], [1.0], 5, 1.0, 1.0, 1.0, _RNG), "touched_ids"),
    ("thr-negative-id", lambda: gaussian_threshold([-1], [1.0], 5, 1.0, 1.0, 1.0, _RNG), "touched_ids"),
    ("thr-nan-count", lambda: gaussian_threshold([1], [NAN], 5, 1.0, 1.0, 1.0, _RNG), "counts"),
    ("thr-sigma-zero", lambda: gaussian_threshold([1], [1.0], 5, 1.0, 0.0, 1.0, _RNG), "noise_multiplier"),
    ("thr-clip-negative", lambda: gaussian_threshold([1], [1.0], 5, 1.0, 1.0, -1.0, _RNG), "clip_norm"),
    ("thr-nan-threshold", lambda: gaussian_threshold([1], [1.0], 5, NAN, 1.0, 1.0, _RNG), "threshold"),
    # DP-FEST
    ("fest-id-too-large", lambda: fest_top_k([0, 2], [1, 5], 5, 1, 1.0, 2, _RNG), "ids"),
    ("fest-negative-id", lambda: fest_top_k([0, 2], [1, -1], 5, 1, 1.0, 2, _RNG), "ids"),
    ("fest-k-too-large", lambda: fest_top_k([0, 2], [1, 2], 5, 6, 1.0, 2, _RNG), r"^k "),
    ("fest-k-zero", lambda: fest_top_k([0, 2], [1, 2], 5, 0, 1.0, 2, _RNG), r"^k "),
    ("fest-sigma-zero", lambda: fest_top_k([0, 2], [1, 2], 5, 1, 0.0, 2, _RNG), "noise_multiplier"),
    ("fest-L-zero", lambda: fest_top_k([0, 2], [1, 2], 5, 1, 1.0, 0, _RNG), "max_rows_per_example"),
    # random
    ("random-k-too-large", lambda: random_rows(5, 6, _RNG), r"^k "),
    ("random-k-zero", lambda: random_rows(5, 0, _RNG), r"^k "),
    ("random-num-rows-zero", lambda: random_rows(0, 1, _RNG), "num_rows"),
]


@pytest.mark.parametrize("call,match", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_value_error_naming_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()
