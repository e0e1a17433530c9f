"""Tiny in-memory datasets and engine builders for the trainer tests (no parquet; Ray only
when `make_engine(..., backend="ray")` is asked for)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from widedp.trainer.data.format.jagged import KeyedJaggedTensor

from widedp.accounting import PrivacyLedger
from widedp.selection.registry import get_selector, is_selector
from widedp.trainer.engine import Engine, EngineOptions, EnginePrivacy, PrivacyPlan
from widedp.trainer.engine.layout import FeatureSpec, ShardLayout, TableSpec
from widedp.trainer.models import MODELS
from widedp.trainer.engine.randomness import PrivacyRandomness


@dataclasses.dataclass
class Meta:
    features: list
    feature_tables: dict
    table_sizes: dict
    pooling: dict
    num_dense: int
    bayes_auc: float = None
    kind: str = "ctr"


@dataclasses.dataclass
class MemBatch:
    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor
    indices: np.ndarray

    @property
    def size(self):
        return int(self.indices.size)


class MemoryDataset:
    """bags[f][i] = list of ids of feature f in example i."""

    def __init__(self, meta: Meta, bags: dict, dense: np.ndarray, labels: np.ndarray):
        self.meta, self.bags, self.dense, self.labels = meta, bags, dense.astype(np.float32), labels.astype(np.float32)

    def __len__(self):
        return len(self.labels)

    def take(self, indices):
        indices = np.asarray(indices, dtype=np.int64)
        values, lengths = [], []
        for f in self.meta.features:
            for i in indices:
                values.extend(self.bags[f][i])
                lengths.append(len(self.bags[f][i]))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=list(self.meta.features), values=torch.tensor(values, dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int64))
        return MemBatch(kjt, torch.from_numpy(self.dense[indices]).reshape(len(indices), self.dense.shape[1]),
                        torch.from_numpy(self.labels[indices]), indices)

    def iter_batches(self, batch_size):
        for s in range(0, len(self), batch_size):
            yield self.take(np.arange(s, min(len(self), s + batch_size)))

    def feature_rows(self, feature):
        bags = self.bags[feature]
        offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])]).astype(np.int64)
        return offsets, np.array([i for b in bags for i in b], dtype=np.int64)


class ListSampler:
    """Replays a fixed list of index arrays (so an engine and a reference see the same batches)."""

    def __init__(self, batches):
        self.batches = [np.asarray(b, dtype=np.int64) for b in batches]
        self.position = 0

    def sample(self):
        if self.position >= len(self.batches):
            raise IndexError(f"ListSampler has only {len(self.batches)} batches")
        out = self.batches[self.position]
        self.position += 1
        return out.copy()

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, s):
        self.position = int(s["position"])


class SimpleSampler:
    """Poisson sampling by per-example Bernoulli draws (obvious; the real sampler is O(b))."""

    def __init__(self, n, q, seed):
        self.n, self.q, self.rng = n, q, np.random.default_rng(seed)

    def sample(self):
        return np.flatnonzero(self.rng.random(self.n) < self.q)

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, s):
        self.rng.bit_generator.state = s["rng"]


def tiny_ctr(n=64, tables=(23, 17), num_dense=3, seed=0, max_bag=3):
    """CTR-like data: feature 0 mean-pooled bags with repeats, feature 1 sum-pooled, feature 2
    shares table 1 with feature 1 (so one example can hit a row through two features)."""
    rng = np.random.default_rng(seed)
    meta = Meta(features=["f0", "f1", "f2"], feature_tables={"f0": "t0", "f1": "t1", "f2": "t1"},
                table_sizes={"t0": tables[0], "t1": tables[1]}, pooling={"f0": "mean", "f1": "sum", "f2": "sum"},
                num_dense=num_dense)
    bags = {}
    for f in meta.features:
        size = meta.table_sizes[meta.feature_tables[f]]
        bags[f] = []
        for _ in range(n):
            length = int(rng.integers(0, max_bag + 1))
            ids = rng.integers(0, min(size, 6), size=length).tolist()  # few hot ids: many repeats
            bags[f].append(ids)
    dense = rng.normal(size=(n, num_dense))
    labels = (rng.random(n) < 0.4).astype(np.float32)
    return MemoryDataset(meta, bags, dense, labels)


def poisson_batches(n, q, seed, steps):
    """The index arrays `SimpleSampler(n, q, seed)` yields in its first `steps` draws."""
    sampler = SimpleSampler(n, q, seed)
    return [sampler.sample() for _ in range(steps)]


def wide_ctr(n=48, tables=(23, 17, 2), num_dense=3, seed=0, max_bag=3):
    """Like tiny_ctr but ids span whole tables (so 2-3 shards all own touched rows), with hot
    ids spread over the table (repeats within bags and across examples), and a third, 2-row
    table (with 3 shards one shard owns none of its rows). f0: t0 mean; f1, f2: t1 sum (shared
    table); f3: t2 mean."""
    rng = np.random.default_rng(seed)
    meta = Meta(features=["f0", "f1", "f2", "f3"],
                feature_tables={"f0": "t0", "f1": "t1", "f2": "t1", "f3": "t2"},
                table_sizes={"t0": tables[0], "t1": tables[1], "t2": tables[2]},
                pooling={"f0": "mean", "f1": "sum", "f2": "sum", "f3": "mean"}, num_dense=num_dense)
    bags = {}
    for f in meta.features:
        size = meta.table_sizes[meta.feature_tables[f]]
        hot = np.unique([1 % size, size // 2, size - 1])
        bags[f] = []
        for _ in range(n):
            length = int(rng.integers(0, max_bag + 1))
            ids = np.where(rng.random(length) < 0.5, rng.choice(hot, size=length), rng.integers(0, size, size=length))
            bags[f].append([int(i) for i in ids])
    dense = rng.normal(size=(n, num_dense))
    labels = (rng.random(n) < 0.4).astype(np.float32)
    return MemoryDataset(meta, bags, dense, labels)


def tiny_cbow(n=40, vocab=(19, 13), negatives=2, seed=0, max_context=4):
    """CBOW-shaped data: `context` mean-pooled from table `input` (with repeats), `target` and
    `neg_i` single ids from table `output` (the target may equal a negative)."""
    rng = np.random.default_rng(seed)
    features = ["context", "target"] + [f"neg_{i}" for i in range(negatives)]
    meta = Meta(features=features, feature_tables={f: ("input" if f == "context" else "output") for f in features},
                table_sizes={"input": vocab[0], "output": vocab[1]},
                pooling={f: ("mean" if f == "context" else "sum") for f in features}, num_dense=1, kind="cbow")
    bags = {"context": [rng.integers(0, vocab[0], size=int(rng.integers(1, max_context + 1))).tolist() for _ in range(n)]}
    for f in features[1:]:
        bags[f] = [[int(rng.integers(0, vocab[1]))] for _ in range(n)]
    return MemoryDataset(meta, bags, np.zeros((n, 1)), np.ones(n))


def with_examples(ds, examples):
    """A copy of `ds` with extra examples appended: each is (bags: {feature: [ids]}, dense, label)."""
    bags = {f: [list(b) for b in ds.bags[f]] for f in ds.meta.features}
    dense, labels = [ds.dense], [ds.labels]
    for ex_bags, ex_dense, ex_label in examples:
        for f in ds.meta.features:
            bags[f].append(list(ex_bags.get(f, [])))
        dense.append(np.asarray(ex_dense, dtype=np.float32).reshape(1, -1))
        labels.append(np.asarray([ex_label], dtype=np.float32))
    return MemoryDataset(ds.meta, bags, np.concatenate(dense), np.concatenate(labels))


def engine_params(engine):
    """({table name: full [V_t, D] table}, {dense name: tensor}), read back from the shards."""
    states = engine.shards.broadcast("state_dict")
    tables = {t.name: torch.from_numpy(np.concatenate([s["weights"][i] for s in states]))
              for i, t in enumerate(engine.layout.tables)}
    return tables, {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def layout_for(ds, num_shards, dim=4):
    m = ds.meta
    return ShardLayout(tuple(TableSpec(t, s, dim) for t, s in m.table_sizes.items()),
                       tuple(FeatureSpec(f, m.feature_tables[f], m.pooling[f]) for f in m.features), num_shards)


# The selector parameters make_engine uses unless overridden, by config key (selection.registry).
PLAN_DEFAULTS = dict(selection_epsilon=0.5, selection_delta=1e-5, selection_sigma=1.5, score_clip=0.05, threshold=0.5,
                     contribution_clip=1.0, fest_noise_multiplier=2.0, fest_max_rows_per_example=32)
PLAN_FIELDS = {f.name for f in dataclasses.fields(PrivacyPlan)}


def make_plan(selection, *, sigma=0.8, second_clip=None, k=5, overrides=None):
    """A PrivacyPlan: `overrides` keys are PrivacyPlan fields or selector config keys."""
    overrides = dict(overrides or {})
    plan_kw = dict(noise_multiplier=sigma, clip_norm=1.0, second_clip_norm=second_clip, selection=selection)
    plan_kw.update({key: overrides.pop(key) for key in list(overrides) if key in PLAN_FIELDS})
    given = plan_kw.pop("selection_params", None)
    if not is_selector(plan_kw["selection"]):  # "none": DP-SGD
        return PrivacyPlan(**plan_kw, selection_params=None)
    selector = get_selector(plan_kw["selection"])
    if isinstance(given, dict):
        given = selector.Params(**given)
    if given is None:
        source = {**PLAN_DEFAULTS, "k": k, **overrides}
        source["delta"] = source["selection_delta"]
        given = selector.params_from(source, "config")
    return PrivacyPlan(**plan_kw, selection_params=given)


def make_engine(ds, *, num_shards=1, mode="sparse", selection="em", backend="local", optimizer="sgd", q=0.25,
                sigma=0.8, k=5, seed=0, dim=4, target_epsilon=1e9, second_clip=None, accountant="rdp",
                lr=0.1, dense_lr=0.05, model="dlrm", sampler=None, dense_optimizer="sgd", init_std=0.3,
                plan_overrides=None, dense_tables=(), ema_decay=0.0, num_trainers=1,
                selection_on_shards=False, trainer_actors=False, dense_reduction="coordinator", lead_fanout=8, fuse_selection=True,
                example_units=None,
                group_size=1, data_plane="calls", fold_write_back=None, norms_on_trainer=True, lazy_noise=False):
    """An engine over `ds`. Extras (defaults keep the original behaviour): `sampler` replaces
    the Poisson `SimpleSampler(len(ds), q, seed + 7)` (e.g. a `ListSampler`);
    `dense_optimizer` is "sgd" | "adam" | "adagrad" (lr = dense_lr); `plan_overrides` replaces
    PrivacyPlan fields (noise_multiplier, clip_norm, second_clip_norm, selection, selection_params
    as a dict or Params) or the selector's parameters by their config names (`privacy.<key>`:
    selection_epsilon, selection_sigma, threshold, score_clip, contribution_clip,
    fest_noise_multiplier, fest_max_rows_per_example, k; `selection_delta` for SVT's δ);
    `dense_tables`: table indices noised densely in sparse mode (trainer/config/table_policy.py);
    `trainer_actors`: the trainers as Ray actors (backend "ray"); `fuse_selection`: the
    shards select in the row-sum call when they can (one trainer); `example_units`: user level
    (a unit index per example; q and b stay as given); `group_size`: every event charged for
    groups of that many examples (user level by example sampling); `data_plane`: the Ray shard
    group's ("calls" or "compiled"); `fold_write_back`: the group's (None: its default, off
    in-process, on for Ray); `norms_on_trainer`: the engine's (False: the shards' norms round);
    `lazy_noise`: DP-SGD's noise deferred to each row's next read (trainer/engine/shard_update.py)."""
    from widedp.trainer.engine.shard_group import InProcessShardGroup
    from widedp.trainer.cluster.ray_shards import RayShardGroup
    from widedp.trainer.cluster.ray_trainers import ray_trainer_factory

    layout = layout_for(ds, num_shards, dim)
    torch.manual_seed(seed)
    net = MODELS[model](features=list(ds.meta.features), embedding_dim=dim, num_dense=ds.meta.num_dense,
                        bottom_mlp=[5], top_mlp=[5])
    kwargs = dict(optimizer=optimizer, lr=lr, seed=seed, init_std=init_std, ema_decay=ema_decay, lazy_noise=lazy_noise)
    fold = {} if fold_write_back is None else {"fold_write_back": fold_write_back}
    shards = InProcessShardGroup(layout, **fold, **kwargs) if backend == "local" else RayShardGroup(
        layout, cpus_per_shard=0.25, data_plane=data_plane, **fold, **kwargs)
    plan = None
    ledger = None
    if mode != "nonprivate":
        plan = make_plan(selection, sigma=sigma, second_clip=second_clip, k=k, overrides=plan_overrides)
        ledger = PrivacyLedger(accountant, 1e-5)
    dense_params = [p for p in net.parameters() if p.numel()] or list(net.parameters())
    optimizers = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad}
    privacy = None if plan is None else EnginePrivacy(plan, ledger, target_epsilon, group_size=group_size)
    options = EngineOptions(num_trainers=num_trainers, selection_on_shards=selection_on_shards,
                            trainer_group=ray_trainer_factory(0.25, dense_reduction, lead_fanout) if trainer_actors else None,
                            fuse_selection=fuse_selection, norms_on_trainer=norms_on_trainer)
    return Engine(net, layout, shards, ds, SimpleSampler(len(ds), q, seed + 7) if sampler is None else sampler,
                  mode=mode, expected_batch_size=q * len(ds), sample_rate=q,
                  dense_optimizer=optimizers[dense_optimizer](dense_params, lr=dense_lr), privacy=privacy,
                  randomness=PrivacyRandomness.from_seed(seed), options=options, dense_tables=dense_tables,
                  ema_decay=ema_decay, example_units=example_units)
