"""Sequence features (a TorchRec `EmbeddingCollection`'s id lists, read position by position) and
tables of different widths through `make_private` (trainer/private/features.py): the position
bags are each example's last L ids, and one private step's clipped sums — the tables' rows and
the dense module's parameters — equal a per-example reference in plain PyTorch, in which an id
an example holds at several positions adds its gradients into one row before the norm."""

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from widedp.trainer.private import KJTDataset, make_private
from widedp.trainer.private.features import embedding_inputs, expand_batch, expand_feature_rows

L = 5  # the history's max_sequence_length
ITEMS, USERS = 40, 30


def _modules():
    torch.manual_seed(0)  # public initialization of the test's tables
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="user_table", embedding_dim=4, num_embeddings=USERS, feature_names=["user"], pooling=PoolingType.MEAN)])
    ec = EmbeddingCollection(tables=[EmbeddingConfig(
        name="item_table", embedding_dim=8, num_embeddings=ITEMS, feature_names=["history", "target"])])
    return [ebc, ec]


def _data(n=300, seed=0):
    """history: 0..8 ids (often more than L, often repeating), target: one item, user: 1..2 ids."""
    rng = np.random.default_rng(seed)
    hist_len = rng.integers(0, 9, n)
    hist = rng.integers(0, ITEMS // 4, int(hist_len.sum()))  # few distinct items: repeats within a history
    target = rng.integers(0, ITEMS, n)
    user_len = rng.integers(1, 3, n)
    user = rng.integers(0, USERS, int(user_len.sum()))
    starts = np.concatenate([[0], np.cumsum(hist_len)[:-1]])
    labels = np.array([float(t in hist[s:s + k]) for t, s, k in zip(target, starts, hist_len)], np.float32)
    kjt = KeyedJaggedTensor(keys=["history", "target", "user"],
                            values=torch.from_numpy(np.concatenate([hist, target, user])),
                            lengths=torch.from_numpy(np.concatenate([hist_len, np.ones(n), user_len]).astype(np.int32)))
    return KJTDataset(kjt, torch.from_numpy(labels), dense=torch.from_numpy(rng.normal(size=(n, 2)).astype(np.float32)))


class SequenceModel(nn.Module):
    """Self-attention-free sequential scorer: positions + Linear over the sequence dimension,
    LayerNorm, a masked mean, the target and the user."""

    def __init__(self):
        super().__init__()
        self.position = nn.Embedding(L, 8)
        self.mix = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8 + 8 + 4 + 2, 1)

    def forward(self, emb, dense, lengths):
        mask = (torch.arange(L) < lengths["history"].unsqueeze(1)).to(dense.dtype).unsqueeze(-1)
        h = self.norm(torch.relu(self.mix(emb["history"] + self.position(torch.arange(L).expand(dense.shape[0], L))))) * mask
        summary = h.sum(1) / mask.sum(1).clamp(min=1.0)
        return self.out(torch.cat([summary, emb["target"][:, 0], emb["user"], dense], 1)).squeeze(-1)


def bce(outputs, labels):
    return nn.functional.binary_cross_entropy_with_logits(outputs, labels, reduction="none")


LENGTHS = {"history": L, "target": 1}


# ---- the position bags ---------------------------------------------------------------------------------------

def _kept(ids: list, length: int, keep: str = "first") -> list:
    return ids[:length] if keep == "first" else ids[max(0, len(ids) - length):]


@pytest.mark.parametrize("keep", ["first", "last"])
def test_position_bags_hold_each_examples_kept_ids(keep):
    data = _data(n=60)
    inputs = embedding_inputs(_modules(), 1, LENGTHS, keep)
    assert [f.name for f in inputs.layout.features] == ["user", *[f"history@{p}" for p in range(L)], "target@0"]
    batch = data.take(np.arange(60))
    sparse, dense = expand_batch(inputs, batch.sparse, batch.dense)
    per = sparse.to_dict()
    raw = batch.sparse.to_dict()
    for j in range(60):
        kept = _kept(raw["history"].to_dense()[j].tolist(), L, keep)
        for p in range(L):
            assert per[f"history@{p}"].to_dense()[j].tolist() == ([kept[p]] if p < len(kept) else [])
        assert per["target@0"].to_dense()[j].tolist() == raw["target"].to_dense()[j].tolist()
        assert per["user"].to_dense()[j].tolist() == raw["user"].to_dense()[j].tolist()
        assert dense[j, 2:].tolist() == [len(kept), 1.0] and torch.equal(dense[j, :2], batch.dense[j])
    # the whole-data-set rows (DP-FEST's input) agree with the batches
    for p in range(L):
        offsets, ids = expand_feature_rows(inputs, f"history@{p}", data.feature_rows)
        jt = per[f"history@{p}"]
        assert np.array_equal(np.diff(offsets), jt.lengths().numpy()) and np.array_equal(ids, jt.values().numpy())


def test_sequence_settings_are_checked():
    with pytest.raises(ValueError, match=r"sequence feature 'history' \(an EmbeddingCollection's\) needs max_sequence_length"):
        embedding_inputs(_modules(), 1)
    with pytest.raises(ValueError, match="max_sequence_length has no entry for sequence feature 'target'"):
        embedding_inputs(_modules(), 1, {"history": 3})
    with pytest.raises(ValueError, match=r"max_sequence_length of 'history' must be an integer >= 1, got 0"):
        embedding_inputs(_modules(), 1, {"history": 0, "target": 1})
    with pytest.raises(ValueError, match=r"max_sequence_length names \['clicks'\], which are not sequence features"):
        embedding_inputs(_modules(), 1, {**LENGTHS, "clicks": 2})
    with pytest.raises(ValueError, match=r"sequence_keep must be one of \('first', 'last'\), got 'newest'"):
        embedding_inputs(_modules(), 1, LENGTHS, "newest")
    with pytest.raises(ValueError, match="table name 'item_table' is used twice"):
        embedding_inputs([*_modules(), EmbeddingConfig(name="item_table", embedding_dim=8, num_embeddings=3,
                                                       feature_names=["other"])], 1, 2)
    with pytest.raises(ValueError, match='pooled_as = "tensor" needs pooled features of one embedding width'):
        make_private(_modules(), SequenceModel(), bce, _data(n=50), target_epsilon=4.0, batch_size=10, steps=2,
                     max_sequence_length=LENGTHS, pooled_as="tensor")


# ---- one step against the per-example reference ----------------------------------------------------------------

def _reference_lookup(tables: dict, batch, feature_lengths=LENGTHS):
    """The user's view of a batch in plain PyTorch: {feature: [B, D] mean-pooled user, [B, L, D] padded
    sequences} from the tables (autograd leaves) and the kept lengths."""
    raw = {f: jt.to_dense() for f, jt in batch.sparse.to_dict().items()}
    B = len(raw["user"])
    emb, lengths = {}, {}
    emb["user"] = torch.stack([tables["user_table"][torch.tensor(raw["user"][j])].mean(0) for j in range(B)])
    for f, length in feature_lengths.items():
        rows = []
        for j in range(B):
            kept = _kept(raw[f][j].tolist(), length)
            seq = [tables["item_table"][i] for i in kept] + [torch.zeros(8)] * (length - len(kept))
            rows.append(torch.stack(seq))
        emb[f] = torch.stack(rows)
        lengths[f] = torch.tensor([min(len(raw[f][j]), length) for j in range(B)])
    return emb, lengths


@pytest.mark.parametrize("method", ["ghost", "per_example"])
def test_one_steps_clipped_sums_equal_the_per_example_reference(method):
    data = _data()
    clip = 0.05  # small enough that (nearly) every example is clipped
    with make_private(_modules(), SequenceModel(), bce, data, mode="dpsgd", target_epsilon=8.0, batch_size=40,
                      steps=5, max_sequence_length=LENGTHS,
                      config=[f"privacy.clip_norm={clip}", "train.optimizer=sgd"]) as trainer:
        role = trainer.engine.trainers.roles[0]
        role.options = dataclasses.replace(role.options, dense_grad_method=method)
        idx = np.arange(0, 300, 7)
        part = role.step_part(idx)
        b = role.options.expected_batch_size
        state = trainer.embedding_state_dict()
        module = trainer.model.module
        # the reference: per example, the gradient over both tables (at their own widths) and the module
        tables = {"user_table": state["embedding_bags.user_table.weight"].clone().requires_grad_(),
                  "item_table": state["embeddings.item_table.weight"].clone().requires_grad_()}
        params = dict(module.named_parameters())
        want_rows = {t: torch.zeros_like(w, dtype=torch.float64) for t, w in tables.items()}
        want_dense = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
        norms = []
        for j in range(idx.size):
            one = data.take(idx[j:j + 1])
            emb, lengths = _reference_lookup(tables, one)
            loss = bce(module(emb, one.dense, lengths), one.labels).sum()
            leaves = [*tables.values(), *params.values()]
            grads = torch.autograd.grad(loss, leaves)
            norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
            norms.append(norm)
            factor = min(1.0, clip / norm)
            for t, g in zip(tables, grads[:2]):
                want_rows[t] += factor * g.double()
            for n, g in zip(params, grads[2:]):
                want_dense[n] += factor * g.double()
        got_rows = {t: torch.zeros_like(w, dtype=torch.float64) for t, w in want_rows.items()}
        names = [t.name for t in trainer.layout.tables]
        for shard in part.row_sums:
            t_idx, ids, sums = shard[0], shard[1], shard[2]
            for t, r, s in zip(np.asarray(t_idx), np.asarray(ids), torch.as_tensor(sums)):
                name = names[int(t)]
                width = want_rows[name].shape[1]
                assert torch.all(s[width:] == 0), "a padded column received gradient"
                got_rows[name][int(r)] += s[:width].double()
        for t in want_rows:
            assert torch.allclose(got_rows[t], want_rows[t], rtol=1e-4, atol=1e-7), t
        for n in want_dense:
            assert torch.allclose(part.dense_sum[f"module.{n}"] * b, want_dense[n], rtol=1e-4, atol=1e-7), n
        assert part.batch_size == idx.size and len(norms) == idx.size
        assert sum(n > clip for n in norms) > idx.size // 2  # clipping binds: the factors are tested


def test_repeated_ids_add_into_one_row_before_the_norm():
    """The engine's per-example norm of the history's rows merges an id held at several
    positions; the broken variant (each position its own row) gives a different, larger value
    for the examples with repeats — the engine matches the merged one."""
    from widedp.trainer.engine.example_norms import embedding_sq_norms

    data = _data(n=80)
    inputs = embedding_inputs(_modules(), 1, LENGTHS)
    batch = data.take(np.arange(80))
    sparse, _ = expand_batch(inputs, batch.sparse, batch.dense)
    F = len(inputs.layout.features)
    g = np.random.default_rng(1).normal(size=(80, F, inputs.width)).astype(np.float32)
    g[:, 0, 4:] = 0  # the user table's padded columns get no gradient from the module
    g[:, 1:, :] = np.abs(g[:, 1:, :])  # same-sign position gradients: merging repeats changes the norm
    got = embedding_sq_norms(inputs.layout, sparse, 80, g)
    per = sparse.to_dict()
    lengths = {f.name: per[f.name].lengths().numpy() for f in inputs.layout.features}
    values = {f.name: per[f.name].values().numpy() for f in inputs.layout.features}
    offsets = {k: np.concatenate([[0], np.cumsum(v)]) for k, v in lengths.items()}
    repeats = 0
    for j in range(80):
        rows: dict = {}
        separate = 0.0
        for k, f in enumerate(inputs.layout.features):
            ids = values[f.name][offsets[f.name][j]:offsets[f.name][j + 1]]
            weight = 1.0 / max(len(ids), 1) if f.pooling == "mean" else 1.0
            for i in ids:
                key = (f.table, int(i))
                rows[key] = rows.get(key, 0) + weight * g[j, k].astype(np.float64)
                separate += float(np.sum((weight * g[j, k].astype(np.float64)) ** 2))
        merged = sum(float(np.sum(v ** 2)) for v in rows.values())
        assert got[j] == pytest.approx(merged, rel=1e-5)
        if not np.isclose(merged, separate, rtol=1e-5):
            repeats += 1
            assert got[j] != pytest.approx(separate, rel=1e-5)
    assert repeats > 10  # the data has examples whose history repeats an item


# ---- training, and the tables handed back ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["sparse", "dpsgd"])
def test_trains_and_hands_back_tables_at_their_own_widths(mode):
    data = _data(n=400)
    train, test = data.split(0.25, seed=0)
    ebc, ec = _modules()
    with make_private([ebc, ec], SequenceModel(), bce, train, mode=mode, target_epsilon=8.0, batch_size=50,
                      steps=6, max_sequence_length=LENGTHS,
                      config=["train.optimizer=sgd", "train.lr=0.5", "privacy.clip_norm=1.0"]) as trainer:
        assert trainer.train() == 6 and 0 < trainer.epsilon() <= 8.0
        state = trainer.embedding_state_dict()
        assert set(state) == {"embedding_bags.user_table.weight", "embeddings.item_table.weight"}
        assert state["embedding_bags.user_table.weight"].shape == (USERS, 4)
        assert state["embeddings.item_table.weight"].shape == (ITEMS, 8)
        ebc.load_state_dict({k: v for k, v in state.items() if k.startswith("embedding_bags.")})
        ec.load_state_dict({k: v for k, v in state.items() if k.startswith("embeddings.")})
        metrics = trainer.evaluate(test)
        assert {"auc", "logloss", "ece"} <= set(metrics)
        # the released model in plain PyTorch: the loaded modules' tables and the dense module
        out = trainer.predict(test)
        batch = test.take(np.arange(len(test)))
        tables = {"user_table": ebc.embedding_bags["user_table"].weight.detach(),
                  "item_table": ec.embeddings["item_table"].weight.detach()}
        emb, lengths = _reference_lookup(tables, batch)
        with torch.no_grad():
            want = trainer.model.module(emb, batch.dense, lengths)
        assert torch.allclose(out, want, atol=1e-5)


@pytest.fixture
def own_ray():
    import ray

    started = not ray.is_initialized()
    yield
    if started and ray.is_initialized():
        ray.shutdown()


def test_sequences_on_ray_shard_actors_are_the_in_process_run(own_ray):
    """backend="ray", two row-shards per table: with one reproducible seed the released tables
    and ε equal the in-process run's, bit for bit."""
    got = {}
    for backend in ("local", "ray"):
        torch.manual_seed(0)
        with make_private(_modules(), SequenceModel(), bce, _data(n=300), target_epsilon=4.0, batch_size=40,
                          steps=3, backend=backend, num_shards=2, max_sequence_length=LENGTHS,
                          config=["train.optimizer=sgd", "privacy.reproducible=true", "privacy.noise_seed=5",
                                  "privacy.gamma=0.2"]) as trainer:
            assert trainer.train() == 3
            got[backend] = (trainer.embedding_state_dict(), trainer.epsilon())
    (local, eps_local), (ray_tables, eps_ray) = got["local"], got["ray"]
    assert eps_local == eps_ray
    for key in local:
        torch.testing.assert_close(local[key], ray_tables[key], rtol=0, atol=0)


# ---- weighted bags ----------------------------------------------------------------------------------------------

def _weighted_data(n=200, seed=3, most=4):
    """A weighted bag of 1..`most` (id, weight) pairs (ids repeat within a bag) and a plain one."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, most + 1, n)
    ids = rng.integers(0, 12, int(lens.sum()))
    weights = rng.uniform(-2.0, 3.0, int(lens.sum())).astype(np.float32)
    user = rng.integers(0, USERS, n)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    labels = np.array([float((weights[s:s + k] * (ids[s:s + k] % 3)).sum() > 1.0) for s, k in zip(starts, lens)],
                      np.float32)
    kjt = KeyedJaggedTensor(keys=["scores", "user"], values=torch.from_numpy(np.concatenate([ids, user])),
                            lengths=torch.from_numpy(np.concatenate([lens, np.ones(n)]).astype(np.int32)),
                            weights=torch.from_numpy(np.concatenate([weights, np.ones(n, np.float32)])))
    return KJTDataset(kjt, torch.from_numpy(labels), dense=torch.from_numpy(rng.normal(size=(n, 2)).astype(np.float32)))


def _weighted_modules():
    torch.manual_seed(1)
    scored = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="score_table", embedding_dim=8, num_embeddings=12, feature_names=["scores"])], is_weighted=True)
    plain = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="user_table", embedding_dim=4, num_embeddings=USERS, feature_names=["user"], pooling=PoolingType.MEAN)])
    return [scored, plain]


class WeightedTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8 + 4 + 2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, emb, dense):
        return self.mlp(torch.cat([emb["scores"], emb["user"], dense], 1)).squeeze(-1)


@pytest.mark.parametrize("most", [4, 1])
def test_weighted_bags_step_equals_torchrecs_weighted_collection_per_example(most):
    """A weighted EmbeddingBagCollection (per-id weights, repeated ids; or one id per bag, where
    the unweighted norms take a shortcut that weights must not): one step's clipped row and dense
    sums equal per-example gradients through TorchRec's own weighted EBC forward."""
    data = _weighted_data(most=most)
    modules = _weighted_modules()
    clip = 0.05
    with make_private(modules, WeightedTower(), bce, data, mode="dpsgd", target_epsilon=8.0, batch_size=40, steps=3,
                      config=[f"privacy.clip_norm={clip}", "train.optimizer=sgd"]) as trainer:
        role = trainer.engine.trainers.roles[0]
        idx = np.arange(0, 200, 5)
        part = role.step_part(idx)
        b = role.options.expected_batch_size
        module = trainer.model.module
        scored, plain = modules
        leaves = [scored.embedding_bags["score_table"].weight, plain.embedding_bags["user_table"].weight,
                  *module.parameters()]
        want = [torch.zeros_like(p, dtype=torch.float64) for p in leaves]
        clipped = 0
        for j in idx:
            one = data.take(np.array([j]))
            sub = lambda keys: KJTDataset(one.sparse, one.labels, one.dense, features=keys).take([0]).sparse  # noqa
            emb = {**scored(sub(["scores"])).to_dict(), **plain(sub(["user"])).to_dict()}
            grads = torch.autograd.grad(bce(module(emb, one.dense), one.labels).sum(), leaves)
            norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
            clipped += norm > clip
            for w, g in zip(want, grads):
                w += min(1.0, clip / norm) * g.double()
        got = [torch.zeros_like(w) for w in want[:2]]
        for t_idx, ids, sums, *_ in part.row_sums:
            for t, r, s in zip(np.asarray(t_idx), np.asarray(ids), torch.as_tensor(sums)):
                width = got[int(t)].shape[1]
                got[int(t)][int(r)] += s[:width].double()
        for g, w in zip(got, want[:2]):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)
        for (name, p), w in zip(module.named_parameters(), want[2:]):
            torch.testing.assert_close(part.dense_sum[f"module.{name}"] * b, w, rtol=1e-4, atol=1e-7)
        assert clipped > idx.size // 2
        # the released model in plain PyTorch: TorchRec's weighted EBC over the released tables
        state = trainer.embedding_state_dict()
        scored.load_state_dict({k: v for k, v in state.items() if "score_table" in k})
        plain.load_state_dict({k: v for k, v in state.items() if "user_table" in k})
        test = data.subset(np.arange(150, 200))
        batch = test.take(np.arange(50))
        emb = {**scored(test.with_features(["scores"]).take(np.arange(50)).sparse).to_dict(),
               **plain(test.with_features(["user"]).take(np.arange(50)).sparse).to_dict()}
        with torch.no_grad():
            torch.testing.assert_close(trainer.predict(test), module(emb, batch.dense), rtol=1e-5, atol=1e-5)


def test_weighted_features_need_weights_and_sum_pooling():
    data = _data(n=60)
    with pytest.raises(ValueError, match=r"features \['scores'\] are a weighted EmbeddingBagCollection's"):
        unweighted = _weighted_data()
        kjt = unweighted.take(np.arange(len(unweighted))).sparse
        plain = KJTDataset(KeyedJaggedTensor(kjt.keys(), kjt.values(), lengths=kjt.lengths()), unweighted.labels,
                           unweighted.dense)
        make_private(_weighted_modules(), WeightedTower(), bce, plain, target_epsilon=4.0, batch_size=10, steps=2)
    with pytest.raises(ValueError, match="a weighted EmbeddingBagCollection pools by SUM"):
        embedding_inputs(EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name="t", embedding_dim=4, num_embeddings=5, feature_names=["f"], pooling=PoolingType.MEAN)],
            is_weighted=True), 1)
    assert len(data) == 60
