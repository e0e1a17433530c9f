"""Poisson sampling of examples (the sampling the privacy analysis assumes)."""

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
    (trainer/randomness.py: Philox with a 128-bit key, ChaCha20 in secure mode), or an int seed
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
