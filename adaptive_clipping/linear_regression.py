"""One-pass private linear regression (seed C): DP-AMBSSGD (adaptive clip), DP-SSGD (fixed clip), SGD.

Privacy assumption: **replace-one** neighbours — data sets of the same public size n that differ
in one example (x_i, y_i). This is the seed's stated "replacement model", and it is the relation
under which the seed's parallel-composition argument is sound: the data are shuffled by a
secret uniform permutation and cut into consecutive fixed-size blocks, so for every permutation
the replaced example sits in the same block of both data sets and every other block is the same.
Under add/remove the argument fails (inserting one example shifts every later example into
another block), and n — which sets the number of steps — would be private; so add/remove is
*not* claimed here. (A replace-one guarantee is implied by add/remove with group size 2; the
converse does not hold.) Unlike the seed's DP-SSGD, no amplification by shuffling is used: the
fixed-clip baseline is accounted as plain one-pass Gaussian (parallel composition), which is
always an upper bound on its true cost (Feldman–McMillan–Talwar's bound would be smaller).
`dp_ssgd(amplification="shuffling")` is refused, and why (the (ε₀, δ₀) theorem it needs could not
be verified; b > 1 is not a local randomizer of one record) is in `adaptive_clipping.shuffling`.

Accounting is zCDP (Bun & Steinke 2016), emitted as dp_accounting Gaussian events whose noise
multipliers are stated w.r.t. the replace-one ℓ2 sensitivity (the events are relation-agnostic;
composing them with add/remove events of another mechanism would mix relations — don't):
- one clipped-mean update, clip γ, noise std σγ/b: the mean (1/b)Σ clip_γ(g_i) moves by at most
  2γ/b when one example is replaced (both clipped gradients have norm ≤ γ), so its multiplier is
  σ/2, `GaussianDpEvent(σ/2)`, ρ_update = 2/σ². (Reconstructed: the seed's sensitivity constant
  was lost in extraction; under replace-one it is 2γ/b, not γ/b.)
- DP-STAT on m separate points: ρ_STAT (see `adaptive_clipping.dp_stat`).
- Parallel composition: every example is read by exactly one of these mechanisms (one block),
  all others see identical inputs given the past outputs, so the whole run is
  max(ρ_update, ρ_STAT)-zCDP (chain rule for Rényi divergence, then joint quasi-convexity over
  the secret permutation). The seed (and its summary) add the two — ρ_update + ρ_STAT — which is
  what one gets if DP-STAT reads the *same* points as the update; with fresh points, as the seed's
  Algorithm 2 and this module do, the sum is a valid but loose upper bound and the max is exact.
- ε at δ: the seed's conversion ε = ρ + 2√(ρ·log(1/δ)) (Bun & Steinke 2016, Prop. 1.3),
  `zcdp_epsilon`; our RDP accountant accounts the emitted Gaussian events directly and gives a
  slightly smaller ε (its α·ρ curve is the same, its conversion is tighter).

Randomness: every function takes `rng: numpy.random.Generator`, which draws the permutation and
all noise; production callers seed it from OS entropy (`numpy.random.default_rng()`), since the
guarantee needs both to stay secret.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from accounting.events import DpEvent, GaussianDpEvent, NonPrivateDpEvent
from . import dp_stat as _dp_stat  # relative: the package may be loaded under an alias (see benchmarks)


# ---- conversions -------------------------------------------------------------------------------

def zcdp_epsilon(rho: float, delta: float) -> float:
    """ε = ρ + 2√(ρ·log(1/δ)): ρ-zCDP implies (ε, δ)-DP (Bun & Steinke 2016, Prop. 1.3)."""
    rho = _positive("rho", rho)
    delta = _probability("delta", delta)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def zcdp_rho_for_epsilon(epsilon: float, delta: float) -> float:
    """The largest ρ with `zcdp_epsilon(ρ, δ) ≤ ε`: ρ = (√(L+ε) - √L)², L = log(1/δ)."""
    epsilon = _positive("epsilon", epsilon)
    log_inv = math.log(1.0 / _probability("delta", delta))
    return (math.sqrt(log_inv + epsilon) - math.sqrt(log_inv)) ** 2


def update_noise_multiplier(rho: float) -> float:
    """σ such that one clipped-mean update (noise σγ/b, replace-one sensitivity 2γ/b) is ρ-zCDP:
    ρ = (2γ/b)²/(2(σγ/b)²) = 2/σ², so σ = √(2/ρ)."""
    return math.sqrt(2.0 / _positive("rho", rho))


def update_event(noise_multiplier: float) -> DpEvent:
    """One clipped-mean update with noise std σγ/b: `GaussianDpEvent(σ/2)` (multiplier w.r.t.
    the replace-one sensitivity 2γ/b), i.e. 2/σ²-zCDP under replace-one neighbours."""
    return GaussianDpEvent(_positive("noise_multiplier", noise_multiplier) / 2.0)


def update_noise_std(clip_norm: float, noise_multiplier: float, batch_size: int) -> float:
    """Std σγ/b of the Gaussian added to the clipped mean gradient (seed Alg 2 step 10)."""
    return noise_multiplier * clip_norm / batch_size


# ---- the step --------------------------------------------------------------------------------

def per_example_gradients(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """g_i = x_i(⟨x_i, w⟩ - y_i), the gradient of ½(⟨x_i, w⟩ - y_i)² (not private)."""
    return X * (X @ w - y)[:, None]


def clip_rows(g: np.ndarray, clip_norm: float) -> np.ndarray:
    """Each row scaled by min(1, γ/‖g_i‖) (ℓ2 norm ≤ γ afterwards)."""
    norms = np.linalg.norm(g, axis=1)
    scale = np.minimum(1.0, clip_norm / np.maximum(norms, np.finfo(np.float64).tiny))
    return g * scale[:, None]


def noisy_clipped_mean(g: np.ndarray, clip_norm: float, noise_multiplier: float,
                       rng: np.random.Generator) -> np.ndarray:
    """(1/b)Σ clip_γ(g_i) + N(0, (σγ/b)² I) with b = len(g) (public: the fixed block size).

    Relation: replace-one (of the b rows); sensitivity 2γ/b; event `update_event(σ)`. `rng`
    from OS entropy in production."""
    b = g.shape[0]
    std = update_noise_std(clip_norm, noise_multiplier, b)
    return clip_rows(g, clip_norm).sum(axis=0) / b + rng.normal(0.0, std, size=g.shape[1])


# ---- results -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RegressionResult:
    """Output of one training run.

    `event`: the per-example privacy event of the whole run (replace-one, see the module
    docstring), `rho` its zCDP ρ (inf when not private). `events` names the parts it comes from.
    `clip_norms`: the clip norm of every step (DP outputs themselves for DP-AMBSSGD: releasing
    them costs nothing more). `steps`: number of updates; `unused`: examples never read
    (n not a multiple of the block size), which cost nothing."""

    w: np.ndarray
    event: DpEvent
    rho: float
    events: dict
    clip_norms: np.ndarray
    steps: int
    unused: int

    def epsilon(self, delta: float) -> float:
        """ε at δ by the zCDP conversion (`zcdp_epsilon`); inf when not private."""
        return math.inf if math.isinf(self.rho) else zcdp_epsilon(self.rho, delta)


# ---- algorithms ------------------------------------------------------------------------------

def dp_ambssgd(X, y, *, rho: float, batch_size: int, stat_size: int, lr: float, theta: float,
               num_doublings: int, beta: float = 0.05, tail_fraction: float = 0.5,
               w0: Optional[np.ndarray] = None, rng: np.random.Generator) -> RegressionResult:
    """DP-AMBSSGD (seed Alg 2): one pass over shuffled data, adaptive clip norm by DP-STAT.

    Neighbouring relation: replace-one (fixed public n); see the module docstring for why.
    The data are permuted (secret, `rng`) and cut into T = ⌊n/(m+b)⌋ blocks of m = `stat_size`
    "fresh" points followed by b = `batch_size` update points. Step t:
      γ_t = DP-STAT({‖x_i(⟨x_i, w_t⟩ - y_i)‖ : i in the m fresh points}) with ρ_STAT = ρ,
      w_{t+1} = w_t - η[(1/b)Σ_i clip_γt(x_i(⟨x_i, w_t⟩ - y_i)) + (σγ_t/b)ξ_t], σ = √(2/ρ),
    output: the average of the last ⌈tail_fraction·T⌉ iterates w_{T-s+1..T} (tail averaging).
    Sensitivity: DP-STAT's count vector √(J+1) (per point), the update's mean 2γ_t/b. Each
    point is read once, so the run is max(ρ_update, ρ_STAT) = ρ-zCDP (parallel composition;
    `event` = the Gaussian with the smaller multiplier, `events` holds both). The seed's sum
    ρ_update + ρ_STAT would apply if DP-STAT read the update points themselves.
    `theta`, `num_doublings`: DP-STAT's grid θ·2^j, j = 0..J, must be data-independent.
    `rng`: secret; production callers seed it from OS entropy.
    """
    X, y = _data(X, y)
    n, d = X.shape
    rho = _positive("rho", rho)
    b = _positive_int("batch_size", batch_size)
    m = _positive_int("stat_size", stat_size)
    lr = _positive("lr", lr)
    _dp_stat.grid(theta, num_doublings)  # validates theta, num_doublings
    _dp_stat._probability("beta", beta)
    _check_rng(rng)
    T = n // (m + b)
    if T < 1:
        raise ValueError(f"batch_size + stat_size = {m + b} exceeds the number of examples n = {n}")
    sigma = update_noise_multiplier(rho)
    order = rng.permutation(n)
    w = _initial(w0, d)
    iterates, gammas = [], []
    stat_event: DpEvent = GaussianDpEvent(1.0)  # replaced in the first step
    for t in range(T):
        block = order[t * (m + b):(t + 1) * (m + b)]
        fresh, batch = block[:m], block[m:]
        norms = np.linalg.norm(per_example_gradients(X[fresh], y[fresh], w), axis=1)
        stat = _dp_stat.dp_stat(norms, theta=theta, num_doublings=num_doublings, rho=rho, beta=beta, rng=rng)
        stat_event = stat.event
        gammas.append(stat.gamma)
        w = w - lr * noisy_clipped_mean(per_example_gradients(X[batch], y[batch], w), stat.gamma, sigma, rng)
        iterates.append(w)
    upd_event = update_event(sigma)
    return RegressionResult(
        w=_tail_average(iterates, tail_fraction), event=_worst_of(upd_event, stat_event), rho=rho,
        events={"update": upd_event, "dp_stat": stat_event, "composition": "parallel (each point read once): max"},
        clip_norms=np.asarray(gammas), steps=T, unused=n - T * (m + b))


def dp_ssgd(X, y, *, rho: float, batch_size: int, lr: float, clip_norm: float, tail_fraction: float = 0.5,
            w0: Optional[np.ndarray] = None, amplification: str = "none",
            rng: np.random.Generator) -> RegressionResult:
    """DP-SSGD with a fixed clip norm C (the seed's Alg 1 uses b = 1; any b allowed here).

    Neighbouring relation: replace-one (fixed public n). One pass over a secret permutation in
    T = ⌊n/b⌋ blocks; w ← w - η[(1/b)Σ clip_C(g_i) + (σC/b)ξ], σ = √(2/ρ); tail average.
    Sensitivity of each update's mean: 2C/b; event `GaussianDpEvent(σ/2)`; each point is read
    once, so the run is ρ-zCDP by parallel composition. No amplification by shuffling is
    claimed (the seed's Theorem 3.1 uses Feldman et al. 2021): this accounting is an upper bound.
    `amplification`: only "none" (recorded in `events["amplification"]`); "shuffling" raises
    ValueError saying why — see `adaptive_clipping.shuffling`'s docstring, "DP-SSGD".
    `rng`: secret; production callers seed it from OS entropy.
    """
    X, y = _data(X, y)
    n, d = X.shape
    rho = _positive("rho", rho)
    b = _positive_int("batch_size", batch_size)
    _check_amplification(amplification, b)
    lr = _positive("lr", lr)
    clip_norm = _positive("clip_norm", clip_norm)
    _check_rng(rng)
    T = n // b
    if T < 1:
        raise ValueError(f"batch_size = {b} exceeds the number of examples n = {n}")
    sigma = update_noise_multiplier(rho)
    order = rng.permutation(n)
    w = _initial(w0, d)
    iterates = []
    for t in range(T):
        batch = order[t * b:(t + 1) * b]
        w = w - lr * noisy_clipped_mean(per_example_gradients(X[batch], y[batch], w), clip_norm, sigma, rng)
        iterates.append(w)
    event = update_event(sigma)
    return RegressionResult(w=_tail_average(iterates, tail_fraction), event=event, rho=rho,
                            events={"update": event, "composition": "parallel (each point read once)",
                                    "amplification": "none"},
                            clip_norms=np.full(T, clip_norm), steps=T, unused=n - T * b)


def sgd(X, y, *, batch_size: int, lr: float, tail_fraction: float = 0.5, w0: Optional[np.ndarray] = None,
        rng: np.random.Generator) -> RegressionResult:
    """Non-private one-pass mini-batch SGD with the same schedule (shuffle, blocks of b, tail
    average). Not private: `event` is `NonPrivateDpEvent`, ρ = inf. `rng` draws the permutation."""
    X, y = _data(X, y)
    n, d = X.shape
    b = _positive_int("batch_size", batch_size)
    lr = _positive("lr", lr)
    _check_rng(rng)
    T = n // b
    if T < 1:
        raise ValueError(f"batch_size = {b} exceeds the number of examples n = {n}")
    order = rng.permutation(n)
    w = _initial(w0, d)
    iterates = []
    for t in range(T):
        batch = order[t * b:(t + 1) * b]
        w = w - lr * per_example_gradients(X[batch], y[batch], w).mean(axis=0)
        iterates.append(w)
    return RegressionResult(w=_tail_average(iterates, tail_fraction), event=NonPrivateDpEvent(), rho=math.inf,
                            events={}, clip_norms=np.full(T, math.inf), steps=T, unused=n - T * b)


# ---- helpers ---------------------------------------------------------------------------------

def _worst_of(a: DpEvent, b: DpEvent) -> DpEvent:
    """Of two Gaussian-reducible events, the one with the smaller effective multiplier (larger ρ),
    as one GaussianDpEvent: the per-example cost under parallel composition."""
    from accounting.events import gaussian_noise_multiplier

    sa, sb = gaussian_noise_multiplier(a), gaussian_noise_multiplier(b)
    assert sa is not None and sb is not None
    return GaussianDpEvent(min(sa, sb))


def _tail_average(iterates: list, tail_fraction: float) -> np.ndarray:
    if not (isinstance(tail_fraction, (int, float)) and 0 < tail_fraction <= 1):
        raise ValueError(f"tail_fraction must be in (0, 1], got {tail_fraction!r}")
    s = max(1, math.ceil(tail_fraction * len(iterates)))
    return np.mean(np.asarray(iterates[-s:]), axis=0)


def _data(X, y) -> tuple[np.ndarray, np.ndarray]:
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] < 1 or X.shape[1] < 1:
        raise ValueError(f"X must be a 2-d array (n, d) with n, d >= 1, got shape {X.shape}")
    if y.shape != (X.shape[0],):
        raise ValueError(f"y must have shape ({X.shape[0]},) to match X, got {y.shape}")
    if not (np.all(np.isfinite(X)) and np.all(np.isfinite(y))):
        raise ValueError("X and y must be finite")
    return X, y


def _initial(w0, d: int) -> np.ndarray:
    if w0 is None:
        return np.zeros(d)
    w = np.asarray(w0, dtype=np.float64)
    if w.shape != (d,) or not np.all(np.isfinite(w)):
        raise ValueError(f"w0 must be a finite vector of shape ({d},), got shape {w.shape}")
    return w.copy()


def _check_amplification(amplification, batch_size: int) -> None:
    """Only "none". "shuffling" is refused with the reason; see `adaptive_clipping.shuffling`."""
    if amplification == "none":
        return
    if amplification != "shuffling":
        raise ValueError(f"amplification must be 'none' (or 'shuffling', refused), got {amplification!r}")
    if batch_size > 1:
        raise ValueError(
            f"amplification='shuffling' needs batch_size = 1, got {batch_size}: with b > 1 a step reads b "
            "records jointly, so it is not a local randomizer of one record; treating the block as the "
            "'user' would need sensitivity 2C instead of 2C/b (b² times the zCDP cost), which loses the "
            "gain (see adaptive_clipping.shuffling)")
    raise ValueError(
        "amplification='shuffling' is not offered: the Gaussian step is only (eps0, delta0)-DP, and the "
        "exact statement of Feldman-McMillan-Talwar's approximate-DP shuffling theorem (arXiv 2012.12803, "
        "Thm 3.8) could not be verified here; the run stays accounted unamplified "
        "(see adaptive_clipping.shuffling, 'DP-SSGD')")


def _check_rng(rng) -> None:
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")


def _positive(name: str, value) -> float:
    return _dp_stat._positive(name, value)


def _probability(name: str, value) -> float:
    return _dp_stat._probability(name, value)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)
