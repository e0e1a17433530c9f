"""Tests for sparse_learners.output_perturbation: the solver against a reference optimizer, the
stated sensitivities against the exact minimizers of random neighbours, the poster's constants
under replace-one, validation, and statistical privacy audits (tests/privacy_audit.py) paired
with broken variants the same audit catches.

Audits: worst-case add/remove neighbours D = {} and D' = {(e₀, +1)}, n = 1 public, logistic loss,
λ = 10 (large λ makes the logistic derivative at the minimizer ≈ ½, the tightest this loss gets);
the events are fixed from the two exact minimizers (computed once, deterministically) before any
sampling. The deterministic solve is memoized per data set so the audit's many runs only redraw
the noise — the released vectors are identical to uncached calls.
"""

import math

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.optimize import minimize

from widedp.sparse_learners import output_perturbation as op
from tests.privacy_audit import audit_neighbours as _audit



def _random_problem(rng, rows, d, s, loss):
    idx = np.stack([rng.choice(d, s, replace=False) for _ in range(rows)]) if rows else np.zeros((0, s), int)
    vals = rng.normal(size=(rows, s))
    vals /= np.linalg.norm(vals, axis=1, keepdims=True) * 1.0001 if rows else 1.0
    X = sp.csr_matrix((vals.ravel(), idx.ravel(), np.arange(0, rows * s + 1, s)), shape=(rows, d))
    y = np.where(rng.random(rows) < 0.5, 1.0, -1.0) if loss == "logistic" else rng.uniform(-1, 1, rows)
    return X, y


def test_solver_matches_scipy_bfgs_on_a_small_dense_problem():
    rng = np.random.default_rng(0)
    for loss in op.LOSSES:
        X, y = _random_problem(rng, 40, 12, 3, loss)
        x, gnorm = op.solve_regularized_erm(X, y, loss=loss, lam=0.05, n=40, tol=1e-10)
        fg, _ = op.regularized_objective(X, y, loss, 0.05, 40)
        ref = minimize(fg, np.ones(12), jac=True, method="BFGS", options={"gtol": 1e-12})
        assert gnorm <= 1e-10
        np.testing.assert_allclose(x, ref.x, atol=1e-7)


@pytest.mark.parametrize("loss", op.LOSSES)
def test_minimizers_of_random_neighbours_move_at_most_the_stated_l2_and_l1_sensitivities(loss):
    rng = np.random.default_rng(1)
    n, d, s, lam = 30, 20, 3, 0.05
    L, H = op.lipschitz_and_smoothness(loss, 1.0, lam, n, label_bound=1.0)
    worst = {"l2": 0.0, "l1": 0.0}
    for trial in range(20):
        X, y = _random_problem(rng, n + 1, d, s, loss)
        full, _ = op.solve_regularized_erm(X, y, loss=loss, lam=lam, n=n, tol=1e-12)
        removed, _ = op.solve_regularized_erm(X[:-1], y[:-1], loss=loss, lam=lam, n=n, tol=1e-12)
        X2, y2 = _random_problem(rng, 1, d, s, loss)
        replaced, _ = op.solve_regularized_erm(sp.vstack([X[:-1], X2]).tocsr(), np.concatenate([y[:-1], y2]), loss=loss,
                                               lam=lam, n=n, tol=1e-12)
        for other, relation in [(removed, "add-remove"), (replaced, "replace-one")]:
            diff = full - other
            l2 = op.l2_sensitivity(L, lam, n, relation, tol=1e-12)
            l1 = op.l1_sensitivity(L, H, s, lam, n, d, relation, tol=1e-12)
            assert np.linalg.norm(diff) <= l2 and np.abs(diff).sum() <= l1, (trial, relation)
            worst["l2"] = max(worst["l2"], np.linalg.norm(diff) / l2)
            worst["l1"] = max(worst["l1"], np.abs(diff).sum() / l1)
    assert worst["l2"] > 0.01  # the neighbours really moved the minimizer (the check has teeth)


def test_replace_one_reproduces_the_posters_noise_scales_exactly_and_add_remove_halves_them():
    # All-zero features: x* = 0 exactly, so the output is the noise (the ℓ2 ball is far away).
    n, d, s, B, lam, eps, delta = 500, 3, 4, 2.0, 0.5, 0.7, 1e-6
    X = sp.csr_matrix((n, d))
    y = np.ones(n)
    L, H = B, B * B / 4  # logistic
    poster_laplace = 2 * math.sqrt(2 * s) * L / (lam * n * eps) * (2 * H / lam + 1)
    poster_gauss = math.sqrt(8 * L**2 * math.log(1.25 / delta) / (lam * n * eps) ** 2)
    for relation, factor in [("replace-one", 1.0), ("add-remove", 0.5)]:
        common = dict(loss="logistic", lam=lam, s=s, feature_bound=B, radius=1e6, epsilon=eps, relation=relation,
                      tol=1e-300)
        out, ev = op.output_perturbation(X, y, rng=np.random.default_rng(5), **common)
        np.testing.assert_allclose(out / np.random.default_rng(5).laplace(0, 1, d), factor * poster_laplace, rtol=1e-12)
        assert ev.noise_multiplier == pytest.approx(1 / eps)
        out, ev = op.output_perturbation(X, y, delta=delta, rng=np.random.default_rng(6), **common)
        np.testing.assert_allclose(out / np.random.default_rng(6).normal(0, 1, d), factor * poster_gauss, rtol=1e-12)


def test_the_output_lies_in_the_feasible_l2_ball():
    rng = np.random.default_rng(2)
    X, y = _random_problem(rng, 50, 30, 4, "logistic")
    out, _ = op.output_perturbation(X, y, loss="logistic", lam=0.1, s=4, feature_bound=1.0, radius=0.5, epsilon=1.0,
                                    rng=rng)
    assert np.linalg.norm(out) <= 0.5 * (1 + 1e-12)


def test_bad_input_gets_errors_naming_the_parameter_or_row():
    rng = np.random.default_rng(3)
    X = sp.csr_matrix(np.array([[0.6, 0.0, 0.8], [0.0, 1.0, 0.0]]))
    base = dict(loss="logistic", lam=0.1, s=2, feature_bound=1.0, radius=1.0, epsilon=1.0, rng=rng)
    with pytest.raises(ValueError, match="-1 or \\+1 .*row 1 has 0.0"):
        op.output_perturbation(X, np.array([1.0, 0.0]), **base)
    with pytest.raises(ValueError, match="row 0 of X has ℓ2 norm"):
        op.output_perturbation(X * 2, np.ones(2), **base)
    with pytest.raises(ValueError, match="label_bound"):
        op.output_perturbation(X, np.ones(2), **{**base, "loss": "squared"})
    with pytest.raises(ValueError, match="label_bound = 1.0; row 1 has 3.0"):
        op.output_perturbation(X, np.array([0.5, 3.0]), label_bound=1.0, **{**base, "loss": "squared"})
    for key, value in [("lam", 0.0), ("loss", "hinge"), ("radius", -1.0), ("epsilon", math.inf), ("relation", "x")]:
        with pytest.raises(ValueError, match=key):
            op.output_perturbation(X, np.ones(2), **{**base, key: value})
    with pytest.raises(ValueError, match="rows > n \\+ 1"):
        op.output_perturbation(sp.vstack([X, X]).tocsr(), np.ones(4), n=2, **base)


# ---- statistical privacy audits ---------------------------------------------------------------------


@pytest.fixture
def memoized_solver(monkeypatch):
    cache = {}
    real = op.solve_regularized_erm

    def solve(X, y, **kw):
        key = (X.shape, X.data.tobytes(), X.indices.tobytes(), y.tobytes(), tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = real(X, y, **kw)
        return cache[key]

    monkeypatch.setattr(op, "solve_regularized_erm", solve)


def _neighbours():
    d = 3
    D = (sp.csr_matrix((0, d)), np.zeros(0))
    Dp = (sp.csr_matrix(np.array([[1.0, 0.0, 0.0]])), np.array([1.0]))
    lam = 10.0
    shift = op.solve_regularized_erm(Dp[0], Dp[1], loss="logistic", lam=lam, n=1, tol=1e-14)[0][0]
    return D, Dp, lam, shift


def test_output_perturbation_laplace_passes_the_audit_and_a_tenth_of_its_noise_is_caught(memoized_solver):
    D, Dp, lam, shift = _neighbours()
    claimed = 1.0
    event = lambda x: bool(x[0] >= shift)  # noqa: E731  the optimal Laplace event: beyond the D' minimizer

    def mech(eps):
        return lambda data, rng: op.output_perturbation(data[0], data[1], loss="logistic", lam=lam, s=1, feature_bound=1.0,
                                                        radius=100.0, epsilon=eps, n=1, rng=rng)[0]

    assert _audit(mech(claimed), D, Dp, event, 6000, 0.0, seed=1).eps_lb <= claimed
    assert _audit(mech(10 * claimed), D, Dp, event, 3000, 0.0, seed=2).eps_lb > claimed


def test_output_perturbation_gaussian_passes_the_audit_and_a_tenth_of_its_noise_is_caught(memoized_solver):
    D, Dp, lam, shift = _neighbours()
    claimed, delta = 1.0, 1e-2
    event = lambda x: bool(x[0] >= 0.75 * shift)  # noqa: E731  a half-space ¾ of the way to the D' minimizer

    def mech(eps):
        return lambda data, rng: op.output_perturbation(data[0], data[1], loss="logistic", lam=lam, s=1, feature_bound=1.0,
                                                        radius=100.0, epsilon=eps, delta=delta, n=1, rng=rng)[0]

    assert _audit(mech(claimed), D, Dp, event, 6000, delta, seed=3).eps_lb <= claimed
    assert _audit(mech(10 * claimed), D, Dp, event, 8000, delta, seed=4).eps_lb > claimed
