"""Random-access splits of a data set and the batches they produce."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from widedp.trainer.data.format.jagged import KeyedJaggedTensor

from widedp.trainer.data.format.meta import DATA_FILE, TEST_FILE, DatasetMeta, read_meta
from widedp.trainer.data.format.store import Columns, load_all_columns


@dataclass
class Batch:
    """One batch of examples.

    ``sparse``: keys == ``meta.features``; values int64 row ids within each feature's table,
    key-major (all of feature 0's ids for examples 0..B-1, then feature 1's, ...); lengths
    int32, ``len(keys) * B`` of them; ``stride() == B``.
    ``dense``: float32 [B, num_dense] ([B, 0] for cbow). ``labels``: float32 [B] (zeros for
    cbow). ``indices``: int64 [B], the indices *into the split* (what was passed to
    ``take``), in the order given.

    Note (torchrec 1.8): for B == 0 the KJT is valid (empty values, ``stride() == 0``,
    ``kjt[key]`` works) but ``kjt.to_dict()`` raises inside torchrec; check ``batch.size``.
    """

    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor
    indices: np.ndarray

    @property
    def size(self) -> int:
        return int(len(self.indices))


class ParquetDataset:
    """One split of a data set: random access by index in ``[0, len(self))``.

    The columns are decoded once (see ``trainer.data.format.store``: memory-mapped by default) and
    shared by the splits of one ``open_dataset`` call. ``rows`` holds, for each split index,
    the row of its file (``path``: data.parquet, or test.parquet for the test split of a data
    set that has one) it refers to (sorted ascending).
    """

    def __init__(self, meta: DatasetMeta, columns: Columns, rows: np.ndarray,
                 path: Optional[Path] = None, name: str = ""):
        self.meta = meta
        self.rows = np.ascontiguousarray(rows, dtype=np.int64)
        self.path = path
        self.name = name
        self._cols = columns
        self._identity = len(self.rows) == columns.num_rows  # rows == arange(N)
        fixed_pos = {f: j for j, f in enumerate(columns.fixed_features)}
        # feature -> ("fixed", column) | ("jagged", name), in meta.features order
        self._layout = [("fixed", fixed_pos[f]) if f in fixed_pos else ("jagged", f)
                        for f in meta.features]
        self._all_fixed = all(kind == "fixed" for kind, _ in self._layout) and \
            [j for _, j in self._layout] == list(range(columns.fixed.shape[1]))

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"ParquetDataset({self.name or 'split'}, kind={self.meta.kind}, n={len(self)})"

    def _file_rows(self, indices: np.ndarray) -> np.ndarray:
        return indices if self._identity else self.rows[indices]

    def _check_indices(self, indices) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {idx.shape}")
        if idx.size == 0:
            return np.zeros(0, dtype=np.int64)
        if not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"indices must be integers, got {idx.dtype}")
        idx = idx.astype(np.int64, copy=False)
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= len(self):
            bad = lo if lo < 0 else hi
            raise IndexError(f"index {bad} out of range for split of size {len(self)}")
        return idx

    def take(self, indices: np.ndarray) -> Batch:
        """Examples at these split indices (any order, repeats allowed, empty -> B=0)."""
        idx = self._check_indices(indices)
        rows = self._file_rows(idx)
        b = len(rows)
        cols = self._cols
        fixed = cols.fixed[rows]  # [B, F_fixed], one contiguous row per example
        if self._all_fixed:
            values = np.ascontiguousarray(fixed.T).reshape(-1)
            lengths = np.ones(b * fixed.shape[1], dtype=np.int32)
        else:
            vals, lens = [], []
            for kind, ref in self._layout:
                if kind == "fixed":
                    vals.append(fixed[:, ref])
                    lens.append(np.ones(b, dtype=np.int32))
                else:
                    offsets, flat = cols.jagged[ref]
                    v, ln = _gather_jagged(offsets, flat, rows)
                    vals.append(v)
                    lens.append(ln.astype(np.int32))
            values = np.concatenate(vals) if vals else np.zeros(0, dtype=np.int64)
            lengths = np.concatenate(lens)
        sparse = KeyedJaggedTensor(
            keys=list(self.meta.features), values=torch.from_numpy(values.astype(np.int64, copy=False)),
            lengths=torch.from_numpy(lengths), stride=b)
        dense = torch.from_numpy(np.array(cols.dense[rows], dtype=np.float32, copy=True))
        labels = torch.from_numpy(np.array(cols.labels[rows], dtype=np.float32, copy=True))
        return Batch(sparse=sparse, dense=dense.reshape(b, self.meta.num_dense), labels=labels,
                     indices=idx.copy())

    def iter_batches(self, batch_size: int) -> Iterator[Batch]:
        """Sequential batches of ``batch_size`` (the last may be smaller), for evaluation."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for start in range(0, len(self), batch_size):
            yield self.take(np.arange(start, min(start + batch_size, len(self)), dtype=np.int64))

    def units(self) -> Optional[np.ndarray]:
        """int64 [len(self)]: the privacy unit (e.g. a hashed user id) of each example of the
        split, in split order; None when the data set has no unit column (then every example
        is its own unit)."""
        units = self._cols.units
        return None if units is None else np.array(units[self._file_rows(np.arange(len(self)))], dtype=np.int64)

    def timestamps(self) -> Optional[np.ndarray]:
        """int64 [len(self)]: each example's timestamp (seconds, UTC); None without one."""
        ts = self._cols.timestamps
        return None if ts is None else np.array(ts[self._file_rows(np.arange(len(self)))], dtype=np.int64)

    def feature_rows(self, feature: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets int64 [n+1], ids int64) of one feature over the whole split (DP-FEST)."""
        if feature not in self.meta.features:
            raise KeyError(f"unknown feature {feature!r}; features are {self.meta.features}")
        kind, ref = self._layout[self.meta.features.index(feature)]
        rows = self._file_rows(np.arange(len(self), dtype=np.int64))
        if kind == "fixed":
            assert isinstance(ref, int)  # a "fixed" entry's ref is its column
            return np.arange(len(self) + 1, dtype=np.int64), np.array(self._cols.fixed[rows, ref])
        offsets, flat = self._cols.jagged[ref]
        values, lengths = _gather_jagged(offsets, flat, rows)
        out = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(lengths, out=out[1:])
        return out, values


def _gather_jagged(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray):
    """Values of bags ``rows`` concatenated in that order, and their lengths."""
    starts = np.asarray(offsets[rows], dtype=np.int64)
    lengths = np.asarray(offsets[rows + 1], dtype=np.int64) - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64), lengths
    # position p of bag i -> starts[i] + (p - first output position of bag i)
    out_starts = np.cumsum(lengths) - lengths
    idx = np.repeat(starts - out_starts, lengths) + np.arange(total, dtype=np.int64)
    return np.asarray(values[idx], dtype=np.int64), lengths


def open_dataset(path, *, test_fraction: float = 0.1, seed: int = 0,
                 cache: bool = True) -> tuple[ParquetDataset, ParquetDataset]:
    """(train, test) splits of the data set in directory ``path``.

    A data set with a test file (``test.parquet``, dataset.json ``test_examples``: made by
    ``convert table --test`` or ``--test-after``): train = all of data.parquet, test = all of
    test.parquet; ``test_fraction`` and ``seed`` are ignored. Otherwise the split is a seeded
    permutation of the rows: the first ``floor(N * test_fraction)`` rows of
    ``numpy.random.default_rng(seed).permutation(N)`` form the test split, the rest the train
    split; each split's rows are sorted. Deterministic in (N, test_fraction, seed).
    ``split_rule`` says which rule applies. The files are validated once (DataError naming file
    and row); with ``cache`` the decoded columns are memory-mapped from
    ``path/.widedp-cache`` (see trainer.data.format.store).
    """
    directory = Path(os.fspath(path))
    if not (0.0 <= test_fraction < 1.0):
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    meta = read_meta(directory)
    parts = load_all_columns(directory, meta, cache=cache)
    columns = parts[0]
    if meta.test_examples is not None:
        test_columns = parts[1]
        return (ParquetDataset(meta, columns, np.arange(columns.num_rows), directory / DATA_FILE, "train"),
                ParquetDataset(meta, test_columns, np.arange(test_columns.num_rows), directory / TEST_FILE, "test"))
    n = columns.num_rows
    n_test = int(np.floor(n * test_fraction))
    if n_test == 0:  # nothing held out (a part of a partitioned data set): the permutation would only be sorted back
        test_rows, train_rows = np.zeros(0, dtype=np.int64), np.arange(n, dtype=np.int64)
    else:
        perm = np.random.default_rng(seed).permutation(n)
        test_rows = np.sort(perm[:n_test])
        train_rows = np.sort(perm[n_test:])
    file = directory / DATA_FILE
    return (ParquetDataset(meta, columns, train_rows, file, "train"),
            ParquetDataset(meta, columns, test_rows, file, "test"))


def split_rule(meta: DatasetMeta, test_fraction: float, seed: int) -> str:
    """Which train/test split ``open_dataset`` makes of this data set, in words a run records:
    ``"file"`` / ``"timestamp>=..."`` (the data set's test.parquet) or
    ``"random(test_fraction=F, seed=S)"``."""
    if meta.test_examples is not None:
        return str(meta.test_split or "file")
    return f"random(test_fraction={test_fraction}, seed={seed})"


class SplitSubset:
    """The examples of `base` at `positions` (sorted, distinct) as a split of their own: index
    i is base example positions[i]. The engine's data interface (`meta`, `len`, `take`,
    `iter_batches`, `feature_rows`, `units`) and a canary split's `override_pooled_grads`
    pass through with the indices mapped. Used to train on each user's kept examples
    (trainer/data/sampler.py `trimmed_positions`)."""

    def __init__(self, base, positions: np.ndarray):
        positions = np.asarray(positions, dtype=np.int64)
        if positions.ndim != 1 or (positions.size and (positions.min() < 0 or positions.max() >= len(base)
                                                       or np.any(np.diff(positions) <= 0))):
            raise ValueError(f"positions must be sorted distinct indices into the split of {len(base)} examples")
        self.base, self.positions = base, positions
        meta = base.meta
        has_count = dataclasses.is_dataclass(meta) and any(f.name == "num_examples" for f in dataclasses.fields(meta))
        self.meta = dataclasses.replace(meta, num_examples=int(positions.size)) if has_count else meta
        if hasattr(base, "override_pooled_grads"):
            self.override_pooled_grads = lambda indices, grads, features: base.override_pooled_grads(
                self.positions[np.asarray(indices, dtype=np.int64)], grads, features)

    def __len__(self) -> int:
        return int(self.positions.size)

    def take(self, indices) -> Batch:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
            raise IndexError(f"index {bad} out of range for split of size {len(self)}")
        return dataclasses.replace(self.base.take(self.positions[idx]), indices=idx.copy())

    def iter_batches(self, batch_size: int) -> Iterator[Batch]:
        for start in range(0, len(self), batch_size):
            yield self.take(np.arange(start, min(start + batch_size, len(self)), dtype=np.int64))

    def feature_rows(self, feature: str) -> tuple[np.ndarray, np.ndarray]:
        offsets, ids = self.base.feature_rows(feature)
        values, lengths = _gather_jagged(offsets, ids, self.positions)
        return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), values

    def units(self) -> Optional[np.ndarray]:
        units = self.base.units() if hasattr(self.base, "units") else None
        return None if units is None else np.asarray(units)[self.positions]


def hold_out(split: ParquetDataset, fraction: float, seed: int = 0,
             name: str = "validation") -> tuple[ParquetDataset, ParquetDataset]:
    """(rest, held out): ``floor(len(split) * fraction)`` of ``split``'s examples, chosen by a
    permutation seeded from ``(seed, 1)`` (independent of ``open_dataset``'s test permutation),
    form the held-out split; the rest keep the split's name. A validation split carved from the
    training data this way is never trained on, so metrics on it are held-out metrics (the
    guarantee then covers the remaining training examples only). Deterministic in
    (len(split), fraction, seed); each part's rows stay sorted."""
    if not (0.0 <= fraction < 1.0):
        raise ValueError(f"validation fraction must be in [0, 1), got {fraction}")
    n_held = int(np.floor(len(split) * fraction))
    perm = np.random.default_rng([seed, 1]).permutation(len(split))
    held_rows, rest_rows = split.rows[np.sort(perm[:n_held])], split.rows[np.sort(perm[n_held:])]
    return (ParquetDataset(split.meta, split._cols, rest_rows, split.path, split.name),
            ParquetDataset(split.meta, split._cols, held_rows, split.path, name))


def concat_batches(batches: list) -> Batch:
    """The examples of `batches` in order as one batch (the KJT's key-major layout kept: each
    feature's ids of every batch's examples, batch after batch)."""
    keys = list(batches[0].sparse.keys())
    values, lengths = [], []
    per_batch = []
    for b in batches:
        if list(b.sparse.keys()) != keys:
            raise ValueError("concat_batches: the batches have different features")
        lens = b.sparse.lengths().reshape(len(keys), b.size) if b.size else torch.zeros(len(keys), 0, dtype=torch.int32)
        per_key = lens.sum(dim=1).tolist()
        per_batch.append((torch.split(b.sparse.values(), per_key) if b.size else [b.sparse.values()[:0]] * len(keys),
                          lens))
    for k in range(len(keys)):
        for vals, lens in per_batch:
            values.append(vals[k])
            lengths.append(lens[k])
    B = sum(b.size for b in batches)
    sparse = KeyedJaggedTensor(keys=keys, values=torch.cat(values).to(torch.int64),
                               lengths=torch.cat(lengths).to(torch.int32), stride=B)
    return Batch(sparse=sparse, dense=torch.cat([b.dense for b in batches]),
                 labels=torch.cat([b.labels for b in batches]),
                 indices=np.concatenate([b.indices for b in batches]).astype(np.int64))
