"""Placement: which shard owns which rows, and routing a batch's ids to the shards.

Block bucketing: shard s owns rows [s·⌈V/S⌉, (s+1)·⌈V/S⌉) of every table of V rows. Routing is
local compute over the batch's KeyedJaggedTensor; storage never moves. Also: deterministic,
partition-independent per-row random numbers (initialization, DP-SGD noise), so a table's
values do not depend on how many shards hold it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from widedp.selection.keyed_random import NoiseKey, standard_normals, uniforms
from widedp.selection._sparse import unique_ints


@dataclasses.dataclass(frozen=True)
class TableSpec:
    name: str
    num_rows: int
    dim: int


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    name: str
    table: str
    pooling: str  # "sum" | "mean"
    weighted: bool = False  # ids carry the KJT's per-id weights (a weighted EmbeddingBagCollection's)


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    tables: tuple[TableSpec, ...]
    features: tuple[FeatureSpec, ...]
    num_shards: int

    def __post_init__(self):
        names = {t.name for t in self.tables}
        for f in self.features:
            if f.table not in names:
                raise ValueError(f"feature {f.name!r} uses unknown table {f.table!r}")
            if f.pooling not in ("sum", "mean"):
                raise ValueError(f"feature {f.name!r}: pooling must be 'sum' or 'mean', got {f.pooling!r}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        dims = {t.dim for t in self.tables}
        if len(dims) != 1:
            raise ValueError(f"all tables must share one embedding dim, got {sorted(dims)}")

    @property
    def dim(self) -> int:
        return self.tables[0].dim

    def table_index(self, name: str) -> int:
        return [t.name for t in self.tables].index(name)

    @property
    def feature_tables(self) -> np.ndarray:
        """The table index of each feature (int64, in `features` order)."""
        return np.array([self.table_index(f.table) for f in self.features], dtype=np.int64)

    @property
    def tables_unshared(self) -> bool:
        """Every feature reads a table of its own (no two features share one)."""
        tables = self.feature_tables
        return bool(np.unique(tables).size == tables.size)

    @property
    def weighted(self) -> bool:
        """Some feature's ids carry per-id weights."""
        return any(f.weighted for f in self.features)

    def no_row_repeats(self, lengths: np.ndarray) -> bool:
        """No example of a batch touches a (table, row) twice: tables unshared and every bag
        (`lengths`, a KJT's) holds at most one id."""
        return self.tables_unshared and (lengths.size == 0 or int(lengths.max()) <= 1)

    def block_size(self, table: TableSpec) -> int:
        return -(-table.num_rows // self.num_shards)

    def row_range(self, table: TableSpec, shard: int) -> tuple[int, int]:
        b = self.block_size(table)
        return min(shard * b, table.num_rows), min((shard + 1) * b, table.num_rows)

    def owner(self, table_idx: np.ndarray, row_ids: np.ndarray) -> np.ndarray:
        """The shard that owns each (table index, row id within the table): the one placement rule
        (block bucketing; `row_range` is its inverse). Vectorized; int64."""
        blocks = np.array([max(self.block_size(t), 1) for t in self.tables], dtype=np.int64)
        row_ids = np.asarray(row_ids, dtype=np.int64)
        return row_ids // blocks[np.asarray(table_idx, dtype=np.int64)] if row_ids.size else np.empty(0, np.int64)

    def shard_start(self, table_idx: np.ndarray, shard: np.ndarray) -> np.ndarray:
        """First row (within its table) owned by `shard`: local id = row id − shard_start."""
        blocks = np.array([self.block_size(t) for t in self.tables], dtype=np.int64)
        return np.asarray(shard, dtype=np.int64) * blocks[np.asarray(table_idx, dtype=np.int64)]

    @property
    def table_offsets(self) -> np.ndarray:
        """Global row id of each table's row 0 (tables concatenated: the selection vocabulary)."""
        return np.concatenate([[0], np.cumsum([t.num_rows for t in self.tables])]).astype(np.int64)

    @property
    def vocabulary_size(self) -> int:
        return int(sum(t.num_rows for t in self.tables))


@dataclasses.dataclass
class ShardInput:
    """One shard's part of a batch: flat arrays over the ids it owns (feature-major order)."""

    example: np.ndarray  # int64 example index in the batch
    feature: np.ndarray  # int64 feature index
    local_id: np.ndarray  # int64 row id local to the shard's range of the feature's table
    weight: np.ndarray  # float32 per-id weight (1 for sum pooling, 1/|bag| for mean)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.example, self.feature, self.local_id, self.weight))

    def __getstate__(self) -> dict:  # the memo of `bags` does not travel
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def bags(self, batch_size: int) -> "ShardBags":
        """The distinct (example, feature) bags this shard holds ids of, feature-major. The
        coordinator and the shard both derive them from the routed ids, so per-bag arrays
        (partial pooled embeddings, pooled-output gradients) travel without their indices.
        Computed once per batch size (in-process, the trainer and the shard share the object)."""
        memo = self.__dict__.setdefault("_bags_memo", {})
        if batch_size not in memo:
            memo[batch_size] = self._bags(batch_size)
        return memo[batch_size]

    def _bags(self, batch_size: int) -> "ShardBags":
        key = self.feature * batch_size + self.example
        features = int(self.feature.max()) + 1 if self.feature.size else 0
        uniq, id_bag = unique_ints(key, return_inverse=True, upper=features * batch_size)
        examples, id_example = unique_ints(self.example, return_inverse=True, upper=batch_size)
        return ShardBags(uniq % batch_size, uniq // batch_size, id_bag, examples, id_example)


@dataclasses.dataclass(frozen=True)
class ShardBags:
    """`ShardInput.bags`: bag b is (example[b], feature[b]); id i lies in bag id_bag[i]; the
    shard's distinct examples (sorted), id i's example being examples[id_example[i]]."""

    example: np.ndarray
    feature: np.ndarray
    id_bag: np.ndarray
    examples: np.ndarray
    id_example: np.ndarray


def id_coordinates(lengths: np.ndarray, num_features: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(feature, example) of every id of a KJT whose lengths are feature-major — lengths[f·B + j]
    is the bag size of feature f for example j — in the KJT's value order."""
    lengths = np.asarray(lengths).reshape(-1)
    feature = np.repeat(np.repeat(np.arange(num_features), batch_size), lengths)
    example = np.repeat(np.tile(np.arange(batch_size), num_features), lengths)
    return feature, example


def id_weights(layout: ShardLayout, lengths: np.ndarray, feature: np.ndarray, example: np.ndarray,
               batch_size: int, kjt=None) -> np.ndarray:
    """Each id's pooling weight w_i (float32): 1/|bag| for mean pooling, 1 for sum pooling,
    times the id's own weight in the KJT (`kjt.weights()`) for a weighted feature — the pooled
    embedding is Σ_i w_i E[id_i] either way. `route` sends them to the shards;
    trainer/engine/example_norms.py uses them for the norms. `lengths`: feature-major [F·B];
    `feature`, `example`: per id."""
    bag = lengths[feature * batch_size + example]
    mean = np.array([f.pooling == "mean" for f in layout.features], dtype=bool)
    w = np.where(mean[feature], 1.0 / np.maximum(bag, 1), 1.0).astype(np.float32)
    if layout.weighted:
        given = None if kjt is None else kjt.weights_or_none()
        if given is None:
            names = [f.name for f in layout.features if f.weighted]
            raise ValueError(f"weighted features {names} need a KeyedJaggedTensor with weights")
        weighted = np.array([f.weighted for f in layout.features], dtype=bool)
        w = np.where(weighted[feature], w * given.numpy().astype(np.float32, copy=False), w).astype(np.float32)
    return w


def route(layout: ShardLayout, kjt, batch_size: int, example_ids=None) -> list[ShardInput]:
    """Split a batch's ids (KeyedJaggedTensor with keys == layout features) by owning shard.

    Raises ValueError naming the feature, example (its dataset index when `example_ids` is
    given) and id for an id outside its table.
    """
    keys = list(kjt.keys())
    expected = [f.name for f in layout.features]
    if keys != expected:
        raise ValueError(f"batch features {keys} do not match the model's features {expected}")
    values = kjt.values().numpy().astype(np.int64, copy=False)
    lengths = kjt.lengths().numpy().astype(np.int64, copy=False)
    feature, example = id_coordinates(lengths, len(keys), batch_size)
    weight = id_weights(layout, lengths, feature, example, batch_size, kjt)
    table_rows = np.array([layout.tables[layout.table_index(f.table)].num_rows for f in layout.features])
    table_of_feature = layout.feature_tables
    if values.size:
        bad = np.flatnonzero((values < 0) | (values >= table_rows[feature]))
        if bad.size:
            i = bad[0]
            f = layout.features[feature[i]]
            name = f"dataset example {example_ids[example[i]]}" if example_ids is not None else f"example {example[i]}"
            raise ValueError(
                f"feature {f.name!r}, {name}: id {values[i]} outside table {f.table!r} "
                f"of {table_rows[feature[i]]} rows"
            )
    table = table_of_feature[feature] if values.size else np.empty(0, np.int64)
    shard = layout.owner(table, values)
    local = values - layout.shard_start(table, shard)
    out = []
    for s in range(layout.num_shards):
        sel = np.flatnonzero(shard == s)
        out.append(ShardInput(example[sel], feature[sel], local[sel], weight[sel]))
    return out


def public_key(seed: int) -> NoiseKey:
    """The key of a public, seeded draw (initialization from `train.seed`): not a privacy path."""
    return NoiseKey(int(seed) % (1 << 128))


def row_block_normal(key: NoiseKey, domain: str, step: int, table: int, start: int, end: int, dim: int,
                     std: float) -> torch.Tensor:
    """N(0, std²) values (float32) for global rows [start, end) of a table, identical however the
    rows are partitioned: row r's values are values [r·dim, (r+1)·dim) of the stream of
    `key.derive(domain, step, table)` (`selection.keyed_random.standard_normals`: AES-128-CTR under
    the 128-bit key; AES-256 and the 4-draw Gaussian when `key.secure`)."""
    z = standard_normals(key.derive(domain, int(step), int(table)), start * dim, (end - start) * dim)
    return z.view(end - start, dim).to(torch.float32).mul_(std)


def row_block_uniform(key: NoiseKey, domain: str, step: int, table: int, start: int, end: int, dim: int) -> torch.Tensor:
    """U[0, 1) values for rows [start, end), partition-independent like `row_block_normal`
    (ModelMix's mixing weights, trainer/engine/modelmix.py)."""
    return uniforms(key.derive(domain, int(step), int(table)), start * dim, (end - start) * dim).view(end - start, dim)
