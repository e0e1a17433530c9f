"""A training set the user already holds in memory — one KeyedJaggedTensor over all its
examples, their dense features and labels — in the form the engine samples from.

Privacy assumption: none of its own. Each row (example) is one element of the data set the
neighbouring relation is over (add/remove one example; with `units`, one unit with all of its
examples); the engine Poisson-samples rows by index, so nothing here may depend on which rows
are present other than through `take`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from widedp.public import public
from widedp.trainer.data.format.dataset import Batch


@public
class KJTDataset:
    """Random access by example index into a KeyedJaggedTensor of n examples (stride n).

    Args:
        sparse: the ids of every example, one key per feature (`sparse.stride()` = n); with
            per-id weights (`sparse.weights()`) for a weighted EmbeddingBagCollection.
        labels: [n] float labels (any values the user's loss takes).
        dense: [n, num_dense] float dense features; None: no dense features ([n, 0]).
        units: [n] integer privacy units (e.g. user ids) for `privacy.unit = "user"`; None:
            every example is its own unit.
        features: the feature order of `take`'s batches; None: the KJT's key order.
        privacy_events: what preparing the data already spent — (description, DpEvent) pairs
            (a `convert table` data set's DP vocabularies and statistics); charged to the
            training ledger before the first step.
        privacy_event_units: per event, "example" or "user": whom it bounds.
        dataset_path: the directory whose `privacy_budget.jsonl` counts every model trained on
            these examples (`from_split` sets it to the widedp data set's); None: no budget file.

    Attributes:
        features: the feature names of `take`'s batches, in order.
        labels, dense: the examples' labels [n] and dense features [n, num_dense].
        num_dense: the number of dense features.
        meta: None (no dataset.json: the shape is the tensors').
    """

    meta = None

    def __init__(self, sparse: KeyedJaggedTensor, labels: torch.Tensor, dense: Optional[torch.Tensor] = None,
                 units: Optional[Sequence[int]] = None, features: Optional[Sequence[str]] = None,
                 privacy_events: Sequence = (), privacy_event_units: Sequence[str] = (),
                 dataset_path=None):
        if not isinstance(sparse, KeyedJaggedTensor):
            raise TypeError(f"sparse must be a torchrec KeyedJaggedTensor, got {type(sparse).__name__}")
        n = int(sparse.stride())
        labels = torch.as_tensor(labels, dtype=torch.float32).reshape(-1)
        if labels.numel() != n:
            raise ValueError(f"labels has {labels.numel()} entries, the KeyedJaggedTensor {n} examples (its stride)")
        dense = torch.zeros((n, 0)) if dense is None else torch.as_tensor(dense, dtype=torch.float32)
        if dense.dim() != 2 or dense.shape[0] != n:
            raise ValueError(f"dense must be [n = {n}, num_dense], got shape {tuple(dense.shape)}")
        keys = list(sparse.keys())
        order = keys if features is None else list(features)
        missing = [f for f in order if f not in keys]
        if missing:
            raise ValueError(f"features {missing} are not keys of the KeyedJaggedTensor (its keys: {keys})")
        per_key = sparse.to_dict() if n else {}
        self._columns: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._weights: Optional[dict[str, np.ndarray]] = {} if sparse.weights_or_none() is not None else None
        for f in order:
            if n == 0:
                self._columns[f] = (np.zeros(1, np.int64), np.zeros(0, np.int64))
                if self._weights is not None:
                    self._weights[f] = np.zeros(0, np.float32)
                continue
            jt = per_key[f]
            lengths = jt.lengths().numpy().astype(np.int64)
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            values = jt.values().numpy().astype(np.int64)
            bad = np.flatnonzero(values < 0)
            if bad.size:
                row = int(np.searchsorted(offsets, bad[0], side="right") - 1)
                raise ValueError(f"feature {f!r}, example {row}: id {int(values[bad[0]])} is negative")
            self._columns[f] = (offsets, values)
            if self._weights is not None:
                weights = jt.weights().numpy().astype(np.float32)
                if not np.isfinite(weights).all():
                    row = int(np.searchsorted(offsets, int(np.flatnonzero(~np.isfinite(weights))[0]), side="right") - 1)
                    raise ValueError(f"feature {f!r}, example {row}: a weight that is not finite")
                self._weights[f] = weights
        self.features = tuple(order)
        self.labels, self.dense = labels, dense.contiguous()
        self.num_dense = int(dense.shape[1])
        self._units = None if units is None else np.asarray(units, dtype=np.int64).reshape(-1)
        if self._units is not None and self._units.size != n:
            raise ValueError(f"units has {self._units.size} entries, the data set {n} examples")
        self._n = n
        self.dataset_path = None if dataset_path is None else Path(dataset_path)
        self.privacy_events = list(privacy_events)
        self.privacy_event_units = list(privacy_event_units) or ["example"] * len(self.privacy_events)
        if len(self.privacy_event_units) != len(self.privacy_events):
            raise ValueError(f"{len(self.privacy_events)} privacy_events but {len(self.privacy_event_units)} units")

    @classmethod
    def from_split(cls, split) -> "KJTDataset":
        """A widedp data set's split (`widedp.trainer.data.open_dataset`: a `convert table` or
        `synth` output) in memory, with its units when it has a unit column."""
        batch = split.take(np.arange(len(split), dtype=np.int64))
        meta = split.meta
        path = getattr(split, "path", None)
        return cls(batch.sparse, batch.labels, batch.dense, units=split.units() if hasattr(split, "units") else None,
                   privacy_events=meta.privacy_events, privacy_event_units=meta.privacy_event_units,
                   dataset_path=None if path is None else Path(path).parent)

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"KJTDataset({self._n} examples, features {list(self.features)}, {self.num_dense} dense)"

    def with_features(self, features: Sequence[str]) -> "KJTDataset":
        """The same examples with `take`'s batches keyed in this feature order (a subset allowed)."""
        missing = [f for f in features if f not in self._columns]
        if missing:
            raise ValueError(f"features {missing} are not in the data set (its features: {list(self.features)})")
        out = object.__new__(KJTDataset)
        out.__dict__.update(self.__dict__)
        out.features = tuple(features)
        return out

    def split(self, test_fraction: float, seed: int = 0) -> tuple["KJTDataset", "KJTDataset"]:
        """(training, held-out) data sets: a `test_fraction` of the examples, drawn uniformly
        with the public `seed`, held out (train on the first, report on the second)."""
        if not 0 < test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        order = np.random.default_rng(seed).permutation(self._n)
        cut = self._n - max(1, int(round(test_fraction * self._n)))
        return self.subset(np.sort(order[:cut])), self.subset(np.sort(order[cut:]))

    def subset(self, indices) -> "KJTDataset":
        """The examples at `indices` as a data set of their own (units kept)."""
        idx = self._check_indices(indices)
        batch = self.take(idx)
        return KJTDataset(batch.sparse, batch.labels, batch.dense,
                          units=None if self._units is None else self._units[idx], features=self.features,
                          privacy_events=self.privacy_events, privacy_event_units=self.privacy_event_units,
                          dataset_path=self.dataset_path)

    def max_ids(self, feature: str) -> tuple[int, int]:
        """(the largest id of `feature`, the first example holding it); (-1, -1) when it has none."""
        offsets, values = self._columns[feature]
        if not values.size:
            return -1, -1
        at = int(values.argmax())
        return int(values[at]), int(np.searchsorted(offsets, at, side="right") - 1)

    def _check_indices(self, indices) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            raise IndexError(f"example indices must be in [0, {self._n}), got {idx.min()}..{idx.max()}")
        return idx

    def take(self, indices) -> Batch:
        """The examples at `indices` (any order, repeats allowed) as one batch (`Batch`)."""
        idx = self._check_indices(indices)
        vals, lens, wts = [], [], []
        for f in self.features:
            offsets, values = self._columns[f]
            starts, ends = offsets[idx], offsets[idx + 1]
            lengths = ends - starts
            total = int(lengths.sum())
            pos = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(total, dtype=np.int64)
            vals.append(values[pos])
            lens.append(lengths.astype(np.int32))
            if self._weights is not None:
                wts.append(self._weights[f][pos])
        weights = None
        if self._weights is not None:
            weights = torch.from_numpy(np.concatenate(wts) if wts else np.zeros(0, np.float32))
        sparse = KeyedJaggedTensor(keys=list(self.features),
                                   values=torch.from_numpy(np.concatenate(vals) if vals else np.zeros(0, np.int64)),
                                   lengths=torch.from_numpy(np.concatenate(lens) if lens else np.zeros(0, np.int32)),
                                   weights=weights, stride=int(idx.size))
        t = torch.from_numpy(idx)
        return Batch(sparse=sparse, dense=self.dense[t].clone(), labels=self.labels[t].clone(), indices=idx.copy())

    def iter_batches(self, batch_size: int) -> Iterator[Batch]:
        """Sequential batches of `batch_size` (the last may be smaller), for evaluation."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for start in range(0, self._n, batch_size):
            yield self.take(np.arange(start, min(start + batch_size, self._n), dtype=np.int64))

    def feature_rows(self, feature: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets int64 [n+1], ids int64) of one feature over every example (DP-FEST)."""
        if feature not in self._columns:
            raise KeyError(f"unknown feature {feature!r}; features are {list(self.features)}")
        offsets, values = self._columns[feature]
        return offsets.copy(), values.copy()

    @property
    def weighted(self) -> bool:
        """The ids carry per-id weights."""
        return self._weights is not None

    def units(self) -> Optional[np.ndarray]:
        """[n] the privacy unit of each example, None when none was given."""
        return None if self._units is None else self._units.copy()
