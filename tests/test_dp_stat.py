"""DP-STAT (seed C, Alg 3 / Lemma 3.10): reference agreement, utility, event, privacy audit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from widedp.accounting.base import make_accountant
from widedp.accounting.events import GaussianDpEvent, SelfComposedDpEvent
from widedp.accounting.rdp import rdp_curve
from widedp.adaptive_clipping import dp_stat as ds
from tests import privacy_audit as pa


def reference_dp_stat_index(values, theta, num_doublings, threshold, noise) -> int:
    """Slow, obvious DP-STAT: walk the grid θ·2^j, count the points above by a loop, stop at the
    first candidate whose noisy count is ≤ threshold; the last candidate if none is."""
    for j in range(num_doublings + 1):
        candidate = theta * 2.0 ** j
        above = 0
        for v in values:
            if v > candidate:
                above += 1
        if above + noise[j] <= threshold:
            return j
    return num_doublings


def test_fast_dp_stat_matches_the_loop_reference_given_the_same_noise():
    rng = np.random.default_rng(0)
    for trial in range(300):
        m = int(rng.integers(0, 60))
        J = int(rng.integers(0, 12))
        theta = float(rng.uniform(0.01, 2.0))
        values = rng.exponential(scale=rng.uniform(0.1, 50.0), size=m)
        if trial % 5 == 0 and m:  # values exactly on grid points: "above" is strict
            values[: m // 2] = theta * 2.0 ** rng.integers(0, J + 1, size=m // 2)
        noise = rng.normal(0.0, rng.uniform(0.1, 10.0), size=J + 1)
        threshold = float(rng.uniform(-2.0, 20.0))
        assert ds.dp_stat_from_noise(values, theta, J, threshold, noise) == \
            reference_dp_stat_index(list(values), theta, J, threshold, noise)


def test_dp_stat_gamma_is_the_grid_point_of_its_index_and_uses_the_drawn_noise():
    values = np.random.default_rng(1).exponential(3.0, size=500)
    out = ds.dp_stat(values, theta=0.5, num_doublings=10, rho=0.5, beta=0.05, rng=np.random.default_rng(7))
    noise = np.random.default_rng(7).normal(0.0, out.noise_std, size=11)
    assert out.index == ds.dp_stat_from_noise(values, 0.5, 10, out.threshold, noise)
    assert out.gamma == 0.5 * 2.0 ** out.index


def test_noise_scale_and_threshold_follow_the_stated_formulas():
    assert ds.count_noise_std(0.5, 3) == pytest.approx(math.sqrt(4 / 1.0))
    assert ds.stopping_threshold(2.0, 3, 0.05) == pytest.approx(2.0 * math.sqrt(2 * math.log(2 * 4 / 0.05)))


def test_event_pays_for_every_grid_point_and_its_rho_is_the_claimed_one():
    out = ds.dp_stat(np.ones(10), theta=1.0, num_doublings=7, rho=0.3, rng=np.random.default_rng(0))
    assert out.event == SelfComposedDpEvent(GaussianDpEvent(out.noise_std), 8)
    assert 8 / (2 * out.noise_std ** 2) == pytest.approx(0.3)
    # our RDP accountant accounts it directly: its RDP curve is α·ρ, i.e. ρ-zCDP
    orders = np.array([2.0, 8.0, 32.0])
    assert np.allclose(rdp_curve(out.event, orders), orders * 0.3)
    assert make_accountant("rdp").supports(out.event)


def test_count_vector_moves_by_at_most_one_per_grid_point_under_add_remove_and_replace():
    rng = np.random.default_rng(3)
    cands = ds.grid(0.25, 12)
    for _ in range(200):
        values = rng.exponential(5.0, size=int(rng.integers(1, 40)))
        base = ds.counts_above(values, cands)
        added = ds.counts_above(np.append(values, rng.exponential(50.0)), cands)
        replaced = values.copy()
        replaced[0] = rng.exponential(50.0)
        for other in (added, ds.counts_above(replaced, cands)):
            diff = other - base
            assert np.max(np.abs(diff)) <= 1
            assert np.all(diff >= 0) or np.all(diff <= 0)  # one direction: ℓ2 ≤ √(J+1)


def test_with_high_probability_few_points_exceed_gamma_and_gamma_is_at_most_twice_the_max():
    rng = np.random.default_rng(4)
    J, theta, rho, beta = 20, 1e-3, 0.5, 0.05
    failures = 0
    for _ in range(400):
        values = rng.exponential(rng.uniform(0.01, 100.0), size=400)
        out = ds.dp_stat(values, theta=theta, num_doublings=J, rho=rho, beta=beta, rng=rng)
        ok_count = np.count_nonzero(values > out.gamma) <= 2 * out.threshold
        ok_size = out.gamma <= max(theta, 2 * values.max())
        failures += not (ok_count and ok_size)
    assert failures <= 400 * beta  # the lemma's failure probability is ≤ β per call


def test_empty_batch_is_allowed_and_stops_at_the_first_candidate_almost_surely():
    out = ds.dp_stat([], theta=2.0, num_doublings=5, rho=1.0, rng=np.random.default_rng(0))
    assert out.gamma == 2.0


@pytest.mark.parametrize("kwargs, name", [
    (dict(theta=0.0), "theta"), (dict(theta=float("nan")), "theta"), (dict(num_doublings=-1), "num_doublings"),
    (dict(num_doublings=2.5), "num_doublings"), (dict(rho=0.0), "rho"), (dict(beta=1.0), "beta"),
    (dict(values=[1.0, -1.0]), "values"), (dict(values=[[1.0]]), "values"), (dict(rng=123), "rng"),
])
def test_bad_input_raises_value_error_naming_the_parameter(kwargs, name):
    args = dict(values=[1.0, 2.0], theta=1.0, num_doublings=3, rho=0.5, beta=0.05, rng=np.random.default_rng(0))
    args.update(kwargs)
    values = args.pop("values")
    with pytest.raises(ValueError, match=name):
        ds.dp_stat(values, **args)


def test_noise_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="noise"):
        ds.dp_stat_from_noise([1.0], 1.0, 3, 1.0, np.zeros(3))


# ---- statistical privacy audit ---------------------------------------------------------------

AUDIT_RHO, AUDIT_J, AUDIT_DELTA, AUDIT_TRIALS = 0.5, 3, 1e-5, 20_000


def _worst_case_neighbours():
    """Counts at the stopping threshold on every grid point, moved by one at every grid point:
    D has k points above the whole grid (k ≈ τ), D' adds one more (add/remove neighbours; a
    replace-one pair 0 → 1000 gives the same count vectors)."""
    sigma = ds.count_noise_std(AUDIT_RHO, AUDIT_J)
    k = int(round(ds.stopping_threshold(sigma, AUDIT_J, 0.05)))
    d = np.array([1000.0] * k + [0.0] * 10)
    return d, np.append(d, 1000.0)


def _never_stopped(index: int) -> bool:
    """The pre-specified event: every noisy count stayed above τ (output = last grid point).
    It is the worst case above: each grid point's likelihood ratio multiplies into it."""
    return index == AUDIT_J


def _audit(noise_divisor: float) -> pa.EpsilonLowerBound:
    rng = np.random.default_rng(12345)
    sigma = ds.count_noise_std(AUDIT_RHO, AUDIT_J)
    tau = ds.stopping_threshold(sigma, AUDIT_J, 0.05)
    d, d_prime = _worst_case_neighbours()

    def run(values) -> int:
        return ds.dp_stat_from_noise(values, 1.0, AUDIT_J, tau, rng.normal(0.0, sigma / noise_divisor, AUDIT_J + 1))

    # the event is likelier on D' (one more count above): D' is the numerator side
    on_dprime = pa.run_trials(lambda: run(d_prime), _never_stopped, AUDIT_TRIALS)
    on_d = pa.run_trials(lambda: run(d), _never_stopped, AUDIT_TRIALS)
    return pa.epsilon_lower_bound(on_dprime, on_d, delta=AUDIT_DELTA)


def _claimed_epsilon() -> float:
    sigma = ds.count_noise_std(AUDIT_RHO, AUDIT_J)
    return make_accountant("rdp").epsilon([(ds.dp_stat_event(sigma, AUDIT_J), 1)], AUDIT_DELTA)


def test_dp_stat_passes_a_worst_case_privacy_audit():
    claimed = _claimed_epsilon()
    assert claimed <= AUDIT_RHO + 2 * math.sqrt(AUDIT_RHO * math.log(1 / AUDIT_DELTA))  # ≤ the zCDP conversion
    bound = _audit(noise_divisor=1.0)
    assert bound.eps_lb <= claimed, str(bound)


def test_the_audit_catches_dp_stat_with_its_count_noise_divided_by_ten():
    bound = _audit(noise_divisor=10.0)
    assert bound.eps_lb > _claimed_epsilon(), str(bound)
