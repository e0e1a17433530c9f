"""The one Gaussian privacy profile (accounting/gaussian_profile.py) that sparse mean estimation,
the shuffled Gaussian and the Gaussian-DP audit share: against the closed form evaluated
directly (where it does not cancel), dp_accounting's PLD of one Gaussian, and each caller."""

from __future__ import annotations

import math

import pytest
from scipy import special

from widedp.accounting.gaussian_profile import gaussian_delta, log_gaussian_delta


def _direct(eps, mu):
    return special.ndtr(mu / 2 - eps / mu) - math.exp(eps) * special.ndtr(-mu / 2 - eps / mu)


@pytest.mark.parametrize("mu", [0.1, 0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("eps", [0.0, 0.3, 1.0, 3.0])
def test_the_profile_is_the_closed_form_rounded_up(eps, mu):
    direct = _direct(eps, mu)
    if direct < 1e-12:
        return  # the direct form cancels there; the log-space one does not (next test)
    assert gaussian_delta(eps, mu) == pytest.approx(direct, rel=1e-7)
    assert gaussian_delta(eps, mu) >= direct
    assert math.exp(log_gaussian_delta(eps, mu)) == pytest.approx(direct, rel=1e-7)


def test_the_profile_matches_dp_accountings_gaussian_and_its_log_stays_finite_where_the_direct_form_underflows():
    from dp_accounting import pld

    for sigma, eps in [(0.8, 2.0), (1.0, 4.0), (2.0, 1.0)]:
        acc = pld.PLDAccountant()
        acc.compose(pld.pld_privacy_accountant.dp_event.GaussianDpEvent(sigma))
        assert gaussian_delta(eps, 1 / sigma) == pytest.approx(acc.get_delta(eps), rel=1e-3)
    # δ ≈ 10⁻¹³⁹⁰ underflows in the direct form (and as a float); its log does not
    assert _direct(8.0, 0.1) == 0.0 and -3300 < log_gaussian_delta(8.0, 0.1) < -3000


def test_every_caller_uses_it():
    from widedp.adaptive_clipping.shuffling import gaussian_delta as shuffled_gaussian_delta
    from widedp.auditing.fdp_one_run import gdp_epsilon
    from widedp.sparse_learners.mean_estimation import gaussian_delta as mean_gaussian_delta

    assert mean_gaussian_delta(1.5, 2.0) == gaussian_delta(1.5, 0.5)
    assert shuffled_gaussian_delta(1.5, 3.0, 6.0) == gaussian_delta(1.5, 0.5)
    eps = gdp_epsilon(0.5, 1e-5)
    assert math.exp(log_gaussian_delta(eps, 0.5)) == pytest.approx(1e-5, rel=1e-6)


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="mu must be"):
        gaussian_delta(1.0, 0.0)
    with pytest.raises(ValueError, match="epsilon must be"):
        gaussian_delta(-1.0, 1.0)
