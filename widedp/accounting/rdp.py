"""Rényi-DP accountant for heterogeneous, Poisson-subsampled steps.

Bounds used (all for the add/remove-one neighbouring relation):
- Gaussian, noise multiplier σ: ε(α) = α/(2σ²).
- Poisson-subsampled Gaussian-reducible step: the exact sampled-Gaussian RDP of Mironov,
  Talwar & Zhang 2019 (computed by Opacus's `compute_rdp`, so our numbers equal Opacus's).
  Several Gaussians on one batch reduce to one σ_eff (`events.gaussian_noise_multiplier`).
- Pure ε-DP mechanism (each report-noisy-max round, each sparse-vector round): every ε-DP
  pair is a post-processing of randomized response (Kairouz, Oh & Viswanath 2015), so
  ε(α) ≤ D_α(RR_ε) = log[(e^{αε} + e^{(1-α)ε}) / (1 + e^ε)] / (α - 1).
- Exponential mechanism draw with parameter ε: ε-bounded-range (Durfee & Rogers 2019) hence
  ε²/8-zCDP (Cesar & Rogers 2021): ε(α) ≤ min(α ε²/8, D_α(RR_ε)).
- Poisson-subsampled step with any other base mechanism M (e.g. selection + Gaussian on the
  same batch, composed within the step): the general upper bound of Zhu & Wang 2019
  ("Poisson subsampled Rényi differential privacy", Thm 6), integer α ≥ 2:
    ε'(α) ≤ 1/(α-1) · log[ (1-q)^{α-1}(αq - q + 1) + C(α,2) q² (1-q)^{α-2} e^{ε(2)}
                          + 3 Σ_{l=3}^{α} C(α,l) q^l (1-q)^{α-l} e^{(l-1) ε(l)} ],
  also capped by ε(α) (subsampling never hurts). Non-integer orders are +∞ for such steps.
- ModelMix step (`accounting.modelmix.ModelMixDpEvent`, seed B): its own Poisson-subsampled
  curve `modelmix.modelmix_rdp` (integer orders; removal direction exact, addition direction
  bounded), also when unsampled (q = 1). Wrapped with other mechanisms it gets Zhu & Wang above.
RDP → (ε, δ) uses the conversion of Balle et al. 2020, Thm 21 (the formula of Opacus's
  `get_privacy_spent`), minimized over `DEFAULT_ORDERS` (Opacus's grid, so our numbers equal
  Opacus's) and, when the minimum sits on that grid's edge, over the orders beyond it
  (`EDGE_ORDERS_ABOVE` / `_BELOW`): a bound holds at every order, so this only tightens it, and
  there is no "optimal order is the largest alpha" warning a user cannot act on.
- Events with an additive δ (Gaussian partition selection, at the top level only): their
  Gaussian part is composed as above and their δ is subtracted from the target δ before the
  conversion (`base.split_additive_delta`); ε = inf when nothing is left.

`supports` / `check` are structural (`rdp_problem`, the twin of `rdp_curve`): an event is
supported iff every event in it has an RDP curve here (`RDP_CURVES`, by exact type), its
parameters are valid (probabilities in [0, 1], noise ≥ 0, counts integers ≥ 0), additive-δ
events sit at the top level, and no event is stated for another neighbouring relation. A
Poisson-sampled event with q = 0 is a no-op whatever it wraps (ε contribution 0, as before).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
from opacus.accountants.analysis import rdp as opacus_rdp
from scipy import special

from widedp.accounting import events as ev
from widedp.accounting.modelmix import ModelMixDpEvent, modelmix_rdp
from widedp.accounting.tuning import TrialCount, selection_rdp
from widedp.accounting.base import (Accountant, History, Unsupported, UnsupportedEventError, split_event, check_delta,
                             count_problem, misplaced_additive_delta, nonnegative_problem, probability_problem,
                             register, remaining_delta, split_additive_delta)

DEFAULT_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
# Searched only when the minimum over DEFAULT_ORDERS is at its largest / smallest order (very small
# or very large ε per step): integers, as the Zhu–Wang and ModelMix curves need.
EDGE_ORDERS_ABOVE: tuple[float, ...] = tuple(float(a) for a in (64, 80, 96, 128, 160, 192, 256, 384, 512, 768, 1024,
                                                                 1536, 2048, 4096, 8192, 16384))
EDGE_ORDERS_BELOW: tuple[float, ...] = (1.001, 1.002, 1.005, 1.01, 1.02, 1.05)


def rdp_to_epsilon(orders, rdp, delta: float) -> tuple[float, Optional[float]]:
    """(ε, the order attaining it) of a mechanism with RDP curve `rdp` at `orders`, for δ:
    ε = min_α rdp(α) + log((α-1)/α) − (log δ + log α)/(α−1) (Balle et al. 2020, Thm 21).
    Orders where the curve is infinite are skipped; (inf, None) if it is infinite everywhere."""
    a = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = r - (math.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)
    eps = np.where(np.isfinite(eps), eps, np.inf)
    i = int(np.argmin(eps))
    return (math.inf, None) if not np.isfinite(eps[i]) else (float(eps[i]), float(a[i]))


def pure_dp_rdp(epsilon: float, orders: np.ndarray) -> np.ndarray:
    """Tight RDP curve of an ε-DP mechanism (randomized response is the worst case)."""
    a = np.asarray(orders, dtype=np.float64)
    if epsilon == 0:
        return np.zeros_like(a)
    val = (np.logaddexp(a * epsilon, (1 - a) * epsilon) - np.logaddexp(0.0, epsilon)) / (a - 1)
    return np.minimum(val, epsilon)


def exponential_mechanism_rdp(epsilon: float, orders: np.ndarray) -> np.ndarray:
    a = np.asarray(orders, dtype=np.float64)
    return np.minimum(a * epsilon**2 / 8.0, pure_dp_rdp(epsilon, a))


def laplace_rdp(scale: float, orders: np.ndarray) -> np.ndarray:
    """Exact RDP of the Laplace mechanism with sensitivity 1 and scale b (Mironov 2017)."""
    a = np.asarray(orders, dtype=np.float64)
    lam = 1.0 / scale
    terms = np.logaddexp(np.log(a / (2 * a - 1)) + (a - 1) * lam, np.log((a - 1) / (2 * a - 1)) - a * lam)
    return terms / (a - 1)


def zhu_wang_poisson_rdp(q: float, base_rdp: Callable[[np.ndarray], np.ndarray], orders: np.ndarray) -> np.ndarray:
    """General Poisson-subsampled RDP bound (Zhu & Wang 2019, Thm 6); +inf at non-integer α."""
    a_all = np.asarray(orders, dtype=np.float64)
    out = np.full(a_all.shape, np.inf)
    ints = [int(a) for a in a_all if float(a).is_integer() and a >= 2]
    if not ints:
        return out
    max_a = max(ints)
    ls = np.arange(2, max_a + 1, dtype=np.float64)
    eps_l = np.asarray(base_rdp(ls), dtype=np.float64)  # ε(l) for l = 2..max_a
    log_q, log_1mq = math.log(q), math.log1p(-q) if q < 1 else -np.inf
    for i, a in enumerate(a_all):
        if not (float(a).is_integer() and a >= 2):
            continue
        a = int(a)
        if q == 1.0:
            out[i] = eps_l[a - 2]
            continue
        terms = [(a - 1) * log_1mq + math.log(a * q - q + 1)]
        terms.append(math.log(special.comb(a, 2)) + 2 * log_q + (a - 2) * log_1mq + eps_l[0])
        for l in range(3, a + 1):
            terms.append(
                math.log(3.0) + special.gammaln(a + 1) - special.gammaln(l + 1) - special.gammaln(a - l + 1)
                + l * log_q + (a - l) * log_1mq + (l - 1) * eps_l[l - 2]
            )
        bound = special.logsumexp(terms) / (a - 1)
        out[i] = min(bound, eps_l[a - 2])
    return out


# ---- registry: event type -> RDP curve of the *unsampled* mechanism ------------------------

def _composed(event, orders):
    return sum((rdp_curve(e, orders) for e in event.events), np.zeros(len(orders)))


RDP_CURVES: dict[type, Callable] = {
    ev.NoOpDpEvent: lambda e, o: np.zeros(len(o)),
    ev.NonPrivateDpEvent: lambda e, o: np.full(len(o), np.inf),
    ev.GaussianDpEvent: lambda e, o: np.asarray(o, dtype=np.float64) / (2 * e.noise_multiplier**2)
    if e.noise_multiplier > 0 else np.full(len(o), np.inf),
    ev.LaplaceDpEvent: lambda e, o: laplace_rdp(e.noise_multiplier, o),
    ev.ZCDpEvent: lambda e, o: e.xi + e.rho * np.asarray(o, dtype=np.float64),
    ev.ExponentialTopKDpEvent: lambda e, o: e.k * exponential_mechanism_rdp(e.epsilon_per_draw, o),
    ev.NoisyMaxTopKDpEvent: lambda e, o: e.k * pure_dp_rdp(e.epsilon_per_draw, o),
    ev.SparseVectorDpEvent: lambda e, o: e.max_answers * (
        pure_dp_rdp(1.0 / e.threshold_noise + 2.0 / e.query_noise, o)
        + (pure_dp_rdp(1.0 / e.value_noise, o) if e.value_noise is not None else 0.0)
    ),
    ev.ComposedDpEvent: _composed,
    ev.SelfComposedDpEvent: lambda e, o: e.count * rdp_curve(e.event, o) if e.count else np.zeros(len(o)),
    ev.PoissonSampledDpEvent: lambda e, o: _poisson_sampled(e, o),
    ModelMixDpEvent: lambda e, o: modelmix_rdp(e, 1.0, o),
    ev.RandomTrialsDpEvent: lambda e, o: _random_trials(e, o),
}


def _random_trials(event: ev.RandomTrialsDpEvent, orders) -> np.ndarray:
    """Best of K trials (accounting/tuning.py): one trial's curve is the pointwise maximum of the
    candidates' curves (a uniform mixture of them); the bound needs it at every order."""
    trial = np.max([rdp_curve(c, orders) for c in event.candidates], axis=0)
    count = TrialCount(event.distribution, eta=event.eta, gamma=event.gamma, mu=event.mu)
    return selection_rdp(count, trial, orders)


def _poisson_sampled(event: ev.PoissonSampledDpEvent, orders) -> np.ndarray:
    q = float(event.sampling_probability)
    if not 0 <= q <= 1:
        raise UnsupportedEventError(f"sampling probability {q} outside [0, 1]")
    if q == 0:
        return np.zeros(len(orders))
    if type(event.event) is ModelMixDpEvent:
        return modelmix_rdp(event.event, q, orders)
    sigma = ev.gaussian_noise_multiplier(event.event)
    if sigma is not None:
        if math.isinf(sigma):
            return np.zeros(len(orders))
        if sigma == 0:
            return np.full(len(orders), np.inf)
        return np.asarray(opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(orders)), dtype=np.float64)
    return zhu_wang_poisson_rdp(q, lambda ls: rdp_curve(event.event, ls), orders)


def rdp_curve(event: ev.DpEvent, orders) -> np.ndarray:
    """RDP ε(α) of `event` at each order; raises UnsupportedEventError for unknown events."""
    fn = RDP_CURVES.get(type(event))
    if fn is None:
        raise UnsupportedEventError(f"rdp accountant: no RDP bound for {type(event).__name__}")
    return np.asarray(fn(event, orders), dtype=np.float64)


def _first_problem(events) -> Optional[Unsupported]:
    return next((p for p in map(rdp_problem, events) if p is not None), None)


def _composed_problem(e) -> Optional[Unsupported]:
    if not isinstance(e.events, (list, tuple)):
        return Unsupported(e, f"ComposedDpEvent.events must be a list of events, got {type(e.events).__name__}")
    return _first_problem(e.events)


def _poisson_problem(e) -> Optional[Unsupported]:
    problem = probability_problem(e, e.sampling_probability, "sampling_probability")
    if problem is not None or e.sampling_probability == 0:
        return problem  # q = 0: the mechanism never runs (rdp_curve returns 0 without looking inside)
    return rdp_problem(e.event)


# Event type -> structural check of its parameters (and of the events it wraps); types in
# RDP_CURVES without an entry here need none (our own events validate at construction).
RDP_PARAMETERS: dict[type, Callable] = {
    ev.GaussianDpEvent: lambda e: nonnegative_problem(e, e.noise_multiplier, "noise_multiplier"),
    ev.LaplaceDpEvent: lambda e: nonnegative_problem(e, e.noise_multiplier, "noise_multiplier", positive=True),
    ev.ZCDpEvent: lambda e: nonnegative_problem(e, e.rho, "rho") or nonnegative_problem(e, e.xi, "xi"),
    ev.SparseVectorDpEvent: lambda e: None if e.value_noise is None
    else nonnegative_problem(e, e.value_noise, "value_noise", positive=True),
    ev.ComposedDpEvent: _composed_problem,
    ev.SelfComposedDpEvent: lambda e: count_problem(e, e.count) or rdp_problem(e.event),
    ev.PoissonSampledDpEvent: _poisson_problem,
    ev.RandomTrialsDpEvent: lambda e: _first_problem(e.candidates) or _trial_count_problem(e),
}


def _trial_count_problem(e) -> Optional[Unsupported]:
    try:
        TrialCount(e.distribution, eta=e.eta, gamma=e.gamma, mu=e.mu)
    except ValueError as exc:
        return Unsupported(e, str(exc))
    return None  # an additive-δ event inside a trial: refused as misplaced (base.misplaced_additive_delta)


def rdp_problem(event: ev.DpEvent) -> Optional[Unsupported]:
    """Structural twin of `rdp_curve`: None iff it returns a curve for `event` (no ε computed)."""
    if type(event) not in RDP_CURVES:
        return Unsupported(event, f"no RDP bound is known for {type(event).__name__}")
    check = RDP_PARAMETERS.get(type(event))
    return None if check is None else check(event)


@register
class RdpAccountant(Accountant):
    """Tight-ish accountant for everything with a known RDP curve (see module docstring)."""

    name = "rdp"

    def __init__(self, orders=DEFAULT_ORDERS) -> None:
        self.orders = tuple(float(o) for o in orders)
        self._cache: dict[str, np.ndarray] = {}  # keyed by repr: composed events hold lists

    def _curve(self, event: ev.DpEvent, orders: tuple[float, ...]) -> np.ndarray:
        key = repr((event, orders))
        if key not in self._cache:
            self._cache[key] = rdp_curve(event, orders)
        return self._cache[key]

    def total_rdp(self, history: History, orders: Optional[tuple[float, ...]] = None) -> np.ndarray:
        orders = self.orders if orders is None else orders
        total = np.zeros(len(orders))
        for event, count in history:
            total = total + count * self._curve(event, orders)
        return total

    def _event_problem(self, event: ev.DpEvent) -> Optional[Unsupported]:
        # As `details` computes: additive-δ events split off at the top level, then curves.
        return misplaced_additive_delta(event) or rdp_problem(split_event(event, self.name)[0])

    def epsilon(self, history: History, delta: float) -> float:
        return self.details(history, delta)["epsilon"]

    def details(self, history: History, delta: float) -> dict:
        delta = check_delta(delta)
        self.check(history)
        history, additive_delta = split_additive_delta(history, self.name)
        extra = {"additive_delta": additive_delta} if additive_delta else {}
        rdp = self.total_rdp(history)
        delta = remaining_delta(delta, additive_delta)
        if delta is None or not np.any(np.isfinite(rdp)):
            return {"epsilon": math.inf, "order": None, **extra}
        eps, order = rdp_to_epsilon(self.orders, rdp, delta)
        # The minimum on the grid's edge: the orders beyond it may give a tighter bound.
        if order == max(self.orders) and order < EDGE_ORDERS_ABOVE[-1]:
            beyond = tuple(a for a in EDGE_ORDERS_ABOVE if a > order)
            eps, order = min((eps, order), rdp_to_epsilon(beyond, self.total_rdp(history, beyond), delta))
        elif order == min(self.orders) and order > EDGE_ORDERS_BELOW[0]:
            below = tuple(a for a in EDGE_ORDERS_BELOW if a < order)
            eps, order = min((eps, order), rdp_to_epsilon(below, self.total_rdp(history, below), delta))
        return {"epsilon": float(eps), "order": order, **extra}
