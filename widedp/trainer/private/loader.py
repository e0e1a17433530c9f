"""Your own loader feeding the private step: widedp draws each step's Poisson sample
(`PrivateTrainer.sample()`), your pipeline loads exactly those examples, and `step(batch)`
trains on them.

Privacy assumption: the engine's (docs/DESIGN.md §1) — add/remove one example (one unit with
all of its examples at `privacy.unit = "user"`) of a training set of `num_examples` examples that
the user indexes 0..n-1 and does not change during the run; each step trains on the examples
of widedp's Poisson sample at rate q, normalized by the expected batch size q·n. What is the
user's to hold, and what is checked:
- the batch handed to `step` holds exactly the examples at the indices `sample()` returned, in
  that order, each as stored (no filtering, no duplicates, no augmentation that depends on
  other examples). Checked: the batch size equals the sample's; the ids are checked against
  the tables. Not checkable here: that they are those examples;
- the indices are secret (which examples a step used is what the guarantee hides): the loader
  that reads them is inside the run's trust boundary, and must not log or publish them;
- `num_examples` (and, at user level, the unit of each example) are public, as n is for a data
  set widedp reads itself.
A one-time selection over the whole data set (the DP-FEST selectors) and trainer actors (which
read their data themselves) need the data set and are refused here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from widedp.public import public


@public
class LoaderData:
    """The public shape of a training set that your own loader reads: `make_private(...,
    data=LoaderData(n))`, then `trainer.sample()` / `trainer.step(batch)`.

    Args:
        num_examples: n, the examples your loader indexes 0..n-1 (public, as widedp's own data
            sets' n is).
        units: [n] integer privacy units (e.g. user ids) for `privacy.unit = "user"`; None:
            every example is its own unit.
        num_dense: dense features per example in your batches.
        privacy_events, privacy_event_units: what preparing the data already spent, as
            `KJTDataset`'s.
        dataset_path: the directory whose `privacy_budget.jsonl` counts every model trained on
            these examples; None: no budget file.

    Attributes:
        num_dense: the dense features per example.
        dataset_path: as given (a `Path`), or None.
        privacy_events, privacy_event_units: as given.
        meta: None (no dataset.json).
    """

    meta = None

    def __init__(self, num_examples: int, units: Optional[Sequence[int]] = None, num_dense: int = 0,
                 privacy_events: Sequence = (), privacy_event_units: Sequence[str] = (), dataset_path=None):
        if isinstance(num_examples, bool) or int(num_examples) != num_examples or num_examples < 1:
            raise ValueError(f"num_examples must be an integer >= 1, got {num_examples!r}")
        if isinstance(num_dense, bool) or int(num_dense) != num_dense or num_dense < 0:
            raise ValueError(f"num_dense must be an integer >= 0, got {num_dense!r}")
        self._n, self.num_dense = int(num_examples), int(num_dense)
        self._units = None if units is None else np.asarray(units, dtype=np.int64).reshape(-1)
        if self._units is not None and self._units.size != self._n:
            raise ValueError(f"units has {self._units.size} entries, num_examples is {self._n}")
        self.privacy_events = list(privacy_events)
        self.privacy_event_units = list(privacy_event_units) or ["example"] * len(self.privacy_events)
        self.features: tuple = ()
        self.dataset_path = None if dataset_path is None else Path(dataset_path)

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"LoaderData({self._n} examples, {self.num_dense} dense)"

    def units(self) -> Optional[np.ndarray]:
        return None if self._units is None else self._units.copy()

    def with_features(self, features: Sequence[str]) -> "LoaderData":
        self.features = tuple(features)
        return self

    def max_ids(self, feature: str) -> tuple[int, int]:
        """Unknown before the batches come ((-1, -1)): each batch's ids are checked as it is routed."""
        return -1, -1


class HandedBatches:
    """The engine's training set in loader mode: `take(idx)` gives the examples of the batch the
    user handed over for this step's sample (a subset of it for one of several in-process
    trainers), and refuses any other indices."""

    meta = None

    def __init__(self, data: LoaderData):
        self.data = data
        self.features = data.features
        self.pending: Optional[np.ndarray] = None
        self.batch = None  # a KJTDataset of the pending sample's examples, in its order

    def __len__(self) -> int:
        return len(self.data)

    def units(self) -> Optional[np.ndarray]:
        return self.data.units()

    def hand_over(self, indices: np.ndarray, batch) -> None:
        self.pending, self.batch = np.asarray(indices, dtype=np.int64), batch

    def clear(self) -> None:
        self.pending, self.batch = None, None

    def take(self, indices):
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if self.pending is None or self.batch is None:
            raise RuntimeError("no batch was handed over for this step: call trainer.sample(), load those examples, "
                               "then trainer.step(batch)")
        at = np.searchsorted(self.pending, idx)
        if idx.size and (at.max() >= self.pending.size or not np.array_equal(self.pending[at], idx)):
            raise RuntimeError("the engine asked for examples outside this step's sample")
        out = self.batch.take(at)
        return dataclasses.replace(out, indices=idx.copy())

    def iter_batches(self, batch_size: int):
        raise ValueError("a training set read by your own loader has no sequential batches here: evaluate on a "
                         "KJTDataset")

    def feature_rows(self, feature: str):
        raise ValueError("a one-time selection over the whole data set (train.selection = fest-*) needs the data "
                         "set; with your own loader choose a per-step selector (e.g. threshold)")


class HandOverSampler:
    """The engine's sampler in loader mode: `draw()` takes the next Poisson sample from the run's
    own (secret-keyed) sampler for `PrivateTrainer.sample()`; the engine's `sample()` then gets
    that same draw, once. Checkpoints hold the real sampler's state."""

    def __init__(self, sampler):
        self.sampler = sampler
        self._drawn: Optional[np.ndarray] = None

    def draw(self) -> np.ndarray:
        if self._drawn is None:
            self._drawn = np.asarray(self.sampler.sample(), dtype=np.int64)
        return self._drawn

    @property
    def drawn(self) -> Optional[np.ndarray]:
        return self._drawn

    def sample(self) -> np.ndarray:
        if self._drawn is None:
            raise RuntimeError("the step's sample was not drawn: call trainer.sample() first")
        idx, self._drawn = self._drawn, None
        return idx

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._drawn = None
        self.sampler.load_state_dict(state)

    def __getattr__(self, name):  # the real sampler's other attributes (units_of, num_examples, ...)
        return getattr(self.__dict__["sampler"], name)


def batch_of(given, features: Sequence[str], size: int, num_dense: int):
    """The user's batch for a sample of `size` examples — a `KJTDataset`, or a tuple (sparse KJT,
    labels[, dense]) — as a KJTDataset in the model's feature order. ValueError naming what
    does not fit."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from widedp.trainer.private.data import KJTDataset

    if isinstance(given, KJTDataset):
        data = given
    elif isinstance(given, (tuple, list)) and 2 <= len(given) <= 3 and isinstance(given[0], KeyedJaggedTensor):
        data = KJTDataset(given[0], given[1], given[2] if len(given) == 3 else None)
    else:
        raise TypeError("step(batch): batch must be a KJTDataset or a tuple (KeyedJaggedTensor, labels[, dense]), "
                        f"got {type(given).__name__}")
    if len(data) != size:
        raise ValueError(f"step(batch): the batch holds {len(data)} examples, this step's sample {size}: load exactly "
                         "the examples at the indices trainer.sample() returned, in that order")
    if data.num_dense != num_dense:
        raise ValueError(f"step(batch): {data.num_dense} dense features per example, LoaderData says {num_dense}")
    return data.with_features(features)


__all__ = ["HandOverSampler", "HandedBatches", "LoaderData", "batch_of"]
