"""Seed D's subsampled bias-reduced gradient estimator and the projected DP-SGD that uses it.

Privacy assumption: **add/remove-one example** neighbours. Each step releases four Gaussian
mean estimates (per-example gradients clipped to ℓ2 norm L), and the step's privacy cost is the
**same data-independent amount whatever level N is drawn and whichever mean estimator is used**,
so T steps compose plainly.

Estimator (poster, "Subsampled Bias-Reduced Gradient Estimator"; Blanchet & Glynn 2015): with
K = ⌊log₂ n⌋ − 1, draw N ∈ {0, 1, …, K} with P[N = k] = p_k ∝ 2^{−k}; B = 2^{N+1} examples
uniformly without replacement, in random order; O = its first half, E = its second half (an
equipartition); i uniform in [n]. Release
  G_B = A(B), G_O = A(O), G_E = A(E), G_i = A({i}),
where A is the DP mean estimator (`mean_estimator`), and 𝒢(x) = (1/p_N)[G_B − ½(G_O + G_E)] + G_i.
The poster writes N ∈ [log(n) − 1]; we read [m] as {0, …, m} because it is the only reading under
which the sum below telescopes down to G_i's batch size 1 (starting at N = 1 leaves a bias
μ_1 − μ_2 — see "What 𝒢 is unbiased for").

DP mean estimators (same noise, same code path `_gaussian_mean`, the projection is applied after):
- "gaussian": A(S) = mean_S clip(∇f) + N(0, σ_k² I_d), σ_k = z·2L/k, k = |S|;
- "projection" (the poster's; Nikolov, Talwar & Zhang 2013): A(S) = Π(mean_S clip(∇f) + N(0, σ_k² I_d)),
  Π the Euclidean projection onto the ℓ1 ball of radius L√s (`projection.project_l1_ball`). It
  needs every per-example gradient s-sparse: for a linear model ∇f(x, z_i) = φ'(⟨x, a_i⟩)·a_i is
  supported on the row a_i, so rows with ≤ s nonzeros suffice (checked, naming the offending
  row); clipped to ℓ2 norm L, each has ‖·‖₁ ≤ √s·L, so the ball contains every per-example
  gradient and every mean of them.

What 𝒢 is unbiased for (exact, both estimators, every x). Let M = 2^{K+1} (= n when n is a power
of two) and, for m ∈ {1, 2, 4, …, M}, μ_m(x) = E[A(S)] with S a uniform m-subset of [n] (expectation
over S and the noise). Given N = k, B is a uniform 2^{k+1}-subset and O, E are (each, marginally)
uniform 2^k-subsets, so E[G_B − ½(G_O + G_E) | N = k] = μ_{2^{k+1}} − μ_{2^k}, and E[G_i] = μ_1:
  E𝒢 = Σ_{k=0}^{K} p_k (μ_{2^{k+1}} − μ_{2^k}) / p_k + μ_1 = μ_M.
That is, 𝒢 is an unbiased estimate of the expected output of the mean estimator run once on M
examples (with the noise of that size, σ_M = 2zL/M) — **not** of the mean clipped gradient ḡ(x)
in general, and not of ∇F(x) (clipping biases against ∇F for both estimators, and the data set
is the ERM target).
- Gaussian: μ_m = ḡ for every m (A is linear and unbiased), so the correction has mean zero —
  indeed B = O ∪ E makes mean_B = ½(mean_O + mean_E) exactly, and the correction is pure noise —
  and 𝒢 is unbiased for ḡ; the levels only add variance.
- Projection: Π is nonlinear and biased (it shrinks the noisy mean towards the ball's interior),
  and the bias shrinks with the batch because σ_m = 2zL/m does. The single-example release G_i
  alone has mean μ_1 (noise 2zL: heavily biased); the correction has mean μ_M − μ_1 ≠ 0 and moves
  the expectation to μ_M, whose bias ‖μ_M − ḡ‖₂ ≤ E‖Π(ḡ + ξ_M) − ḡ‖₂ ≤ E‖ξ_M‖₂ (Π is nonexpansive
  and ḡ is in the ball) is that of the projection mechanism at the largest batch — at an expected
  cost of Σ_k p_k 2^{k+1} + 1 = O(K) examples per step. This is where the multilevel debiasing
  does something. The price is a heavy-tailed oracle: the correction is bounded by 2L√s/p_N.
`tests/test_bias_reduced_sgd.py` checks E𝒢 = μ_M statistically against a Monte Carlo μ_M.

Sensitivity (per mean estimate over a uniformly drawn set of k examples, add/remove-one):
couple the draw on D' = D + {x} with the draw on D — if x is not drawn the sets are equal; if it
is, the other k − 1 are uniform in D, and D's draw is those plus one more uniform y in x's
position — so the sets differ by replacing one element, and the mean of clipped gradients moves
by at most **2L/k in ℓ2** (`mean_estimation.l2_sensitivity(L, k, "replace-one")`). By joint
convexity of the hockey-stick (and Rényi) divergences, the estimate is then as private as the
Gaussian mechanism with that sensitivity (we claim no amplification by the subsampling:
conservative). O and E are disjoint and x keeps y's position, so only one of G_O, G_E differs.
The index i is an independent draw: sensitivity 2L (k = 1).

Privacy of the projection estimator: the same Gaussian releases, then Π, which reads only the
noisy vector and the public L and s — post-processing. So the event is unchanged and the
projection cannot weaken it; s-sparsity is a utility precondition (the ball must contain ḡ),
not a privacy one. (A sparsity violation raises before any release.)

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
import scipy.sparse as sp
from scipy import optimize

from widedp.accounting import events as ev
from widedp.accounting.base import make_accountant
from widedp.sparse_learners import linear_models as lm
from widedp.sparse_learners import mean_estimation as me
from widedp.sparse_learners.projection import project_l1_ball

History = list[tuple[ev.DpEvent, int]]
MEAN_ESTIMATORS = ("gaussian", "projection")


def num_levels(n: int) -> int:
    """K = ⌊log₂ n⌋ − 1: levels N ∈ {0, …, K}, the largest level's batch 2^{K+1} ≤ n. Needs n ≥ 2."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise ValueError(f"the bias-reduced estimator needs n >= 2 examples (K = floor(log2 n) - 1 >= 0), got {n}")
    return int(math.floor(math.log2(int(n)))) - 1


def level_probabilities(levels: int) -> np.ndarray:
    """p_k ∝ 2^{−k} for k = 0..K (`levels` = K), normalized; entry k is P[N = k]."""
    return _level_probabilities(int(levels)).copy()


@functools.lru_cache(maxsize=64)
def _level_probabilities(levels: int) -> np.ndarray:
    p = 2.0 ** -np.arange(0, levels + 1)
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
    """Mean of the clipped gradients of `rows` + N(0, (z·2L/k)² I_d): ℓ2 sensitivity 2L/k (the
    replace-one sensitivity of a k-example mean, which is what the subsampling coupling of the
    module docstring reduces add/remove-one to). The only place noise is drawn, for both estimators."""
    k = rows.size
    d = data.X.shape[1]
    sigma = z * me.l2_sensitivity(clip, k, "replace-one")
    out = rng.normal(0.0, sigma, size=d) if z > 0 else np.zeros(d)
    ids, vals = lm.sparse_weighted_sum(data.X, rows, scalars)
    out[ids] += vals / k
    return out


def _mean_estimate(data: lm.Dataset, rows: np.ndarray, scalars: np.ndarray, clip: float, z: float,
                   rng: np.random.Generator, l1_radius: Optional[float]) -> np.ndarray:
    """`_gaussian_mean`, then (projection estimator, `l1_radius` = L√s) the Euclidean projection
    onto the ℓ1 ball of that radius — post-processing of the Gaussian release."""
    g = _gaussian_mean(data, rows, scalars, clip, z, rng)
    return g if l1_radius is None else project_l1_ball(g, l1_radius)


def _check_estimator(mean_estimator: str, sparsity) -> Optional[int]:
    """The sparsity bound s for "projection" (required there, refused for "gaussian")."""
    if mean_estimator not in MEAN_ESTIMATORS:
        raise ValueError(f"mean_estimator must be one of {MEAN_ESTIMATORS}, got {mean_estimator!r}")
    if mean_estimator == "gaussian":
        if sparsity is not None:
            raise ValueError("sparsity is only used by mean_estimator='projection'")
        return None
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, np.integer)) or sparsity < 1:
        raise ValueError(f"mean_estimator='projection' needs sparsity = s, an integer >= 1 bounding the nonzeros "
                         f"of every row of X (a public bound, not read off the data), got {sparsity!r}")
    return int(sparsity)


def check_sparsity(X: sp.csr_matrix, s: int) -> None:
    """Every row of X has at most s nonzeros (so every per-example gradient φ'·x_i is s-sparse);
    ValueError naming the first offending row otherwise. Stored zeros do not count."""
    me.validate_sparse_rows(X, s, math.inf, name="X")


def _check_rows_sparse(X: sp.csr_matrix, rows: np.ndarray, s: int) -> None:
    """`check_sparsity` restricted to `rows` (the rows one estimator call touches): O(|rows|·s)."""
    lengths = X.indptr[rows + 1] - X.indptr[rows]
    for r in np.unique(rows[lengths > s]):  # stored entries ≥ nonzeros: only these can violate
        nnz = int(np.count_nonzero(X.data[X.indptr[r]:X.indptr[r + 1]]))
        if nnz > s:
            raise ValueError(f"row {int(r)} of X has {nnz} nonzeros > s = {s}: its gradient is not s-sparse, so "
                             "the ℓ1 ball of radius L√s need not contain it")


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One call of the estimator: 𝒢(x) = `correction` + `base`, the level N, p_N, and the step's
    privacy event. `correction` = (1/p_N)[G_B − ½(G_O + G_E)], `base` = G_i (both post-processing
    of the step's releases)."""

    gradient: np.ndarray
    level: int
    p_level: float
    event: ev.DpEvent
    correction: np.ndarray
    base: np.ndarray


def bias_reduced_gradient(data: lm.Dataset, w: np.ndarray, *, clip: float, noise_multiplier: float,
                          rng: np.random.Generator, l2_norms: Optional[np.ndarray] = None,
                          mean_estimator: str = "gaussian", sparsity: Optional[int] = None) -> Estimate:
    """𝒢(w) of the module docstring on validated data (`linear_models.check_data`).

    Neighbouring relation: add/remove-one example. Sensitivity: per-example gradients clipped
    to ℓ2 norm L = `clip`; each mean estimate over k examples has ℓ2 sensitivity 2L/k and noise
    std z·2L/k, z = `noise_multiplier` (z = 0: no noise, not private — for reference checks).
    `mean_estimator`: "gaussian" (noisy mean) or "projection" (noisy mean projected onto the ℓ1
    ball of radius L√s, s = `sparsity`; the rows drawn are checked to have ≤ s nonzeros).
    Event: `step_event(z)` whatever N is and for both estimators. rng: seed from OS entropy in
    production.
    """
    s = _check_estimator(mean_estimator, sparsity)
    l1_radius = None if s is None else clip * math.sqrt(s)
    n = data.X.shape[0]
    p = _level_probabilities(num_levels(n))
    N = int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"))  # P[N = k] = p_k, k = 0..K
    N = min(N, p.size - 1)  # guards the float edge rng.random()·Σp = Σp
    norms = lm.row_norms(data.X, "2") if l2_norms is None else l2_norms
    batch = rng.choice(n, size=2 ** (N + 1), replace=False)  # random order: O = first half, E = second half
    half = 2**N
    i = rng.integers(n, size=1)
    if s is not None:
        _check_rows_sparse(data.X, np.concatenate([batch, i]), s)
    s_b = _clipped_scalars(data, batch, w, norms, clip)
    z = noise_multiplier
    g_b = _mean_estimate(data, batch, s_b, clip, z, rng, l1_radius)
    g_o = _mean_estimate(data, batch[:half], s_b[:half], clip, z, rng, l1_radius)
    g_e = _mean_estimate(data, batch[half:], s_b[half:], clip, z, rng, l1_radius)
    g_i = _mean_estimate(data, i, _clipped_scalars(data, i, w, norms, clip), clip, z, rng, l1_radius)
    p_n = float(p[N])
    correction = (g_b - 0.5 * (g_o + g_e)) / p_n
    event = step_event(z) if z > 0 else ev.NonPrivateDpEvent()
    return Estimate(correction + g_i, N, p_n, event, correction, g_i)


@dataclasses.dataclass(frozen=True)
class BiasReducedSgdResult:
    """`w`: last iterate; `w_average`: average of the iterates x_1..x_T; `history`: [(step_event(z), T)];
    `epsilon`, `delta`: the RDP accountant's bound for `history`; `levels`: the N drawn at each step;
    `mean_estimator`: "gaussian" or "projection"."""

    w: np.ndarray
    w_average: np.ndarray
    history: History
    epsilon: float
    delta: float
    noise_multiplier: float
    levels: np.ndarray
    mean_estimator: str


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
    mean_estimator: str = "gaussian",
    sparsity: Optional[int] = None,
) -> BiasReducedSgdResult:
    """Projected DP-SGD with the bias-reduced estimator: x_{t+1} = Π_R(x_t − η(𝒢(x_t) + λx_t)).

    Neighbouring relation: add/remove-one example. Sensitivity: per-example gradients clipped
    to ℓ2 norm L = `clip`; every mean estimate over k examples has ℓ2 sensitivity 2L/k (module
    docstring). Events: T × `step_event(z)`; z = `noise_multiplier`, or (default) the smallest z
    for which the RDP accountant certifies (ε, δ) = (`epsilon`, `delta`). The returned `epsilon`
    is the RDP accountant's bound for the run (≤ the target when z is calibrated here).
    `mean_estimator`: "gaussian" or "projection" (the poster's; needs `sparsity` = s, a public
    bound on the nonzeros of every row of X, checked up front, naming the first offending row).
    Both estimators have the same events: the projection is post-processing.
    X: scipy.sparse CSR (n × d, rows never densified), y: labels (±1 or 0/1 for logistic).
    rng: production callers must seed it from OS entropy (`np.random.default_rng()`).
    Raises ValueError naming the invalid parameter (or the row of X).
    """
    data = lm.check_data(X, y, loss)
    n, d = data.X.shape
    s = _check_estimator(mean_estimator, sparsity)
    if s is not None:
        check_sparsity(data.X, s)
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
        est = bias_reduced_gradient(data, w, clip=clip, noise_multiplier=z, rng=rng, l2_norms=norms,
                                    mean_estimator=mean_estimator, sparsity=s)
        levels[t] = est.level
        w = lm.project_l2(w - learning_rate * (est.gradient + l2 * w), radius)
        total += w
    history = run_history(z, int(steps))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps = float(make_accountant("rdp").epsilon(history, delta))
    return BiasReducedSgdResult(w, total / int(steps), history, eps, float(delta), z, levels, mean_estimator)
