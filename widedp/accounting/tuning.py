"""Private hyper-parameter selection with a random number of trials (Papernot & Steinke 2022).

Privacy assumption: a *trial* is one run of a randomized mechanism Q on the whole data set —
a candidate drawn uniformly from a public list, a private training run with that candidate
and a noised score of the result — and every trial's randomness is independent and secret.
The tuning draws the number of trials K from a public distribution, independently of the
data and of the trials, keeps K secret, runs Q K times and releases **only** the trial with
the best noised score (its candidate, its model, its noised score); with K = 0 it releases
nothing. Releasing K, any other trial's output, or choosing on an un-noised score voids
every bound below (tests/test_private_tuning.py catches the last).

Bounds (add/remove-one neighbours, Rényi DP; ε_Q(λ) is Q's RDP curve):
- K from the truncated negative binomial D_{η,γ} (η ≥ 0, γ ∈ (0, 1)): P[K = k] ∝
  (1−γ)^k · Π_{l<k} (l+η)/(l+1) for k ≥ 1 (η = 0: the logarithmic distribution; η = 1: the
  geometric). Papernot & Steinke 2022, Thm 2: for all λ > 1 and λ̂ ≥ 1
    ε'(λ) ≤ ε_Q(λ) + (1+η)(1 − 1/λ̂) ε_Q(λ̂) + (1+η) log(1/γ)/λ̂ + log E[K]/(λ−1),
  minimized over λ̂ on the curve's orders. E[K] = η(1−γ)/(γ(1−γ^η)), and (1/γ−1)/log(1/γ)
  at η = 0.
- K ~ Poisson(μ): Papernot & Steinke 2022, Thm 6: if Q is (ε̂, δ̂)-DP with
  e^ε̂ ≤ 1 + 1/(λ−1), then ε'(λ) ≤ ε_Q(λ) + μ·δ̂ + log(μ)/(λ−1). δ̂ here is the smallest δ the
  curve gives at ε̂ = log(1 + 1/(λ−1)) (the conversion of Balle et al. 2020, Thm 21, inverted).
- Candidates: Q picks one of them uniformly, so Q's output distribution is a mixture, with the
  same weights on both neighbours, of the candidates' mechanisms; Rényi divergence is jointly
  quasi-convex, so ε_Q(λ) ≤ max over candidates of their curves at λ (taken pointwise).

Choice of the default (docs/DESIGN.md §1.12, measured by `compare_distributions`): at the same
E[K], the logarithmic distribution (η = 0) costs least of the truncated negative binomials for
the trials we run (many-step DP-SGD and sparse runs, whose curves are close to a Gaussian's),
and Poisson is close to it but can release nothing (K = 0); Liu & Talwar 2019's geometric
stopping is the η = 1 case. `widedp tune` defaults to η = 0.

Pure: numpy and scipy only; no trainer, selection, torch or Ray.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

DISTRIBUTIONS = ("truncated_negative_binomial", "poisson")


@dataclasses.dataclass(frozen=True)
class TrialCount:
    """The public distribution of the number of trials K.

    Args:
        distribution: "truncated_negative_binomial" (K ≥ 1) or "poisson" (K ≥ 0).
        eta: η ≥ 0 of the truncated negative binomial (0: logarithmic, 1: geometric).
        gamma: γ ∈ (0, 1) of the truncated negative binomial.
        mu: μ > 0 of the Poisson distribution.
    """

    distribution: str
    eta: float = 0.0
    gamma: float = 0.0
    mu: float = 0.0

    def __post_init__(self):
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"the number of trials' distribution must be one of {DISTRIBUTIONS}, "
                             f"got {self.distribution!r}")
        if self.distribution == "poisson":
            if not (math.isfinite(self.mu) and self.mu > 0):
                raise ValueError(f"a Poisson number of trials needs mu > 0, got {self.mu!r}")
        else:
            if not (math.isfinite(self.eta) and self.eta >= 0):
                raise ValueError(f"the truncated negative binomial needs eta >= 0, got {self.eta!r}")
            if not (0 < self.gamma < 1):
                raise ValueError(f"the truncated negative binomial needs gamma in (0, 1), got {self.gamma!r}")

    @classmethod
    def with_mean(cls, mean: float, distribution: str = "truncated_negative_binomial", eta: float = 0.0) -> "TrialCount":
        """The distribution with E[K] = `mean` (> 1 for the truncated negative binomial, whose K ≥ 1)."""
        if distribution == "poisson":
            return cls("poisson", mu=float(mean))
        if not (math.isfinite(mean) and mean > 1):
            raise ValueError(f"the expected number of trials must be > 1, got {mean!r}")
        lo, hi = 1e-12, 1 - 1e-12  # E[K] falls from ∞ to 1 as γ rises from 0 to 1
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if _tnb_mean(eta, mid) > mean:
                lo = mid
            else:
                hi = mid
        return cls(distribution, eta=float(eta), gamma=float(0.5 * (lo + hi)))

    @property
    def expected(self) -> float:
        """E[K]."""
        return self.mu if self.distribution == "poisson" else _tnb_mean(self.eta, self.gamma)

    def pmf(self, k: np.ndarray) -> np.ndarray:
        """P[K = k] (the slow, obvious definition: tests compare `sample` with it)."""
        k = np.asarray(k, dtype=np.int64)
        if self.distribution == "poisson":
            from scipy import stats

            return stats.poisson.pmf(k, self.mu)
        out = np.zeros(k.shape)
        for i, kk in np.ndenumerate(k):
            if kk >= 1 and self.eta == 0:  # the logarithmic distribution: the limit η → 0
                out[i] = (1 - self.gamma) ** kk / kk
            elif kk >= 1:
                w = (1 - self.gamma) ** kk
                for l in range(int(kk)):
                    w *= (l + self.eta) / (l + 1)
                out[i] = w
        if self.eta == 0:
            norm = -math.log(self.gamma)  # Σ_k (1-γ)^k / k
        else:
            norm = self.gamma ** (-self.eta) - 1  # Σ_{k≥1} C(k+η-1, k)(1-γ)^k
        return out / norm

    def sample(self, rng: np.random.Generator) -> int:
        """One draw of K from `rng` (the tuning's keyed secret generator)."""
        if self.distribution == "poisson":
            return int(rng.poisson(self.mu))
        if self.eta == 0:
            return int(rng.logseries(1 - self.gamma))
        while True:  # the negative binomial conditioned on K ≥ 1
            k = int(rng.negative_binomial(self.eta, self.gamma))
            if k >= 1:
                return k

    def describe(self) -> str:
        if self.distribution == "poisson":
            return f"Poisson(μ = {self.mu:g})"
        name = {0.0: "logarithmic", 1.0: "geometric"}.get(self.eta, "truncated negative binomial")
        return f"{name} (η = {self.eta:g}, γ = {self.gamma:.6g}, E[K] = {self.expected:.4g})"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _tnb_mean(eta: float, gamma: float) -> float:
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return eta * (1 - gamma) / (gamma * (1 - gamma ** eta))


def _delta_at(orders: np.ndarray, curve: np.ndarray, epsilon: float) -> float:
    """The smallest δ such that a mechanism with RDP `curve` at `orders` is (epsilon, δ)-DP, by
    the conversion of Balle et al. 2020, Thm 21: δ = exp((α−1)(ε(α) − ε)) · ((α−1)/α)^(α−1) / α."""
    with np.errstate(over="ignore", invalid="ignore"):
        log_delta = (orders - 1) * (curve - epsilon) + (orders - 1) * np.log((orders - 1) / orders) - np.log(orders)
    log_delta = np.where(np.isfinite(log_delta), log_delta, np.inf)
    return float(min(1.0, math.exp(min(0.0, float(np.min(log_delta))))))


def selection_rdp(count: TrialCount, trial_curve: np.ndarray, orders: Sequence[float]) -> np.ndarray:
    """RDP curve ε'(λ) at `orders` of releasing the best of K trials (module docstring), given
    one trial's RDP curve `trial_curve` at the same `orders` (+∞ where unknown).

    Args:
        count: the distribution of K.
        trial_curve: ε_Q(λ) of one trial, for add/remove-one neighbours, at `orders`.
        orders: the Rényi orders λ > 1 (λ̂ ranges over the same orders).
    Returns:
        ε'(λ) at each order (+∞ where the bound needs a value the curve does not give).
    """
    a = np.asarray(orders, dtype=np.float64)
    eps = np.asarray(trial_curve, dtype=np.float64)
    if a.shape != eps.shape:
        raise ValueError(f"the trial's curve has {eps.size} values for {a.size} orders")
    if np.any(a <= 1):
        raise ValueError("Rényi orders must be > 1")
    if count.distribution == "poisson":
        out = np.empty_like(a)
        for i, lam in enumerate(a):
            delta_hat = _delta_at(a, eps, math.log1p(1.0 / (lam - 1)))
            out[i] = eps[i] + count.mu * delta_hat + math.log(count.mu) / (lam - 1)
        return out
    eta, gamma = count.eta, count.gamma
    with np.errstate(invalid="ignore"):
        over_hat = (1 + eta) * (1 - 1 / a) * eps + (1 + eta) * math.log(1 / gamma) / a
    over_hat = np.where(np.isfinite(over_hat), over_hat, np.inf)
    return eps + float(np.min(over_hat)) + math.log(count.expected) / (a - 1)


def known_count_rdp(trials: int, trial_curve: np.ndarray) -> np.ndarray:
    """RDP of releasing all of `trials` trials, a number fixed in advance (composition): the
    baseline a random K is compared with."""
    return trials * np.asarray(trial_curve, dtype=np.float64)


def compare_distributions(trial_curve: np.ndarray, orders: Sequence[float], mean: float, delta: float,
                          to_epsilon: Callable[[Sequence[float], np.ndarray, float], float]) -> dict[str, float]:
    """ε at `delta` of the best of K trials for the distributions a user can choose, at E[K] =
    `mean` (`to_epsilon(orders, curve, delta)`: the RDP → (ε, δ) conversion), beside one trial
    and `mean` trials composed."""
    out = {"one trial": to_epsilon(orders, np.asarray(trial_curve), delta),
           f"{mean:g} trials composed": to_epsilon(orders, known_count_rdp(int(round(mean)), trial_curve), delta)}
    for name, count in (("logarithmic (eta 0)", TrialCount.with_mean(mean, eta=0.0)),
                        ("truncated negative binomial (eta 0.5)", TrialCount.with_mean(mean, eta=0.5)),
                        ("geometric (eta 1)", TrialCount.with_mean(mean, eta=1.0)),
                        ("Poisson", TrialCount.with_mean(mean, "poisson"))):
        out[name] = to_epsilon(orders, selection_rdp(count, trial_curve, orders), delta)
    return out
