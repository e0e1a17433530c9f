"""The shard's fused storage (one TBE holding every table) against a slow obvious reference.

The reference keeps each table as a plain array and does, row by row, what a lookup and the
three embedding optimizers mean: weighted sum pooling per (example, feature) bag; SGD
w -= lr·g; FBGEMM's row-wise Adagrad (accumulator += mean(g²) over the row, then
w -= lr·g/(√acc + eps)); lazy Adam on the written rows. The layout has what a per-table loop
would handle separately and a fused call must not mix up: two features sharing one table,
mean and sum pooling, repeated ids in a bag, tables of different sizes, a table no feature
uses (written only by dense noise), and two shards with uneven row ranges."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import widedp.trainer.engine.shard_storage as storage_module  # the device choice lives there
import widedp.trainer.engine.shard_update as update_module  # the write-back's chunk size lives there
from widedp.selection.keyed_random import NoiseKey
from widedp.trainer.engine.layout import FeatureSpec, ShardInput, ShardLayout, TableSpec, row_block_normal
from widedp.trainer.engine.shard import EmbeddingShard

D = 4
LAYOUT = ShardLayout(
    tables=(TableSpec("a", 7, D), TableSpec("b", 5, D), TableSpec("unused", 3, D), TableSpec("c", 2, D)),
    features=(FeatureSpec("fa", "a", "sum"), FeatureSpec("fb", "b", "mean"), FeatureSpec("fa2", "a", "mean"),
              FeatureSpec("fc", "c", "sum")),
    num_shards=2,
)


def shard_input(rng, shard, batch_size=5, nnz=30) -> ShardInput:
    feature = rng.integers(0, len(LAYOUT.features), nnz)
    table = np.array([LAYOUT.table_index(LAYOUT.features[f].table) for f in feature])
    ranges = [LAYOUT.row_range(t, shard) for t in LAYOUT.tables]
    keep = np.array([ranges[t][1] > ranges[t][0] for t in table])
    feature, table = feature[keep], table[keep]
    local = np.array([rng.integers(0, ranges[t][1] - ranges[t][0]) for t in table], dtype=np.int64)
    example = rng.integers(0, batch_size, feature.size)
    n = feature[1::4].size  # repeats: the same id in the same bag
    feature[1::4], local[1::4], example[1::4] = feature[::4][:n], local[::4][:n], example[::4][:n]
    weight = rng.uniform(0.2, 1.5, feature.size).astype(np.float32)
    return ShardInput(example.astype(np.int64), feature.astype(np.int64), local, weight)


def reference_lookup(tables, inp, batch_size):
    out = np.zeros((batch_size, len(LAYOUT.features), D))
    for j, f, r, w in zip(inp.example, inp.feature, inp.local_id, inp.weight):
        out[j, f] += w * tables[LAYOUT.table_index(LAYOUT.features[f].table)][r]
    return out


class ReferenceOptimizer:
    def __init__(self, tables, kind, lr, eps=1e-8, betas=(0.9, 0.999)):
        self.w = [t.astype(np.float64).copy() for t in tables]
        self.kind, self.lr, self.eps, self.betas = kind, lr, eps, betas
        self.acc = [np.zeros(len(t)) for t in tables]
        self.m = [np.zeros_like(t) for t in self.w]
        self.v = [np.zeros_like(t) for t in self.w]
        self.t = [np.zeros(len(t), dtype=int) for t in tables]

    def update(self, t, r, g):
        g = np.asarray(g, dtype=np.float64)
        if self.kind == "sgd":
            self.w[t][r] -= self.lr * g
        elif self.kind == "adagrad":
            self.acc[t][r] += np.mean(g ** 2)
            self.w[t][r] -= self.lr * g / (np.sqrt(self.acc[t][r]) + self.eps)
        else:
            b1, b2 = self.betas
            self.t[t][r] += 1
            self.m[t][r] = b1 * self.m[t][r] + (1 - b1) * g
            self.v[t][r] = b2 * self.v[t][r] + (1 - b2) * g * g
            mh, vh = self.m[t][r] / (1 - b1 ** self.t[t][r]), self.v[t][r] / (1 - b2 ** self.t[t][r])
            self.w[t][r] -= self.lr * mh / (np.sqrt(vh) + self.eps)


def random_rows_of_every_table(shard, rng):
    """(table index, global row id) of a random non-empty set of distinct rows of every table."""
    tables, ids = [], []
    for t, (start, end) in enumerate(shard.storage.ranges):
        rows = rng.choice(np.arange(start, end), size=rng.integers(1, end - start + 1), replace=False)
        tables += [t] * rows.size
        ids += rows.tolist()
    return np.array(tables), np.array(ids)


def tables_of(shard):
    return [shard.storage.weights(t).detach().numpy().astype(np.float64).copy() for t in range(len(LAYOUT.tables))]


@pytest.mark.parametrize("shard_index", [0, 1])
def test_one_fused_lookup_equals_the_bag_by_bag_reference(shard_index):
    shard = EmbeddingShard(LAYOUT, shard_index, seed=3, init_std=0.5)
    inp = shard_input(np.random.default_rng(shard_index), shard_index)
    assert inp.example.size > 10 and np.unique(inp.feature).size == len(LAYOUT.features)
    bags = inp.bags(5)
    got = np.zeros((5, len(LAYOUT.features), D))
    got[bags.example, bags.feature] = shard.call("lookup", inp, 5)  # only the shard's own bags travel
    want = reference_lookup(tables_of(shard), inp, 5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(np.abs(want).sum(-1)) == bags.example.size  # every other bag is empty
    np.testing.assert_allclose(shard.call("lookup", inp, 5, averaged=True), got[bags.example, bags.feature], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_one_fused_write_back_equals_row_by_row_updates(optimizer):
    """Rows of every table in one call, three steps (so Adagrad's and Adam's states carry)."""
    rng = np.random.default_rng(0)
    shard = EmbeddingShard(LAYOUT, 0, optimizer=optimizer, lr=0.3, seed=1, init_std=0.5)
    ref = ReferenceOptimizer(tables_of(shard), optimizer, lr=0.3)
    for step in range(1, 4):
        tables, ids = random_rows_of_every_table(shard, rng)
        update = rng.normal(size=(ids.size, D)).astype(np.float32)
        shard.call("apply_rows", tables, ids, update, step=step)
        for t, r, g in zip(tables, ids, update):
            ref.update(t, r - shard.storage.ranges[t][0], g)
        for t in range(len(LAYOUT.tables)):
            np.testing.assert_allclose(shard.storage.weights(t).detach().numpy(), ref.w[t], rtol=1e-5, atol=1e-6, err_msg=f"table {t}")


def test_rows_not_written_do_not_move():
    shard = EmbeddingShard(LAYOUT, 1, optimizer="adagrad", lr=0.3, seed=1, init_std=0.5)
    before = tables_of(shard)
    shard.call("apply_rows", np.array([0, 3]), np.array([shard.storage.ranges[0][0] + 1, shard.storage.ranges[3][0]]),
                     np.ones((2, D), np.float32), step=1)
    after = tables_of(shard)
    changed = [(t, r) for t in range(4) for r in range(len(after[t])) if not np.array_equal(after[t][r], before[t][r])]
    assert changed == [(0, 1), (3, 0)]


def test_dense_noise_update_in_small_chunks_equals_one_chunk_and_reaches_the_unused_table(monkeypatch):
    """Rows [cK, (c+1)K) of every dense table per fused call: the result does not depend on K,
    every row of the requested tables moves by its own noise, and a table no feature uses is
    written through its own channel."""
    def run(chunk):
        monkeypatch.setattr(update_module, "UPDATE_CHUNK", chunk)
        shard = EmbeddingShard(LAYOUT, 0, lr=1.0, seed=1, init_std=0.5)
        before = tables_of(shard)
        touched_t, touched_id = np.array([0, 2]), np.array([shard.storage.ranges[0][0] + 2, shard.storage.ranges[2][0]])
        shard.call("apply_dense_noise_update", 0, NoiseKey(99), 0.1, touched_t, touched_id, np.full((2, D), 5.0, np.float32),
                                       tables=(0, 2, 3))
        return shard, before, tables_of(shard)

    shard, before, one = run(1 << 16)
    _, _, small = run(2)
    for t in range(4):
        np.testing.assert_array_equal(small[t], one[t])
    for t in (0, 2, 3):
        start, end = shard.storage.ranges[t]
        noise = row_block_normal(NoiseKey(99), "dpsgd", 0, t, start, end, D, 0.1).numpy().astype(np.float64)
        grad = noise.copy()
        if t == 0:
            grad[2] += 5.0
        if t == 2:
            grad[0] += 5.0
        np.testing.assert_allclose(one[t], before[t] - grad, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(one[1], before[1])  # table b is not dense here


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_dense_noise_update_in_place_equals_row_by_row_updates(optimizer, monkeypatch):
    """DP-SGD's every-row update (in place on contiguous slices) is the same optimizer as the
    write-back of given rows: three steps against the row-by-row reference, chunks of
    2 rows so a table spans several slices, averaging on (the EMA sees every row each step)."""
    monkeypatch.setattr(update_module, "UPDATE_CHUNK", 2)
    rng = np.random.default_rng(5)
    shard = EmbeddingShard(LAYOUT, 1, optimizer=optimizer, lr=0.3, seed=1, init_std=0.5, ema_decay=0.5)
    fused = EmbeddingShard(LAYOUT, 1, optimizer=optimizer, lr=0.3, seed=1, init_std=0.5, ema_decay=0.5)
    ref = ReferenceOptimizer(tables_of(shard), optimizer, lr=0.3)
    dense = (0, 2, 3)
    for step in range(3):
        touched_t = np.array([0, 0, 3])
        touched_id = np.array([shard.storage.ranges[0][0], shard.storage.ranges[0][1] - 1, shard.storage.ranges[3][0]])
        touched = rng.normal(size=(3, D)).astype(np.float32)
        shard.call("apply_dense_noise_update", step, NoiseKey(7), 0.2, touched_t, touched_id, touched, tables=dense, lr_scale=0.5)
        all_t, all_id, all_g = [], [], []
        for t in dense:
            start, end = shard.storage.ranges[t]
            grad = row_block_normal(NoiseKey(7), "dpsgd", step, t, start, end, D, 0.2).numpy().copy()
            for tt, r, g in zip(touched_t, touched_id, touched):
                if tt == t:
                    grad[r - start] += g
            all_t += [t] * (end - start)
            all_id += list(range(start, end))
            all_g.append(grad)
            ref.lr = 0.3 * 0.5
            for r in range(end - start):
                ref.update(t, r, grad[r])
        fused.call("apply_rows", np.array(all_t), np.array(all_id), np.concatenate(all_g), lr_scale=0.5, step=step + 1)
        for t in range(len(LAYOUT.tables)):
            np.testing.assert_allclose(tables_of(shard)[t], ref.w[t], rtol=1e-5, atol=1e-6, err_msg=f"table {t}")
    for got, want in zip(shard.call("averaged_weights"), fused.call("averaged_weights")):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    if optimizer == "adagrad":
        np.testing.assert_allclose(shard.storage.adagrad_state().detach().numpy(), fused.storage.adagrad_state().detach().numpy(), rtol=1e-5)


def test_state_dict_round_trip_keeps_per_table_format_and_optimizer_state():
    a = EmbeddingShard(LAYOUT, 0, optimizer="adagrad", lr=0.3, seed=1, ema_decay=0.5)
    a.call("apply_rows", np.array([0, 1]), np.array([a.storage.ranges[0][0], a.storage.ranges[1][0]]), np.ones((2, D), np.float32), step=1)
    state = a.call("state_dict")
    assert [w.shape[0] for w in state["weights"]] == [end - start for start, end in a.storage.ranges]
    b = EmbeddingShard(LAYOUT, 0, optimizer="adagrad", lr=0.3, seed=2, ema_decay=0.5)
    b.call("load_state_dict", state)
    for x in (a, b):
        x.call("apply_rows", np.array([0]), np.array([x.storage.ranges[0][0]]), np.ones((1, D), np.float32), step=2)
    for k in ("weights", "adagrad", "averaged_weights"):
        for u, v in zip(a.call("state_dict")[k], b.call("state_dict")[k]):
            np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("size,upper", [(0, 10), (1, 5), (1000, 50), (5000, 10**6), (20000, 30000)])
def test_sort_and_marking_uniques_equal_numpy_unique(size, upper):
    """`unique_ints` (one sort, or marking when `upper` is small) is a drop-in np.unique."""
    from widedp.selection._sparse import unique_ints

    values = np.random.default_rng(size).integers(0, upper, size)
    expected, expected_inverse = np.unique(values, return_inverse=True)
    for bound in (None, upper):
        assert np.array_equal(unique_ints(values, upper=bound), expected)
        distinct, inverse = unique_ints(values, return_inverse=True, upper=bound)
        assert np.array_equal(distinct, expected) and distinct.dtype == expected.dtype
        assert np.array_equal(inverse, expected_inverse.reshape(-1))
        assert np.array_equal(distinct[inverse], values)


@pytest.mark.parametrize("one_id_per_bag", [True, False])
def test_per_example_norms_and_row_counts_without_grouping_equal_the_grouped_paths(one_id_per_bag):
    """One table per feature and one id per bag (CTR): no (example, table, row) can repeat, so
    the shard skips the grouping; its norms equal the grouped path's and a brute-force sum.
    With repeated ids in a bag the grouping is required and taken."""
    layout = ShardLayout(tables=(TableSpec("a", 9, D), TableSpec("b", 6, D)),
                         features=(FeatureSpec("fa", "a", "sum"), FeatureSpec("fb", "b", "mean")), num_shards=1)
    rng = np.random.default_rng(11)
    B = 6
    example = np.repeat(np.arange(B), 2)
    feature = np.tile([0, 1], B)
    local = np.where(feature == 0, rng.integers(0, 9, 2 * B), rng.integers(0, 6, 2 * B))
    if not one_id_per_bag:  # example 0 reads its feature-a row twice: that row's gradient doubles
        example, feature, local = np.append(example, 0), np.append(feature, 0), np.append(local, local[0])
    inp = ShardInput(example.astype(np.int64), feature.astype(np.int64), local.astype(np.int64),
                     np.ones(example.size, dtype=np.float32))
    grads = rng.normal(size=(inp.bags(B).example.size, D)).astype(np.float32)
    norms, counts = {}, {}
    weights = rng.uniform(0.1, 1.0, B)
    for unshared in (True, False):
        shard = EmbeddingShard(layout, 0, seed=1)
        assert shard.storage.tables_unshared
        shard.storage.tables_unshared = unshared
        shard.call("lookup", inp, B)
        norms[unshared] = shard.call("example_sq_norms", grads, 0)
        shard.call("clipped_row_sums", np.ones(B), 0, selection_weights=weights)
        base = np.array([0, 9])  # both tables sparse, compact ids back to back
        counts[unshared] = [shard.selection._row_counts(base, weighted) for weighted in (True, False)]
    for (rows_fast, c_fast), (rows_grouped, c_grouped) in zip(counts[True], counts[False]):
        assert np.array_equal(rows_fast, rows_grouped) and np.array_equal(c_fast, c_grouped)
    bags = inp.bags(B)
    row_grad = {}
    for i in range(example.size):  # brute force: Σ over distinct (example, table, row) of ‖Σ w·g‖²
        key = (example[i], feature[i], local[i])
        row_grad[key] = row_grad.get(key, 0) + grads[bags.id_bag[i]].astype(np.float64)
    want = np.zeros(B)
    for (j, _, _), g in row_grad.items():
        want[j] += float(g @ g)
    np.testing.assert_allclose(norms[False], want, rtol=1e-6)
    # Without one id per bag the shortcut would give ‖g‖² + ‖g‖² for the repeated row, not ‖2g‖².
    np.testing.assert_allclose(norms[True], want, rtol=1e-6)


def test_an_id_outside_the_shards_rows_is_refused_naming_feature_and_table():
    """The TBE runs without its own bounds check: the shard checks every id first."""
    shard = EmbeddingShard(LAYOUT, 1, seed=3)
    inp = shard_input(np.random.default_rng(0), 1)
    assert shard.call("lookup", inp, 5).shape[1] == D
    bad_local = inp.local_id.copy()
    bad_local[3] = shard.storage.feature_rows[inp.feature[3]]
    with pytest.raises(ValueError, match=rf"feature '{LAYOUT.features[inp.feature[3]].name}' id {bad_local[3]} .*table"):
        shard.call("lookup", ShardInput(inp.example, inp.feature, bad_local, inp.weight), 5)
    too_small = int(inp.example.max())
    with pytest.raises(ValueError, match=f"example index outside the batch of {too_small}"):
        shard.call("lookup", inp, too_small)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_in_place_write_back_equals_fbgemms_own_fused_backward_update(optimizer):
    """The shard updates rows in place; FBGEMM's TBE would fuse the same EXACT_SGD /
    EXACT_ROWWISE_ADAGRAD update into the backward of a lookup of those rows as bags of one.
    Three steps on every table, weights and Adagrad accumulators compared."""
    import torch

    shard = EmbeddingShard(LAYOUT, 0, optimizer=optimizer, lr=0.3, seed=1, init_std=0.5)
    fbgemm = EmbeddingShard(LAYOUT, 0, optimizer=optimizer, lr=0.3, seed=1, init_std=0.5)
    rng = np.random.default_rng(2)
    for step in range(1, 4):
        tables_a, ids_a = random_rows_of_every_table(shard, rng)
        update = rng.normal(size=(ids_a.size, D)).astype(np.float32)
        shard.call("apply_rows", tables_a, ids_a, update, step=step)
        # FBGEMM: rows as bags of one in the channel of their table, the update as the pooled gradient.
        store = fbgemm.storage
        channel = np.searchsorted(store.channel_table, tables_a)  # a table's first channel
        order = np.argsort(channel, kind="stable")
        position = np.arange(order.size) - np.searchsorted(channel[order], channel[order])
        width = int(position.max()) + 1
        sizes = np.zeros(store.num_channels * width, dtype=np.int64)
        sizes[channel[order] * width + position] = 1
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)]))
        local = ids_a - store.starts[tables_a]
        out = store.tbe(torch.from_numpy(local[order]), offsets)
        grad = torch.zeros((width, store.num_channels, D))
        grad[torch.from_numpy(position), torch.from_numpy(channel[order])] = torch.from_numpy(update[order])
        out.backward(grad.view(width, -1))
        np.testing.assert_allclose(shard.storage.flat.detach().numpy(), store.flat.detach().numpy(), rtol=1e-6, atol=1e-7)
        if optimizer == "adagrad":
            np.testing.assert_allclose(shard.storage.adagrad_state().detach().numpy(), store.adagrad_state().detach().numpy(), rtol=1e-6)


def test_a_re_sent_dispatch_call_runs_once():
    """`EmbeddingShard.dispatch`: the group re-sends a call (same call id) after a lost actor
    without knowing which shards already ran it. Running it again would add a trainer's row
    sums to the reduction twice or apply an update twice; the re-sent call answers from the
    first instead, so the shard ends as one that saw each call once. A new call id runs."""
    rng = np.random.default_rng(3)
    inp, batch = shard_input(rng, 0), 5
    grads = rng.normal(size=(inp.bags(batch).example.size, D)).astype(np.float32)
    factors = rng.uniform(0.2, 1.0, batch)
    once, twice = EmbeddingShard(LAYOUT, 0, lr=0.5), EmbeddingShard(LAYOUT, 0, lr=0.5)
    calls = [("lookup", (inp, batch)), ("set_pooled_grad", (grads,)), ("add_clipped_row_sums", (factors, 0)),
             ("reduced_row_sums", ())]
    for call_id, (method, args) in enumerate(calls):
        first = once.dispatch((call_id, method, args, False))
        again = [twice.dispatch((call_id, method, args, True)) for _ in range(2)]  # copied args, as from a channel
        if method == "reduced_row_sums":
            tables, ids, summed = first
            assert ids.size > 0
            for got in again:
                for a, b in zip(got, first):
                    np.testing.assert_array_equal(a, b)
    update = ("apply_rows", (tables, ids, summed))
    once.dispatch((9, *update, False))
    for _ in range(2):
        twice.dispatch((9, *update, False))
    for a, b in zip(once.call("state_dict")["weights"], twice.call("state_dict")["weights"]):
        np.testing.assert_array_equal(a, b)
    twice.dispatch((10, *update, False))  # a new call id is a new call
    assert not all(np.array_equal(a, b) for a, b in zip(once.call("state_dict")["weights"], twice.call("state_dict")["weights"]))


def test_a_folded_write_back_runs_before_the_call_that_carries_it_and_once():
    """`dispatch` with deferred calls (`ShardGroup.defer`, the folded write-back): the shard
    applies the previous step's update and then answers the call that carried it, exactly as
    two separate calls would; a re-sent request (same call id) applies nothing again; only
    state-changing methods may be deferred."""
    rng = np.random.default_rng(4)
    inp, batch = shard_input(rng, 0), 5
    eager, folded = EmbeddingShard(LAYOUT, 0, lr=0.5), EmbeddingShard(LAYOUT, 0, lr=0.5)
    stale = eager.call("lookup", inp, batch)
    eager.call("set_pooled_grad", np.ones((inp.bags(batch).example.size, D), np.float32))
    update = eager.call("clipped_row_sums", np.ones(batch))
    eager.dispatch((1, "apply_rows", update, False))
    want = eager.dispatch((2, "lookup", (inp, batch), False))
    assert not np.array_equal(want, stale)  # the update shows in the lookup
    got = folded.dispatch((2, "lookup", (inp, batch), True, (("apply_rows", update),)))
    np.testing.assert_array_equal(got, want)
    again = folded.dispatch((2, "lookup", (inp, batch), False, (("apply_rows", update),)))
    np.testing.assert_array_equal(again, want)
    for a, b in zip(eager.call("state_dict")["weights"], folded.call("state_dict")["weights"]):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="only state-changing calls are deferred, got 'lookup'"):
        folded.dispatch((3, "ping", (), False, (("lookup", (inp, batch)),)))


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the CUDA path needs a GPU: benchmarks/gpu_check.sh runs this on a GPU machine")
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_a_shard_on_the_gpu_computes_what_the_cpu_shard_computes(monkeypatch, optimizer):
    """With CUDA the shard holds its tables on the GPU (FBGEMM's CUDA kernels) and answers as
    the CPU shard does: lookups, per-example norms, clipped row sums, the write-back."""
    rng = np.random.default_rng(7)
    inp, batch = shard_input(rng, 0), 5
    gpu = EmbeddingShard(LAYOUT, 0, optimizer=optimizer, lr=0.5, seed=1)
    assert gpu.storage.flat.is_cuda
    monkeypatch.setattr(storage_module, "_device", lambda: (torch.device("cpu"), storage_module.ComputeDevice.CPU,
                                                          storage_module.EmbeddingLocation.HOST))
    cpu = EmbeddingShard(LAYOUT, 0, optimizer=optimizer, lr=0.5, seed=1)
    assert not cpu.storage.flat.is_cuda
    grads = rng.normal(size=(inp.bags(batch).example.size, D)).astype(np.float32)
    answers = []
    for shard in (gpu, cpu):
        pooled = shard.call("lookup", inp, batch)
        norms = shard.call("example_sq_norms", grads)
        sums = shard.call("clipped_row_sums", np.full(batch, 0.5))
        shard.call("apply_rows", *sums)
        answers.append([pooled, norms, *sums, *shard.call("state_dict")["weights"]])
    assert len(answers[0]) == len(answers[1])
    for got, want in zip(*answers):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
