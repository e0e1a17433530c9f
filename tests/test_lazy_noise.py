"""Lazy DP-SGD noise (train.dpsgd_noise, trainer/engine/shard_update.py): a row's noise of the
steps it is not read in arrives in one draw when it is next read or released.

- the point-addressed generator it draws from (`interval_normals`): a function of the key and
  the point alone, N(0, 1), its arguments checked;
- the statistical test: over many secret keys, what the lazy shard's lookups read, what its
  released tables hold, and what moved between a read and the release agree in distribution
  with the eager shard's (two-sample KS per statistic), and three broken variants are caught —
  a release without the pending noise, the pending noise drawn with one step's variance
  whatever the number of steps pending, and reads whose noise the write-back does not store;
- no row is ever read or released with noise missing (an engine run, instrumented);
- the engine over 1 and 3 shards gives the same values (the addressing is layout-free), and the
  config resolves "auto" to lazy exactly where it is exact and refuses "lazy" elsewhere.
Ray (actors, trainer actors, a lost shard replayed): tests/test_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from widedp.selection.keyed_random import NoiseKey, interval_normals
from widedp.trainer.config import ConfigError, lazy_dpsgd_noise, load_config
from widedp.trainer.engine.layout import FeatureSpec, ShardInput, ShardLayout, TableSpec
from widedp.trainer.engine.shard import EmbeddingShard
from widedp.trainer.engine.shard_update import ShardUpdates

from engine_fixtures import engine_params, make_engine, wide_ctr


# ---- the generator ----------------------------------------------------------------------------------
@pytest.mark.parametrize("secure", [False, True], ids=["aes128", "aes256-4draw"])
def test_interval_normals_are_a_function_of_the_key_and_the_point_alone(secure):
    key = NoiseKey(0x1234_5678_9ABC_DEF0_1122_3344_5566_7788, secure)
    rows, starts, ends = np.arange(50, 90), np.arange(40) % 7, np.arange(40) % 7 + 1 + np.arange(40) % 3
    whole = interval_normals(key, rows, starts, ends, 5)
    assert whole.shape == (40, 5) and whole.dtype == torch.float32
    order = np.random.default_rng(0).permutation(40)[:13]
    torch.testing.assert_close(interval_normals(key, rows[order], starts[order], ends[order], 5), whole[order],
                               rtol=0, atol=0)  # however many other points are drawn with it
    moved = interval_normals(key, rows, starts, ends + 1, 5)
    assert not torch.isclose(moved, whole).any(dim=1).all()  # another interval: other values
    other = interval_normals(NoiseKey(key.key ^ 1, secure), rows, starts, ends, 5)
    assert not torch.equal(other, whole)


@pytest.mark.parametrize("secure", [False, True], ids=["aes128", "aes256-4draw"])
def test_interval_normals_are_standard_normal_and_independent_across_points(secure):
    key = NoiseKey(987654321987654321, secure)
    n = 20_000
    z = interval_normals(key, np.arange(n), np.zeros(n), np.full(n, 5), 11).double().numpy()  # several AES blocks a point
    for c in range(11):
        assert stats.kstest(z[:, c], "norm").pvalue > 1e-5
    assert np.abs(np.corrcoef(z.T)[np.triu_indices(11, 1)]).max() < 0.05  # the point's coordinates independent
    neighbours = interval_normals(key, np.arange(n), np.zeros(n), np.full(n, 6), 3).double().numpy()
    assert abs(np.corrcoef(z[:, 0], neighbours[:, 0])[0, 1]) < 0.05  # (r, 0, 5) and (r, 0, 6): independent
    assert abs(np.corrcoef(z[:-1, 0], z[1:, 0])[0, 1]) < 0.05


def test_interval_normals_refuse_bad_points():
    key = NoiseKey(5)
    with pytest.raises(ValueError, match="one start and end per row"):
        interval_normals(key, np.arange(3), np.zeros(2), np.ones(3), 4)
    with pytest.raises(ValueError, match="start < end"):
        interval_normals(key, np.arange(3), np.ones(3), np.ones(3), 4)
    with pytest.raises(ValueError, match="dim"):
        interval_normals(key, np.arange(3), np.zeros(3), np.ones(3), 0)


# ---- the statistical test: lazy against eager --------------------------------------------------------
D = 4
LAYOUT = ShardLayout(tables=(TableSpec("a", 6, D), TableSpec("b", 3, D)),
                     features=(FeatureSpec("fa", "a", "sum"), FeatureSpec("fb", "b", "sum")), num_shards=1)
STEPS = 8
# rows of table a read per step (row 3 is never read: released only), table b's row 1 at step 4
READS = {s: sorted({0} | ({1} if s % 2 == 0 else set()) | ({2} if s == 5 else set()) | ({4} if s in (0, 7) else set())
                   | ({5} if s in (3, 4) else set())) for s in range(STEPS)}
# each pending step's noise at its own lr (a schedule) and its own std (an adaptive clip changes
# it per step): lr·std ranges over 0.15 … 1.2, so an interval's variance summed from the wrong
# steps would show
LR_SCALE = [1.0, 0.5, 1.5, 0.3, 1.2, 0.6, 1.0, 0.8]
STD = [0.3, 2.0, 0.5, 4.0, 0.125, 2.0, 0.9, 1.5]


def _inputs(step: int) -> ShardInput:
    rows_a = READS[step]
    rows_b = [1] if step == 4 else []
    feature = np.array([0] * len(rows_a) + [1] * len(rows_b), dtype=np.int64)
    local = np.array(rows_a + rows_b, dtype=np.int64)
    return ShardInput(np.arange(feature.size, dtype=np.int64), feature, local, np.ones(feature.size, np.float32))


def _simulate(key: NoiseKey, lazy: bool, broken=None):
    """One run of the schedule: per step a lookup of READS[step] (one example per row) and the
    DP-SGD write-back with a fixed gradient on the rows read. Returns (values read per (step,
    row), released tables)."""
    shard = EmbeddingShard(LAYOUT, 0, optimizer="sgd", lr=0.4, seed=3, init_std=0.5, lazy_noise=lazy)
    if broken is not None:
        broken(shard.updates)
    read = {}
    for step in range(STEPS):
        inp = _inputs(step)
        pooled = shard.call("lookup", inp, int(inp.example.size))
        for j, (f, r) in enumerate(zip(inp.feature, inp.local_id)):
            read[(step, int(f), int(r))] = pooled[j].astype(np.float64)
        grads = np.stack([np.full(D, 0.3 * np.sin(step + r + 3 * f), np.float32) for f, r in zip(inp.feature, inp.local_id)])
        shard.call("apply_dense_noise_update", step, key, STD[step], inp.feature.copy(), inp.local_id.copy(), grads,
                   lr_scale=LR_SCALE[step])
    tables = [np.asarray(w, dtype=np.float64) for w in shard.call("state_dict")["weights"]]
    return read, tables


def _release_without_pending_noise(updates: ShardUpdates) -> None:
    updates.flush = lambda flat_ids=None: 0  # the release keeps the pending noise out


def _reads_not_stored(updates: ShardUpdates) -> None:
    flush = updates.flush
    updates.flush = lambda flat_ids=None: 0 if flat_ids is not None else flush(None)  # the write-back forgets
    updates._drawn_match = lambda flat_ids: None  # in its fused write too (`_store_and_update`)


def _one_step_variance(updates: ShardUpdates) -> None:
    original = updates.pending_noise

    def pending(flat_ids):
        ids, noise = original(flat_ids)
        if noise is None:
            return ids, noise
        through = updates.noised_through[torch.from_numpy(ids)].numpy()
        prefix, now = updates._lazy_var, updates.step - updates._lazy_base
        full = np.sqrt(prefix[now] - prefix[through - updates._lazy_base])
        last = np.sqrt(prefix[now] - prefix[now - 1])  # one step's, however many are pending
        return ids, noise * torch.from_numpy(last / full).float().unsqueeze(1)

    updates.pending_noise = pending


def _samples(lazy: bool, repeats: int, broken=None):
    reads, tables = [], []
    for i in range(repeats):
        read, table = _simulate(NoiseKey.fresh(), lazy, broken)
        reads.append(read)
        tables.append(table)
    return reads, tables


def _statistics(reads, tables) -> dict:
    """The coordinates the test compares: the first coordinate of every released row, and of
    the reads made after pending steps (row 2 at step 5, row 4 at step 7, table b at step 4)."""
    out = {f"release t{t} r{r}": np.array([tab[t][r, 0] for tab in tables]) for t in range(2) for r in range(len(tables[0][t]))}
    for step, f, r in ((5, 0, 2), (7, 0, 4), (4, 1, 1), (6, 0, 1)):
        out[f"read s{step} t{f} r{r}"] = np.array([read[(step, f, r)][0] for read in reads])
    # jointly: what moved between a read and the release (the noise of the steps in between,
    # which a read must share with the release)
    for step, f, r in ((0, 0, 4), (5, 0, 2), (3, 0, 5), (4, 1, 1)):
        out[f"release - read s{step} t{f} r{r}"] = np.array([tab[f][r, 0] - read[(step, f, r)][0]
                                                            for read, tab in zip(reads, tables)])
    return out


REPEATS = 400


@pytest.fixture(scope="module")
def eager_samples():
    return _statistics(*_samples(False, REPEATS))


def _ks_pvalues(eager: dict, other: dict) -> dict:
    """Per statistic: the two-sample KS p-value, and Bartlett's for equal variances (the values
    are Gaussian; a scale change KS sees slowly at 400 samples, this at once)."""
    out = {name: stats.ks_2samp(eager[name], other[name]).pvalue for name in eager}
    out.update({f"variance of {name}": stats.bartlett(eager[name], other[name]).pvalue for name in eager})
    return out


def test_lazy_reads_and_releases_have_the_eager_distribution(eager_samples):
    """Two-sample KS and Bartlett's test per statistic over 400 secret keys each: lazy and
    eager agree (every p-value above 1e-4: a false alarm at most 34 × 1e-4), and so do the means."""
    reads, tables = _samples(True, REPEATS)
    lazy = _statistics(reads, tables)
    pvalues = _ks_pvalues(eager_samples, lazy)
    assert min(pvalues.values()) > 1e-4, pvalues
    for name in eager_samples:
        spread = eager_samples[name].std() / np.sqrt(REPEATS)
        assert abs(lazy[name].mean() - eager_samples[name].mean()) < 6 * spread + 1e-6, name
    # rows, tables and coordinates get independent noise (no two points share a draw): released
    # values of the unread row 3 against rows 0 and 5, table b's row 1, and its own other coordinate
    row3 = np.array([t[0][3, 0] for t in tables])
    for other in (np.array([t[0][0, 0] for t in tables]), np.array([t[0][5, 0] for t in tables]),
                  np.array([t[1][1, 0] for t in tables]), np.array([t[0][3, 3] for t in tables])):
        assert abs(np.corrcoef(row3, other)[0, 1]) < 0.25  # 5σ at 400 samples


@pytest.mark.parametrize("broken", [_release_without_pending_noise, _one_step_variance, _reads_not_stored],
                         ids=["release-without-pending-noise", "one-step-variance", "reads-not-stored"])
def test_a_broken_lazy_noise_is_caught(eager_samples, broken):
    bad = _statistics(*_samples(True, REPEATS, broken))
    pvalues = _ks_pvalues(eager_samples, bad)
    assert min(pvalues.values()) < 1e-6, pvalues


def test_a_fixed_key_replays_the_lazy_run_bit_for_bit_with_values_of_its_own():
    """A fixed key: the lazy run's values are its own (not the eager run's draws) — the
    guarantee is the distribution's, tested above — and the same key replays them bit for bit."""
    key = NoiseKey(424242)
    lazy_a, lazy_b, eager = _simulate(key, True), _simulate(key, True), _simulate(key, False)
    for t in range(2):
        np.testing.assert_array_equal(lazy_a[1][t], lazy_b[1][t])
    assert not np.allclose(lazy_a[1][0], eager[1][0])


def _slow_write_back(updates: ShardUpdates) -> None:
    updates._drawn_match = lambda flat_ids: None  # every write-back searches its rows and stores, then updates


def test_the_fused_write_back_equals_store_then_update_bit_for_bit():
    """The write-back whose rows are exactly the step's drawn ones stores their noise and −lr·G in
    one write (`_store_and_update`); the slow path (`flush`, then the SGD update) gives the same
    reads and tables bit for bit, and the fused path is taken."""
    key, fused = NoiseKey(77), []

    def counting(updates: ShardUpdates) -> None:
        original = updates._store_and_update
        updates._store_and_update = lambda *a, **k: (fused.append(1), original(*a, **k))[1]

    fast, slow = _simulate(key, True, counting), _simulate(key, True, _slow_write_back)
    assert len(fused) >= STEPS // 2, len(fused)
    assert fast[0].keys() == slow[0].keys()
    for k in fast[0]:
        np.testing.assert_array_equal(fast[0][k], slow[0][k])
    for t in range(2):
        np.testing.assert_array_equal(fast[1][t], slow[1][t])


# ---- the engine: nothing read or released without its noise -----------------------------------------
def dataset():
    return wide_ctr(n=60, tables=(23, 17, 2), seed=1)


@pytest.mark.parametrize("unit", ["example", "user"])
def test_no_row_is_read_or_released_with_noise_missing(monkeypatch, unit):
    """An in-process lazy DP-SGD engine, 3 shards, at example level and at user level (3
    examples per user, clipped per user: the shards' noise path does not see the unit, so lazy
    noise composes with it unchanged): every row a lookup reads has, at that moment, the noise of
    every earlier step (stored, or pending and added for the read); the rows each write-back
    updates include every row its step read (so the stored state follows from the write-backs);
    after an evaluation every row holds all of its noise."""
    reads: list = []
    original = ShardUpdates.with_pending_noise

    def recorded(self, flat_ids):
        ids, noise = self.pending_noise(flat_ids)
        stored = self.noised_through[torch.from_numpy(np.unique(flat_ids))].numpy()
        waiting = stored < self.step
        assert np.array_equal(np.unique(flat_ids)[waiting], ids)  # every row short of noise gets it now
        reads.append((self, np.unique(flat_ids), self.step))
        return original(self, flat_ids)

    writes: list = []
    original_update = ShardUpdates._lazy_dense_update

    def recorded_update(self, step, noise_key, std, table_idx, global_ids, rows, *rest):
        table_idx, global_ids = np.asarray(table_idx), np.asarray(global_ids)
        writes.append((self, set((self.storage.row_base[table_idx] + global_ids - self.storage.starts[table_idx]).tolist()),
                       step))
        return original_update(self, step, noise_key, std, table_idx, global_ids, rows, *rest)

    monkeypatch.setattr(ShardUpdates, "with_pending_noise", recorded)
    monkeypatch.setattr(ShardUpdates, "_lazy_dense_update", recorded_update)
    ds = dataset()
    units = None if unit == "example" else np.arange(len(ds)) // 3
    engine = make_engine(ds, num_shards=3, mode="dpsgd", optimizer="sgd", lazy_noise=True, q=0.3, seed=4,
                         example_units=units)
    try:
        for _ in range(5):
            reads.clear()
            writes.clear()
            assert engine.step() is not None
            assert writes, "every step writes back"
            for updates, ids, step in reads:
                written = set().union(*(w for u, w, s in writes if u is updates and s == step))
                assert set(ids.tolist()) <= written, "a row read but not written back: its noise would not be stored"
                assert (updates.noised_through[torch.from_numpy(ids)] == step).all()
        assert any(len(ids) for _, ids, _ in reads)
        engine.evaluate(ds, 64)
        for shard in engine.shards.shards:
            u = shard.updates
            assert (u.noised_through[torch.from_numpy(u._valid)] == u.step).all()
    finally:
        engine.shutdown()


def test_the_lazy_engine_gives_the_same_tables_over_one_and_three_shards():
    ds = dataset()
    params = []
    for shards in (1, 3):
        engine = make_engine(ds, num_shards=shards, mode="dpsgd", optimizer="sgd", lazy_noise=True, q=0.3, seed=4)
        try:
            for _ in range(4):
                engine.step()
            params.append(engine_params(engine))
        finally:
            engine.shutdown()
    for name in params[0][0]:
        torch.testing.assert_close(params[1][0][name], params[0][0][name], rtol=1e-5, atol=1e-6)


def test_a_lazy_shard_refuses_what_is_not_exact():
    with pytest.raises(ValueError, match="exact for SGD without averaging"):
        EmbeddingShard(LAYOUT, 0, optimizer="adam", lr=0.1, seed=0, lazy_noise=True)
    with pytest.raises(ValueError, match="exact for SGD without averaging"):
        EmbeddingShard(LAYOUT, 0, optimizer="sgd", ema_decay=0.5, lazy_noise=True)
    shard = EmbeddingShard(LAYOUT, 0, optimizer="sgd", lazy_noise=True)
    with pytest.raises(ValueError, match="ModelMix"):
        shard.call("apply_dense_noise_update", 0, NoiseKey(1), 0.1, np.zeros(0, np.int64), np.zeros(0, np.int64),
                   np.zeros((0, D), np.float32), mix=(NoiseKey(2), 1.0))
    with pytest.raises(ValueError, match="every table"):
        shard.call("apply_dense_noise_update", 0, NoiseKey(1), 0.1, np.zeros(0, np.int64), np.zeros(0, np.int64),
                   np.zeros((0, D), np.float32), tables=(0,))
    with pytest.raises(RuntimeError, match="steps in order"):
        shard.call("apply_dense_noise_update", 3, NoiseKey(1), 0.1, np.zeros(0, np.int64), np.zeros(0, np.int64),
                   np.zeros((0, D), np.float32))


def test_a_saved_state_holds_every_rows_noise_and_loads_into_a_lazy_or_eager_shard():
    key = NoiseKey(77)
    shard = EmbeddingShard(LAYOUT, 0, optimizer="sgd", lr=0.4, seed=3, init_std=0.5, lazy_noise=True)
    for step in range(3):
        inp = _inputs(step)
        shard.call("lookup", inp, int(inp.example.size))
        shard.call("apply_dense_noise_update", step, key, 1.0, inp.feature.copy(), inp.local_id.copy(),
                   np.ones((inp.feature.size, D), np.float32))
    state = shard.call("state_dict")
    assert (shard.updates.noised_through == 3).all()  # flushed: nothing pending leaves
    for lazy in (True, False):
        other = EmbeddingShard(LAYOUT, 0, optimizer="sgd", lr=0.4, seed=9, init_std=0.5, lazy_noise=lazy)
        other.call("load_state_dict", state)
        for got, want in zip(other.call("state_dict")["weights"], state["weights"]):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # a resumed lazy shard goes on from the saved step: nothing pending until its next write-back
    other = EmbeddingShard(LAYOUT, 0, optimizer="sgd", lr=0.4, seed=9, init_std=0.5, lazy_noise=True)
    other.call("load_state_dict", state)
    assert other.updates.pending_noise(other.updates._valid)[1] is None


# ---- the config -------------------------------------------------------------------------------------
def test_auto_is_lazy_exactly_where_lazy_is_exact_and_lazy_is_refused_elsewhere():
    def cfg(*sets):
        return load_config(None, ["train.mode=dpsgd", "train.optimizer=sgd", *sets])

    assert lazy_dpsgd_noise(cfg())
    assert not lazy_dpsgd_noise(cfg("train.dpsgd_noise=eager"))
    for sets, reason in ((["train.optimizer=adam"], "Adagrad's and Adam's state"),
                         (["train.ema_decay=0.9"], "train.ema_decay"),
                         (["train.mode=sparse"], "dpsgd"),
                         (["train.modelmix=true", "privacy.mix_width=2"], "train.modelmix")):
        assert not lazy_dpsgd_noise(cfg(*sets))  # auto: eager there
        cfg(*sets, "data.path=somewhere").validate()  # eager there: a valid config
        with pytest.raises(ConfigError, match=reason):
            cfg(*sets, "train.dpsgd_noise=lazy", "data.path=somewhere").validate()
    with pytest.raises(ConfigError, match="train.dpsgd_noise must be one of"):
        cfg("train.dpsgd_noise=sometimes", "data.path=somewhere").validate()


def test_an_eager_shard_keeps_no_pending_state():
    """An eager shard keeps no pending state and flushes nothing (its evaluation costs nothing more)."""
    shard = EmbeddingShard(LAYOUT, 0, optimizer="sgd")
    assert shard.call("flush_pending") == 0 and not hasattr(shard.updates, "noised_through")


def test_a_lazy_lookup_names_a_bad_id_before_it_indexes_the_pending_state():
    shard = EmbeddingShard(LAYOUT, 0, optimizer="sgd", lazy_noise=True)
    bad = ShardInput(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([6], np.int64), np.ones(1, np.float32))
    with pytest.raises(ValueError, match="feature 'fa' id 6 .* outside this shard's 6 rows of table 'a'"):
        shard.call("lookup", bad, 1)
