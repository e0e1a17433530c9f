"""Projections used by seed D's mechanisms: Euclidean projection onto an ℓ1 ball (the projection
mechanism's last step) and the ℓ∞-nearest point of an ℓ2 ball or of a box (output perturbation's
last step).

Privacy assumption: none. These are deterministic maps applied to an already-private output
(post-processing), so they need no neighbouring relation and have no sensitivity; they never
look at the data set.
"""

from __future__ import annotations

import math

import numpy as np


def _vector(v, name: str) -> np.ndarray:
    arr = np.asarray(v, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-d vector, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    return arr


def _radius(r, name: str) -> float:
    if isinstance(r, bool) or not isinstance(r, (int, float, np.integer, np.floating)) or not math.isfinite(r) or r < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {r!r}")
    return float(r)


def project_l1_ball(v, radius: float) -> np.ndarray:
    """Euclidean projection of `v` onto {w : ‖w‖₁ ≤ radius} (Duchi, Shalev-Shwartz, Singer and
    Chandra 2008, Fig. 1): w = sign(v)·max(|v| - θ, 0) with θ ≥ 0 the root of
    Σ max(|v_j| - θ, 0) = radius. O(d log d) (one sort), dense vectors of d up to 10^7.

    Post-processing: no neighbouring relation, no sensitivity. Returns a new float64 array.
    """
    v = _vector(v, "v")
    radius = _radius(radius, "radius")
    a = np.abs(v)
    total = float(a.sum())
    if total <= radius:
        return v.copy()
    if radius == 0.0:
        return np.zeros_like(v)
    # θ ≥ (‖v‖₁ - r)/d, since Σ max(|v_j| - θ, 0) ≥ ‖v‖₁ - dθ: entries at or below that bound are
    # zero in the projection, so only the others need sorting (same θ; they hold ‖·‖₁ > r).
    theta_floor = (total - radius) / a.size
    cand = a[a > theta_floor]
    mu = np.sort(cand)[::-1]
    cumsum = np.cumsum(mu)
    j = np.arange(1, mu.size + 1)
    rho = int(np.nonzero(mu * j > cumsum - radius)[0][-1]) + 1  # Duchi et al.'s ρ
    theta = (cumsum[rho - 1] - radius) / rho
    return np.sign(v) * np.maximum(a - theta, 0.0)


def linf_distance_to_l2_ball(t, radius: float) -> float:
    """The ℓ∞ distance from `t` to {x : ‖x‖₂ ≤ radius}: the smallest u ≥ 0 such that the box
    [t - u, t + u] meets the ball. The box's point nearest the origin is sign(t)·max(|t| - u, 0),
    so u solves g(u) = Σ max(|t_j| - u, 0)² = radius² (g decreasing, piecewise quadratic); solved
    exactly on the piece found by sorting |t| (O(d log d)). Post-processing only.
    """
    t = _vector(t, "t")
    radius = _radius(radius, "radius")
    a = np.abs(t)
    if float(np.dot(a, a)) <= radius * radius:
        return 0.0
    if radius == 0.0:
        return float(a.max())
    mu = np.sort(a)[::-1]
    s1 = np.cumsum(mu)
    s2 = np.cumsum(mu * mu)
    k = np.arange(1, mu.size + 1)
    # On the piece where exactly the k largest |t_j| exceed u (mu_{k+1} ≤ u ≤ mu_k):
    # k u² - 2 S1_k u + S2_k - r² = 0, and the smaller root lies on the piece (g decreases there).
    # g(mu_k) = Σ_{j≤k} (mu_j - mu_k)² is nondecreasing in k, so the piece is the last k with
    # g(mu_k) < r² (k ≥ 1 since g(mu_1) = 0).
    g_at_mu = s2 - 2.0 * mu * s1 + k * mu * mu
    kk = int(np.nonzero(g_at_mu < radius * radius)[0][-1]) + 1
    S1, S2 = float(s1[kk - 1]), float(s2[kk - 1])
    disc = max(S1 * S1 - kk * (S2 - radius * radius), 0.0)
    u = (S1 - math.sqrt(disc)) / kk
    # Rounding can leave g(u) a few ulps above r²; step u up by ulps so the returned point is in
    # the ball (‖·‖₂ ≤ r) while u stays the exact root to machine precision.
    step = max(u, float(mu[0])) * np.finfo(float).eps
    while _g(a, u) > radius * radius:
        u += step
        step *= 2.0
    return float(u)


def _g(a: np.ndarray, u: float) -> float:
    r = np.maximum(a - u, 0.0)
    return float(np.dot(r, r))


def linf_nearest_in_l2_ball(t, radius: float) -> np.ndarray:
    """A point of {x : ‖x‖₂ ≤ radius} nearest to `t` in ℓ∞ (output perturbation's last step):
    with u = `linf_distance_to_l2_ball(t, radius)`, x = sign(t)·max(|t| - u, 0), the point of the
    optimal box [t - u, t + u] nearest the origin (the ℓ∞-nearest point is not unique in
    general; this one is also the ℓ2-smallest among them). `t` itself when it is in the ball.
    Post-processing: no neighbouring relation, no sensitivity.
    """
    t = _vector(t, "t")
    u = linf_distance_to_l2_ball(t, radius)
    if u == 0.0:
        return t.copy()
    return np.sign(t) * np.maximum(np.abs(t) - u, 0.0)


def linf_nearest_in_box(t, lower, upper) -> np.ndarray:
    """The ℓ∞-nearest point of the box {x : lower ≤ x ≤ upper} to `t`: clip(t, lower, upper),
    which is nearest in every coordinate at once. `lower`/`upper` are scalars or vectors like `t`.
    Post-processing: no neighbouring relation, no sensitivity.
    """
    t = _vector(t, "t")
    lo = np.broadcast_to(np.asarray(lower, dtype=np.float64), t.shape)
    hi = np.broadcast_to(np.asarray(upper, dtype=np.float64), t.shape)
    if np.any(np.isnan(lo)) or np.any(np.isnan(hi)):
        raise ValueError("lower and upper must not be NaN")
    if np.any(lo > hi):
        raise ValueError("lower must be <= upper in every coordinate (the box is empty)")
    return np.clip(t, lo, hi)
