"""Exponential-mechanism top-k selected on the shards and merged (selection/partitioned.py).

- distribution: on a tiny vocabulary split into shards, the frequencies of every k-subset from
  the shard path (each shard's `gumbel_top_k_candidates` with its own stream, mapped to global
  ids, `merge_top_k`) and from `exponential_top_k` (the one-process reference) fit the exact
  peeling probabilities (enumerated), chi-square p > ALPHA with fixed seeds; deliberately broken
  variants (top ⌈k/S⌉ per shard, touched rows only, untouched ids not in random order) are
  rejected by the same test at p < REJECT;
- exactness, deterministic: the shards' top-min(k, p_s) of one noise vector merge to its global
  top-k; a shard given the same Gumbels as the global computation returns its top of them;
- the registered selectors: which statistic each declares, `em` / `em-count` shard_select +
  merge round trip (event = event(params)); with one shard over the whole vocabulary and the
  same stream the shard path is `select`, draw by draw; `merge_top_k`'s errors;
- privacy: the shard path of the registered `em` on neighbouring utilities passes the audit of
  tests/test_privacy_selectors.py (§1, k = 1), and a shard scale twice too large is caught.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import pickle

import numpy as np
import pytest
from scipy import stats

from widedp.accounting.events import ExponentialTopKDpEvent
from privacy_audit import epsilon_lower_bound, run_trials
from widedp.selection import exponential_top_k
from widedp.selection.exponential import exponential_scale
from widedp.selection.partitioned import ShardCandidates, gumbel_top_k_candidates, merge_top_k
from widedp.selection.registry import SelectionContext, get_selector
from widedp.selection.selectors.em_count import example_counts
from widedp.selection.threshold import weighted_row_counts

ALPHA = 1e-4  # a correct implementation fails a goodness-of-fit test with probability <= ALPHA
REJECT = 1e-6  # a broken variant must be rejected below this
DRAWS = 8_000  # per path, unless a case says (the shard path: ~0.35 ms a draw; the file must stay fast)
BROKEN_DRAWS = 1_000  # the broken variants below are rejected with p-values < 1e-60 even so


def _streams(seed: int, n: int) -> list[np.random.Generator]:
    """n independent generators (one per shard)."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(n)]


# ------------------------------------------------------------------------------------------
# The exact distribution of peeling EM, and the shard path
# ------------------------------------------------------------------------------------------

def exact_subset_probabilities(u: np.ndarray, k: int, scale: float) -> dict[tuple[int, ...], float]:
    """P[selected set = S] for every k-subset S under k draws without replacement, each picking
    a remaining row r with probability ∝ exp(scale·u_r): the sum over the orders of S."""
    w = np.exp(scale * (u - u.max()))
    probs: dict[tuple[int, ...], float] = {}
    for order in itertools.permutations(range(u.size), k):
        prob, left = 1.0, w.sum()
        for r in order:
            prob *= w[r] / left
            left -= w[r]
        key = tuple(sorted(order))
        probs[key] = probs.get(key, 0.0) + prob
    return probs


def shard_path(sizes, touched, scores, k, scale, rngs, candidates=gumbel_top_k_candidates, merge=merge_top_k):
    """The protocol: shard s owns global rows [start_s, start_s + p_s), selects among them in
    local ids with its own stream, maps its candidates to global ids; the coordinator merges."""
    parts, start = [], 0
    for size, rng in zip(sizes, rngs):
        own = (touched >= start) & (touched < start + size)
        part = candidates(touched[own] - start, scores[own], size, k, scale, rng)
        parts.append(part.remap(part.ids + start))
        start += size
    return merge(parts, k)


def goodness_of_fit(draw, probs: dict, trials: int) -> tuple[float, np.ndarray]:
    """Chi-square p-value of the observed k-subset frequencies of `draw()` against `probs`
    (every cell's expected count is >= 5 in the cases below), and the observed labels."""
    index = {key: i for i, key in enumerate(sorted(probs))}
    labels = np.empty(trials, dtype=np.int64)
    for t in range(trials):
        ids = draw()
        assert ids.dtype == np.int64 and np.all(np.diff(ids) > 0)
        labels[t] = index[tuple(int(i) for i in ids)]
    expected = trials * np.array([probs[key] for key in sorted(probs)])
    assert expected.min() >= 5, expected.min()
    observed = np.bincount(labels, minlength=len(probs))
    return float(stats.chisquare(observed, expected).pvalue), labels


@dataclasses.dataclass(frozen=True)
class Case:
    sizes: tuple[int, ...]  # shard s owns the next sizes[s] global rows
    touched: tuple[int, ...]  # global ids
    scores: tuple[float, ...]
    k: int
    epsilon_per_draw: float = 2.0
    sensitivity: float = 1.0
    draws: int = DRAWS

    @property
    def p(self) -> int:
        return sum(self.sizes)

    def arrays(self):
        return np.array(self.touched, dtype=np.int64), np.array(self.scores, dtype=np.float64)

    def dense(self) -> np.ndarray:
        u = np.zeros(self.p)
        u[list(self.touched)] = self.scores
        return u

    @property
    def scale(self) -> float:
        return exponential_scale(self.epsilon_per_draw, self.sensitivity)


CASES = {
    # shard 0: rows 0 (touched), 1; shard 1: rows 2, 3 (touched, the favourite), 4 — its top-2
    # of 3 needs the untouched order statistics; shard 2: row 5 only (fewer rows than k).
    "mixed": Case(sizes=(2, 3, 1), touched=(0, 3, 5), scores=(1.0, 2.0, -0.5), k=2),
    # shard 0 has no touched row (its top-2 of 3 is all untouched: which ids get the larger
    # value must be random); shard 2 mixes one touched and one untouched row.
    "untouched-shard": Case(sizes=(3, 1, 2), touched=(3, 5), scores=(1.5, 0.5), k=2, draws=5_000),
}


def _shard_draw(case: Case, seed: int, **variant):
    touched, scores = case.arrays()
    rngs = _streams(seed, len(case.sizes))
    return lambda: shard_path(case.sizes, touched, scores, case.k, case.scale, rngs, **variant)


def test_exact_probabilities_are_a_distribution():
    u = CASES["mixed"].dense()
    probs = exact_subset_probabilities(u, 2, 1.0)
    assert len(probs) == math.comb(6, 2) and sum(probs.values()) == pytest.approx(1.0, abs=1e-12)
    # k = 1 is the softmax
    soft = exact_subset_probabilities(u, 1, 1.0)
    np.testing.assert_allclose([soft[(r,)] for r in range(6)], np.exp(u) / np.exp(u).sum(), rtol=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_shard_path_has_the_distribution_of_peeling_em(name):
    case = CASES[name]
    probs = exact_subset_probabilities(case.dense(), case.k, case.scale)
    shard_p, shard_labels = goodness_of_fit(_shard_draw(case, seed=11), probs, case.draws)
    assert shard_p > ALPHA, f"shard path: chi-square p = {shard_p:.3g}"
    if name != "mixed":
        return  # exponential_top_k itself: tests/test_selection_reference.py; once here as the anchor
    touched, scores = case.arrays()
    rng = np.random.default_rng(12)
    ref_p, ref_labels = goodness_of_fit(
        lambda: exponential_top_k(touched, scores, case.p, case.k, case.epsilon_per_draw, case.sensitivity, rng).ids,
        probs, case.draws)
    assert ref_p > ALPHA, f"exponential_top_k: chi-square p = {ref_p:.3g}"
    # and the two samples against each other
    table = np.array([np.bincount(shard_labels, minlength=len(probs)), np.bincount(ref_labels, minlength=len(probs))])
    assert stats.chi2_contingency(table, correction=False).pvalue > ALPHA


# ---- broken variants, caught by the same test ---------------------------------------------------

def _merge_top_per_shard(parts, k):
    """Broken: the coordinator keeps only the top ⌈k/S⌉ of each shard, then the top k of those."""
    per = math.ceil(k / len(parts))
    kept = []
    for part in parts:
        top = np.argsort(-part.noisy)[:per]
        kept.append(ShardCandidates(part.ids[top], part.noisy[top]))
    return merge_top_k(kept, k)


def _touched_only(touched, scores, num_rows, k, scale, rng):
    """Broken: a shard offers only its touched rows (untouched rows can never win)."""
    if touched.size == 0:
        return ShardCandidates(np.empty(0, np.int64), np.empty(0))
    inner = gumbel_top_k_candidates(np.arange(touched.size), scores, touched.size, k, scale, rng)
    return inner.remap(touched[inner.ids])


def _untouched_in_id_order(touched, scores, num_rows, k, scale, rng):
    """Broken: the untouched candidates' ids are a uniform subset, but the smallest id gets the
    largest value (not a random order): a prefix is no longer a uniform subset."""
    part = gumbel_top_k_candidates(touched, scores, num_rows, k, scale, rng)
    ids, noisy = part.ids.copy(), part.noisy
    untouched = np.flatnonzero(~np.isin(ids, touched))
    by_value = untouched[np.argsort(-noisy[untouched])]
    ids[by_value] = np.sort(ids[untouched])
    return ShardCandidates(ids, noisy)


BROKEN = {
    "top-ceil(k/S)-per-shard": ("mixed", dict(merge=_merge_top_per_shard)),
    "touched-rows-only": ("mixed", dict(candidates=_touched_only)),
    "untouched-ids-in-id-order": ("untouched-shard", dict(candidates=_untouched_in_id_order)),
}


@pytest.mark.parametrize("variant", BROKEN)
def test_goodness_of_fit_rejects_a_broken_shard_path(variant):
    name, kwargs = BROKEN[variant]
    case = CASES[name]
    probs = exact_subset_probabilities(case.dense(), case.k, case.scale)
    pvalue, _ = goodness_of_fit(_shard_draw(case, seed=11, **kwargs), probs, BROKEN_DRAWS)
    assert pvalue < REJECT, f"broken variant {variant} NOT detected: p = {pvalue:.3g}"


# ------------------------------------------------------------------------------------------
# Exactness, deterministic
# ------------------------------------------------------------------------------------------

def _random_sizes(rng, p, shards):
    cuts = np.sort(rng.choice(np.arange(1, p), size=shards - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [p]])).tolist()


@pytest.mark.parametrize("seed", range(5))
def test_merged_shard_top_k_is_the_global_top_k_of_the_same_noise(seed):
    """Whatever the noisy vector, the top-k of the union of each shard's top-min(k, p_s) is its
    global top-k (shards smaller than k included)."""
    rng = np.random.default_rng(seed)
    p = 40
    noisy = rng.standard_normal(p) * 3
    for shards in (1, 2, 3, 7):
        sizes = _random_sizes(rng, p, shards)
        for k in (1, 2, 5, 13, p):
            parts, start = [], 0
            for size in sizes:
                local = noisy[start:start + size]
                top = np.argsort(-local)[:min(k, size)]
                parts.append(ShardCandidates(top, local[top]).remap(top + start))
                start += size
            want = np.sort(np.argpartition(-noisy, k - 1)[:k])
            assert merge_top_k(parts, k).tolist() == want.tolist(), (sizes, k)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_shards_given_the_global_gumbels_merge_to_the_global_top_k(k):
    """Every row touched: each shard's noise is exactly its rng's `gumbel(p_s)`, so replaying
    the shards' streams gives the global noisy vector. Candidates = the shard's top-min(k, p_s)
    of it, with those values; merged = the global top-k (by argpartition)."""
    sizes = (4, 1, 5, 2)
    p = sum(sizes)
    u = np.random.default_rng(5).standard_normal(p)
    scale = 0.7
    seeds = np.random.SeedSequence(99).spawn(len(sizes))
    dense = np.concatenate([scale * u[s:s + n] + np.random.default_rng(seq).gumbel(size=n)
                            for s, n, seq in zip(np.cumsum((0,) + sizes[:-1]), sizes, seeds)])
    parts, start = [], 0
    for size, seq in zip(sizes, seeds):
        part = gumbel_top_k_candidates(np.arange(size), u[start:start + size], size, k, scale,
                                       np.random.default_rng(seq))
        assert len(part) == min(k, size)
        np.testing.assert_array_equal(part.noisy, dense[start + part.ids])
        top = np.argsort(-dense[start:start + size])[:min(k, size)]
        assert sorted(part.ids.tolist()) == sorted(top.tolist())
        parts.append(part.remap(part.ids + start))
        start += size
    assert merge_top_k(parts, k).tolist() == np.sort(np.argpartition(-dense, k - 1)[:k]).tolist()


def test_shard_candidates_hold_the_touched_noise_and_distinct_untouched_rows():
    """Mixed shard: the touched candidates carry scale·u + the stream's first Gumbels; the
    untouched ones are distinct untouched rows whose values are below no touched non-candidate."""
    touched, scores, num_rows, k, scale = np.array([2, 5, 9]), np.array([3.0, -1.0, 0.5]), 1000, 6, 1.3
    part = gumbel_top_k_candidates(touched, scores, num_rows, k, scale, np.random.default_rng(4))
    noisy_touched = scale * scores + np.random.default_rng(4).gumbel(size=3)
    assert len(part) == k and np.unique(part.ids).size == k and part.ids.min() >= 0 and part.ids.max() < num_rows
    is_touched = np.isin(part.ids, touched)
    for r, v in zip(part.ids[is_touched], part.noisy[is_touched]):
        assert v == noisy_touched[np.searchsorted(touched, r)]
    left_out = ~np.isin(touched, part.ids)
    assert np.all(part.noisy.min() >= noisy_touched[left_out])
    # k beyond the shard's rows: all of them
    assert sorted(gumbel_top_k_candidates(touched, scores, 12, 50, scale, np.random.default_rng(0)).ids) == list(range(12))


# ------------------------------------------------------------------------------------------
# The registered selectors
# ------------------------------------------------------------------------------------------

def test_statistic_each_selector_declares():
    declared = {name: get_selector(name).shard_statistic for name in
                ("em", "em-count", "threshold", "fest-threshold", "noisy-max", "noisy-max-count", "svt", "random", "fest")}
    assert declared == {"em": "norms", "em-count": "example_counts", "threshold": "counts", "fest-threshold": "counts",
                        "noisy-max": None, "noisy-max-count": None, "svt": None, "random": None, "fest": None}
    for name in ("noisy-max", "noisy-max-count"):  # Laplace peeling stays on the coordinator
        params = get_selector(name).Params(epsilon_per_draw=1.0, k=2)
        with pytest.raises(NotImplementedError, match="does not run on the shards"):
            get_selector(name).shard_select(np.array([0]), np.array([1.0]), 5, params, np.random.default_rng(0))
        with pytest.raises(NotImplementedError, match="does not run on the shards"):
            get_selector(name).merge([], params, None)


def _context(seed: int, num_rows: int = 60):
    rng = np.random.default_rng(seed)
    offsets = np.array([0, 4, 6, 11, 12], dtype=np.int64)
    ids = rng.integers(0, num_rows, size=12).astype(np.int64)
    touched = np.unique(ids)
    return SelectionContext(num_rows=num_rows, touched_ids=touched, row_norms=rng.random(touched.size) * 0.3,
                            clip_norm=1.0, expected_batch_size=4.0, example_rows=lambda: (offsets, ids))


def _statistic(name: str, context: SelectionContext):
    """(touched global ids, the statistic the selector declares) over the whole vocabulary."""
    if name == "em":
        return context.touched_ids, context.row_norms
    return example_counts(context)


def _on_shards(name, context, params, sizes, seed):
    selector = get_selector(name)
    rows, stat = _statistic(name, context)
    parts, start = [], 0
    for size, rng in zip(sizes, _streams(seed, len(sizes))):
        own = (rows >= start) & (rows < start + size)
        part = selector.shard_select(rows[own] - start, stat[own], size, params, rng, clip_norm=context.clip_norm,
                                     expected_batch_size=context.expected_batch_size)
        assert isinstance(part, ShardCandidates) and len(part) == min(params.k, size)
        parts.append(part.remap(part.ids + start))
        start += size
    return selector.merge(parts, params, None)


PARAMS = {"em": dict(epsilon_per_draw=0.8, k=5, score_clip=0.2), "em-count": dict(epsilon_per_draw=0.8, k=5)}


@pytest.mark.parametrize("name", PARAMS)
def test_shard_select_and_merge_round_trip(name):
    selector = get_selector(name)
    params = selector.Params(**PARAMS[name])
    for seed in range(3):
        got = _on_shards(name, _context(seed), params, (20, 3, 37), seed)
        assert got.event == selector.event(params) == ExponentialTopKDpEvent(epsilon_per_draw=0.8, k=5)
        assert got.ids.dtype == np.int64 and got.ids.size == 5 and np.all(np.diff(got.ids) > 0)
        assert got.ids.min() >= 0 and got.ids.max() < 60


@pytest.mark.parametrize("name", PARAMS)
def test_one_shard_over_the_whole_vocabulary_is_select_draw_by_draw(name):
    """Same utilities, same sensitivity, same scale, same use of the stream as `select`."""
    selector = get_selector(name)
    params = selector.Params(**PARAMS[name])
    for seed in range(5):
        context = _context(seed)
        want = selector.select(context, params, np.random.default_rng(seed))
        rows, stat = _statistic(name, context)
        part = selector.shard_select(rows, stat, 60, params, np.random.default_rng(seed), clip_norm=1.0,
                                     expected_batch_size=4.0)
        got = selector.merge([part], params, None)
        assert got.ids.tolist() == want.ids.tolist() and got.event == want.event


def test_em_on_the_shards_needs_clip_norm_and_batch_size():
    em = get_selector("em")
    params = em.Params(**PARAMS["em"])
    with pytest.raises(ValueError, match=r"needs clip_norm and expected_batch_size .*min\(S1/b, S0\)"):
        em.shard_select(np.array([1]), np.array([0.1]), 10, params, np.random.default_rng(0))
    with pytest.raises(ValueError, match="expected_batch_size must be finite and > 0"):
        em.shard_select(np.array([1]), np.array([0.1]), 10, params, np.random.default_rng(0), clip_norm=1.0,
                        expected_batch_size=0.0)
    # em-count's sensitivity is 1 whatever S1 and b
    count = get_selector("em-count")
    part = count.shard_select(np.array([1]), np.array([3.0]), 10, count.Params(**PARAMS["em-count"]),
                              np.random.default_rng(0))
    assert len(part) == 5


def test_example_counts_of_row_blocks_are_the_blocks_of_em_counts_utility():
    """"example_counts" on a shard: unit weight per distinct (example, row) pair of its rows."""
    context = _context(3)
    offsets, ids = context.example_rows()  # type: ignore[misc]
    rows, counts = example_counts(context)
    example = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    for lo, hi in ((0, 20), (20, 23), (23, 60)):
        mine = (ids >= lo) & (ids < hi)
        got_rows, got = weighted_row_counts(example[mine], ids[mine], np.ones(offsets.size - 1))
        block = (rows >= lo) & (rows < hi)
        assert got_rows.tolist() == rows[block].tolist() and got.tolist() == counts[block].tolist()


def test_threshold_shard_select_ignores_the_new_keywords():
    threshold = get_selector("threshold")
    params = threshold.Params(noise_multiplier=1.0, threshold=1.5)
    args = (np.array([0, 3]), np.array([2.0, 1.0]), 50, params)
    plain = threshold.shard_select(*args, np.random.default_rng(1))
    keyed = threshold.shard_select(*args, np.random.default_rng(1), clip_norm=1.0, expected_batch_size=8.0)
    assert plain.tolist() == keyed.tolist()


def test_merge_top_k_errors_are_clear():
    a = ShardCandidates(np.array([0, 1]), np.array([0.5, 2.0]))
    b = ShardCandidates(np.array([7]), np.array([1.0]))
    assert merge_top_k([a, b], 2).tolist() == [1, 7]
    assert merge_top_k([a, b], 3).tolist() == [0, 1, 7]
    with pytest.raises(ValueError, match=r"returned 3 candidates in total, fewer than k=4: each shard must return its top min\(k"):
        merge_top_k([a, b], 4)
    with pytest.raises(ValueError, match="returned 0 candidates"):
        merge_top_k([], 1)
    with pytest.raises(ValueError, match=r"row 1 is a candidate of more than one shard.*ShardCandidates.remap"):
        merge_top_k([a, b.remap([1])], 2)
    with pytest.raises(TypeError, match=r"parts\[1\] is a ndarray, not ShardCandidates"):
        merge_top_k([a, np.array([3])], 1)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="k must be an integer"):
        merge_top_k([a], 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ShardCandidates.noisy has shape"):
        ShardCandidates(np.array([0, 1]), np.array([1.0]))
    with pytest.raises(ValueError, match="contains a row more than once"):
        ShardCandidates(np.array([3, 3]), np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="ShardCandidates.noisy has shape"):
        a.remap([4])
    assert a.remap([5, 6]).ids.tolist() == [5, 6] and a.ids.tolist() == [0, 1]  # a copy
    back = pickle.loads(pickle.dumps(a))  # what a shard actor sends the coordinator
    assert back.ids.tolist() == [0, 1] and back.noisy.tolist() == [0.5, 2.0]


# ------------------------------------------------------------------------------------------
# Privacy: the shard path of the registered `em` (tests/test_privacy_selectors.py §1 style)
# ------------------------------------------------------------------------------------------
# Contract-level neighbours (ℓ∞ distance Δ on the utilities min(‖G_r‖, S0), Δ = min(S1/b, S0)):
# D: row 0 has ‖G_0‖ = S1/b ≥ S0 (utility Δ = S0), rows 1..7 untouched; D': row 0 untouched,
# rows 1..7 at ‖G_r‖ = S1/b (utility Δ). Rows 0-2 on shard 0, 3-7 on shard 1. k = 1, so the
# claimed ε is k·ε'' = ε''. Event {row 0 selected}: the exact log-ratio is 1.72 for ε'' = 2
# (expected eps_lb ≈ 1.2 at 3,000 trials); a shard scale twice too large (ε''/Δ: the 2 of
# ε''/(2Δ) forgotten) has log-ratio 3.30 (expected eps_lb ≈ 2.6 > 2).

AUDIT_TRIALS, AUDIT_EPS, AUDIT_SIZES = 3_000, 2.0, (3, 5)
AUDIT_PARAMS = dict(epsilon_per_draw=AUDIT_EPS, k=1, score_clip=0.1)
AUDIT_S1, AUDIT_B = 1.0, 4.0  # S1/b = 0.25 > S0: Δ = 0.1


def _audit_em_on_shards(scale_factor: float, seed: int):
    em = get_selector("em")
    params = em.Params(**AUDIT_PARAMS)
    shard_params = em.Params(**{**AUDIT_PARAMS, "epsilon_per_draw": AUDIT_EPS * scale_factor})
    norm = AUDIT_S1 / AUDIT_B

    def mechanism(touched, rngs):
        def run():
            parts, start = [], 0
            for size, rng in zip(AUDIT_SIZES, rngs):
                own = (touched >= start) & (touched < start + size)
                part = em.shard_select(touched[own] - start, np.full(int(own.sum()), norm), size, shard_params, rng,
                                       clip_norm=AUDIT_S1, expected_batch_size=AUDIT_B)
                parts.append(part.remap(part.ids + start))
                start += size
            sel = em.merge(parts, params, None)
            assert sel.event == ExponentialTopKDpEvent(epsilon_per_draw=AUDIT_EPS, k=1)  # what the run records
            return sel
        return run

    on_d = run_trials(mechanism(np.array([0]), _streams(seed, 2)), lambda s: s.ids.tolist() == [0], AUDIT_TRIALS)
    on_dp = run_trials(mechanism(np.arange(1, 8), _streams(seed + 1, 2)), lambda s: s.ids.tolist() == [0],
                       AUDIT_TRIALS)
    return epsilon_lower_bound(on_d, on_dp, delta=0.0)


def test_em_on_the_shards_passes_the_privacy_audit():
    result = _audit_em_on_shards(1.0, seed=808)
    print(f"\n[privacy audit] em on the shards k=1 real: claimed eps={AUDIT_EPS}  {result}")
    assert result.eps_lb <= AUDIT_EPS, str(result)
    assert result.eps_lb > 0.5 * AUDIT_EPS, f"audit no longer near-tight (~1.2 expected): {result}"


def test_em_on_the_shards_with_twice_the_scale_is_caught():
    result = _audit_em_on_shards(2.0, seed=808)
    print(f"\n[privacy audit] em on the shards k=1 broken (scale doubled): claimed eps={AUDIT_EPS}  {result}")
    assert result.eps_lb > AUDIT_EPS, str(result)
