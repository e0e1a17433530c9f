"""Output perturbation with ℓ∞-projection for λ-regularized convex ERM (seed D, "Upper Bounds for
DP-SO"): x*_λ = argmin (1/n)Σ f(x; z_i) + (λ/2)‖x‖₂², then x̃ = x*_λ + ξ, then the ℓ∞-nearest
point of the feasible set X = {‖x‖₂ ≤ R}.

Privacy assumption: examples z_i = (a_i, y_i) with s-sparse feature vectors ‖a_i‖₂ ≤ B (checked,
naming the first bad row), labels y_i ∈ {-1, +1} (logistic) or |y_i| ≤ Y (squared); losses are
generalized linear, so every gradient ∇f(x; z) = ℓ'(⟨a, x⟩, y)·a is s-sparse; n is public (a
neighbour is normalised by the same n) and the data set has at most n + 1 rows, so the smaller of
two add/remove neighbours has at most n (a larger input is refused from its row count alone).

Neighbouring relation: `relation="add-remove"` (default; the project's unit) or "replace-one" (the
poster's). Sensitivity of the minimizer (exact minimizers; F_S λ-strongly convex). Let x = x*(S),
x' = x*(S'). Subtracting the optimality conditions ∇F_S(x) = 0 = ∇F_{S'}(x'):
  add-remove, S' = S + {z}:  λ(x - x') = -(1/n)[Σ_{i∈S} (∇f(x; z_i) - ∇f(x'; z_i))] + (1/n)∇f(x'; z).
Taking the inner product with x - x' (each bracketed term has ⟨·, x - x'⟩ ≥ 0 by convexity) gives
(with S the smaller of the two, |S| ≤ n)
  ‖x - x'‖₂ ≤ ‖∇f(x'; z)‖₂/(λn) ≤ L/(λn)          (replace-one: 2L/(λn), the poster's)
and, taking ℓ1 norms (each bracketed term is a difference of two s-sparse gradients: ≤ 2s-sparse
with ℓ2 norm ≤ H‖x - x'‖₂, so ℓ1 norm ≤ √(2s)·H‖x - x'‖₂),
  ‖x - x'‖₁ ≤ (1/λ)[√(2s)·H·L/(λn) + √s·L/n] = √s·L/(λn)·(√2·H/λ + 1)
           ≤ √(2s)·L/(λn)·(2H/λ + 1) = half the poster's replace-one bound 2√(2s)L/(λn)(2H/λ + 1).
So add-remove gets exactly half the poster's ℓ1 and ℓ2 sensitivities (factor 1 vs 2), and both
are upper bounds (the ℓ1 one with room to spare). L must bound ‖∇f(x*; z)‖₂ at the minimizers of
S and of every neighbour, H the smoothness of f in x.

Inexact minimizers: we compute x̂ with ‖∇F_S(x̂)‖₂ ≤ g (checked after solving), so
‖x̂ - x*‖₂ ≤ g/λ by strong convexity and the sensitivities grow by 2g/λ (ℓ2) and 2√d·g/λ (ℓ1);
the default g = 1e-6·L/n makes that a 2·10⁻⁶ relative cost in ℓ2 (2√d·10⁻⁶ in ℓ1). The noise is
calibrated to these enlarged sensitivities, so the guarantee covers the vector actually released.
If the solver cannot reach g, `output_perturbation` raises before releasing anything (that
refusal is not covered by the guarantee: treat it as a failed run and change λ or tol, not retry).

Randomness: `rng` (numpy Generator); tests seed it, production callers must pass a generator
seeded from OS entropy (`np.random.default_rng()`). Floating-point effects are out of scope.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
import scipy.sparse as sp
from dp_accounting import dp_event
from scipy.optimize import minimize
from scipy.sparse.linalg import LinearOperator, cg

from widedp.sparse_learners.mean_estimation import (_delta, _positive, _positive_int, _rng, gaussian_noise_multiplier,
                                             relation_factor, validate_sparse_rows)
from widedp.sparse_learners.projection import linf_nearest_in_l2_ball

LOSSES = ("logistic", "squared")


def _check_loss(loss: str) -> str:
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    return loss


def _labels(y, rows: int, loss: str, label_bound: Optional[float]) -> np.ndarray:
    y = np.asarray(y, dtype=np.float64)
    if y.shape != (rows,):
        raise ValueError(f"y must be a vector of length {rows} (one label per row of X), got shape {y.shape}")
    if not np.all(np.isfinite(y)):
        raise ValueError(f"y must be finite; row {int(np.nonzero(~np.isfinite(y))[0][0])} is not")
    if loss == "logistic":
        bad = np.nonzero(np.abs(y) != 1.0)[0]
        if bad.size:
            raise ValueError(f"y must be -1 or +1 for the logistic loss; row {int(bad[0])} has {float(y[bad[0]])!r}")
    else:
        if label_bound is None:
            raise ValueError("label_bound (Y, with |y_i| ≤ Y) is required for the squared loss")
        bad = np.nonzero(np.abs(y) > label_bound)[0]
        if bad.size:
            raise ValueError(f"|y| must be ≤ label_bound = {label_bound!r}; row {int(bad[0])} has {float(y[bad[0]])!r}")
    return y


# ---- the regularized objective -------------------------------------------------------------------


def _derivatives(loss: str, margin: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(f, ℓ', ℓ'') of the loss as a function of the prediction p = ⟨a, x⟩ (arrays over rows)."""
    if loss == "logistic":
        m = y * margin
        f = np.logaddexp(0.0, -m)
        sig = 0.5 * (1.0 + np.tanh(-0.5 * m))  # σ(-m), overflow-free
        return f, -y * sig, sig * (1.0 - sig)
    r = margin - y
    return 0.5 * r * r, r, np.ones_like(r)


def regularized_objective(X: sp.csr_matrix, y: np.ndarray, loss: str, lam: float, n: int) -> tuple[
        Callable[[np.ndarray], tuple[float, np.ndarray]], Callable[[np.ndarray, np.ndarray], np.ndarray]]:
    """(fun_and_grad, hessp) of F(x) = (1/n)Σ f(x; z_i) + (λ/2)‖x‖₂² (rows of X = a_i)."""
    XT = X.T.tocsr()

    def fun_and_grad(x: np.ndarray) -> tuple[float, np.ndarray]:
        f, d1, _ = _derivatives(loss, X @ x, y)
        return float(f.sum() / n + 0.5 * lam * np.dot(x, x)), XT @ d1 / n + lam * x

    def hessp(x: np.ndarray, v: np.ndarray) -> np.ndarray:
        _, _, d2 = _derivatives(loss, X @ x, y)
        return XT @ (d2 * (X @ v)) / n + lam * v

    return fun_and_grad, hessp


def solve_regularized_erm(X: sp.csr_matrix, y: np.ndarray, *, loss: str, lam: float, n: int, tol: float,
                          max_iter: int = 1000) -> tuple[np.ndarray, float]:
    """(x̂, ‖∇F(x̂)‖₂) for F above: L-BFGS (scipy, explicit gradient) from 0, then full Newton-CG
    steps (Hessian-vector products) until ‖∇F(x̂)‖₂ ≤ tol — Newton converges quadratically near
    the minimizer and, unlike the line search, needs no measurable decrease of F, so it reaches
    gradient norms far below √(machine ε). Deterministic. Raises RuntimeError if tol is not met.
    Non-private on its own (it is the exact-as-checked minimizer that output perturbation noises).
    """
    d = X.shape[1]
    fun_and_grad, hessp = regularized_objective(X, y, loss, lam, n)
    res = minimize(fun_and_grad, np.zeros(d), jac=True, method="L-BFGS-B",
                   options={"maxiter": max_iter, "gtol": tol / math.sqrt(d), "ftol": 1e-15, "maxcor": 20})
    x = np.asarray(res.x, dtype=np.float64)
    gnorm = float(np.linalg.norm(fun_and_grad(x)[1]))
    for _ in range(30):
        if gnorm <= tol:
            break
        g = fun_and_grad(x)[1]
        H = LinearOperator((d, d), matvec=lambda v, x=x: hessp(x, v), dtype=np.float64)
        step, _info = cg(H, -g, rtol=min(0.1, gnorm), atol=0.0, maxiter=max(50, 2 * d))
        x = x + step
        gnorm = float(np.linalg.norm(fun_and_grad(x)[1]))
    if not gnorm <= tol:
        raise RuntimeError(f"regularized ERM: gradient norm {gnorm:.3g} > tol = {tol:.3g} after L-BFGS and Newton "
                           f"polishing; nothing was released (increase lam or tol)")
    return x, gnorm


# ---- constants and sensitivities -----------------------------------------------------------------


def lipschitz_and_smoothness(loss: str, feature_bound: float, lam: float, n: int,
                             label_bound: Optional[float] = None) -> tuple[float, float]:
    """(L, H) for ‖a_i‖₂ ≤ B = feature_bound: L bounds ‖∇f(x*; z)‖₂ at the minimizers of the data
    set and of every neighbour, H the smoothness.
    logistic (y = ±1): |ℓ'| ≤ 1, ℓ'' ≤ 1/4, so L = B, H = B²/4.
    squared (|y| ≤ Y): ℓ' = ⟨a, x⟩ - y is unbounded, so bound the minimizers: F(x*) ≤ F(0) ≤
    k·Y²/(2n) for a data set of k ≤ n + 1 rows, hence ‖x*‖₂ ≤ Y·√((n + 1)/(nλ)), and
    L = B·(B·Y·√((n + 1)/(nλ)) + Y); H = B².
    """
    B = _positive(feature_bound, "feature_bound")
    if _check_loss(loss) == "logistic":
        return B, B * B / 4.0
    if label_bound is None:
        raise ValueError("label_bound (Y, with |y_i| ≤ Y) is required for the squared loss")
    Y = _positive(label_bound, "label_bound")
    radius = Y * math.sqrt((n + 1) / (n * lam))
    return B * (B * radius + Y), B * B


def l2_sensitivity(L: float, lam: float, n: int, relation: str = "add-remove", tol: float = 0.0) -> float:
    """ℓ2 sensitivity of the (tol-inexact) minimizer: factor·L/(λn) + 2·tol/λ (factor 1 add-remove,
    2 replace-one; derivation in the module docstring)."""
    return relation_factor(relation) * L / (lam * n) + 2.0 * tol / lam


def l1_sensitivity(L: float, H: float, s: int, lam: float, n: int, d: int, relation: str = "add-remove",
                   tol: float = 0.0) -> float:
    """ℓ1 sensitivity of the (tol-inexact) minimizer: factor·√(2s)·L/(λn)·(2H/λ + 1) + 2√d·tol/λ —
    replace-one (factor 2) is the poster's bound, add-remove (factor 1) is justified in the module
    docstring."""
    return relation_factor(relation) * math.sqrt(2 * s) * L / (lam * n) * (2 * H / lam + 1) \
        + 2.0 * math.sqrt(d) * tol / lam


# ---- the mechanism -------------------------------------------------------------------------------


def output_perturbation(X, y, *, loss: str, lam: float, s: int, feature_bound: float, radius: float,
                        epsilon: float, rng: np.random.Generator, delta: float = 0.0,
                        label_bound: Optional[float] = None, n: Optional[int] = None,
                        relation: str = "add-remove", tol: Optional[float] = None) -> tuple[np.ndarray, dp_event.DpEvent]:
    """Output perturbation with ℓ∞-projection (the poster's algorithm) for the logistic or squared
    loss over s-sparse feature rows `X` (CSR n×d or dense; never densified) and labels `y`.

    x̂ ≈ x*_λ (`solve_regularized_erm`, ‖∇F(x̂)‖₂ ≤ tol, default 1e-6·L/n), x̃ = x̂ + ξ with
      δ = 0: ξ ~ Lap(Δ₁/ε)^{⊗d}, Δ₁ = `l1_sensitivity` (replace-one: the poster's
             σ = 2√(2s)L/(λnε)·(2H/λ + 1); add-remove half of it) + 2√d·tol/λ;
      δ > 0: ξ ~ N(0, σ² I_d), σ = Δ₂·`gaussian_noise_multiplier(ε, δ)`, Δ₂ = `l2_sensitivity`
             (replace-one: the poster's σ² = 8L² ln(1.25/δ)/(λnε)²; add-remove half of σ) + 2·tol/λ;
    output: the ℓ∞-nearest point of the ℓ2 ball of radius `radius` (post-processing).
    L, H from `lipschitz_and_smoothness`. Neighbouring relation: `relation` (add-remove default),
    n public (default: the number of rows; X may have at most n + 1 rows).
    Returns (x, event): δ = 0 → LaplaceDpEvent(1/ε), pure ε-DP; δ > 0 → GaussianDpEvent(σ/Δ₂),
    (ε, δ)-DP (an accountant's ε at δ for it is ≤ ε). `rng`: seed from OS entropy in production.
    """
    loss = _check_loss(loss)
    lam, s = _positive(lam, "lam"), _positive_int(s, "s")
    B, R = _positive(feature_bound, "feature_bound"), _positive(radius, "radius")
    epsilon, rng = _positive(epsilon, "epsilon"), _rng(rng)
    delta = _delta(delta, allow_zero=True)
    relation_factor(relation)
    Xc = validate_sparse_rows(X, s, B, name="X")
    rows, d = Xc.shape
    if n is None:
        if rows < 1:
            raise ValueError("n must be given when X has no rows")
        n = rows
    n = _positive_int(n, "n")
    if rows > n + 1:
        raise ValueError(f"X has {rows} rows > n + 1 = {n + 1}: n (public) must bound the smaller neighbour's size")
    y = _labels(y, rows, loss, None if label_bound is None else _positive(label_bound, "label_bound"))
    L, H = lipschitz_and_smoothness(loss, B, lam, n, label_bound)
    tol = 1e-6 * L / n if tol is None else _positive(tol, "tol")
    x_hat, _gnorm = solve_regularized_erm(Xc, y, loss=loss, lam=lam, n=n, tol=tol)
    event: dp_event.DpEvent
    if delta == 0.0:
        scale = l1_sensitivity(L, H, s, lam, n, d, relation, tol) / epsilon
        noisy = x_hat + rng.laplace(0.0, scale, size=d)
        event = dp_event.LaplaceDpEvent(1.0 / epsilon)
    else:
        multiplier = gaussian_noise_multiplier(epsilon, delta)
        noisy = x_hat + rng.normal(0.0, multiplier * l2_sensitivity(L, lam, n, relation, tol), size=d)
        event = dp_event.GaussianDpEvent(multiplier)
    return linf_nearest_in_l2_ball(noisy, R), event
