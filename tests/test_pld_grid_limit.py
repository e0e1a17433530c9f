"""The PLD accountant declines a Gaussian whose grid would not fit (tiny σ) instead of building it
until memory runs out; "auto" then uses RDP. The estimate of the grid's size is checked against
the PMFs dp_accounting actually builds."""

from __future__ import annotations

import pytest

from widedp.accounting import events as ev
from widedp.accounting.auto import AutoAccountant
from widedp.accounting.base import UnsupportedEventError
from widedp.accounting.pld import PldAccountant
from widedp.accounting.pld_gaussian import MAX_GRID_POINTS, gaussian_pld, grid_points


@pytest.mark.parametrize("sigma, q, interval", [(0.2, 0.01, 1e-3), (0.1, 1.0, 1e-3), (0.5, 0.05, 1e-4)])
def test_the_estimate_is_the_size_of_the_pmf_that_is_built(sigma, q, interval):
    built = len(gaussian_pld(sigma, q, interval)._pmf_remove._probs)
    assert 0.9 * built <= grid_points(sigma, q, interval) <= 1.3 * built


def _sampled(sigma, steps=400, q=0.0057):
    return [(ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(sigma)), steps)]


def test_a_tiny_noise_multiplier_is_declined_by_pld_and_accounted_by_rdp_under_auto():
    history = _sampled(0.001)
    with pytest.raises(UnsupportedEventError, match="noise multiplier 0.001 is too small for the PLD grid"):
        PldAccountant().check(history)
    auto = AutoAccountant()
    assert auto.resolve(history) == "rdp"
    assert auto.epsilon(history, 1e-6) > 1e3  # finite, and huge: σ = 0.001 is barely noise


def test_ordinary_noise_stays_with_pld_and_the_limit_sits_between():
    auto = AutoAccountant()
    assert auto.resolve(_sampled(0.5)) == "pld"
    assert grid_points(0.05, 0.0057, 1e-4) < MAX_GRID_POINTS < grid_points(0.02, 0.0057, 1e-4)
    assert auto.resolve(_sampled(0.05)) == "pld" and auto.resolve(_sampled(0.02)) == "rdp"
    # a composed entry is checked piece by piece
    mixed = [(ev.ComposedDpEvent([ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(0.5)),
                                  ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(0.001))]), 3)]
    assert auto.resolve(mixed) == "rdp"
