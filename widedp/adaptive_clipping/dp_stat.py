"""DP-STAT (seed C, Algorithm 3 / Lemma 3.10): a private near-maximum of nonnegative statistics.

Privacy assumption: the input is a batch of nonnegative numbers, one per data point (in
DP-AMBSSGD: the norm of one point's gradient at an iterate that does not depend on that point).
Neighbouring batches differ in one point, under **either** relation: add/remove one point, or
replace one point (the seed's "replacement model"). The released quantity is a function of J+1
Gaussian counts, and the count vector has the same ℓ2 sensitivity √(J+1) under both relations
(each count moves by at most 1), so one event serves both. The stopping rule never reads the
batch size, so add/remove neighbours (whose sizes differ) need no public size either.

Mechanism (reconstructed; the extraction lost the pseudo-code and most of the symbols of
Lemma 3.10's proof). Grid γ_j = θ·2^j, j = 0..J. For each j the count of points *above* γ_j,
    a_j = |{i : v_i > γ_j}|,
gets independent noise N(0, σ²); the output is the first γ_j with a_j + Z_j ≤ τ
(θ·2^J if there is none). The surviving proof text fixes this up to notation:
- "each of the computation in Step 4 is of sensitivity one" → one count per grid point;
- "we perform at most [J+1] such computations ... by ... composition (Bun and Steinke)" → the
  privacy cost is the composition of all grid points' counts, ρ = (J+1)/(2σ²);
- "w.p. ≥ 1-β none of the noise ... exceeds [τ]", "if [count] ... then ..., since the true
  count can never exceed [m]. Combining the two cases gives ..." → the threshold is the
  Gaussian union-bound width τ = σ·√(2·log(2(J+1)/β)), and the rule stops at the first j whose
  noisy count says at most τ points lie above (equivalently: at least m-τ below, the seed's
  "count below ≥ m - τ" form; counting *above* is the same rule without needing m).
Utility (Lemma 3.10, reconstructed): with probability ≥ 1-β every |Z_j| ≤ τ, and then
(i) at most 2τ points exceed the output γ (it stopped: a_j ≤ noisy + τ ≤ 2τ), and
(ii) γ ≤ max(θ, 2·max_i v_i) (at the first grid point ≥ max v, a_j = 0 so the noisy count is
≤ τ and the search stops there at the latest). So the batch should have m ≫ 2τ points.

Why the cost is J+1 queries and not one. The released index is post-processing of the whole
noisy vector (a_0 + Z_0, ..., a_J + Z_J), whose ℓ2 sensitivity is √(J+1); that gives
ρ = (J+1)/(2σ²). Stopping early does not make it one query: for neighbours whose counts all sit
at τ and differ by one at every grid point, P[index ≥ k] = Φ(·)^k on one side and Φ(· - 1/σ)^k
on the other, a privacy loss growing linearly in k (there is no noise on the threshold, so the
sparse-vector argument does not apply). The seed's Lemma 3.10 composes over the grid too.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from widedp.accounting.events import DpEvent, GaussianDpEvent, SelfComposedDpEvent


def _positive(name: str, value: float) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}") from None
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return x


def _num_doublings(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"num_doublings must be an integer >= 0, got {value!r}")
    return int(value)


def _probability(name: str, value: float) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in (0, 1), got {value!r}") from None
    if not 0 < x < 1:
        raise ValueError(f"{name} must be a number in (0, 1), got {value!r}")
    return x


def _values(values) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1:
        raise ValueError(f"values must be a 1-d array of nonnegative numbers, got shape {v.shape}")
    if v.size and not (np.all(np.isfinite(v)) and v.min() >= 0):
        raise ValueError("values must be finite and nonnegative")
    return v


def grid(theta: float, num_doublings: int) -> np.ndarray:
    """The candidates θ·2^j, j = 0..J (J = num_doublings); data-independent."""
    theta = _positive("theta", theta)
    return theta * np.exp2(np.arange(_num_doublings(num_doublings) + 1, dtype=np.float64))


def count_noise_std(rho: float, num_doublings: int) -> float:
    """σ of each count's Gaussian noise so that all J+1 counts together are ρ-zCDP.

    The count vector has ℓ2 sensitivity √(J+1) under add/remove and under replace-one (each
    count moves by ≤ 1), and a Gaussian of std σ on a sensitivity-Δ vector is Δ²/(2σ²)-zCDP
    (Bun & Steinke 2016, Prop. 1.6): σ = √((J+1)/(2ρ)).
    """
    rho = _positive("rho", rho)
    return math.sqrt((_num_doublings(num_doublings) + 1) / (2.0 * rho))


def stopping_threshold(noise_std: float, num_doublings: int, beta: float) -> float:
    """τ = σ·√(2·log(2(J+1)/β)): with probability ≥ 1-β all J+1 noises satisfy |Z_j| ≤ τ
    (Chernoff: P[|Z| > t] ≤ 2·exp(-t²/(2σ²)); union bound over the J+1 draws).

    Reconstructed (the seed's symbol was lost; its proof uses "none of the noise added ...
    exceeds" this width, so a union bound of this form). Data-independent: no privacy cost.
    """
    noise_std = _positive("noise_std", noise_std)
    beta = _probability("beta", beta)
    return noise_std * math.sqrt(2.0 * math.log(2.0 * (_num_doublings(num_doublings) + 1) / beta))


def dp_stat_event(noise_std: float, num_doublings: int) -> DpEvent:
    """The privacy event of one DP-STAT call: J+1 Gaussian counts of sensitivity 1 each,
    `SelfComposedDpEvent(GaussianDpEvent(σ), J+1)`, i.e. ρ = (J+1)/(2σ²) zCDP. Valid for
    add/remove and replace-one neighbours alike (see the module docstring)."""
    return SelfComposedDpEvent(GaussianDpEvent(_positive("noise_std", noise_std)), _num_doublings(num_doublings) + 1)


def counts_above(values, candidates) -> np.ndarray:
    """a_j = |{i : v_i > candidates[j]}| for sorted candidates (exact, not private)."""
    v = np.sort(_values(values))
    return v.size - np.searchsorted(v, np.asarray(candidates, dtype=np.float64), side="right")


def dp_stat_from_noise(values, theta: float, num_doublings: int, threshold: float, noise) -> int:
    """Deterministic core of DP-STAT: the index j of the output θ·2^j given the noise draws.

    `noise[j]` is the noise added to count a_j (all J+1 of them; those after the stop are
    never looked at). Returns the first j with a_j + noise[j] ≤ threshold, or J if none.
    Privacy holds only when `noise` is i.i.d. N(0, σ²) with σ from `count_noise_std` and
    secret; `dp_stat` draws it. Relation and sensitivity: as in `dp_stat`.
    """
    J = _num_doublings(num_doublings)
    noise = np.asarray(noise, dtype=np.float64)
    if noise.shape != (J + 1,):
        raise ValueError(f"noise must have shape ({J + 1},) (one draw per grid point), got {noise.shape}")
    if not math.isfinite(float(threshold)):
        raise ValueError(f"threshold must be finite, got {threshold!r}")
    return first_below(counts_above(values, grid(theta, J)) + noise, threshold)


def first_below(noisy_counts, threshold: float) -> int:
    """The stop rule on the noisy counts (a_0 + Z_0, ..., a_J + Z_J): the first j at or below
    `threshold`, J if none. The one implementation of the rule: `dp_stat_from_noise` and the
    engine's per-step DP-STAT (trainer/engine/adaptive_clip.py, counts summed over trainers) call it."""
    noisy = np.asarray(noisy_counts, dtype=np.float64)
    below = np.flatnonzero(noisy <= threshold)
    return int(below[0]) if below.size else noisy.size - 1


@dataclasses.dataclass(frozen=True)
class DpStatResult:
    """Output of `dp_stat`: the clip norm γ = θ·2^index, and the call's privacy event and ρ."""

    gamma: float
    index: int
    event: DpEvent
    rho: float
    noise_std: float
    threshold: float


def dp_stat(values, *, theta: float, num_doublings: int, rho: float, beta: float = 0.05,
            rng: np.random.Generator) -> DpStatResult:
    """DP-STAT: a private γ such that almost all `values` are ≤ γ (seed Alg 3, reconstructed).

    Neighbouring relation: add/remove one value or replace one value (both; the count vector's
    ℓ2 sensitivity is √(J+1) under each, every count having sensitivity 1).
    Mechanism: noisy counts above each grid point θ·2^j (j = 0..J, J = `num_doublings`), noise
    N(0, σ²) with σ = √((J+1)/(2ρ)); output the first grid point whose noisy count is ≤
    τ = σ·√(2 log(2(J+1)/β)), else θ·2^J. Event: `SelfComposedDpEvent(GaussianDpEvent(σ), J+1)`
    = ρ-zCDP — the whole grid is paid for, however early the search stops.
    Utility (w.p. ≥ 1-β): at most 2τ values exceed γ and γ ≤ max(θ, 2·max values), so the batch
    needs m ≫ 2τ values for "almost all" to mean something.

    `rng`: the secret noise source; production callers seed it from OS entropy
    (`numpy.random.default_rng()` with no seed). Empty `values` are allowed (γ is then a
    function of noise alone).
    """
    v = _values(values)
    J = _num_doublings(num_doublings)
    theta = _positive("theta", theta)
    rho = _positive("rho", rho)
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    sigma = count_noise_std(rho, J)
    tau = stopping_threshold(sigma, J, beta)
    index = dp_stat_from_noise(v, theta, J, tau, rng.normal(0.0, sigma, size=J + 1))
    return DpStatResult(gamma=float(theta * 2.0 ** index), index=index, event=dp_stat_event(sigma, J),
                        rho=rho, noise_std=sigma, threshold=tau)
