"""Accounting for groups (`GroupDpEvent`: user-level DP by example sampling).

Specification: a group of k examples, each Poisson-sampled at rate q on its own, moves one
Gaussian step's sum by j ~ Binom(k, q); its dominating pair is the mixture Σ_j Binom(j; k, q)
N(j, σ²) against N(0, σ²) (Ganesh 2024, Thm. 3.1), which only the PLD accountant composes. The
fast PLD equals dp_accounting's own construction bit for bit; k = 1 is the example-level step;
an unsampled group of k is the Gaussian of σ/k; the claim survives a statistical audit of the
mixture, and the example-level claim for the same mechanism does not.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dp_accounting.pld import privacy_loss_distribution
from privacy_audit import EventCounts, epsilon_lower_bound
from widedp.accounting import make_accountant
from widedp.accounting import events as ev
from widedp.accounting.base import UnsupportedEventError
from widedp.accounting.pld_gaussian import group_gaussian_pld


def _sampled(q, sigma):
    return ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(sigma))


@pytest.mark.parametrize("sigma,q,k", [(2.0, 0.1, 2), (2.0, 0.3, 3)])
def test_the_fast_mixture_pld_is_dp_accountings_bit_for_bit(sigma, q, k):
    fast = group_gaussian_pld(sigma, q, k, 2e-3)
    reference = privacy_loss_distribution.from_mixture_gaussian_mechanism(
        sigma, list(range(k + 1)), list(stats.binom.pmf(range(k + 1), k, q)), value_discretization_interval=2e-3)
    for ours, theirs in ((fast._pmf_remove, reference._pmf_remove), (fast._pmf_add, reference._pmf_add)):
        assert ours._lower_loss == theirs._lower_loss and np.array_equal(ours._probs, theirs._probs)
        assert ours._infinity_mass == theirs._infinity_mass


def test_a_group_of_one_is_the_example_and_an_unsampled_group_is_a_smaller_sigma():
    acc = make_accountant("pld")
    step = _sampled(0.02, 1.1)
    assert acc.epsilon([(ev.grouped(step, 1), 30)], 1e-6) == acc.epsilon([(step, 30)], 1e-6)
    assert ev.grouped(step, 1) == step
    assert acc.epsilon([(ev.GroupDpEvent(ev.GaussianDpEvent(6.0), 3), 1)], 1e-6) == pytest.approx(
        acc.epsilon([(ev.GaussianDpEvent(2.0), 1)], 1e-6), rel=1e-9)


def test_group_epsilon_grows_with_k_and_stays_inside_the_group_privacy_lemma():
    """ε₁ ≤ ε_k, and ε_k at δ_k = k·e^{(k−1)ε₁}·δ is at most k·ε₁ (Vadhan's group-privacy lemma
    applied to the example-level guarantee: the tight analysis can only be better)."""
    acc = make_accountant("pld")
    step, steps, delta = _sampled(0.05, 1.5), 200, 1e-6
    eps1 = acc.epsilon([(step, steps)], delta)
    previous = eps1
    for k in (2, 3):
        grouped = [(ev.grouped(step, k), steps)]
        eps_k = acc.epsilon(grouped, delta)
        assert previous < eps_k
        previous = eps_k
        assert acc.epsilon(grouped, k * math.exp((k - 1) * eps1) * delta) <= k * eps1


def test_only_pld_composes_sampled_groups_and_auto_routes_there():
    history = [(ev.grouped(_sampled(0.05, 1.0), 3), 10)]
    for name in ("rdp", "prv"):
        with pytest.raises(UnsupportedEventError, match="GroupDpEvent|sampled group"):
            make_accountant(name).epsilon(history, 1e-6)
    assert make_accountant("auto").details(history, 1e-6)["accountant_used"] == "pld"
    with pytest.raises(UnsupportedEventError, match="group of groups"):
        make_accountant("pld").epsilon([(ev.GroupDpEvent(ev.GroupDpEvent(_sampled(0.05, 1.0), 2), 2), 1)], 1e-6)
    with pytest.raises(ValueError, match="group_size"):
        ev.GroupDpEvent(_sampled(0.05, 1.0), 0)


def test_group_events_survive_the_ledger_format():
    event = ev.grouped(_sampled(0.05, 1.0), 4)
    assert ev.event_from_dict(ev.event_to_dict(event)) == event


# ---- the statistical audit of the claim ------------------------------------------------------------
SIGMA, Q, K, DELTA, TRIALS = 1.0, 0.5, 4, 1e-5, 200_000


def _threshold() -> float:
    """The half-space {y ≥ t} used by the audit, fixed from the analysis before sampling: the t
    on a grid maximizing the exact log ratio among events with P_D ≥ 5e-4 (estimable)."""
    grid = np.linspace(0.0, 4.0, 401)
    upper = sum(stats.binom.pmf(j, K, Q) * stats.norm.sf((grid - j) / SIGMA) for j in range(K + 1))
    lower = stats.norm.sf(grid / SIGMA)
    ok = lower >= 5e-4
    return float(grid[ok][np.argmax(np.log(upper[ok]) - np.log(lower[ok]))])


def _one_step(with_group: bool, rng: np.random.Generator) -> np.ndarray:
    """One Gaussian step's output along the group's (aligned, worst-case) direction."""
    noise = rng.normal(0.0, SIGMA, TRIALS)
    return noise + (rng.binomial(K, Q, TRIALS) if with_group else 0.0)


def test_the_group_claim_survives_an_audit_and_the_example_level_claim_does_not():
    rng = np.random.default_rng(2024)
    t = _threshold()
    on_d = EventCounts(int((_one_step(True, rng) >= t).sum()), TRIALS)
    on_dprime = EventCounts(int((_one_step(False, rng) >= t).sum()), TRIALS)
    eps_lb = epsilon_lower_bound(on_d, on_dprime, DELTA).eps_lb
    acc = make_accountant("pld")
    claimed = acc.epsilon([(ev.grouped(_sampled(Q, SIGMA), K), 1)], DELTA)
    example_level = acc.epsilon([(_sampled(Q, SIGMA), 1)], DELTA)
    print(f"\n[privacy audit] sampled group k={K}: eps_lb {eps_lb:.3f}, group claim {claimed:.3f}, "
          f"example-level claim {example_level:.3f}")
    assert eps_lb <= claimed
    assert eps_lb > example_level + 1.0
