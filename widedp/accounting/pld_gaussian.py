"""The (Poisson-sampled) Gaussian's privacy loss distribution, built with vectorized inverses.

Privacy assumption: none of its own. It builds, for add/remove-one neighbours, the same
pessimistic connect-the-dots PLD as dp_accounting's `from_gaussian_mechanism(σ, sensitivity 1,
sampling_prob q)` (dp_accounting 0.6, Doroshenko et al. 2022, "Connect the Dots", §2.2),
which stays the reference: `tests/test_pld_gaussian.py` compares the two PMFs and the ε they
give for every (σ, q, interval) kind the accountants meet.

Why: the reference computes the hockey-stick divergence δ(ε_i) on ~10⁵ grid points by calling
the scalar `inverse_privacy_loss` once per point (its `get_delta_for_epsilon`), ~0.9 s per
distribution on this project's machines, which made PLD calibration (~30 distributions) cost
seconds per run. The inverse privacy loss of the Gaussian is closed form, so here it is one
numpy expression over the whole grid; everything else (the grid, the rounding, the tails, the
PMF) is dp_accounting's own code.

Inverse privacy loss (the largest x whose loss is ≥ ℓ), mechanism N(0, σ²) against N(1, σ²)
(REMOVE: μ_upper = N(0,σ²), μ_lower = N(1,σ²); ADD: μ_upper = (1−q)N(0,σ²) + qN(1,σ²), …):
  unsampled, REMOVE:  x(ℓ) = −1/2 − ℓσ²            ADD: x(ℓ) = 1 + (−1/2 − ℓσ²)
  sampled, REMOVE:    ℓ₀ = log(1 + (e^ℓ − 1)/q)    ADD: ℓ₀ = −log(1 + (e^(−ℓ) − 1)/q)
(dp_accounting's `_inverse_privacy_loss_{add,remove}` and `GaussianPrivacyLoss`).
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence, Union

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as plm

_ADD, _REMOVE = plm.AdjacencyType.ADD, plm.AdjacencyType.REMOVE


def _log_a_times_exp_b_plus_c(a: float, b: np.ndarray, c: float) -> np.ndarray:
    """log(a·e^b + c) elementwise for a > 0, c < 0 (dp_accounting's `common.log_a_times_exp_b_plus_c`
    in that branch: log(a + c) where b = 0, else d + log1p(−e^(log(−c) − d)) with d = b + log a)."""
    d = b + np.log(a)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = d + np.log1p(-np.exp(np.log(-c) - d))
    return np.where(b == 0, np.log(a + c), out)


def _isclose(values: np.ndarray, target: float) -> np.ndarray:
    """`math.isclose(v, target)` elementwise (relative tolerance 1e-9, no absolute tolerance)."""
    with np.errstate(invalid="ignore"):
        return (values == target) | (np.abs(values - target) <= 1e-9 * np.maximum(np.abs(values), abs(target)))


class VectorizedGaussianPrivacyLoss(plm.GaussianPrivacyLoss):
    """dp_accounting's GaussianPrivacyLoss (add/remove adjacency) whose `get_delta_for_epsilon`
    on a sequence of ε computes the inverse privacy losses as one array (module docstring);
    a scalar ε and REPLACE adjacency take the parent's path."""

    def _inverse_privacy_losses(self, losses: np.ndarray) -> np.ndarray:
        q, s, var = self.sampling_prob, self.sensitivity, self._standard_deviation ** 2
        if self.adjacency_type == _REMOVE:
            if q == 1.0:
                unsampled = losses
            else:
                edge = _isclose(losses, math.log(1 - q))
                if np.any(~edge & (losses <= math.log(1 - q))):
                    raise ValueError(f"privacy loss below log(1 - sampling_prob) ({math.log(1 - q)})")
                unsampled = np.where(edge, -np.inf, _log_a_times_exp_b_plus_c(1 / q, losses, 1 - 1 / q))
            with np.errstate(invalid="ignore"):
                return -0.5 * s - unsampled * var / s
        if q == 1.0:
            unsampled = losses
        else:
            edge = _isclose(losses, -math.log(1 - q))
            if np.any(~edge & (losses > -math.log(1 - q))):
                raise ValueError(f"privacy loss above -log(1 - sampling_prob) ({-math.log(1 - q)})")
            unsampled = np.where(edge, np.inf, -_log_a_times_exp_b_plus_c(1 / q, -losses, 1 - 1 / q))
        with np.errstate(invalid="ignore"):
            return s + (-0.5 * s - unsampled * var / s)

    def get_delta_for_epsilon(self, epsilon: Union[float, Sequence[float]]) -> Union[float, Sequence[float]]:
        """δ(ε) = μ_upper_cdf(x(ε)) − e^ε·μ_lower_cdf(x(ε)) (the parent's formula and cases,
        with x(ε) computed for the whole array at once)."""
        if isinstance(epsilon, numbers.Number) or self.adjacency_type not in (_ADD, _REMOVE):
            return super().get_delta_for_epsilon(epsilon)
        epsilons = np.asarray(epsilon)
        deltas = np.zeros_like(epsilons, dtype=float)
        if self.sampling_prob == 1.0:
            inverse = np.full_like(epsilons, True, dtype=bool)
        elif self.adjacency_type == _ADD:
            inverse = epsilons < -math.log1p(-self.sampling_prob)  # δ = 0 beyond
        else:
            inverse = epsilons > math.log1p(-self.sampling_prob)
            deltas[~inverse] = -np.expm1(epsilons[~inverse])
        x_cutoffs = self._inverse_privacy_losses(epsilons[inverse].astype(float))
        deltas[inverse] = self.mu_upper_cdf(x_cutoffs) - np.exp(epsilons[inverse] + self.mu_lower_log_cdf(x_cutoffs))
        return np.clip(deltas, 0, 1)


#: The most grid points one distribution may need before the PLD accountant declines it (about
#: 80 MB per array of the PMF's construction; σ below ≈ 0.03 at the default 1e-4 grid).
MAX_GRID_POINTS = 10_000_000


def grid_points(noise_multiplier: float, sampling_prob: float, value_discretization_interval: float,
                group_size: int = 1) -> float:
    """About how many grid points `gaussian_pld` (or a group's mixture, `group_size` = k) needs:
    the privacy loss of N(0, σ²) against N(k, σ²) over x within ±10σ of the means (the −50 log-mass
    truncation) spans (k² + 20kσ)/σ², half of it when Poisson-sampled (the loss is then bounded
    below by log(1 − q)), divided by the grid interval."""
    if not noise_multiplier > 0:
        return float("inf")
    k = float(group_size)
    span = (k * k + 20.0 * k * noise_multiplier) / noise_multiplier ** 2
    return span / (2.0 if sampling_prob < 1.0 else 1.0) / value_discretization_interval


def gaussian_pld(noise_multiplier: float, sampling_prob: float = 1.0,
                 value_discretization_interval: float = 1e-4) -> pld_lib.PrivacyLossDistribution:
    """The PLD of one application of the Gaussian mechanism with sensitivity 1 and noise
    multiplier σ, Poisson-sampled with probability q, for add/remove-one neighbours, pessimistic
    connect-the-dots: what dp_accounting's `from_gaussian_mechanism(σ, sampling_prob=q,
    value_discretization_interval=…)` returns, built faster (module docstring)."""
    if not noise_multiplier > 0 or not 0 < sampling_prob <= 1:
        raise ValueError(f"gaussian_pld needs σ > 0 and 0 < q <= 1, got σ = {noise_multiplier}, q = {sampling_prob}")

    def single(adjacency_type):
        loss = VectorizedGaussianPrivacyLoss(noise_multiplier, sensitivity=1, pessimistic_estimate=True,
                                             log_mass_truncation_bound=-50, sampling_prob=sampling_prob,
                                             adjacency_type=adjacency_type)
        return pld_lib._create_pld_pmf_from_monotone_privacy_loss(
            loss, pessimistic_estimate=True, value_discretization_interval=value_discretization_interval,
            use_connect_dots=True)

    return pld_lib._pld_for_subsampled_mechanism(single, sampling_prob)


class VectorizedMixtureGaussianPrivacyLoss(plm.MixtureGaussianPrivacyLoss):
    """dp_accounting's MixtureGaussianPrivacyLoss whose inverse privacy losses are found by one
    bisection over the whole array at once instead of its recursive one that calls the scalar
    `privacy_loss` per split (~1–3 minutes per distribution here at k = 8). The bisection is the
    same for every entry — the same interval, the same midpoints, the same comparison
    `l < ℓ(mid)`, the same stop at width ≤ precision and the same rounding of the final upper
    end — so each x equals the reference's; `privacy_losses_at` is `privacy_loss` for an array
    (the same summands and the same sequential `logaddexp` reduction)."""

    def privacy_losses_at(self, x: np.ndarray) -> np.ndarray:
        x_loss = np.multiply.outer(x, self.sensitivities) / self._variance  # [n, sensitivities]
        if self.adjacency_type == _ADD:
            return -np.logaddexp.reduce(self._precompute_privacy_loss_constants + x_loss, axis=1)
        return np.logaddexp.reduce(self._precompute_privacy_loss_constants - x_loss, axis=1)

    def _inverse_privacy_losses_with_range(self, privacy_losses, bounds, precision: float = 1e-6):
        losses = np.asarray(privacy_losses, dtype=float)
        if losses.size == 0:
            return []
        lo = np.full(losses.shape, float(bounds[0]))
        hi = np.full(losses.shape, float(bounds[1]))
        active = hi - lo > precision  # per entry, as the reference stops per branch
        while active.any():
            at = np.flatnonzero(active)
            mid = (lo[at] + hi[at]) / 2
            below = losses[at] < self.privacy_losses_at(mid)  # the inverse lies above mid
            lo[at] = np.where(below, mid, lo[at])
            hi[at] = np.where(below, hi[at], mid)
            active[at] = hi[at] - lo[at] > precision
        return np.floor(hi / precision) * precision


def group_gaussian_pld(noise_multiplier: float, sampling_prob: float, group_size: int,
                       value_discretization_interval: float = 1e-4) -> pld_lib.PrivacyLossDistribution:
    """The PLD of one Poisson-sampled Gaussian step (σ, q) for a group of k = `group_size`
    examples each sampled on its own: the mixture of Gaussians with sensitivity j ∈ {0, …, k}
    of probability Binom(j; k, q) (Ganesh 2024, Thm. 3.1) — what dp_accounting's
    `from_mixture_gaussian_mechanism(σ, range(k+1), Binom(k, q).pmf)` returns (pessimistic,
    connect the dots), built with `VectorizedMixtureGaussianPrivacyLoss`."""
    from scipy import stats

    if not noise_multiplier > 0 or not 0 < sampling_prob <= 1 or int(group_size) != group_size or group_size < 1:
        raise ValueError(f"group_gaussian_pld needs σ > 0, 0 < q <= 1 and an integer k >= 1, got σ = "
                         f"{noise_multiplier}, q = {sampling_prob}, k = {group_size}")
    sensitivities = np.arange(int(group_size) + 1, dtype=float)
    probabilities = stats.binom.pmf(np.arange(int(group_size) + 1), int(group_size), sampling_prob)

    def single(adjacency_type):
        loss = VectorizedMixtureGaussianPrivacyLoss(noise_multiplier, sensitivities, probabilities,
                                                    pessimistic_estimate=True, log_mass_truncation_bound=-50,
                                                    adjacency_type=adjacency_type)
        return pld_lib._create_pld_pmf_from_monotone_privacy_loss(
            loss, pessimistic_estimate=True, value_discretization_interval=value_discretization_interval,
            use_connect_dots=True)

    return pld_lib.PrivacyLossDistribution(single(_REMOVE), single(_ADD))


__all__ = ["VectorizedGaussianPrivacyLoss", "VectorizedMixtureGaussianPrivacyLoss", "gaussian_pld",
           "group_gaussian_pld"]


# ---- self-composition with vectorized truncation bounds ---------------------------------------
# dp_accounting's `DensePLDPmf.self_compose` spends ~2/3 of its time in
# `common.compute_self_convolve_bounds`: the Chernoff bounds that say which part of the T-fold
# convolution may be dropped (mass ≤ tail_mass_truncation, added to the infinity mass), from the
# log-MGF log Σ_i p_i·e^(i·o) at the 40 orders o = ±j/L (j = 1..20, L = the PMF's length), one
# scipy `logsumexp` call per order. Here the 40 log-MGFs come from one pass of powers:
# e^(i·j/L) = r_i^j with r_i = e^(i/L), so Σ_i p_i·r_i^j for j = 1..20 (and r_i^(−j)) by
# repeated multiplication (r_i ∈ [1, e]: no overflow). The bounds, the FFT convolution and the
# resulting PMF are then dp_accounting's formulas; tests/test_pld_gaussian.py holds the bounds to
# the library's and the composed ε to `self_compose`'s.


def _chernoff_log_mgfs(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(orders, log Σ_i p_i·e^(i·order)) at dp_accounting's default orders ±j/L, j = 1..20."""
    p = np.asarray(probs, dtype=np.float64)
    size = p.size
    ratio = np.exp(np.arange(size, dtype=np.float64) / size)
    up, down = p.copy(), p.copy()
    positive, negative = np.empty(20), np.empty(20)
    for j in range(20):
        up *= ratio
        down /= ratio
        positive[j], negative[j] = up.sum(), down.sum()
    orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / size
    with np.errstate(divide="ignore"):
        log_mgfs = np.log(np.concatenate((negative[::-1], positive)))
    return orders, log_mgfs


def self_convolve_bounds(probs: np.ndarray, num_times: int, tail_mass_truncation: float) -> tuple[int, int]:
    """dp_accounting's `common.compute_self_convolve_bounds(probs, num_times,
    tail_mass_truncation)` (default orders) from `_chernoff_log_mgfs`."""
    size = len(probs)
    upper_bound, lower_bound = (size - 1) * num_times, 0
    if tail_mass_truncation == 0:
        return lower_bound, upper_bound
    orders, log_mgfs = _chernoff_log_mgfs(probs)
    for order, log_mgf in zip(orders.tolist(), log_mgfs.tolist()):
        bound = (num_times * log_mgf + math.log(2 / tail_mass_truncation)) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper_bound = min(upper_bound, math.ceil(bound))
        if order < 0:
            lower_bound = max(lower_bound, math.floor(bound))
    return lower_bound, upper_bound


def _self_compose_pmf(pmf, num_times: int, tail_mass_truncation: float):
    """`pmf.self_compose(num_times, tail_mass_truncation)` for a `DensePLDPmf` (its own code
    with `self_convolve_bounds`); any other PMF type composes itself."""
    from dp_accounting.pld import pld_pmf
    from scipy import fft

    if type(pmf) is not pld_pmf.DensePLDPmf:
        return pmf.self_compose(num_times, tail_mass_truncation)
    if num_times <= 0:
        raise ValueError(f"num_times should be >= 1, num_times={num_times}")
    probs = pmf._probs
    low, high = self_convolve_bounds(probs, num_times, tail_mass_truncation)
    output_len = high - low + 1
    fast_len = fft.next_fast_len(max(output_len, len(probs)))
    convolution = np.real(fft.ifft(fft.fft(probs, fast_len) ** num_times))
    out = np.array(np.roll(convolution, -low)[:output_len])
    infinity_mass = tail_mass_truncation - math.expm1(num_times * math.log1p(-pmf._infinity_mass))
    return pld_pmf.DensePLDPmf(pmf._discretization, pmf._lower_loss * num_times + low, out, infinity_mass,
                               pmf._pessimistic_estimate)


def self_composed(pld: pld_lib.PrivacyLossDistribution, num_times: int,
                  tail_mass_truncation: float = 1e-15) -> pld_lib.PrivacyLossDistribution:
    """`pld.self_compose(num_times, tail_mass_truncation)`, with the truncation bounds computed
    in one pass (section comment above)."""
    remove = _self_compose_pmf(pld._pmf_remove, num_times, tail_mass_truncation)
    if pld._symmetric:
        return pld_lib.PrivacyLossDistribution(remove)
    return pld_lib.PrivacyLossDistribution(remove, _self_compose_pmf(pld._pmf_add, num_times, tail_mass_truncation))
