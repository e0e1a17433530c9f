"""accounting/pld_gaussian.py is a fast path: the Gaussian PLD it builds must be dp_accounting's
`from_gaussian_mechanism` (the slow reference) exactly — the same grid, the same PMF masses, the
same infinity mass, for both adjacencies — and the PLD accountant built on it must give the ε of
dp_accounting's own PLDAccountant on the same events. Its self-composition (`self_composed`,
vectorized truncation bounds) must be `self_compose`'s, bounds and PMF alike."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as reference

from widedp.accounting import events as ev
from widedp.accounting.pld import PldAccountant
from widedp.accounting.pld_gaussian import (VectorizedGaussianPrivacyLoss, gaussian_pld, group_gaussian_pld,
                                            self_composed, self_convolve_bounds)


def _dense(pmf):
    dense = pmf.to_dense_pmf() if hasattr(pmf, "to_dense_pmf") else pmf
    return dense._lower_loss, np.asarray(dense._probs), dense._infinity_mass


@pytest.mark.parametrize("sigma", [0.4, 1.0, 3.0, 72.0])
@pytest.mark.parametrize("q", [1.0, 0.3, 0.004])
@pytest.mark.parametrize("interval", [1e-3, 1e-2])
def test_the_pmfs_are_the_reference_ones(sigma, q, interval):
    fast = gaussian_pld(sigma, q, interval)
    slow = reference.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=interval)
    assert fast._symmetric == slow._symmetric
    for mine, theirs in zip((fast._pmf_remove, fast._pmf_add), (slow._pmf_remove, slow._pmf_add)):
        lower, probs, infinity = _dense(mine)
        ref_lower, ref_probs, ref_infinity = _dense(theirs)
        assert lower == ref_lower and probs.shape == ref_probs.shape
        np.testing.assert_allclose(probs, ref_probs, rtol=1e-12, atol=1e-300)
        assert infinity == pytest.approx(ref_infinity, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("adjacency", ["ADD", "REMOVE"])
@pytest.mark.parametrize("q", [1.0, 0.5, 0.01])
def test_the_vectorized_delta_is_the_scalar_one_point_by_point(adjacency, q):
    from dp_accounting.pld.privacy_loss_mechanism import AdjacencyType, GaussianPrivacyLoss

    kind = getattr(AdjacencyType, adjacency)
    fast = VectorizedGaussianPrivacyLoss(0.8, sampling_prob=q, adjacency_type=kind)
    slow = GaussianPrivacyLoss(0.8, sampling_prob=q, adjacency_type=kind)
    edges = [-math.log1p(-q), math.log1p(-q)] if q < 1 else []  # where the sampled loss is cut off
    epsilons = np.concatenate([np.linspace(-3, 3, 61), edges])
    expected = np.array([slow.get_delta_for_epsilon(float(e)) for e in epsilons])
    np.testing.assert_allclose(fast.get_delta_for_epsilon(epsilons), expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("history", [
    [(ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(0.9)), 300)],
    [(ev.GaussianDpEvent(20.0), 1), (ev.PoissonSampledDpEvent(0.002, ev.GaussianDpEvent(1.3)), 1000),
     (ev.GaussianDpEvent(72.0), 1)],
    [(ev.PoissonSampledDpEvent(0.05, ev.GaussianDpEvent(2.0)), 10), (ev.GaussianDpEvent(5.0), 3)],
])
def test_the_accountant_gives_dp_accountings_epsilon(history):
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    for event, count in history:
        inner = dp_event.GaussianDpEvent(event.event.noise_multiplier) if isinstance(event, ev.PoissonSampledDpEvent) \
            else dp_event.GaussianDpEvent(event.noise_multiplier)
        if isinstance(event, ev.PoissonSampledDpEvent):
            inner = dp_event.PoissonSampledDpEvent(event.sampling_probability, inner)
        acc.compose(inner, count)
    expected = acc.get_epsilon(1e-6)
    assert PldAccountant(value_discretization_interval=1e-3).epsilon(history, 1e-6) == pytest.approx(expected, rel=1e-9)


def test_a_noiseless_piece_is_infinite_and_bad_parameters_are_refused():
    assert PldAccountant().pieces_epsilon([(0.1, 0.0, 5, 1)], 1e-6) == math.inf
    with pytest.raises(ValueError, match="σ > 0"):
        gaussian_pld(0.0, 0.5)
    with pytest.raises(ValueError, match="q <= 1"):
        gaussian_pld(1.0, 1.5)


@pytest.mark.parametrize("sigma, q, interval, times", [(1.0, 0.01, 1e-4, 400), (0.8, 0.03, 1e-3, 1000),
                                                       (3.0, 0.005, 1e-4, 50), (0.6, 0.2, 1e-3, 7), (5.0, 1.0, 1e-3, 3)])
def test_self_composition_is_the_librarys_bounds_and_pmfs(sigma, q, interval, times):
    from dp_accounting.pld import common

    pld = gaussian_pld(sigma, q, interval)
    for pmf in (pld._pmf_remove, pld._pmf_add):
        for truncation in (1e-15, 1e-10, 0.0):
            assert self_convolve_bounds(pmf._probs, times, truncation) == \
                common.compute_self_convolve_bounds(pmf._probs, times, truncation)
    fast, slow = self_composed(pld, times), pld.self_compose(times)
    assert fast._symmetric == slow._symmetric
    for a, b in ((fast._pmf_remove, slow._pmf_remove), (fast._pmf_add, slow._pmf_add)):
        assert _dense(a)[0] == _dense(b)[0] and _dense(a)[2] == _dense(b)[2]
        np.testing.assert_array_equal(_dense(a)[1], _dense(b)[1])
    assert fast.get_epsilon_for_delta(1e-6) == slow.get_epsilon_for_delta(1e-6)


def test_self_composition_of_a_sampled_group_is_the_librarys():
    pld = group_gaussian_pld(1.5, 0.05, 3, 1e-3)
    assert self_composed(pld, 60).get_epsilon_for_delta(1e-6) == pld.self_compose(60).get_epsilon_for_delta(1e-6)
