"""ModelMix (seed B, SEEDS.md §B; Xiao, Wan & Devadas, "Differentially private deep learning
with ModelMix") — its privacy event and a rigorous RDP upper bound for it.

!!! THREAT MODEL — READ BEFORE USING THESE NUMBERS !!!
The amplification computed here holds ONLY if, at every step,
  (1) the mixing weights α ~ U[0, 1]^d stay SECRET (fresh OS entropy, never logged, never in a
      checkpoint that is released; DESIGN.md §1 "Secret randomness"). If α leaks, the step is plain
      DP-SGD with the same σ, whose ε (same noise, no mixing) is typically orders of magnitude
      larger (hundreds to thousands in the headline setting);
  (2) the gap is ENFORCED: before mixing, every coordinate of the two latest released states
      θ_{t-1}, θ_{t-2} is pushed apart (symmetrically about its midpoint) to distance ≥ τ. Without
      it a coordinate with θ_{t-1} = θ_{t-2} gets no mixing at all and the bound is void;
  (3) what is released is the sequence of states θ_t (the accounting covers every θ_t, so an
      adversary may see all of them; the mixed state θ̄ and α are never released);
  (4) only coordinates that are mixed are amplified: a parameter updated without mixing (e.g. a
      layer excluded from ModelMix) gets NO amplification, and the event below does not describe it
      (account it as a plain Gaussian).

Mechanism (Alg 1, reconstructed — the extraction lost its formulas): with θ̄ = α⊙θ_{t-1} +
(1−α)⊙θ_{t-2} and the gap enforced,  θ_t = θ̄ − η(Σ_{i∈B} clip(g_i) + N(0, σ²c²I)),  B a Poisson
sample of rate q. Per coordinate i, θ̄_i = θ_{t-2,i} + α_i(θ_{t-1,i} − θ_{t-2,i}) is uniform on an
interval of public endpoints and width w_i = |θ_{t-1,i} − θ_{t-2,i}| ≥ τ. Divided by the update's
sensitivity (η·c for a summed gradient; η·c/b when the sum is normalized by the expected batch b,
DESIGN.md §1), a step is the additive mechanism "Σ clip(g_i) + N(0, σ²) + U(0, w)" on each coordinate.

Normalization of the event (`ModelMixDpEvent`), everything in units of the update's ℓ2 sensitivity
S (S = η·c, or η·c/b with the expected-batch normalization):
- `noise_multiplier` σ = noise std / S (the usual DP-SGD noise multiplier);
- `mix_width` w = τ / S, the enforced minimal gap in the same units. With the paper's τ = r·η and
  gradients averaged over the expected batch b: w = r·b/c. (τ = r·η with a summed gradient gives
  w = r/c; τ = r·η·c gives w = r.)
- `coordinates` k: 1 for Alg 1 with ℓ2 clipping (Thm 4.1); k > 1 for Alg 2's refined clipping
  (ℓ2 clip to c, then clamp each coordinate to c/√k; Cor 4.1).

Neighbouring relation: add/remove one example. Sensitivity: the summed clipped gradient moves by a
vector g with ‖g‖₂ ≤ 1 (and ‖g‖∞ ≤ 1/√k under Alg 2) in units of S. Thm 4.1 / Cor 4.1 (Appendix C,
reconstructed): because the per-coordinate divergence is a convex function of the squared shift,
the worst case over that set is a one-hot shift of 1 (k = 1), resp. k coordinates shifted by 1/√k.
So with Q = N(0, σ²) ⊛ U(0, w), P = Q(· − Δ), Δ = 1/√k, the step's pair is
(P^{⊗k}, Q^{⊗k}) and Poisson sampling gives R = (1−q)Q^{⊗k} + qP^{⊗k}.

RDP (integer orders α ≥ 2; at fractional orders only the Gaussian cap below applies):
- removal direction, exact: exp((α−1)D_α(R‖Q^{⊗k})) = A(α) = Σ_j C(α,j)(1−q)^{α−j} q^j M_j^k,
  M_j = ∫ P^j Q^{1−j} (M_0 = M_1 = 1) — the paper's formula (Thm 4.1 proof, eq. (38)).
- addition direction: the paper invokes Mironov, Talwar & Zhang 2019 Thm 5 to drop it, but that
  theorem is proved for Gaussians only, so we BOUND it instead. With Λ = dP^{⊗k}/dQ^{⊗k},
  t = q(Λ−1) ≥ −q and h(t) = (1+t)^{1−α}, Taylor with a third-order Lagrange remainder
  (h''' < 0) gives h(t) ≤ 1 + (1−α)t + C(α,2)t²(1 + (α+1)q(1−q)^{−α−2}/3), and E_Q[Λ] = 1, so
  exp((α−1)D_α(Q^{⊗k}‖R)) ≤ 1 + C(α,2) q² (M_2^k − 1)(1 + (α+1)q(1−q)^{−α−2}/3).
  For q = 1 both directions coincide (Q is symmetric about w/2, so reflecting x ↦ w+Δ−x swaps P
  and Q). The reported RDP is the max of the two directions, capped by the sampled Gaussian's
  curve with the same σ (mixing adds independent public-support noise to the Gaussian mechanism's
  output — a post-processing), which also makes it finite at fractional orders.
- w = 0 is exactly the sampled Gaussian (the repo's Opacus-computed curve, all orders).

M_j is computed by a quadrature that ONLY OVER-ESTIMATES (`log_moment_upper`):
- Q is log-concave (Prékopa: a convolution of log-concave densities), so for j ≥ 1,
  c(x) = j·log P(x) is concave and v(x) = (1−j)·log Q(x) is convex. On a cell [a, b], c ≤ the
  lower envelope of its tangents at a and b, and v ≤ its chord; so log f ≤ a piecewise-linear
  function whose exponential integrates in closed form. Splitting a cell never increases this
  bound (for concave c and x ≤ m ≤ b the tangent at m lies below the tangent at b at x; chords of
  a convex function shrink under refinement), so a nested finer grid never reports more.
- left tail x < a₀: L = P/Q is nondecreasing (log-concavity), so ∫ P L^{j−1} ≤ L(a₀)^{j−1}
  Φ((a₀−Δ)/σ) (Q's CDF ≤ Φ(·/σ) since U ≥ 0);
- right tail x > b₀ ≥ w+Δ: P(x) ≤ φ_σ(x−Δ−w) and Q(x) ≥ φ_σ(x), so
  ∫ P^j Q^{1−j} ≤ exp(j(j−1)s²/(2σ²)) Φ̄((b₀−js)/σ), s = Δ+w;
- a relative slack of `FLOAT_SLACK` per M_j absorbs floating-point rounding.
The grid reaches b₀ ≈ 2j(Δ+w) (the right-tail bound is crude), so the cost grows with the order; orders
above MAX_ORDER = 256 are not computed (+∞ before the Gaussian cap).

Monotonicity in the gap: the realized gaps are ≥ τ, and the accountant charges width τ. For a
gap that is an integer multiple m·τ this is exact post-processing (U(0, mτ) = U(0, τ) ⊛
uniform{0, τ, …, (m−1)τ}); for other gaps it is verified numerically on a grid of widths
(tests/test_modelmix_accountant.py), not proved.

What reproduced (tests/test_modelmix_accountant.py pins these):
- SEEDS.md §B headline (n = 50,000, b = 1,500 so q = 0.03, c = 20, T = 3,400, σ = 0.335, r = 0.15,
  k = 100, δ = 1/(2n), order α = 4, the paper's conversion ε = T·RDP(α) + log(1/δ)/(α−1)):
  REPRODUCED, ε = 8.000, under exactly one reading of τ: τ = r·η with the clipped gradients
  averaged over the expected batch, i.e. w = r·b/c = 11.25. The other readings do not come close
  at α = 4: w = r = 0.15 (τ = r·η·c, summed gradient) gives 43,710; w = r/c = 0.0075 (τ = r·η,
  summed) gives 44,698; no mixing gives 44,700 (k = 1 at w = 11.25: 39,217 — the refined
  clipping is what makes the headline number). The RDP accountant's own conversion (Balle et al.
  2020, best order) reports 7.25 for the headline setting and 303.5 for the same noise without
  mixing.
- Fig 3's triples (DP-SGD, ModelMix, ModelMix + ℓ∞ truncation) = (57.2, 17.9, 15.3) and
  (40.4, 9.0, 7.9): NOT reproduced. The extracted §4.3 lost every parameter value (n, δ, c, T,
  the three τ/η ratios, k); only "expected batch 1,000" survives. The regular DP-SGD value differs
  between subfigures (57.2 vs 40.4) although the text says T and the budget are the same in all
  subfigures, so the setting cannot be pinned down from the text; we do not guess it.
"""

from __future__ import annotations

import math
from typing import ClassVar, Sequence

import attr
import numpy as np

from widedp.accounting import _dp_event_light  # noqa: F401  (the event classes without dp_accounting's __init__)
from dp_accounting.dp_event import DpEvent
from dp_accounting.privacy_accountant import NeighboringRelation

#: Relative slack added to every M_j upper bound for floating-point rounding (each cell's bound
#: is a handful of exp/log operations in float64, relative error ≲ 1e-13).
FLOAT_SLACK = 1e-9
#: Largest integer order this module computes (the RDP accountant's default orders stop at 63).
MAX_ORDER = 256


def _nonneg(instance, attribute, value):
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a finite number >= 0, got {value!r}")


def _pos(instance, attribute, value):
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a finite number > 0, got {value!r}")


def _pos_int(instance, attribute, value):
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be an integer >= 1, got {value!r}")


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ModelMixDpEvent(DpEvent):
    """One (unsampled) ModelMix step, Alg 1 (k = 1) or Alg 1 + Alg 2's refined clipping (k > 1).

    Neighbouring relation: add/remove one example. In units of the update's ℓ2 sensitivity S
    (see the module docstring): the output is x + g + N(0, σ²I) + U(0, w)^{⊗d} with ‖g‖₂ ≤ 1
    (and ‖g‖∞ ≤ 1/√k when `coordinates` = k > 1), the uniform part being the secret mixing over an
    enforced gap ≥ τ = w·S. Wrap it in `PoissonSampledDpEvent(q, ·)` for a sampled step.

    noise_multiplier: σ = noise std / S.  mix_width: w = τ / S (0: no mixing, a plain Gaussian).
    coordinates: k of Cor 4.1 (1 = ℓ2 clipping only).
    """

    neighboring_relation: ClassVar[NeighboringRelation] = NeighboringRelation.ADD_OR_REMOVE_ONE

    noise_multiplier: float = attr.ib(validator=_pos)
    mix_width: float = attr.ib(validator=_nonneg)
    coordinates: int = attr.ib(default=1, validator=_pos_int)


# ---- the one-dimensional densities ------------------------------------------------------------

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _log_q(x: np.ndarray, sigma: float, w: float) -> np.ndarray:
    """log of Q = N(0, σ²) ⊛ U(0, w) (w > 0): (Φ(x/σ) − Φ((x−w)/σ))/w, stable in log space.
    Q is symmetric about w/2, so evaluate at min(x, w−x) where both Φ arguments are ≤ w/(2σ)."""
    from scipy import special  # scipy.special loads when a bound is computed, not with the event class
    y = np.minimum(x, w - x)
    la = special.log_ndtr(y / sigma)
    lb = special.log_ndtr((y - w) / sigma)
    return la + np.log(-np.expm1(lb - la)) - math.log(w)


def _dlog_q(x: np.ndarray, sigma: float, w: float) -> np.ndarray:
    """(log Q)'(x) = (φ(a) − φ(b)) / (σ (Φ(a) − Φ(b))), a = x/σ, b = (x−w)/σ; odd about w/2."""
    from scipy import special  # scipy.special loads when a bound is computed, not with the event class
    y = np.minimum(x, w - x)
    sign = np.where(x <= w - x, 1.0, -1.0)
    a, b = y / sigma, (y - w) / sigma
    la = special.log_ndtr(a)
    log_diff_cdf = la + np.log(-np.expm1(special.log_ndtr(b) - la))
    # φ(a) − φ(b) = φ(a)·(−expm1((a² − b²)/2)), (a² − b²)/2 = (w/σ)(2y − w)/(2σ) ≤ 0 here.
    log_phi_a = -0.5 * a * a - _LOG_SQRT_2PI
    factor = -np.expm1((w / sigma) * (2 * y - w) / (2 * sigma))
    return sign * factor * np.exp(log_phi_a - log_diff_cdf) / sigma


def _log_exprel(u: np.ndarray) -> np.ndarray:
    """log((e^u − 1)/u), 0 at u = 0."""
    au = np.abs(u)
    small = au < 1e-12
    safe = np.where(small, 1.0, au)
    val = np.maximum(u, 0.0) + np.log(-np.expm1(-safe)) - np.log(safe)
    return np.where(small, 0.5 * u, val)


def _log_int_exp_linear(log_start: np.ndarray, slope: np.ndarray, length: np.ndarray) -> np.ndarray:
    """log ∫_0^length exp(log_start + slope·t) dt (−inf for length 0)."""
    with np.errstate(divide="ignore"):
        log_len = np.log(length)
    return np.where(length > 0, log_start + log_len + _log_exprel(slope * length), -np.inf)


def _cells_log_upper(x: np.ndarray, j: int, sigma: float, w: float, delta: float) -> np.ndarray:
    """Per-cell log upper bounds of ∫ P^j Q^{1−j} over [x_i, x_{i+1}] (tangent envelope of the
    concave j·log P, chord of the convex (1−j)·log Q; see the module docstring)."""
    c = j * _log_q(x - delta, sigma, w)
    dc = j * _dlog_q(x - delta, sigma, w)
    v = (1 - j) * _log_q(x, sigma, w)
    a_c, b_c, a_dc, b_dc = c[:-1], c[1:], dc[:-1], dc[1:]
    h = np.diff(x)
    sv = (v[1:] - v[:-1]) / h
    # Intersection of the two tangents, in local coordinates t ∈ [0, h]; any split point gives a
    # valid bound, so numerical trouble only loosens it.
    with np.errstate(divide="ignore", invalid="ignore"):
        t_star = (b_c - a_c - b_dc * h) / (a_dc - b_dc)
    t_star = np.where(np.isfinite(t_star), np.clip(t_star, 0.0, h), 0.5 * h)
    first = _log_int_exp_linear(a_c + v[:-1], a_dc + sv, t_star)
    start2 = b_c + b_dc * (t_star - h) + v[:-1] + sv * t_star
    second = _log_int_exp_linear(start2, b_dc + sv, h - t_star)
    return np.logaddexp(first, second)


def _log_tails(j: int, sigma: float, w: float, delta: float, a0: float, b0: float) -> tuple[float, float]:
    from scipy import special  # scipy.special loads when a bound is computed, not with the event class
    log_l_a0 = float(_log_q(np.array([a0 - delta]), sigma, w)[0] - _log_q(np.array([a0]), sigma, w)[0])
    left = float(special.log_ndtr((a0 - delta) / sigma)) + (j - 1) * log_l_a0
    s = delta + w
    right = j * (j - 1) * s * s / (2 * sigma * sigma) + float(special.log_ndtr(-(b0 - j * s) / sigma))
    return left, right


def log_moment_upper(j: int, sigma: float, w: float, delta: float, refine: int = 64) -> float:
    """Rigorous upper bound on log M_j = log ∫ P^j Q^{1−j}, Q = N(0, σ²) ⊛ U(0, w), P = Q(· − Δ).

    j = 0, 1: exactly 0. w = 0: the Gaussian's closed form j(j−1)Δ²/(2σ²). Otherwise a coarse
    grid of spacing σ/4 over [a₀, b₀] (tails bounded in closed form beyond), whose cells carrying
    non-negligible mass (bound ≥ max cell bound − 40 in log) are split into `refine` equal
    sub-cells. `refine` must be a power of 2 so that larger values are nested refinements (which
    never report more)."""
    from scipy import special  # scipy.special loads when a bound is computed, not with the event class
    if j in (0, 1):
        return 0.0
    if w == 0:
        return j * (j - 1) * delta * delta / (2 * sigma * sigma)
    if refine < 1 or refine & (refine - 1):
        raise ValueError(f"refine must be a power of 2, got {refine}")
    s = delta + w
    a0 = -delta - 40.0 * sigma
    b0 = max(w + delta, j * s + math.sqrt(j * (j - 1)) * s + 40.0 * sigma)
    h = sigma / 4.0
    n = int(math.ceil((b0 - a0) / h))
    coarse = a0 + h * np.arange(n + 1)
    bounds = _cells_log_upper(coarse, j, sigma, w, delta)
    keep = bounds >= bounds.max() - 40.0
    pieces = [bounds[~keep]]
    if refine > 1 and keep.any():
        starts = coarse[:-1][keep]
        sub = starts[:, None] + (h / refine) * np.arange(refine + 1)[None, :]
        pieces.append(_sub_bounds(sub, j, sigma, w, delta))
    else:
        pieces.append(bounds[keep])
    left, right = _log_tails(j, sigma, w, delta, a0, float(coarse[-1]))
    total = special.logsumexp(np.concatenate(pieces + [np.array([left, right])]))
    return float(total) + math.log1p(FLOAT_SLACK)


def _sub_bounds(sub: np.ndarray, j: int, sigma: float, w: float, delta: float) -> np.ndarray:
    """Cell bounds of each row of `sub` (sorted sub-grids), flattened."""
    rows, width = sub.shape
    flat = sub.reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):  # seams between rows may have length 0
        cells = _cells_log_upper(flat, j, sigma, w, delta)  # rows·width − 1 cells, incl. row seams
    cells = np.append(cells, -np.inf).reshape(rows, width)[:, : width - 1]
    return cells.reshape(-1)


# ---- RDP ---------------------------------------------------------------------------------------

def _integer_orders(orders: Sequence[float]) -> list[int]:
    return sorted({int(a) for a in orders if float(a).is_integer() and 2 <= a <= MAX_ORDER})


def log_moments(event: ModelMixDpEvent, max_order: int, refine: int = 64) -> np.ndarray:
    """Upper bounds on log M_j, j = 0..max_order, for one coordinate (shift 1/√k)."""
    delta = 1.0 / math.sqrt(event.coordinates)
    return np.array([log_moment_upper(j, float(event.noise_multiplier), float(event.mix_width), delta, refine)
                     for j in range(max_order + 1)])


def modelmix_rdp(event: ModelMixDpEvent, q: float, orders: Sequence[float], refine: int = 64,
                 directions: bool = False):
    """RDP ε(α) of `PoissonSampledDpEvent(q, event)` at each order (see the module docstring).

    Integer orders 2..MAX_ORDER get the max of the removal direction (exact formula, M_j bounded
    above) and the addition-direction bound; every order is capped by the sampled Gaussian's curve
    (other orders get just that; w = 0 is exactly it). With `directions`, also returns the two
    uncapped curves (+∞ at fractional orders)."""
    from scipy import special  # scipy.special loads when a bound is computed, not with the event class
    from opacus.accountants.analysis import rdp as opacus_rdp

    orders_arr = np.asarray(orders, dtype=np.float64)
    if not 0 <= q <= 1:
        raise ValueError(f"sampling probability must be in [0, 1], got {q}")
    if q == 0:
        zero = np.zeros(len(orders_arr))
        return (zero, zero, zero) if directions else zero
    if event.mix_width == 0:
        curve = np.asarray(opacus_rdp.compute_rdp(q=q, noise_multiplier=float(event.noise_multiplier), steps=1,
                                                  orders=list(orders_arr)), dtype=np.float64)
        return (curve, curve, np.full(len(curve), -np.inf)) if directions else curve
    ints = _integer_orders(orders_arr.tolist())
    remove = np.full(len(orders_arr), np.inf)
    add = np.full(len(orders_arr), np.inf)
    if ints:
        k = event.coordinates
        log_m = log_moments(event, max(ints), refine)
        log_q = math.log(q)
        log_1mq = math.log1p(-q) if q < 1 else -np.inf
        for i, a in enumerate(orders_arr):
            if not (float(a).is_integer() and 2 <= a <= MAX_ORDER):
                continue
            a = int(a)
            if q == 1:
                remove[i] = k * log_m[a] / (a - 1)
                add[i] = remove[i]  # the two directions coincide (symmetry)
                continue
            js = np.arange(a + 1)
            log_binom = special.gammaln(a + 1) - special.gammaln(js + 1) - special.gammaln(a - js + 1)
            terms = log_binom + (a - js) * log_1mq + js * log_q + k * log_m[: a + 1]
            remove[i] = special.logsumexp(terms) / (a - 1)
            # addition direction: log(1 + C(a,2) q² (M_2^k − 1)(1 + (a+1) q (1−q)^{−a−2}/3))
            m2k_minus_1 = math.expm1(k * log_m[2])
            corr = 1.0 + (a + 1) * q * math.exp(-(a + 2) * log_1mq) / 3.0
            add[i] = math.log1p(a * (a - 1) / 2.0 * q * q * m2k_minus_1 * corr) / (a - 1)
    # Mixing adds independent, data-independent noise to the Gaussian mechanism's output: a
    # post-processing, so the sampled Gaussian's curve (all orders, exact) is a cap.
    gauss = np.asarray(opacus_rdp.compute_rdp(q=q, noise_multiplier=float(event.noise_multiplier), steps=1,
                                              orders=list(orders_arr)), dtype=np.float64)
    curve = np.minimum(np.maximum(remove, add), gauss)
    return (curve, remove, add) if directions else curve


def epsilon_at_order(rdp_per_step: float, steps: int, order: float, delta: float) -> float:
    """The paper's conversion (Thm 2.2, Mironov 2017): ε = T·RDP(α) + log(1/δ)/(α − 1). Looser than
    the Balle et al. 2020 conversion the RDP accountant uses; used to compare with the paper."""
    return steps * rdp_per_step + math.log(1.0 / delta) / (order - 1)
