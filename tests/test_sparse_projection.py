"""Reference tests for sparse_learners.projection: each fast projection against a slow, obvious
optimization on small inputs (scipy.optimize.minimize, SLSQP)."""

import numpy as np
import pytest
from scipy.optimize import minimize

from widedp.sparse_learners.projection import (linf_distance_to_l2_ball, linf_nearest_in_box, linf_nearest_in_l2_ball,
                                        project_l1_ball)


def _slsqp_l1_projection(v, r):
    # min ½‖p - q - v‖² s.t. Σ(p + q) ≤ r, p, q ≥ 0  (w = p - q)
    d = v.size
    obj = lambda pq: 0.5 * np.sum((pq[:d] - pq[d:] - v) ** 2)  # noqa: E731
    jac = lambda pq: np.concatenate([pq[:d] - pq[d:] - v, -(pq[:d] - pq[d:] - v)])  # noqa: E731
    cons = [{"type": "ineq", "fun": lambda pq: r - pq.sum(), "jac": lambda pq: -np.ones(2 * d)}]
    res = minimize(obj, np.zeros(2 * d), jac=jac, bounds=[(0, None)] * (2 * d), constraints=cons, method="SLSQP",
                   options={"ftol": 1e-14, "maxiter": 500})
    return res.x[:d] - res.x[d:]


def test_l1_ball_projection_matches_scipy_slsqp_on_small_inputs():
    rng = np.random.default_rng(0)
    for trial in range(30):
        d = int(rng.integers(1, 9))
        v = rng.normal(size=d) * rng.choice([0.1, 1.0, 5.0])
        r = float(rng.choice([0.0, 0.3, 1.0, 4.0]))
        got = project_l1_ball(v, r)
        ref = _slsqp_l1_projection(v, r)
        np.testing.assert_allclose(got, ref, atol=1e-6, err_msg=f"trial {trial}: v={v}, r={r}")
        assert np.abs(got).sum() <= r * (1 + 1e-12) + 1e-15


def test_l1_ball_projection_leaves_points_inside_the_ball_unchanged_and_scales_to_a_million_coordinates():
    v = np.array([0.2, -0.3, 0.0])
    np.testing.assert_array_equal(project_l1_ball(v, 1.0), v)
    rng = np.random.default_rng(1)
    big = rng.normal(size=10**6)
    w = project_l1_ball(big, 10.0)
    assert abs(np.abs(w).sum() - 10.0) < 1e-9
    # KKT: the support is exactly where |v| exceeds θ, and |v| - |w| = θ there.
    support = w != 0
    theta = np.abs(big[support]) - np.abs(w[support])
    assert np.ptp(theta) < 1e-12
    assert np.all(np.abs(big[~support]) <= theta[0] + 1e-12)
    assert np.all(np.sign(w[support]) == np.sign(big[support]))


def _slsqp_linf_distance(t, R):
    # min u s.t. |x_j - t_j| ≤ u, ‖x‖² ≤ R²; variables (x, u)
    d = t.size
    cons = [{"type": "ineq", "fun": lambda xu: xu[d] - (xu[:d] - t)},
            {"type": "ineq", "fun": lambda xu: xu[d] + (xu[:d] - t)},
            {"type": "ineq", "fun": lambda xu: R * R - np.dot(xu[:d], xu[:d])}]
    x0 = np.concatenate([t * min(1.0, R / max(np.linalg.norm(t), 1e-300)), [np.abs(t).max()]])
    res = minimize(lambda xu: xu[d], x0, constraints=cons, method="SLSQP", options={"ftol": 1e-14, "maxiter": 1000})
    return res.fun


def test_linf_distance_to_l2_ball_matches_scipy_slsqp_on_small_inputs():
    rng = np.random.default_rng(2)
    for trial in range(30):
        d = int(rng.integers(1, 8))
        t = rng.normal(size=d) * rng.choice([0.5, 2.0, 10.0])
        R = float(rng.choice([0.1, 1.0, 3.0]))
        u = linf_distance_to_l2_ball(t, R)
        x = linf_nearest_in_l2_ball(t, R)
        assert np.linalg.norm(x) <= R * (1 + 1e-15)
        assert np.abs(x - t).max() == pytest.approx(u, rel=1e-12, abs=1e-15)
        if np.linalg.norm(t) <= R:
            assert u == 0.0 and np.array_equal(x, t)
        else:
            assert u == pytest.approx(_slsqp_linf_distance(t, R), rel=1e-6, abs=1e-9), f"trial {trial}"


def test_linf_distance_is_minimal_to_machine_precision():
    rng = np.random.default_rng(3)
    t = rng.normal(size=1000) * 3
    u = linf_distance_to_l2_ball(t, 5.0)
    shrunk = np.maximum(np.abs(t) - u * (1 - 1e-9), 0.0)  # any smaller box misses the ball
    assert np.linalg.norm(shrunk) > 5.0
    assert np.linalg.norm(np.maximum(np.abs(t) - u, 0.0)) <= 5.0


def test_linf_nearest_in_box_is_coordinatewise_clipping_and_rejects_an_empty_box():
    t = np.array([-3.0, 0.5, 7.0])
    np.testing.assert_array_equal(linf_nearest_in_box(t, -1.0, [1.0, 1.0, 5.0]), [-1.0, 0.5, 5.0])
    with pytest.raises(ValueError, match="lower"):
        linf_nearest_in_box(t, 1.0, 0.0)


def test_projections_reject_bad_input_naming_the_parameter():
    with pytest.raises(ValueError, match="radius"):
        project_l1_ball(np.ones(3), -1.0)
    with pytest.raises(ValueError, match="v must be finite"):
        project_l1_ball(np.array([1.0, np.nan]), 1.0)
    with pytest.raises(ValueError, match="t must be a 1-d"):
        linf_nearest_in_l2_ball(np.ones((2, 2)), 1.0)
