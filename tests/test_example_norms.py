"""Specification of the trainer-side embedding norms (trainer/engine/example_norms.py).

The clip factor of every example is sized from these norms, so they must equal the norms of the
gradient whose clipped sum is released. Two references: an obvious loop over ids and rows, and
the shards' own `example_sq_norms` summed over shards (the path they replace). The wrong
groupings a fast path could make (every occurrence alone, or rows of a shared table not merged
across features) are shown to differ on the same data, so the equality checks can fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine_fixtures import MemoryDataset, layout_for, tiny_cbow, tiny_ctr, wide_ctr
from widedp.trainer.engine.example_norms import embedding_sq_norms
from widedp.trainer.engine.layout import route
from widedp.trainer.engine.shard import EmbeddingShard

DIM = 4


def one_id_ctr(n=50, seed=0):
    """Every feature its own table and exactly one id per bag (CTR's shape): the fast path."""
    from tests.engine_fixtures import Meta

    rng = np.random.default_rng(seed)
    meta = Meta(features=["a", "b", "c"], feature_tables={"a": "ta", "b": "tb", "c": "tc"},
                table_sizes={"ta": 11, "tb": 7, "tc": 3}, pooling={"a": "sum", "b": "mean", "c": "sum"}, num_dense=2)
    bags = {f: [[int(rng.integers(0, meta.table_sizes[meta.feature_tables[f]]))] for _ in range(n)]
            for f in meta.features}
    return MemoryDataset(meta, bags, rng.normal(size=(n, 2)), (rng.random(n) < 0.5).astype(np.float32))


DATASETS = {"tiny_ctr": tiny_ctr, "wide_ctr": wide_ctr, "tiny_cbow": tiny_cbow, "one_id_ctr": one_id_ctr}


def loop_sq_norms(layout, kjt, B, g_pooled, group_by="row"):
    """The obvious reference: walk every id, add w_i·g_{j,f} into its group's gradient, square.
    group_by "row": (example, table, row) — the right per-example row gradient;
    "occurrence": every id alone; "feature": (example, feature, row) — a shared table's row is
    not merged across features. The last two are the mistakes a fast path could make."""
    values = kjt.values().numpy()
    lengths = kjt.lengths().numpy().reshape(len(layout.features), B)
    groups: dict = {}
    i = 0
    for f, spec in enumerate(layout.features):
        for j in range(B):
            n = int(lengths[f, j])
            w = 1.0 / max(n, 1) if spec.pooling == "mean" else 1.0
            for _ in range(n):
                key = {"row": (j, spec.table, int(values[i])), "occurrence": (j, i),
                       "feature": (j, f, int(values[i]))}[group_by]
                groups[key] = groups.get(key, 0.0) + w * g_pooled[j, f].astype(np.float64)
                i += 1
    out = np.zeros(B)
    for key, grad in groups.items():
        out[key[0]] += float(grad @ grad)
    return out


def shard_sq_norms(layout, kjt, B, g_pooled):
    """The shards' norms round: every shard's `example_sq_norms` of its bags, summed."""
    from widedp.trainer.engine.trainer_role import per_bag

    out = np.zeros(B)
    for s, part in enumerate(route(layout, kjt, B)):
        shard = EmbeddingShard(layout, s, seed=1, init_std=0.1)
        shard.call("lookup", part, B)
        bags = part.bags(B)
        out[bags.examples] += shard.call("example_sq_norms", per_bag(g_pooled, bags))
    return out


def batch_of(ds, seed, size):
    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(len(ds), size=size, replace=False))
    return ds.take(idx), size


@pytest.mark.parametrize("name", sorted(DATASETS))
@pytest.mark.parametrize("num_shards", [1, 3])
def test_norms_equal_the_loop_and_the_shards(name, num_shards):
    ds = DATASETS[name]()
    layout = layout_for(ds, num_shards, DIM)
    for seed in range(3):
        batch, B = batch_of(ds, seed, 17)
        g = np.random.default_rng(100 + seed).normal(size=(B, len(layout.features), DIM)).astype(np.float32)
        fast = embedding_sq_norms(layout, batch.sparse, B, g)
        assert fast.dtype == np.float64 and fast.shape == (B,)
        np.testing.assert_allclose(fast, loop_sq_norms(layout, batch.sparse, B, g), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(fast, shard_sq_norms(layout, batch.sparse, B, g), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("wrong,name", [("occurrence", "tiny_ctr"), ("occurrence", "tiny_cbow"),
                                        ("feature", "tiny_ctr")])
def test_wrong_groupings_differ_on_this_data(wrong, name):
    """The data above has repeated ids in bags (cbow's context, ctr's hot ids) and a table two
    features share (ctr's t1): a fast path that squared every occurrence alone, or did not merge
    the shared table's rows, would fail the equality test."""
    ds = DATASETS[name]()
    layout = layout_for(ds, 2, DIM)
    batch, B = batch_of(ds, 0, 30)
    g = np.random.default_rng(7).normal(size=(B, len(layout.features), DIM)).astype(np.float32)
    right = embedding_sq_norms(layout, batch.sparse, B, g)
    assert not np.allclose(right, loop_sq_norms(layout, batch.sparse, B, g, group_by=wrong), rtol=1e-3)


def test_empty_bags_and_empty_batch():
    ds = tiny_ctr()
    layout = layout_for(ds, 2, DIM)
    batch, B = batch_of(ds, 1, 20)
    g = np.zeros((B, len(layout.features), DIM), np.float32)
    assert np.array_equal(embedding_sq_norms(layout, batch.sparse, B, g), np.zeros(B))
    empty = ds.take(np.zeros(0, np.int64))
    assert embedding_sq_norms(layout, empty.sparse, 0, np.zeros((0, 3, DIM), np.float32)).shape == (0,)


def test_norms_are_those_of_the_autograd_gradient():
    """Independent of both references: the per-example gradient of the embedding tables by
    autograd through `embedding_bag` (one example at a time), its squared norm."""
    ds = tiny_ctr()
    layout = layout_for(ds, 1, DIM)
    batch, B = batch_of(ds, 2, 12)
    g = np.random.default_rng(3).normal(size=(B, len(layout.features), DIM)).astype(np.float32)
    values = batch.sparse.values().numpy()
    lengths = batch.sparse.lengths().numpy().reshape(len(layout.features), B)
    starts = np.concatenate([[0], np.cumsum(lengths.reshape(-1))])
    expected = np.zeros(B)
    for j in range(B):
        tables = {t.name: torch.zeros(t.num_rows, DIM, dtype=torch.float64, requires_grad=True) for t in layout.tables}
        loss = torch.zeros((), dtype=torch.float64)
        for f, spec in enumerate(layout.features):
            k = f * B + j
            ids = torch.from_numpy(values[starts[k]:starts[k + 1]].astype(np.int64))
            pooled = torch.nn.functional.embedding_bag(ids, tables[spec.table], torch.tensor([0]), mode=spec.pooling)
            loss = loss + (pooled[0] * torch.from_numpy(g[j, f]).double()).sum()
        loss.backward()
        expected[j] = sum(float(t.grad.pow(2).sum()) for t in tables.values())
    np.testing.assert_allclose(embedding_sq_norms(layout, batch.sparse, B, g), expected, rtol=1e-6, atol=1e-9)
