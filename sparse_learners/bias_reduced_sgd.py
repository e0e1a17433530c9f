"""Seed D's subsampled bias-reduced gradient estimator and the projected DP-SGD that uses it.

Privacy assumption: **add/remove-one example** neighbours. Each step releases four Gaussian
mean estimates (per-example gradients clipped to ℓ2 norm L), and the step's privacy cost is the
**same data-independent amount whatever level N is drawn**, so T steps compose plainly.

Estimator (poster, "Subsampled Bias-Reduced Gradient Estimator"; Blanchet & Glynn 2015): with
K = ⌊log₂ n⌋ − 1 levels, draw N ∈ {1, …, K} with P[N = k] = p_k ∝ 2^{−k}; B = 2^{N+1} examples
uniformly without replacement, in random order; O = its first half, E = its second half (an
equipartition); i uniform in [n]. Release
  G_B = mean_B clip(∇f) + N(0, σ_B² I),  G_O, G_E likewise on O, E,  G_i = clip(∇f(x, z_i)) + N(0, σ_i² I),
and 𝒢(x) = (1/p_N)[G_B − ½(G_O + G_E)] + G_i.

Sensitivity (per mean estimate over a uniformly drawn set of k examples, add/remove-one):
couple the draw on D' = D + {x} with the draw on D — if x is not drawn the sets are equal; if it
is, the other k − 1 are uniform in D, and D's draw is those plus one more uniform y in x's
position — so the sets differ by replacing one element, and the mean of clipped gradients moves
by at most **2L/k in ℓ2**. By joint convexity of the hockey-stick (and Rényi) divergences, the
estimate is then as private as the Gaussian mechanism with that sensitivity (we claim no
amplification by the subsampling: conservative). O and E are disjoint and x keeps y's position,
so only one of G_O, G_E differs. The index i is an independent draw: sensitivity 2L (k = 1).

Calibration — the conservative, simpler bound the brief allows, **not** a privacy filter: each
mean estimate over k examples gets σ = z·2L/k for one fixed noise multiplier z, so each of the
three differing releases (G_B, one of G_O/G_E, G_i) is a Gaussian mechanism with noise multiplier
z, i.e. ρ = 1/(2z²) zCDP, whatever N is. A step is therefore ComposedDpEvent([Gaussian(z)] × 3)
(3/(2z²)-zCDP), identical for every step and independent of the data and of N, and the T-step
run is T-fold composition of that fixed event — valid by plain adaptive composition. The poster
instead lets the budget vary with N and accounts the random stopping time by fully adaptive
composition (Whitehouse, Ramdas, Rogers & Wu 2023); a privacy filter would let larger levels
spend more, but equalizing the cost makes a filter unnecessary and the proof one line. We run a
fixed number of steps T (no random stopping time). z is calibrated with our RDP accountant
(`calibrate_noise_multiplier`), which composes Gaussians exactly in RDP.

Note (math, not a choice): with this *linear* (Gaussian) mean estimator B = O ∪ E gives
mean_B = ½(mean_O + mean_E) exactly, so the level correction G_B − ½(G_O + G_E) is pure
zero-mean noise: 𝒢 is unbiased for the mean clipped gradient, and the levels add variance only.
The multilevel construction removes bias only for a *nonlinear* (biased) mean estimator such as
the poster's projection mechanism; the structure is kept so one can be substituted.

DP-SGD: x_{t+1} = Π_R(x_t − η(𝒢(x_t) + λx_t)), Π_R the projection onto the ℓ2 ball of radius R
(post-processing). Returns the last and the average iterate.

Randomness: every random draw comes from `rng`; production callers must seed it from OS entropy
(`np.random.default_rng()` with no seed).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Optional

import numpy as np
from scipy import optimize

from accounting import events as ev
from accounting.base import make_accountant
from sparse_learners import linear_models as lm

History = list[tuple[ev.DpEvent, int]]


def num_levels(n: int) -> int:
    """K = ⌊log₂ n⌋ − 1: the largest level's batch 2^{K+1} ≤ n. Needs n ≥ 4."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 4:
        raise ValueError(f"the bias-reduced estimator needs n >= 4 examples (K = floor(log2 n) - 1 >= 1), got {n}")
    return int(math.floor(math.log2(int(n)))) - 1


def level_probabilities(levels: int) -> np.ndarray:
    """p_k ∝ 2^{−k}, k = 1..K, normalized."""
    return _level_probabilities(int(levels)).copy()


@functools.lru_cache(maxsize=64)
def _level_probabilities(levels: int) -> np.ndarray:
    p = 2.0 ** -np.arange(1, levels + 1)
    return p / p.sum()


def step_event(noise_multiplier: float) -> ev.DpEvent:
    """One estimator call: three Gaussian mechanisms with noise multiplier z (G_B, one of G_O/G_E,
    G_i; see the module docstring). Add/remove-one; the same event for every level N."""
    g = ev.GaussianDpEvent(noise_multiplier)
    return ev.ComposedDpEvent([g, g, g])


def run_history(noise_multiplier: float, steps: int) -> History:
    return [(step_event(noise_multiplier), steps)]


@functools.lru_cache(maxsize=128)
def calibrate_noise_multiplier(epsilon: float, delta: float, steps: int) -> float:
    """Smallest z (to 1e-6 relative) at which T steps cost at most ε at δ under the RDP accountant.

    Add/remove-one; each step is `step_event(z)`."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    acc = make_accountant("rdp")

    def excess(log_z: float) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(acc.epsilon(run_history(math.exp(log_z), steps), delta)) - epsilon

    lo, hi = math.log(1e-3), math.log(1e5)
    if excess(hi) > 0:
        raise ValueError(f"epsilon={epsilon} is out of reach for {steps} steps at delta={delta}")
    if excess(lo) <= 0:
        return math.exp(lo)
    z = math.exp(optimize.brentq(excess, lo, hi, xtol=1e-7))
    while excess(math.log(z)) > 0:
        z *= 1 + 1e-6
    return z


def _margins(data: lm.Dataset, rows: np.ndarray, w: np.ndarray) -> np.ndarray:
    """⟨w, x_i⟩ for the given rows without slicing the CSR matrix (rows may repeat)."""
    X = data.X
    starts, ends = X.indptr[rows], X.indptr[rows + 1]
    lengths = ends - starts
    out = np.zeros(rows.size)
    total = int(lengths.sum())
    if total:
        pos = np.arange(total) + np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
        prods = X.data[pos] * w[X.indices[pos]]
        nonempty = lengths > 0
        out[nonempty] = np.add.reduceat(prods, np.concatenate(([0], np.cumsum(lengths)[:-1]))[nonempty])
    return out


def _clipped_scalars(data: lm.Dataset, rows: np.ndarray, w: np.ndarray, l2_norms: np.ndarray, clip: float):
    s = lm.loss_derivative(data.loss, _margins(data, rows, w), data.y[rows])
    return lm.clip_scalars(s, l2_norms[rows], clip)


def _gaussian_mean(data: lm.Dataset, rows: np.ndarray, scalars: np.ndarray, clip: float, z: float,
                   rng: np.random.Generator) -> np.ndarray:
    """Mean of the clipped gradients of `rows` + N(0, (z·2L/k)² I_d): ℓ2 sensitivity 2L/k, add/remove."""
    k = rows.size
    d = data.X.shape[1]
    out = rng.normal(0.0, z * 2.0 * clip / k, size=d) if z > 0 else np.zeros(d)
    ids, vals = lm.sparse_weighted_sum(data.X, rows, scalars)
    out[ids] += vals / k
    return out


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One call of the estimator: 𝒢(x), the level N, p_N, and the step's privacy event."""

    gradient: np.ndarray
    level: int
    p_level: float
    event: ev.DpEvent


def bias_reduced_gradient(data: lm.Dataset, w: np.ndarray, *, clip: float, noise_multiplier: float,
                          rng: np.random.Generator, l2_norms: Optional[np.ndarray] = None) -> Estimate:
    """𝒢(w) of the module docstring on validated data (`linear_models.check_data`).

    Neighbouring relation: add/remove-one example. Sensitivity: per-example gradients clipped
    to ℓ2 norm L = `clip`; each mean estimate over k examples has ℓ2 sensitivity 2L/k and noise
    std z·2L/k, z = `noise_multiplier` (z = 0: no noise, not private — for reference checks).
    Event: `step_event(z)` whatever N is. rng: seed from OS entropy in production.
    """
    n = data.X.shape[0]
    p = _level_probabilities(num_levels(n))
    N = int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right")) + 1  # P[N = k] = p_k
    N = min(N, p.size)  # guards the float edge rng.random()·Σp = Σp
    norms = lm.row_norms(data.X, "2") if l2_norms is None else l2_norms
    batch = rng.choice(n, size=2 ** (N + 1), replace=False)  # random order: O = first half, E = second half
    half = 2**N
    i = rng.integers(n, size=1)
    s_b = _clipped_scalars(data, batch, w, norms, clip)
    g_b = _gaussian_mean(data, batch, s_b, clip, noise_multiplier, rng)
    g_o = _gaussian_mean(data, batch[:half], s_b[:half], clip, noise_multiplier, rng)
    g_e = _gaussian_mean(data, batch[half:], s_b[half:], clip, noise_multiplier, rng)
    g_i = _gaussian_mean(data, i, _clipped_scalars(data, i, w, norms, clip), clip, noise_multiplier, rng)
    p_n = float(p[N - 1])
    grad = (g_b - 0.5 * (g_o + g_e)) / p_n + g_i
    return Estimate(grad, N, p_n, step_event(noise_multiplier) if noise_multiplier > 0 else ev.NonPrivateDpEvent())


@dataclasses.dataclass(frozen=True)
class BiasReducedSgdResult:
    """`w`: last iterate; `w_average`: average of the iterates x_1..x_T; `history`: [(step_event(z), T)];
    `epsilon`, `delta`: the RDP accountant's bound for `history`; `levels`: the N drawn at each step."""

    w: np.ndarray
    w_average: np.ndarray
    history: History
    epsilon: float
    delta: float
    noise_multiplier: float
    levels: np.ndarray


def bias_reduced_dp_sgd(
    X,
    y,
    *,
    epsilon: float,
    delta: float,
    steps: int,
    learning_rate: float,
    clip: float,
    radius: float,
    rng: np.random.Generator,
    loss: str = "logistic",
    l2: float = 0.0,
    noise_multiplier: Optional[float] = None,
    w0: Optional[np.ndarray] = None,
) -> BiasReducedSgdResult:
    """Projected DP-SGD with the bias-reduced estimator: x_{t+1} = Π_R(x_t − η(𝒢(x_t) + λx_t)).

    Neighbouring relation: add/remove-one example. Sensitivity: per-example gradients clipped
    to ℓ2 norm L = `clip`; every mean estimate over k examples has ℓ2 sensitivity 2L/k (module
    docstring). Events: T × `step_event(z)`; z = `noise_multiplier`, or (default) the smallest z
    for which the RDP accountant certifies (ε, δ) = (`epsilon`, `delta`). The returned `epsilon`
    is the RDP accountant's bound for the run (≤ the target when z is calibrated here).
    X: scipy.sparse CSR (n × d, rows never densified), y: labels (±1 or 0/1 for logistic).
    rng: production callers must seed it from OS entropy (`np.random.default_rng()`).
    Raises ValueError naming the invalid parameter (or the row of X).
    """
    data = lm.check_data(X, y, loss)
    n, d = data.X.shape
    num_levels(n)
    for name, value in (("epsilon", epsilon), ("learning_rate", learning_rate), ("clip", clip), ("radius", radius)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if l2 < 0 or not math.isfinite(l2):
        raise ValueError(f"l2 must be a finite number >= 0, got {l2}")
    if noise_multiplier is None:
        z = calibrate_noise_multiplier(float(epsilon), float(delta), int(steps))
    else:
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier}")
        z = float(noise_multiplier)
    w = np.zeros(d) if w0 is None else lm.project_l2(np.array(w0, dtype=np.float64), radius)
    if w.shape != (d,):
        raise ValueError(f"w0 must have shape ({d},), got {w.shape}")
    norms = lm.row_norms(data.X, "2")
    total = np.zeros(d)
    levels = np.zeros(int(steps), dtype=np.int64)
    for t in range(int(steps)):
        est = bias_reduced_gradient(data, w, clip=clip, noise_multiplier=z, rng=rng, l2_norms=norms)
        levels[t] = est.level
        w = lm.project_l2(w - learning_rate * (est.gradient + l2 * w), radius)
        total += w
    history = run_history(z, int(steps))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps = float(make_accountant("rdp").epsilon(history, delta))
    return BiasReducedSgdResult(w, total / int(steps), history, eps, float(delta), z, levels)
