"""User-level privacy (privacy.unit = "user"): the engine's per-unit step against the slow
reference, the unit sampler, and the pieces that must count units instead of examples.

Specification: with `example_units` the neighbouring relation is add/remove one unit with all
its examples. A unit's gradient is the sum of its step examples' gradients over every
embedding row and dense parameter, clipped as one vector to S1 (tests/reference_alg3.py sums
whole-table autograd gradients per unit); count selectors count a unit's distinct rows once
with one weight; DP-FEST counts a unit's first L distinct rows. Every one of those is checked
here against the reference, and a mutant that clips per example while claiming user level
must fail the same comparison.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_fixtures import ListSampler, engine_params, make_engine, wide_ctr, with_examples
from reference_alg3 import ReferenceAlg3
from widedp.trainer.data.sampler import UnitPoissonSampler, unit_indices
from widedp.trainer.engine.trainer_role import TrainerRole, UnitSample, rows_by_unit

SEED = 5
LR, DENSE_LR, DIM, INIT_STD = 0.1, 0.05, 4, 0.3
Q = 0.35
CLIP = 0.7  # S1: binds for some units and not others (asserted)
S2 = 0.02

# The crafted example of tests/test_engine.py: repeats a row inside a bag and reaches row 16 of
# t1 through two features; here its unit also holds examples that touch the same rows.
CRAFTED = ({"f0": [2, 2, 5], "f1": [16, 16, 3], "f2": [16, 9], "f3": [1, 1]}, [0.5, -1.0, 2.0], 1.0)

PLANS = {
    "threshold": dict(threshold=1.0, selection_sigma=0.5, contribution_clip=1.0),
    "fest-threshold": dict(threshold=1.0, selection_sigma=0.5, k=3, fest_max_rows_per_example=4),
    "em": dict(selection_epsilon=20.0),
    "em-count": dict(selection_epsilon=4.0),
}


def dataset_and_units(seed=0):
    """49 examples in 18 units of sizes 1..6 (the crafted example shares unit 0 with examples
    that hit its rows), dense unit ids in a shuffled order (units are not contiguous)."""
    ds = with_examples(wide_ctr(n=48, seed=seed), [CRAFTED])
    n = len(ds)
    rng = np.random.default_rng(seed + 1)
    sizes = [3, 1, 6, 2, 4, 1, 5, 2, 3, 1, 4, 2, 3, 1, 5, 2, 3]
    labels = np.repeat(np.arange(len(sizes)), sizes)[: n - 1]
    labels = np.concatenate([labels, np.full(n - 1 - labels.size, len(sizes))])
    rng.shuffle(labels)
    units = np.concatenate([labels, [labels[0]]])  # the crafted example joins example 0's unit
    return ds, unit_indices(units)[0]


def unit_batches(units, steps, seed=11, cap=None):
    """Per step: each unit with probability Q, all its examples (at most `cap`, the first ones)."""
    rng = np.random.default_rng(seed)
    U = int(units.max()) + 1
    out = []
    for step in range(steps):
        chosen = np.flatnonzero(rng.random(U) < Q)
        if step == 0:
            chosen = np.union1d(chosen, [units[-1]])  # the crafted example's unit
        idx = [np.flatnonzero(units == u)[:cap] for u in chosen]
        out.append(np.sort(np.concatenate(idx)).astype(np.int64))
    return out


def build(ds, units, batches, mode, selection, *, num_shards=1, num_trainers=1, selection_on_shards=False,
          second_clip=None, example_units="given"):
    overrides = None if mode == "nonprivate" else {"clip_norm": CLIP, **PLANS.get(selection, {})}
    return make_engine(ds, num_shards=num_shards, mode=mode, selection=selection, q=Q, seed=SEED, dim=DIM,
                       lr=LR, dense_lr=DENSE_LR, init_std=INIT_STD, sampler=ListSampler(batches),
                       second_clip=second_clip, num_trainers=num_trainers, selection_on_shards=selection_on_shards,
                       plan_overrides=overrides, example_units=units if example_units == "given" else example_units)


def max_difference(got, want) -> float:
    worst = 0.0
    for part_got, part_want in zip(got, want):
        assert part_got.keys() == part_want.keys()
        for name in part_want:
            worst = max(worst, float((part_got[name].double() - part_want[name].double()).abs().max()))
    return worst


def run_both(mode, selection, **kw):
    ds, units = dataset_and_units()
    batches = unit_batches(units, 4)
    engine = build(ds, units, batches, mode, selection, **kw)
    ref = ReferenceAlg3(ds, engine.model, mode=mode, plan=engine.plan, expected_batch_size=engine.b, lr=LR,
                        dense_lr=DENSE_LR, seed=SEED, dim=DIM, init_std=INIT_STD, dense_tables=engine.dense_tables,
                        example_units=units)
    if engine.needs_one_time_selection():
        engine.prepare_fest(ds.feature_rows)
        ref.prepare_fest()
        assert np.array_equal(engine.fixed_rows, ref.fixed_rows)
    stats, infos = [], []
    for idx in batches:
        stats.append(engine.step())
        infos.append(ref.step(idx))
    return engine, ref, stats, infos, batches


CASES = [("sparse", "threshold", 1, 1), ("sparse", "threshold", 3, 2), ("sparse", "em", 2, 1),
         ("sparse", "em-count", 1, 2), ("sparse", "fest-threshold", 2, 1), ("dpsgd", None, 3, 2),
         ("nonprivate", None, 2, 2)]


@pytest.mark.parametrize("mode,selection,num_shards,num_trainers", CASES,
                         ids=[f"{m}-{s}-S{n}-N{t}" for m, s, n, t in CASES])
def test_user_level_engine_matches_the_per_unit_reference(mode, selection, num_shards, num_trainers):
    """Every shard/trainer split takes the reference's user-level step: per-unit norms over
    embeddings + dense part, per-unit clip, per-unit counts (and DP-FEST's per-unit counts)."""
    engine, ref, stats, infos, batches = run_both(mode, selection or "em", num_shards=num_shards,
                                                  num_trainers=num_trainers,
                                                  second_clip=S2 if mode == "dpsgd" else None)
    assert max_difference(engine_params(engine), ref.state()) < 1e-5
    for st, info, idx in zip(stats, infos, batches):
        assert st.batch_size == idx.size and st.rows_touched == info["touched"].size
        assert st.loss == pytest.approx(np.mean(info["losses"]), rel=1e-5)
    if mode != "nonprivate":  # the clip bound some units and not others, and units had several examples
        factors = np.concatenate([i["factors"] for i in infos])
        assert 0 < np.mean(factors < 1) < 1
        assert sum(len(i["factors"]) for i in infos) < sum(b.size for b in batches)


def _unit_shard_selection_reference(engine, ref, idx):
    """The selection on the shards at user level, the obvious way: each unit's set of distinct
    sparse rows over its examples, weight min(1, C1/√|set|), counts per row over the units,
    thresholded per shard with that shard's stream."""
    from widedp.selection.threshold import gaussian_threshold

    params, layout = engine.private_plan.selection_params, engine.layout
    counts: dict[int, float] = {}
    for group in ref.groups(idx):
        rows = {r for r in ref.group_global_rows(group) if r in ref.candidate_index}
        for r in rows:
            counts[r] = counts.get(r, 0.0) + min(1.0, params.contribution_clip / np.sqrt(len(rows)))
    parts = []
    for s in range(layout.num_shards):
        own = np.array([engine.table_offsets[t] + r for t, spec in enumerate(layout.tables)
                        if t not in engine.dense_tables for r in range(*layout.row_range(spec, s))], dtype=np.int64)
        mine = sorted(r for r in counts if r in set(own.tolist()))
        rng = engine.shard_selection_key.generator(engine.step_count, s)
        if own.size:
            local = gaussian_threshold(np.searchsorted(own, mine).astype(np.int64), np.array([counts[r] for r in mine]),
                                       own.size, params.threshold, params.noise_multiplier, params.contribution_clip,
                                       rng).ids
            parts.append(own[local])
    ids = np.sort(np.concatenate(parts))
    if engine.fixed_rows is not None:
        ids = np.union1d(ids, engine.sparse_vocabulary.to_global(engine.fixed_rows))
    return ids


@pytest.mark.parametrize("selection,num_trainers,num_shards", [("threshold", 2, 3), ("threshold", 1, 2),
                                                               ("fest-threshold", 1, 2)])
def test_selection_on_the_shards_counts_each_units_distinct_rows_once(selection, num_trainers, num_shards,
                                                                      monkeypatch):
    ds, units = dataset_and_units()
    batches = unit_batches(units, 4)
    engine = build(ds, units, batches, "sparse", selection, num_shards=num_shards, num_trainers=num_trainers,
                   selection_on_shards=True)
    ref = ReferenceAlg3(ds, engine.model, mode="sparse", plan=engine.plan, expected_batch_size=engine.b, lr=LR,
                        dense_lr=DENSE_LR, seed=SEED, dim=DIM, init_std=INIT_STD, example_units=units)
    if engine.needs_one_time_selection():
        engine.prepare_fest(ds.feature_rows)
    seen = []
    real = engine.selection.select_on_shards
    monkeypatch.setattr(engine.selection, "select_on_shards", lambda parts=None: seen.append(real(parts)) or seen[-1])
    for idx in batches:
        want = _unit_shard_selection_reference(engine, ref, idx)
        assert engine.step() is not None
        assert np.array_equal(seen[-1].ids, want)
    assert len(seen) == len(batches) and any(s.ids.size for s in seen)


def test_one_example_per_unit_is_the_example_level_step_exactly():
    ds, _ = dataset_and_units()
    singletons = np.arange(len(ds))
    batches = unit_batches(singletons, 3)
    results = []
    for units in (singletons, None):
        engine = build(ds, units, batches, "sparse", "threshold", num_shards=2, selection_on_shards=True)
        for _ in batches:
            engine.step()
        results.append(engine_params(engine))
    assert max_difference(*results) < 1e-6


def _clip_per_example(monkeypatch):
    """The broken variant: claims user level (units given, n = users) but clips each example."""
    begin = TrainerRole.begin_part

    def per_example_begin(self, idx, dense_state=None, candidates=None, releases=None):
        if isinstance(idx, UnitSample):
            idx = idx.examples
        return begin(self, idx, dense_state, candidates, releases)

    monkeypatch.setattr(TrainerRole, "begin_part", per_example_begin)


def test_the_reference_comparison_catches_per_example_clipping_at_user_level(monkeypatch):
    _clip_per_example(monkeypatch)
    engine, ref, *_ = run_both("dpsgd", "em", num_shards=2)
    assert max_difference(engine_params(engine), ref.state()) > 1e-3


# ---- the pieces ----------------------------------------------------------------------------------

def test_rows_by_unit_concatenates_each_units_examples_rows_in_example_order():
    offsets, ids = np.array([0, 2, 3, 3, 6]), np.array([5, 1, 7, 1, 2, 9])
    units = np.array([1, 0, 1, 0])
    got_offsets, got_ids = rows_by_unit(offsets, ids, units, 3)
    assert got_offsets.tolist() == [0, 4, 6, 6]  # unit 0: examples 1 and 3; unit 1: examples 0 and 2
    assert got_ids.tolist() == [7, 1, 2, 9, 5, 1]


def test_unit_indices_number_units_densely():
    index, count = unit_indices(np.array([90, -4, 90, 7]))
    assert count == 3 and index.tolist() == [2, 0, 2, 1]
    with pytest.raises(ValueError, match="1-D"):
        unit_indices(np.zeros((2, 2)))


def test_unit_sampler_caps_each_unit_and_samples_units_not_examples():
    """Units enter independently at rate q whatever their size (a binomial check per size
    class), a sampled unit keeps min(size, k) examples, every subset of a heavy unit is
    possible, and the stream is resumable."""
    sizes = np.array([1] * 300 + [50] * 300)
    units = np.repeat(np.arange(sizes.size), sizes)
    q, k, steps = 0.1, 4, 400
    sampler = UnitPoissonSampler(units, q, k, seed=7)
    light = heavy = 0
    seen_heavy_examples = set()
    for _ in range(steps):
        idx = sampler.sample()
        assert np.all(np.diff(idx) > 0)
        u, per_unit = np.unique(sampler.units_of(idx), return_counts=True)
        assert np.all(per_unit == np.minimum(sizes[u], k))
        light += int((sizes[u] == 1).sum())
        heavy += int((sizes[u] == 50).sum())
        seen_heavy_examples.update(idx[units[idx] == 300].tolist())
    expected, sd = 300 * steps * q, np.sqrt(300 * steps * q * (1 - q))
    assert abs(light - expected) < 5 * sd and abs(heavy - expected) < 5 * sd
    assert len(seen_heavy_examples) > 30  # ~40 draws of 4 from unit 300's 50: not a fixed subset
    state = sampler.state_dict()
    again = UnitPoissonSampler(units, q, k, seed=0)
    again.load_state_dict(state)
    assert np.array_equal(again.sample(), sampler.sample())
    with pytest.raises(ValueError, match="max_examples_per_unit"):
        UnitPoissonSampler(units, q, 0, seed=0)
    with pytest.raises(ValueError, match="sampler state"):
        UnitPoissonSampler(units, q, k + 1, seed=0).load_state_dict(state)


# ---- user level by example sampling (privacy.user_sampling = "examples") -----------------------------

def test_trimming_keeps_at_most_k_random_examples_of_each_unit():
    from widedp.trainer.data.sampler import trimmed_positions

    units = np.repeat(np.arange(4), [1, 3, 10, 2])
    seen = set()
    for seed in range(30):
        kept = trimmed_positions(units, 3, np.random.default_rng(seed))
        assert np.all(np.diff(kept) > 0)
        assert np.bincount(units[kept], minlength=4).tolist() == [1, 3, 3, 2]
        seen.update(kept[units[kept] == 2].tolist())
    assert seen == set(np.flatnonzero(units == 2).tolist())  # every example of the big unit can be kept


def test_a_subset_split_is_the_base_split_at_its_positions():
    from widedp.trainer.data.format.dataset import SplitSubset

    ds, units = dataset_and_units()

    class WithUnits:  # the engine fixture's data set has no unit column
        def __init__(self, base):
            self.base, self.meta = base, base.meta

        def __len__(self):
            return len(self.base)

        def take(self, idx):
            return self.base.take(idx)

        def feature_rows(self, feature):
            return self.base.feature_rows(feature)

        def units(self):
            return units

    positions = np.array([0, 3, 4, 17, 48])
    sub = SplitSubset(WithUnits(ds), positions)
    assert len(sub) == 5
    a, b = sub.take(np.array([3, 1])), ds.take(positions[[3, 1]])
    assert torch.equal(a.sparse.values(), b.sparse.values()) and torch.equal(a.dense, b.dense)
    assert a.indices.tolist() == [3, 1]
    offsets, ids = sub.feature_rows("f1")
    full_offsets, full_ids = ds.feature_rows("f1")
    assert ids.tolist() == [i for p in positions for i in full_ids[full_offsets[p]:full_offsets[p + 1]].tolist()]
    assert np.array_equal(sub.units(), units[positions])
    with pytest.raises(ValueError, match="sorted distinct"):
        SplitSubset(ds, np.array([3, 3]))


def test_group_accounting_charges_group_events_and_takes_the_example_level_steps():
    from widedp.accounting import events as ev

    ds, _ = dataset_and_units()
    batches = unit_batches(np.arange(len(ds)), 3)
    engines = []
    for group in (1, 3):
        engine = make_engine(ds, num_shards=2, mode="sparse", selection="threshold", q=Q, seed=SEED, dim=DIM, lr=LR,
                             dense_lr=DENSE_LR, init_std=INIT_STD, sampler=ListSampler(batches), group_size=group,
                             accountant="pld",
                             plan_overrides={"clip_norm": CLIP, **PLANS["threshold"]})
        for _ in batches:
            engine.step()
        engines.append(engine)
    assert max_difference(engine_params(engines[0]), engine_params(engines[1])) == 0.0
    plain, grouped = (e.ledger.history for e in engines)
    assert [(ev.grouped(e, 3), c) for e, c in plain] == grouped
    assert engines[1].ledger.epsilon() > engines[0].ledger.epsilon()
    with pytest.raises(ValueError, match="group_size"):
        make_engine(ds, mode="dpsgd", example_units=np.arange(len(ds)), group_size=2, sampler=ListSampler(batches))
