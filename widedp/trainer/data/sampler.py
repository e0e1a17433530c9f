"""Poisson sampling of examples, or of privacy units (users) with a cap on each one's examples
(the sampling the privacy analysis assumes)."""

from __future__ import annotations

import numpy as np


class PoissonSampler:
    """Exact Poisson sampling: each of ``num_examples`` examples is in a sample independently
    with probability ``sample_rate``.

    Drawn in O(b) for expected batch size b = q·n: the sample size is Binomial(n, q), then a
    uniformly random subset of that size (``Generator.choice`` without replacement, Floyd's
    algorithm for small samples). Conditioned on its size a Bernoulli(q)-product sample is a
    uniform subset of that size, and its size is Binomial(n, q), so the two are the same
    distribution. Samples are returned sorted (int64); empty samples are legal steps.

    ``rng``: the numpy Generator the coins come from — in a run, the keyed "sampler" stream
    (trainer/engine/randomness.py: Philox with a 128-bit key, ChaCha20 in secure mode), or an int seed
    (tests: ``numpy.random.default_rng(seed)``).
    ``state_dict()`` / ``load_state_dict()`` capture the numpy Generator's
    ``bit_generator.state`` (a dict; Philox's holds numpy arrays), so a resumed run draws the same batches.
    Distributed use: each data worker samples its own partition with the same q (and its own
    seed); the union is a global Poisson sample.
    """

    def __init__(self, num_examples: int, sample_rate: float, seed: int | np.random.Generator):
        if int(num_examples) != num_examples or num_examples < 0:
            raise ValueError(f"num_examples must be a non-negative integer, got {num_examples}")
        if not (0.0 < float(sample_rate) <= 1.0):
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.num_examples = int(num_examples)
        self.sample_rate = float(sample_rate)
        self._rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)

    def sample(self) -> np.ndarray:
        n, q = self.num_examples, self.sample_rate
        count = int(self._rng.binomial(n, q))
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        chosen = self._rng.choice(n, size=count, replace=False, shuffle=False)
        chosen = np.asarray(chosen, dtype=np.int64)
        chosen.sort()
        return chosen

    def state_dict(self) -> dict:
        return {"num_examples": self.num_examples, "sample_rate": self.sample_rate,
                "bit_generator": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if state["num_examples"] != self.num_examples or state["sample_rate"] != self.sample_rate:
            raise ValueError(
                f"sampler state is for n={state['num_examples']}, q={state['sample_rate']}, "
                f"this sampler has n={self.num_examples}, q={self.sample_rate}")
        bg = state["bit_generator"]
        if bg.get("bit_generator") != type(self._rng.bit_generator).__name__:
            raise ValueError(f"sampler state is for bit generator {bg.get('bit_generator')!r}")
        self._rng.bit_generator.state = bg


def unit_indices(units: np.ndarray) -> tuple[np.ndarray, int]:
    """(dense unit index 0..U-1 of each example, U) from any int64 unit labels (e.g. hashed
    user ids). Units are numbered in the sorted order of their labels."""
    labels = np.asarray(units)
    if labels.ndim != 1:
        raise ValueError(f"units must be one label per example (1-D), got shape {labels.shape}")
    uniq, index = np.unique(labels, return_inverse=True)
    return index.astype(np.int64).reshape(-1), int(uniq.size)


class UnitPoissonSampler:
    """Poisson sampling of privacy *units* (users), then at most ``max_examples_per_unit`` of
    each sampled unit's examples: the sampling user-level DP-SGD assumes (Charles et al. 2024,
    "Fine-tuning LLMs with user-level differential privacy", user-level sampling).

    Neighbouring relation: add/remove one unit with all of its examples. Each of the
    ``num_units`` units is in a step's sample independently with probability ``sample_rate``
    (drawn as `PoissonSampler` draws examples: Binomial(U, q) then a uniform subset); a sampled
    unit with more than k = ``max_examples_per_unit`` examples contributes k of them, a uniform
    subset drawn afresh each step (k is public; the choice uses the secret stream, as the
    coins do). Which examples a unit contributes never changes whether another unit is sampled,
    so the sample of units is exactly Poisson(q) and the accountant's q = b/U holds.

    ``example_units``: dense unit index 0..U-1 of every example (`unit_indices`).
    ``sample()`` returns the chosen examples' dataset indices, sorted (int64); ``units_of(idx)``
    gives their units. ``state_dict()`` / ``load_state_dict()`` as `PoissonSampler`'s.
    """

    def __init__(self, example_units: np.ndarray, sample_rate: float, max_examples_per_unit: int,
                 seed: int | np.random.Generator):
        units = np.asarray(example_units)
        if units.ndim != 1 or not np.issubdtype(units.dtype, np.integer):
            raise ValueError("example_units must be a 1-D integer array (a unit index per example)")
        if units.size and (units.min() < 0):
            raise ValueError("example_units must be >= 0 (dense unit indices, see unit_indices)")
        if not (0.0 < float(sample_rate) <= 1.0):
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if isinstance(max_examples_per_unit, bool) or int(max_examples_per_unit) != max_examples_per_unit \
                or max_examples_per_unit < 1:
            raise ValueError(f"max_examples_per_unit must be an integer >= 1, got {max_examples_per_unit!r}")
        self.example_units = units.astype(np.int64)
        self.num_units = int(units.max()) + 1 if units.size else 0
        self.sample_rate = float(sample_rate)
        self.max_examples_per_unit = int(max_examples_per_unit)
        self._order = np.argsort(self.example_units, kind="stable")  # examples grouped by unit
        counts = np.bincount(self.example_units, minlength=self.num_units)
        self._offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)

    @property
    def num_examples(self) -> int:
        return int(self.example_units.size)

    def sample(self) -> np.ndarray:
        U, q, k = self.num_units, self.sample_rate, self.max_examples_per_unit
        count = int(self._rng.binomial(U, q)) if U else 0
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        chosen = np.sort(np.asarray(self._rng.choice(U, size=count, replace=False, shuffle=False), dtype=np.int64))
        starts, sizes = self._offsets[chosen], np.diff(self._offsets)[chosen]
        small = sizes <= k
        parts = [self._order[_ranges(starts[small], sizes[small])]]
        for start, size in zip(starts[~small], sizes[~small]):  # few per step: the heavy units
            pick = self._rng.choice(int(size), size=k, replace=False, shuffle=False)
            parts.append(self._order[start + np.asarray(pick, dtype=np.int64)])
        out = np.concatenate(parts).astype(np.int64)
        out.sort()
        return out

    def units_of(self, idx: np.ndarray) -> np.ndarray:
        """The unit index of each of the examples `idx`."""
        return self.example_units[np.asarray(idx, dtype=np.int64)]

    def state_dict(self) -> dict:
        return {"num_units": self.num_units, "num_examples": self.num_examples, "sample_rate": self.sample_rate,
                "max_examples_per_unit": self.max_examples_per_unit, "bit_generator": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        mine = {"num_units": self.num_units, "num_examples": self.num_examples, "sample_rate": self.sample_rate,
                "max_examples_per_unit": self.max_examples_per_unit}
        theirs = {key: state.get(key) for key in mine}
        if theirs != mine:
            raise ValueError(f"sampler state is for {theirs}, this sampler has {mine}")
        bg = state["bit_generator"]
        if bg.get("bit_generator") != type(self._rng.bit_generator).__name__:
            raise ValueError(f"sampler state is for bit generator {bg.get('bit_generator')!r}")
        self._rng.bit_generator.state = bg


def _ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The concatenation of arange(s, s + n) over (s, n) pairs."""
    if sizes.size == 0:
        return np.zeros(0, dtype=np.int64)
    total = int(sizes.sum())
    step_starts = np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
    return (np.arange(total, dtype=np.int64) + step_starts).astype(np.int64)


def trimmed_positions(example_units: np.ndarray, max_examples_per_unit: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted positions of the examples kept when each unit keeps at most k =
    `max_examples_per_unit` of its examples, a uniform random subset (all of them when it has
    at most k). User-level DP by example sampling (privacy.user_sampling = "examples"): after
    this, adding or removing one unit changes the training set by at most k examples, whose
    group the accountant then bounds (`accounting.events.GroupDpEvent`). Which examples a unit
    keeps depends on nothing but its own count and `rng` (secret: the "user-trim" stream)."""
    units = np.asarray(example_units, dtype=np.int64)
    k = int(max_examples_per_unit)
    if k < 1:
        raise ValueError(f"max_examples_per_unit must be >= 1, got {max_examples_per_unit!r}")
    if units.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(units, kind="stable")
    counts = np.bincount(units)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    keys = rng.random(units.size)  # a random rank within each unit: keep its k smallest
    ranked = order[np.lexsort((keys[order], units[order]))]
    rank = np.arange(units.size) - np.repeat(starts, counts)
    return np.sort(ranked[rank < k]).astype(np.int64)


class PartitionSampler:
    """One trainer's Poisson sampling of its own parts of a partitioned data set
    (trainer/data/format/partitioned.py): each part is sampled at the one rate q by a sampler
    of its own (`PoissonSampler`, or `UnitPoissonSampler` at user level), each with its own
    stream.

    Privacy assumption: every part's sampler draws independent coins (its own keyed stream:
    the run's "sampler" key derived with the part's index), so each example (unit) of every
    part is in a step's sample independently with probability q; the union over every part
    of every trainer is exactly a global Poisson(q) sample (DESIGN §1: Poisson sampling is
    separable per example), which is what the accountant assumes with q = b/n (b/U).

    Args:
        part_sizes: examples of each of this trainer's parts, in the order they are read.
        sample_rate: q, the same for every part of every trainer.
        generators: one numpy Generator per part (independent streams).
        part_units: user level: per part, its examples' unit labels (any int64); None at
            example level.
        max_examples_per_unit: user level: the public cap k on a sampled unit's examples.

    `sample()` returns the sampled examples' indices into the trainer's parts read as one
    split (part 0's examples, then part 1's, ...), sorted; at user level `sample_units()`
    returns (examples, unit of each numbered 0..m-1 within the sample, m).
    """

    def __init__(self, part_sizes, sample_rate: float, generators: list, part_units: list | None = None,
                 max_examples_per_unit: int | None = None):
        sizes = [int(s) for s in part_sizes]
        if len(generators) != len(sizes):
            raise ValueError(f"one generator per part: {len(generators)} generators for {len(sizes)} parts")
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.sample_rate = float(sample_rate)
        self.unit_level = part_units is not None
        self.samplers: list = []
        self._unit_offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        if part_units is None:
            self.samplers = [PoissonSampler(n, sample_rate, g) for n, g in zip(sizes, generators)]
        else:
            if max_examples_per_unit is None:
                raise ValueError("user-level partition sampling needs max_examples_per_unit")
            for j, (labels, g) in enumerate(zip(part_units, generators)):
                if len(labels) != sizes[j]:
                    raise ValueError(f"part {j}: {len(labels)} unit labels for {sizes[j]} examples")
                dense, count = unit_indices(np.asarray(labels, dtype=np.int64)) if len(labels) else \
                    (np.zeros(0, dtype=np.int64), 0)
                self.samplers.append(UnitPoissonSampler(dense, sample_rate, max_examples_per_unit, g))
                self._unit_offsets[j + 1] = self._unit_offsets[j] + count

    @property
    def num_examples(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_units(self) -> int:
        return int(self._unit_offsets[-1]) if self.unit_level else self.num_examples

    def sample(self) -> np.ndarray:
        return self._draw()[0]

    def sample_units(self) -> tuple[np.ndarray, np.ndarray, int]:
        examples, units = self._draw()
        uniq, local = np.unique(units, return_inverse=True)
        return examples, local.astype(np.int64).reshape(-1), int(uniq.size)

    def _draw(self) -> tuple[np.ndarray, np.ndarray]:
        examples, units = [], []
        for j, sampler in enumerate(self.samplers):
            idx = sampler.sample()
            examples.append(idx + self.offsets[j])
            if self.unit_level:
                units.append(sampler.units_of(idx) + self._unit_offsets[j])
        out = np.concatenate(examples).astype(np.int64) if examples else np.zeros(0, dtype=np.int64)
        return out, (np.concatenate(units).astype(np.int64) if units else np.zeros(0, dtype=np.int64))

    def state_dict(self) -> dict:
        return {"parts": [s.state_dict() for s in self.samplers]}

    def load_state_dict(self, state: dict) -> None:
        parts = state.get("parts") if isinstance(state, dict) else None
        if not isinstance(parts, list) or len(parts) != len(self.samplers):
            raise ValueError(f"sampler state is for {len(parts) if isinstance(parts, list) else '?'} parts, "
                             f"this trainer samples {len(self.samplers)}")
        for sampler, s in zip(self.samplers, parts):
            sampler.load_state_dict(s)
