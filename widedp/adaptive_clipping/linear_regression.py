"""One-pass private linear regression (seed C): DP-AMBSSGD (adaptive clip), DP-SSGD (fixed clip), SGD.

Privacy assumption: **replace-one** neighbours — data sets of the same public size n that differ
in one example (x_i, y_i). This is the seed's stated "replacement model", and it is the relation
under which the seed's parallel-composition argument is sound: the data are shuffled by a
secret uniform permutation and cut into consecutive fixed-size blocks, so for every permutation
the replaced example sits in the same block of both data sets and every other block is the same.
Under add/remove the argument fails (inserting one example shifts every later example into
another block), and n — which sets the number of steps — would be private; so add/remove is
*not* claimed here. (A replace-one guarantee is implied by add/remove with group size 2; the
converse does not hold.) The seed's DP-SSGD (Gaussian noise) is accounted as plain one-pass
Gaussian (parallel composition), always an upper bound on its true cost, *without* amplification
by shuffling here. FMT21's (ε₀, δ₀) theorem itself could not be read; `adaptive_clipping.shuffling`
proves its own extension (Lemma S, for one record per step) and benchmarks/dp_ambssgd.py accounts
the b = 1 Gaussian with it — for the block schedule (b > 1) it cannot lower the noise (the
module's "Scope"). Amplification is offered here where the verified pure-DP theorem
applies: `dp_ssgd(noise="laplace", batch_size=1, amplification="shuffling")`, whose every step is
a pure ε₀-DP local randomizer of the one record it reads (section "DP-SSGD with Laplace noise").

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

DP-SSGD with Laplace noise (`dp_ssgd(noise="laplace", eps0=ε₀)`), pure DP, no zCDP:
- the step: w ← w - η[(1/b)Σ clip¹_C(g_i) + Lap(2C/(b·ε₀))^d], where clip¹_C scales a gradient to
  ℓ1 norm ≤ C (`clip_rows_l1`) and the d noise coordinates are i.i.d. Laplace.
- sensitivity: replacing one record changes one clipped row u into v with ‖u‖₁, ‖v‖₁ ≤ C, so the
  mean moves by ‖u - v‖₁/b ≤ 2C/b in ℓ1 (tight: v = -u). The Laplace mechanism with ℓ1
  sensitivity Δ₁ and per-coordinate scale Δ₁/ε₀ is ε₀-DP (pure), whatever the previous outputs
  (w_{t-1} is public given them), so each step is an ε₀-DP randomizer of its block, for every
  prefix — the adaptive hypothesis of FMT21 when b = 1. Event: `LaplaceDpEvent(1/ε₀)`
  (multiplier = scale / ℓ1 sensitivity).
- why ℓ1 clipping: with the usual ℓ2 clip to C the ℓ1 sensitivity is ‖u - v‖₁ ≤ √d‖u - v‖₂ ≤
  2C√d (also tight: u = C(1..1)/√d = -v), so the same noise needs C/√d as ℓ2 clip; the ℓ2 ball of
  radius C/√d lies inside the ℓ1 ball of radius C, so ℓ1 clipping at C alters every gradient at
  most as much as ℓ2 clipping at C/√d, for the same noise. `clip_norm` is therefore an ℓ1 bound
  on the Laplace path (an ℓ2 bound on the Gaussian path).
- accounting: each record is read by one step, so the run is ε₀-DP (parallel composition,
  `accounting="pure"`). With b = 1 and `amplification="shuffling"`, the run — n steps over a
  secret uniform order, step i an ε₀-DP randomizer of x_π(i) given the previous outputs, the
  iterates and their tail average post-processing — is exactly FMT21's adaptive shuffle model,
  and is (ε, δ)-DP with ε = `shuffling.shuffled_epsilon(ε₀, n, δ)` (the numerical clone bound,
  `accounting="shuffling"`). No dp_accounting event expresses that; `events["amplification"]`
  states the theorem, ε₀, n, δ and ε instead, and `event` stays the per-step Laplace event (the
  unamplified cost, an upper bound). `shuffling.eps0_for_epsilon` calibrates ε₀ for a target ε.
  Amplification is refused with b > 1 (a step then reads b records jointly: not a local
  randomizer of one record) and with Gaussian noise (not pure DP).

Randomness: every function takes `rng: numpy.random.Generator`, which draws the permutation and
all noise; production callers seed it from OS entropy (`numpy.random.default_rng()`), since the
guarantee needs both to stay secret.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from widedp.accounting.events import DpEvent, GaussianDpEvent, LaplaceDpEvent, NonPrivateDpEvent
from . import dp_stat as _dp_stat  # relative: the package may be loaded under an alias (see benchmarks)
from . import shuffling as _shuffling


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


def clip_rows_l1(g: np.ndarray, clip_norm: float) -> np.ndarray:
    """Each row (last axis) scaled by min(1, C/‖g_i‖₁) (ℓ1 norm ≤ C afterwards)."""
    norms = np.abs(g).sum(axis=-1, keepdims=True)
    return g * np.minimum(1.0, clip_norm / np.maximum(norms, np.finfo(np.float64).tiny))


def laplace_noise_scale(clip_norm: float, eps0: float, batch_size: int) -> float:
    """Per-coordinate Laplace scale Δ₁/ε₀ = 2C/(b·ε₀): the ℓ1 sensitivity of the mean of b
    ℓ1-clipped rows under replace-one is 2C/b (see the module docstring)."""
    return 2.0 * clip_norm / (batch_size * eps0)


def laplace_event(eps0: float) -> DpEvent:
    """One Laplace step at ε₀: `LaplaceDpEvent(1/ε₀)` (scale / ℓ1 sensitivity), pure ε₀-DP."""
    return LaplaceDpEvent(1.0 / _positive("eps0", eps0))


def noisy_clipped_mean_laplace(g: np.ndarray, clip_norm: float, eps0: float,
                               rng: np.random.Generator) -> np.ndarray:
    """(1/b)Σ clip¹_C(g_i) + Lap(2C/(b·ε₀))^d over the rows of g (shape (..., b, d); leading axes,
    if any, are independent releases) — one DP-SSGD Laplace step's noisy gradient, ε₀-DP under
    replace-one of one of the b rows (pure; `laplace_event(ε₀)`). With b = 1 it is the ε₀-DP
    local randomizer of the record behind the row. `rng` from OS entropy in production."""
    g = np.asarray(g, dtype=np.float64)
    if g.ndim < 2:
        raise ValueError(f"g must have shape (..., b, d), got {g.shape}")
    return _laplace_step(g, _positive("clip_norm", clip_norm),
                         laplace_noise_scale(clip_norm, _positive("eps0", eps0), g.shape[-2]), rng)


def _laplace_step(g: np.ndarray, clip_norm: float, scale: float, rng: np.random.Generator) -> np.ndarray:
    mean = clip_rows_l1(g, clip_norm).sum(axis=-2) / g.shape[-2]
    return mean + rng.laplace(0.0, scale, size=mean.shape)


# ---- results -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RegressionResult:
    """Output of one training run.

    `event`: the per-example privacy event of the whole run without amplification (replace-one,
    see the module docstring); `rho` its zCDP ρ (inf when not private, nan on the Laplace path,
    which is accounted in pure DP, not zCDP). `events` names the parts it comes from and, under
    `events["amplification"]`, "none" or the shuffling bound used. `noise`: "gaussian",
    "laplace" or "none". `accounting`: how `epsilon(δ)` is computed — "zcdp" (ρ, Bun–Steinke
    conversion), "pure" (ε₀-DP by parallel composition: ε = ε₀ at every δ), "shuffling" (FMT21's
    numerical bound for n shuffled ε₀-DP randomizers, `shuffling.shuffled_epsilon(ε₀, steps, δ)`)
    or "none" (not private). `eps0`: the per-step pure ε₀ (Laplace path), else None.
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
    noise: str = "gaussian"
    accounting: str = "zcdp"
    eps0: Optional[float] = None

    def epsilon(self, delta: float) -> float:
        """ε at δ by `accounting` (see the class docstring); inf when not private."""
        if self.accounting == "none":
            return math.inf
        if self.accounting == "zcdp":
            return zcdp_epsilon(self.rho, delta)
        assert self.eps0 is not None
        if self.accounting == "pure":
            _probability("delta", delta)
            return self.eps0
        if self.accounting == "shuffling":
            return _shuffling.shuffled_epsilon(self.eps0, self.steps, delta)
        raise ValueError(f"unknown accounting {self.accounting!r}")


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


def dp_ssgd(X, y, *, rho: Optional[float] = None, batch_size: int, lr: float, clip_norm: float,
            tail_fraction: float = 0.5, w0: Optional[np.ndarray] = None, amplification: str = "none",
            noise: str = "gaussian", eps0: Optional[float] = None, delta: Optional[float] = None,
            rng: np.random.Generator) -> RegressionResult:
    """DP-SSGD with a fixed clip norm C (the seed's Alg 1 uses b = 1; any b allowed here).

    Neighbouring relation: replace-one (fixed public n). One pass over a secret permutation in
    T = ⌊n/b⌋ blocks, constant step η, tail average of the last ⌈tail_fraction·T⌉ iterates.
    `noise="gaussian"` (default, needs `rho`): w ← w - η[(1/b)Σ clip_C(g_i) + (σC/b)ξ], σ = √(2/ρ),
    ℓ2 clip; sensitivity 2C/b; event `GaussianDpEvent(σ/2)`; each point is read once, so the run
    is ρ-zCDP by parallel composition (`accounting="zcdp"`). Not amplified: the seed's Theorem
    3.1 uses FMT21's (ε₀, δ₀) theorem, whose text could not be read; `adaptive_clipping.shuffling`'s
    Lemma S covers b = 1 only (benchmarks/dp_ambssgd.py uses it there), so this accounting is
    an upper bound.
    `noise="laplace"` (needs `eps0`, no `rho`): w ← w - η[(1/b)Σ clip¹_C(g_i) + Lap(2C/(b·ε₀))^d],
    C an ℓ1 clip (`noisy_clipped_mean_laplace`); each step is pure ε₀-DP, event
    `laplace_event(ε₀)`, the run ε₀-DP by parallel composition (`accounting="pure"`).
    `amplification`: "none" (recorded in `events["amplification"]`) or "shuffling", allowed only
    with noise="laplace" and batch_size = 1 (ValueError saying why otherwise) and then needing
    `delta`: the run is n shuffled adaptive ε₀-DP local randomizers, (ε, δ)-DP with
    ε = `shuffling.shuffled_epsilon(ε₀, n, δ)` (`accounting="shuffling"`; `epsilon(δ')` gives
    other δ'). `events["amplification"]` then records the bound, ε₀, n, δ and ε; there is no
    dp_accounting event for it, so `event` stays the unamplified per-step Laplace event.
    To reach a target (ε, δ): `eps0 = shuffling.eps0_for_epsilon(ε, n, δ)`.
    `rng`: secret; production callers seed it from OS entropy.
    """
    X, y = _data(X, y)
    n, d = X.shape
    b = _positive_int("batch_size", batch_size)
    if noise not in ("gaussian", "laplace"):
        raise ValueError(f"noise must be 'gaussian' or 'laplace', got {noise!r}")
    if noise == "gaussian":
        rho = _positive("rho", rho)
        if eps0 is not None:
            raise ValueError("eps0 is the Laplace path's budget; noise='gaussian' takes rho")
    else:
        eps0 = _positive("eps0", eps0)
        if rho is not None:
            raise ValueError("rho is the Gaussian path's zCDP budget; noise='laplace' takes eps0 (pure DP)")
    _check_amplification(amplification, b, noise)
    if amplification == "shuffling":
        if delta is None:
            raise ValueError("amplification='shuffling' needs delta: the amplified epsilon is stated at a delta")
        delta = _probability("delta", delta)
    elif delta is not None:
        raise ValueError("delta is only used with amplification='shuffling' (the other accountings take it "
                         "in RegressionResult.epsilon)")
    lr = _positive("lr", lr)
    clip_norm = _positive("clip_norm", clip_norm)
    _check_rng(rng)
    T, order = _one_pass(n, b, rng)
    w = _initial(w0, d)
    iterates = []
    if noise == "gaussian":
        assert rho is not None
        sigma = update_noise_multiplier(rho)
        for t in range(T):
            batch = order[t * b:(t + 1) * b]
            w = w - lr * noisy_clipped_mean(per_example_gradients(X[batch], y[batch], w), clip_norm, sigma, rng)
            iterates.append(w)
        event = update_event(sigma)
        return RegressionResult(w=_tail_average(iterates, tail_fraction), event=event, rho=rho,
                                events={"update": event, "composition": "parallel (each point read once)",
                                        "amplification": "none"},
                                clip_norms=np.full(T, clip_norm), steps=T, unused=n - T * b)
    assert eps0 is not None
    scale = laplace_noise_scale(clip_norm, eps0, b)
    Xp, yp = X[order], y[order]
    for t in range(T):
        Xb, yb = Xp[t * b:(t + 1) * b], yp[t * b:(t + 1) * b]
        w = w - lr * _laplace_step(per_example_gradients(Xb, yb, w), clip_norm, scale, rng)
        iterates.append(w)
    event = laplace_event(eps0)
    amp: object = "none"
    if amplification == "shuffling":
        assert delta is not None
        amp = {"bound": "FMT21 numerical clone bound (Thm 3.2 reduction), adaptive pure eps0-DP local "
                        "randomizers, replace-one: adaptive_clipping.shuffling.shuffled_epsilon",
               "eps0": eps0, "n": T, "delta": delta, "epsilon": _shuffling.shuffled_epsilon(eps0, T, delta)}
    return RegressionResult(w=_tail_average(iterates, tail_fraction), event=event, rho=math.nan,
                            events={"update": event, "composition": "parallel (each point read once)",
                                    "amplification": amp},
                            clip_norms=np.full(T, clip_norm), steps=T, unused=n - T * b, noise="laplace",
                            accounting="shuffling" if amplification == "shuffling" else "pure", eps0=eps0)


def sgd(X, y, *, batch_size: int, lr: float, tail_fraction: float = 0.5, w0: Optional[np.ndarray] = None,
        rng: np.random.Generator) -> RegressionResult:
    """Non-private one-pass mini-batch SGD with the same schedule (shuffle, blocks of b, tail
    average). Not private: `event` is `NonPrivateDpEvent`, ρ = inf. `rng` draws the permutation."""
    X, y = _data(X, y)
    n, d = X.shape
    b = _positive_int("batch_size", batch_size)
    lr = _positive("lr", lr)
    _check_rng(rng)
    T, order = _one_pass(n, b, rng)
    w = _initial(w0, d)
    iterates = []
    for t in range(T):
        batch = order[t * b:(t + 1) * b]
        w = w - lr * per_example_gradients(X[batch], y[batch], w).mean(axis=0)
        iterates.append(w)
    return RegressionResult(w=_tail_average(iterates, tail_fraction), event=NonPrivateDpEvent(), rho=math.inf,
                            events={}, clip_norms=np.full(T, math.inf), steps=T, unused=n - T * b,
                            noise="none", accounting="none")


# ---- helpers ---------------------------------------------------------------------------------

def _worst_of(a: DpEvent, b: DpEvent) -> DpEvent:
    """Of two Gaussian-reducible events, the one with the smaller effective multiplier (larger ρ),
    as one GaussianDpEvent: the per-example cost under parallel composition."""
    from widedp.accounting.events import gaussian_noise_multiplier

    sa, sb = gaussian_noise_multiplier(a), gaussian_noise_multiplier(b)
    assert sa is not None and sb is not None
    return GaussianDpEvent(min(sa, sb))


def _one_pass(n: int, b: int, rng: np.random.Generator) -> tuple[int, np.ndarray]:
    """(T = ⌊n/b⌋ blocks, the secret order of one shuffled pass); refuses b > n."""
    T = n // b
    if T < 1:
        raise ValueError(f"batch_size = {b} exceeds the number of examples n = {n}")
    return T, rng.permutation(n)


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


def _check_amplification(amplification, batch_size: int, noise: str) -> None:
    """"none", or "shuffling" with Laplace noise and b = 1; otherwise ValueError with the reason
    (see the module docstring and `adaptive_clipping.shuffling`)."""
    if amplification == "none":
        return
    if amplification != "shuffling":
        raise ValueError(f"amplification must be 'none' or 'shuffling', got {amplification!r}")
    if batch_size > 1:
        raise ValueError(
            f"amplification='shuffling' needs batch_size = 1, got {batch_size}: with b > 1 a step reads b "
            "records jointly, so it is not a local randomizer of one record; treating the block as the "
            "'user' would need sensitivity 2C instead of 2C/b (b² times the zCDP cost), which loses the "
            "gain (see adaptive_clipping.shuffling)")
    if noise != "laplace":
        raise ValueError(
            "amplification='shuffling' needs noise='laplace' (pure eps0-DP steps): the Gaussian step is only "
            "(eps0, delta0)-DP, and the exact statement of Feldman-McMillan-Talwar's approximate-DP shuffling "
            "theorem (arXiv 2012.12803, Thm 3.8) could not be verified here; the Gaussian run stays accounted "
            "unamplified (see adaptive_clipping.shuffling, 'DP-SSGD')")


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
