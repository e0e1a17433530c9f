"""The user's embedding inputs — pooled bags (`EmbeddingBagCollection`), sequences
(`EmbeddingCollection`), tables of different widths — in the engine's one form: pooled bags of
one width over row-sharded tables.

Privacy assumption: none of its own; what the engine clips must be each example's whole
gradient over the rows it reads, and that holds here because nothing changes which rows an
example reads or how its gradient reaches them:
- a sequence feature of at most L ids becomes L one-id "position" bags over the same table
  (position p holds the example's p-th kept id: of its first L ids, as TorchRec's
  `to_padded_dense` truncates, or of its last L). The gradient of the row behind an id is the
  gradient at its position, and an example that holds an id at several positions (or in several
  features of one table) contributes the sum of those gradients to that row once — the engine
  groups an example's ids by (table, row) before it takes the norm
  (trainer/engine/example_norms.py, ShardGradients.example_sq_norms), so the sensitivity is S1
  per example as for bags. The ids an example holds beyond L are dropped (`keep`), a function
  of that example alone;
- a table narrower than the widest is stored at the widest width; the dense module reads only
  its own width, so the extra columns get gradient 0 (norms unchanged) and, in the private
  modes, noise that nothing reads. Row-wise Adagrad would average its accumulator over those
  columns too, so tables of different widths are refused with it.
The lengths of an example's sequences are that example's own input; they reach the dense module
as extra dense columns of the example and are released no more than its ids are.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from widedp.trainer.engine.layout import FeatureSpec, ShardLayout, TableSpec

_POOLINGS = {"SUM": "sum", "MEAN": "mean"}
POSITION_SEPARATOR = "@"


@dataclasses.dataclass(frozen=True)
class EmbeddingInputs:
    """What the user's embedding modules hand the dense module, and how the engine holds it.

    Attributes:
        layout: the engine's layout (sequence features as position bags, one width).
        tables: {table: its own embedding width}.
        table_kind: {table: "bag" (EmbeddingBagCollection) or "sequence" (EmbeddingCollection)}.
        pooled: the pooled features, in order: (name, table).
        sequences: the sequence features, in order: (name, table, L — the most ids kept).
        order: every user feature name in the modules' order.
        keep: which L ids of a longer sequence are kept — "first" or "last".
    """

    layout: ShardLayout
    tables: Mapping[str, int]
    table_kind: Mapping[str, str]
    pooled: tuple
    sequences: tuple
    order: tuple
    keep: str = "first"

    @property
    def width(self) -> int:
        return self.layout.dim

    @property
    def uniform(self) -> bool:
        """Only pooled features, one width: the engine's features are the user's."""
        return not self.sequences and len(set(self.tables.values())) == 1

    @property
    def weighted(self) -> bool:
        """Some pooled feature is a weighted EmbeddingBagCollection's (per-id weights)."""
        return self.layout.weighted

    @property
    def feature_table(self) -> dict[str, str]:
        """{user feature: its table}, in the modules' order."""
        tables = {**dict(self.pooled), **{name: table for name, table, _ in self.sequences}}
        return {f: tables[f] for f in self.order}

    @property
    def engine_features(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.layout.features)

    def state_key(self, table: str) -> str:
        """The table's weight under its TorchRec module's state-dict key."""
        return f"{'embedding_bags' if self.table_kind[table] == 'bag' else 'embeddings'}.{table}.weight"


def position_name(feature: str, position: int) -> str:
    return f"{feature}{POSITION_SEPARATOR}{position}"


def _configs(embeddings) -> list[tuple[str, Any, bool]]:
    """[(kind, config, weighted)] from EBC / EC modules, their config lists, or a list mixing them."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    items = list(embeddings) if isinstance(embeddings, (list, tuple)) else [embeddings]
    out: list[tuple[str, Any, bool]] = []
    for item in items:
        if isinstance(item, EmbeddingBagCollection):
            out += [("bag", c, bool(item.is_weighted())) for c in item.embedding_bag_configs()]
        elif isinstance(item, EmbeddingCollection):
            out += [("sequence", c, False) for c in item.embedding_configs()]
        elif isinstance(item, EmbeddingBagConfig):
            out.append(("bag", item, False))
        elif isinstance(item, EmbeddingConfig):
            out.append(("sequence", item, False))
        else:
            raise TypeError("embeddings must be torchrec EmbeddingBagCollection / EmbeddingCollection modules or "
                            f"their EmbeddingBagConfig / EmbeddingConfig lists, got {type(item).__name__}")
    if not out:
        raise TypeError("embeddings is empty: no table to train")
    return out


SEQUENCE_KEEP = ("first", "last")


def embedding_inputs(embeddings, num_shards: int, max_sequence_length: Union[None, int, Mapping[str, int]] = None,
                     keep: str = "first") -> EmbeddingInputs:
    """The engine's layout of the user's tables and features.

    Args:
        embeddings: an `EmbeddingBagCollection`, an `EmbeddingCollection`, a list of their
            configs, or a list of several of these (table names distinct across all).
        num_shards: row-shards per table.
        max_sequence_length: L for each sequence feature (one int for all, or {feature: L}):
            an example keeps its last L ids. Required when there are sequence features; a
            public setting (never derived from the data).
        keep: of a sequence longer than L, its "first" L ids (TorchRec's `to_padded_dense`
            truncation; lists stored most recent first) or its "last" L (lists in time order).

    Returns:
        `EmbeddingInputs`. Raises ValueError naming the table or feature for what the engine
        cannot take: pooling other than SUM / MEAN, a feature read by two tables, a duplicate
        table name, a sequence feature without L.
    """
    if keep not in SEQUENCE_KEEP:
        raise ValueError(f"sequence_keep must be one of {SEQUENCE_KEEP}, got {keep!r}")
    tables: list[TableSpec] = []
    features: list[FeatureSpec] = []
    widths: dict[str, int] = {}
    kinds: dict[str, str] = {}
    pooled: list[tuple[str, str]] = []
    sequences: list[tuple[str, str, int]] = []
    order: list[str] = []
    seen: dict[str, str] = {}
    configs = _configs(embeddings)
    for kind, c, _ in configs:
        if c.name in widths:
            raise ValueError(f"table name {c.name!r} is used twice")
        if not c.feature_names:
            raise ValueError(f"table {c.name!r} has no feature_names: nothing would read it")
        if int(c.embedding_dim) < 1 or int(c.num_embeddings) < 1:
            raise ValueError(f"table {c.name!r}: embedding_dim and num_embeddings must be >= 1")
        widths[c.name], kinds[c.name] = int(c.embedding_dim), kind
        for f in c.feature_names:
            if f in seen:
                raise ValueError(f"feature {f!r} is read by tables {seen[f]!r} and {c.name!r}")
            if POSITION_SEPARATOR in f:
                raise ValueError(f"feature {f!r}: feature names may not contain {POSITION_SEPARATOR!r}")
            seen[f] = c.name
            order.append(f)
    width = max(widths.values())
    for kind, c, weighted in configs:
        tables.append(TableSpec(c.name, int(c.num_embeddings), width))
        if kind == "bag":
            pooling = _POOLINGS.get(getattr(c.pooling, "name", str(c.pooling)))
            if pooling is None:
                raise ValueError(f"table {c.name!r}: pooling {c.pooling} is not supported (SUM or MEAN)")
            if weighted and pooling != "sum":
                raise ValueError(f"table {c.name!r}: a weighted EmbeddingBagCollection pools by SUM (per-id weights), "
                                 f"not {c.pooling}")
            for f in c.feature_names:
                features.append(FeatureSpec(f, c.name, pooling, weighted))
                pooled.append((f, c.name))
            continue
        for f in c.feature_names:
            length = _sequence_length(f, max_sequence_length)
            features += [FeatureSpec(position_name(f, p), c.name, "sum") for p in range(length)]
            sequences.append((f, c.name, length))
    if isinstance(max_sequence_length, Mapping):
        unknown = sorted(set(max_sequence_length) - {s[0] for s in sequences})
        if unknown:
            raise ValueError(f"max_sequence_length names {unknown}, which are not sequence features "
                             f"(those are {[s[0] for s in sequences]})")
    layout = ShardLayout(tuple(tables), tuple(features), int(num_shards))
    return EmbeddingInputs(layout, widths, kinds, tuple(pooled), tuple(sequences), tuple(order), keep)


def _sequence_length(feature: str, given) -> int:
    if given is None:
        raise ValueError(f"sequence feature {feature!r} (an EmbeddingCollection's) needs max_sequence_length: "
                         "the most ids of one example the model reads (a public setting)")
    value = given.get(feature) if isinstance(given, Mapping) else given
    if value is None:
        raise ValueError(f"max_sequence_length has no entry for sequence feature {feature!r}")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"max_sequence_length of {feature!r} must be an integer >= 1, got {value!r}")
    return int(value)


def check_ids(inputs: EmbeddingInputs, data, example_name=lambda j: f"example {j}") -> None:
    """ValueError naming the feature, the example (`example_name(position in data)`) and the id
    of the first id of `data` (a KJTDataset) outside its table."""
    rows = {t.name: t.num_rows for t in inputs.layout.tables}
    for f, table in inputs.feature_table.items():
        top, example = data.max_ids(f)
        if top >= rows[table]:
            raise ValueError(f"feature {f!r}, {example_name(example)}: id {top} is outside table {table!r} "
                             f"of {rows[table]} rows")


def expand_batch(inputs: EmbeddingInputs, sparse: KeyedJaggedTensor, dense: torch.Tensor
                 ) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """A batch keyed by the user's features as the engine takes it: each sequence feature's
    position bags (position p: the p-th of the example's kept ids, `inputs.keep`), and the sequences' kept
    lengths appended to `dense` as float columns (in `inputs.sequences` order)."""
    if inputs.uniform:
        return sparse, dense
    B = int(sparse.stride())
    per_key = sparse.to_dict() if B else {}
    has_weights = sparse.weights_or_none() is not None
    vals: list[np.ndarray] = []
    lens: list[np.ndarray] = []
    wts: list[np.ndarray] = []
    kept_lengths = []
    sequence_length = {f: L for f, _, L in inputs.sequences}
    done: dict[str, tuple] = {}
    for spec in inputs.layout.features:
        name, _, pos = spec.name.partition(POSITION_SEPARATOR)
        if not pos:  # a pooled bag, as it is
            if B:
                jt = per_key[name]
                vals.append(jt.values().numpy().astype(np.int64, copy=False))
                lens.append(jt.lengths().numpy().astype(np.int64, copy=False))
                if has_weights:
                    wts.append(jt.weights().numpy().astype(np.float32, copy=False))
            else:
                vals.append(np.zeros(0, np.int64))
                lens.append(np.zeros(0, np.int64))
            continue
        if name not in done:
            if B:
                jt = per_key[name]
                values = jt.values().numpy().astype(np.int64, copy=False)
                lengths = jt.lengths().numpy().astype(np.int64, copy=False)
            else:
                values, lengths = np.zeros(0, np.int64), np.zeros(0, np.int64)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if B else lengths
            kept = np.minimum(lengths, sequence_length[name])
            done[name] = (values, starts + (lengths - kept if inputs.keep == "last" else 0), kept)
        values, first, kept = done[name]
        p = int(pos)
        has = p < kept
        vals.append(values[first[has] + p])
        lens.append(has.astype(np.int64))
        if has_weights:  # a position's one id is read as it is
            wts.append(np.ones(int(has.sum()), np.float32))
    for f, _, _ in inputs.sequences:
        kept_lengths.append(done[f][2] if f in done else np.zeros(B, np.int64))
    kjt = KeyedJaggedTensor(keys=list(inputs.engine_features),
                            values=torch.from_numpy(np.concatenate(vals) if vals else np.zeros(0, np.int64)),
                            lengths=torch.from_numpy(np.concatenate(lens).astype(np.int32) if lens
                                                     else np.zeros(0, np.int32)),
                            weights=torch.from_numpy(np.concatenate(wts) if wts else np.zeros(0, np.float32))
                            if has_weights else None,
                            stride=B)
    extra = torch.from_numpy(np.stack(kept_lengths, 1).astype(np.float32)) if kept_lengths else torch.zeros((B, 0))
    return kjt, torch.cat([dense, extra], 1)


def expand_feature_rows(inputs: EmbeddingInputs, feature: str, rows_of) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, ids) over every example of one engine feature (`rows_of(user feature)` gives
    the user feature's): a position bag holds the example's id at that position, if any."""
    name, _, pos = feature.partition(POSITION_SEPARATOR)
    offsets, values = rows_of(name)
    if not pos:
        return offsets, values
    length = dict((f, L) for f, _, L in inputs.sequences)[name]
    lengths = np.diff(offsets)
    kept = np.minimum(lengths, length)
    p = int(pos)
    has = p < kept
    first = offsets[:-1] + (lengths - kept if inputs.keep == "last" else 0)
    out = values[first[has] + p]
    return np.concatenate([[0], np.cumsum(has)]).astype(np.int64), out


class ExpandedDataset:
    """A `KJTDataset` (or a view of one with its interface) whose batches come keyed by the
    engine's features (`expand_batch`). The engine's data interface: `len`, `take`,
    `iter_batches`, `feature_rows`, `units`, and `meta` (None)."""

    meta = None

    def __init__(self, base, inputs: EmbeddingInputs):
        self.base, self.inputs = base, inputs
        self.features = inputs.engine_features

    def __len__(self) -> int:
        return len(self.base)

    def take(self, indices):
        batch = self.base.take(indices)
        sparse, dense = expand_batch(self.inputs, batch.sparse, batch.dense)
        return dataclasses.replace(batch, sparse=sparse, dense=dense)

    def iter_batches(self, batch_size: int):
        for batch in self.base.iter_batches(batch_size):
            sparse, dense = expand_batch(self.inputs, batch.sparse, batch.dense)
            yield dataclasses.replace(batch, sparse=sparse, dense=dense)

    def feature_rows(self, feature: str) -> tuple[np.ndarray, np.ndarray]:
        return expand_feature_rows(self.inputs, feature, self.base.feature_rows)

    def units(self) -> Optional[np.ndarray]:
        return self.base.units()


def split_inputs(inputs: EmbeddingInputs, pooled: torch.Tensor, dense: torch.Tensor, num_dense: int
                 ) -> tuple[dict, torch.Tensor, dict]:
    """The engine's pooled [B, F', W] and dense [B, num_dense + sequences] as the user's dense
    module takes them: ({feature: [B, D_t] pooled, or [B, L, D_t] for a sequence}, dense
    [B, num_dense], {sequence feature: kept lengths [B] int64}), each at its table's width."""
    out: dict[str, torch.Tensor] = {}
    index = {f.name: k for k, f in enumerate(inputs.layout.features)}
    for name, table in inputs.pooled:
        out[name] = pooled[:, index[name], :inputs.tables[table]]
    lengths: dict[str, torch.Tensor] = {}
    for s, (name, table, length) in enumerate(inputs.sequences):
        start = index[position_name(name, 0)]
        out[name] = pooled[:, start:start + length, :inputs.tables[table]]
        lengths[name] = dense[:, num_dense + s].round().long()
    ordered = {f: out[f] for f in inputs.order}
    return ordered, dense[:, :num_dense], lengths


def initial_weights(embeddings, inputs: EmbeddingInputs) -> Optional[dict[str, torch.Tensor]]:
    """{table: [rows, W] starting weights} of the tables the user gave as modules with real
    (non-meta) weights, zero columns past a table's own width; None when there are none. The
    other tables start at N(0, model.init_std²)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    items = list(embeddings) if isinstance(embeddings, (list, tuple)) else [embeddings]
    weights: dict[str, torch.Tensor] = {}
    for item in items:
        if isinstance(item, EmbeddingBagCollection):
            weights.update({name: bag.weight for name, bag in item.embedding_bags.items()})
        elif isinstance(item, EmbeddingCollection):
            weights.update({name: emb.weight for name, emb in item.embeddings.items()})
    weights = {name: w for name, w in weights.items() if w.device.type != "meta"}
    if not weights:
        return None
    out = {}
    for name, w in weights.items():
        padded = torch.zeros((w.shape[0], inputs.width), dtype=torch.float32)
        padded[:, :w.shape[1]] = w.detach().cpu().to(torch.float32)
        out[name] = padded
    return out


__all__ = ["EmbeddingInputs", "ExpandedDataset", "check_ids", "embedding_inputs", "expand_batch", "expand_feature_rows",
           "initial_weights", "position_name", "split_inputs"]
