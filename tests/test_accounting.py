"""Accountants: cross-checks against Opacus / dp_accounting, bounds' internal consistency,
the paper's Theorem 3 reproduced from its own formula, and 'unsupported' instead of guesses."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant
from opacus.accountants import PRVAccountant, RDPAccountant

from widedp.accounting import InvalidBoundError, UnsupportedEventError, make_accountant, step_event
from widedp.accounting import events as ev
from widedp.accounting.paper import advanced_composition
from widedp.accounting.rdp import DEFAULT_ORDERS, pure_dp_rdp, rdp_curve, zhu_wang_poisson_rdp

GAUSS_STEP = ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(1.0))


def test_issue_cross_check_values():
    # Issue: σ=1.0, q=0.01, T=1000, δ=1e-6 -> RDP ε ≈ 2.44 and PRV ε ≈ 2.13 (Opacus 1.6.0).
    assert make_accountant("rdp").epsilon([(GAUSS_STEP, 1000)], 1e-6) == pytest.approx(2.44, abs=0.005)
    assert make_accountant("prv").epsilon([(GAUSS_STEP, 1000)], 1e-6) == pytest.approx(2.13, abs=0.01)


@pytest.mark.parametrize("sigma,q,steps,delta", [(1.0, 0.01, 1000, 1e-6), (0.7, 0.003, 5000, 1e-5), (2.5, 0.1, 200, 1e-8)])
def test_rdp_equals_opacus_rdp_and_prv_equals_opacus_prv(sigma, q, steps, delta):
    hist = [(ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(sigma)), steps)]
    opacus_rdp = RDPAccountant()
    opacus_rdp.history = [(sigma, q, steps)]
    assert make_accountant("rdp").epsilon(hist, delta) == pytest.approx(opacus_rdp.get_epsilon(delta), rel=1e-12)
    opacus_prv = PRVAccountant()
    opacus_prv.history = [(sigma, q, steps)]
    assert make_accountant("prv").epsilon(hist, delta) == pytest.approx(opacus_prv.get_epsilon(delta), rel=1e-9)


def test_pld_equals_dp_accounting_pld():
    for sigma, q, steps in [(1.0, 0.01, 1000), (0.8, 0.05, 300)]:
        ref = pld_privacy_accountant.PLDAccountant()
        ref.compose(dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(sigma)), steps)
        ours = make_accountant("pld").epsilon([(ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(sigma)), steps)], 1e-6)
        assert ours == pytest.approx(ref.get_epsilon(1e-6), rel=1e-12)


def test_threshold_step_accounts_as_one_gaussian():
    # σ_sel⁻² + σ_noise⁻² = σ⁻²: Gaussian thresholding + gradient noise on one batch.
    s_sel, s_noise = 1.7, 1.2
    s_eff = (s_sel**-2 + s_noise**-2) ** -0.5
    composed = step_event(0.02, s_noise, ev.GaussianDpEvent(s_sel))
    single = step_event(0.02, s_eff)
    assert ev.gaussian_noise_multiplier(composed.event) == pytest.approx(s_eff)
    for name in ("rdp", "pld", "prv"):
        acc = make_accountant(name)
        assert acc.epsilon([(composed, 500)], 1e-6) == pytest.approx(acc.epsilon([(single, 500)], 1e-6), rel=1e-9)


def test_pure_dp_rdp_is_randomized_response_divergence():
    eps = 0.8
    p = np.array([math.exp(eps), 1.0]) / (1 + math.exp(eps))
    q = p[::-1]
    for a in [1.5, 2.0, 3.7, 10.0, 40.0]:
        direct = math.log(np.sum(p**a * q ** (1 - a))) / (a - 1)
        assert pure_dp_rdp(eps, np.array([a]))[0] == pytest.approx(direct, rel=1e-12)
        assert pure_dp_rdp(eps, np.array([a]))[0] <= min(eps, a * eps**2 / 2) + 1e-12


def test_zhu_wang_bound_dominates_exact_sampled_gaussian():
    orders = np.arange(2, 40, dtype=float)
    exact = rdp_curve(ev.PoissonSampledDpEvent(0.02, ev.GaussianDpEvent(0.9)), orders)
    general = zhu_wang_poisson_rdp(0.02, lambda a: a / (2 * 0.9**2), orders)
    assert general[0] == pytest.approx(exact[0], rel=1e-9)  # α=2: the bound is exact
    assert np.all(general >= exact - 1e-12)
    assert np.all(general <= orders / (2 * 0.9**2) + 1e-12)  # never worse than no sampling
    # q = 1 is the base mechanism; fractional orders are not bounded (+inf), not guessed.
    assert zhu_wang_poisson_rdp(1.0, lambda a: a / 2.0, np.array([3.0]))[0] == pytest.approx(1.5)
    assert np.isinf(zhu_wang_poisson_rdp(0.1, lambda a: a / 2.0, np.array([2.5]))[0])


def test_selection_step_costs_more_than_its_gaussian_alone():
    rdp = make_accountant("rdp")
    base = rdp.epsilon([(step_event(0.01, 1.0), 1000)], 1e-6)
    for sel in [ev.ExponentialTopKDpEvent(0.05, 100), ev.NoisyMaxTopKDpEvent(0.05, 100), ev.NoOpDpEvent()]:
        eps = rdp.epsilon([(step_event(0.01, 1.0, sel), 1000)], 1e-6)
        assert eps >= base - 1e-9
    # NoOp selection in a step costs (almost) nothing extra: only the Zhu-Wang looseness.
    noop = rdp.epsilon([(step_event(0.01, 1.0, ev.NoOpDpEvent()), 1000)], 1e-6)
    assert noop == pytest.approx(base, rel=1e-9)


def test_unsupported_is_an_error_not_a_guess():
    em_step = step_event(0.01, 1.0, ev.ExponentialTopKDpEvent(0.1, 10))
    for name in ("pld", "prv"):
        with pytest.raises(UnsupportedEventError, match="Gaussian"):
            make_accountant(name).epsilon([(em_step, 10)], 1e-6)
    with pytest.raises(UnsupportedEventError, match="RandomizedResponse"):
        make_accountant("rdp").epsilon([(dpe.RandomizedResponseDpEvent(0.5, 3), 1)], 1e-6)
    with pytest.raises(UnsupportedEventError, match="identical steps"):
        make_accountant("paper").epsilon([(step_event(0.01, 20.0), 5), (step_event(0.02, 20.0), 5)], 1e-6)


def _theorem3_closed_form(q, T, delta_prime, eps_sel, sigma_paper):
    """Seed Theorem 3 as printed in the arXiv version (with the factor 2): the seed's linear
    Lemma 1 (amplified ε = q(ε' + ε_g)) substituted into 4ε̃√(T log(1/(Tδ̃)))."""
    eps_g = 2 * math.sqrt(2 * math.log(1.25 / delta_prime)) / sigma_paper
    return 4 * q * math.sqrt(T * math.log(1 / (2 * q * T * delta_prime))) * (eps_sel + eps_g), 4 * q * T * delta_prime


def _theorem3_corrected(q, T, delta_prime, eps_sel, sigma_paper):
    """The same chain with the correct Poisson amplification ε̃ = log(1 + q(e^ε - 1)), by hand:
    (closed form 4ε̃√(T log(1/(Tδ̃))), KOV expression Tε̃(e^ε̃ - 1) + ε̃√(2T log(1/(Tδ̃))))."""
    eps_step = eps_sel + 2 * math.sqrt(2 * math.log(1.25 / delta_prime)) / sigma_paper
    eps_t = math.log(1 + q * (math.exp(eps_step) - 1))
    slack = T * q * 2 * delta_prime
    return (4 * eps_t * math.sqrt(T * math.log(1 / slack)),
            T * eps_t * (math.exp(eps_t) - 1) + eps_t * math.sqrt(2 * T * math.log(1 / slack)))


def test_paper_accountant_reproduces_theorem3():
    q, T, delta = 1e-4, 10_000, 1e-6
    sigma_paper = 20.0  # paper's σ; worst-case effective multiplier is σ/2 (sensitivity 2·S2)
    step = step_event(q, sigma_paper / 2, ev.ExponentialTopKDpEvent(0.1, 1))
    d = make_accountant("paper").details([(step, T)], delta)
    delta_prime = delta / (4 * q * T)
    expected_eps, expected_delta = _theorem3_closed_form(q, T, delta_prime, 0.1, sigma_paper)
    assert d["valid"], d["violations"]
    assert d["delta_prime"] == pytest.approx(delta_prime)
    # The seed's printed Theorem 3 is still reproduced exactly, flagged as the literal value...
    assert d["epsilon_seed_lemma_literal"] == pytest.approx(expected_eps, rel=1e-12)
    assert d["violations_seed_lemma_literal"] == [] and "NOT a DP guarantee" in d["seed_lemma_literal_note"]
    # ...but `epsilon` is the chain with the correct amplification (changed: it used to be the literal value).
    corrected_eps, corrected_kov = _theorem3_corrected(q, T, delta_prime, 0.1, sigma_paper)
    assert d["epsilon"] == pytest.approx(corrected_eps, rel=1e-12)
    assert d["epsilon_kov"] == pytest.approx(corrected_kov, rel=1e-9)
    assert d["delta"] == pytest.approx(expected_delta, rel=1e-12)
    assert d["epsilon_kov"] <= d["epsilon"]
    assert d["epsilon"] > d["epsilon_seed_lemma_literal"]


def test_poisson_amplification_is_the_tight_bound_not_the_seeds_lemma1():
    from widedp.accounting.paper import poisson_amplification, seed_lemma1_literal

    # Hand computation: ε = 1, q = 0.01 → log(1 + 0.01·(e - 1)) = log(1.0171828...) = 0.0170369...
    assert poisson_amplification(1.0, 0.01) == pytest.approx(math.log(1.0171828182845904), rel=1e-12)
    assert poisson_amplification(1.0, 0.01) == pytest.approx(0.01703686, rel=1e-6)
    assert seed_lemma1_literal(1.0, 0.01) == 0.01  # the seed's Lemma 1: 1.70× too small here
    assert poisson_amplification(1.0, 1e-9) / seed_lemma1_literal(1.0, 1e-9) == pytest.approx(math.e - 1, rel=1e-6)
    for eps in (1e-6, 0.1, 0.5, 1.0, 3.0):  # log(1 + q(e^ε - 1)) > qε for every ε > 0 (convexity of exp)
        assert poisson_amplification(eps, 0.05) > seed_lemma1_literal(eps, 0.05)
    assert poisson_amplification(1.0, 1.0) == pytest.approx(1.0)  # q = 1: no amplification
    assert poisson_amplification(1000.0, 0.01) == pytest.approx(1000.0 + math.log(0.01), rel=1e-12)  # no overflow


def test_paper_accountant_corrected_bound_can_fail_where_the_literal_passes():
    """The corrected ε̃ is what Theorem 3's assumption ε̃ ≤ 1/√T is about: a step that passes it
    with the seed's qε can fail it with log(1 + q(e^ε - 1)), and then the bound is refused."""
    q, T, delta = 0.01, 6000, 1e-6
    step = step_event(q, 10.0, ev.ExponentialTopKDpEvent(0.3, 1))  # per-step ε ≈ 0.925 ≤ 1
    acc = make_accountant("paper")
    d = acc.details([(step, T)], delta)
    assert d["epsilon_tilde_seed_lemma_literal"] <= 1 / math.sqrt(T) < d["epsilon_tilde"]
    assert d["violations_seed_lemma_literal"] == []
    assert not d["valid"] and any("1/√T" in v for v in d["violations"])
    with pytest.raises(InvalidBoundError, match="1/√T"):
        acc.epsilon([(step, T)], delta)


def test_paper_accountant_no_longer_needs_per_step_epsilon_at_most_1():
    """log(1 + q(e^ε - 1)) holds for every ε, so the seed's Lemma 1 condition ε ≤ 1 now only
    flags the literal value; the corrected chain is valid with a per-step ε of 2.1."""
    q, T, delta = 1e-4, 10_000, 1e-6
    step = step_event(q, 10.0, ev.ExponentialTopKDpEvent(1.5, 1))
    d = make_accountant("paper").details([(step, T)], delta)
    assert d["epsilon_step"] > 2
    assert d["valid"], d["violations"]
    assert any("Lemma 1" in v for v in d["violations_seed_lemma_literal"])
    assert d["epsilon"] > d["epsilon_seed_lemma_literal"] * 1.5


def test_paper_accountant_reports_violations_and_refuses_invalid():
    step = step_event(0.01, 1.0, ev.ExponentialTopKDpEvent(0.5, 10))
    acc = make_accountant("paper")
    d = acc.details([(step, 1000)], 1e-6)
    assert not d["valid"] and any("Lemma 3" in v for v in d["violations"])
    with pytest.raises(InvalidBoundError, match="Theorem 3 does not apply"):
        acc.epsilon([(step, 1000)], 1e-6)


def test_advanced_composition_keeps_the_term_alg4_drops():
    eps, k, delta = 0.05, 400, 1e-6
    alg4_claim = eps * math.sqrt(2 * k * math.log(1 / delta))
    assert advanced_composition(eps, k, delta) == pytest.approx(alg4_claim + k * eps * math.expm1(eps))
    assert advanced_composition(eps, k, delta) > alg4_claim


def test_events_serialize_round_trip():
    events = [
        GAUSS_STEP,
        step_event(0.01, 1.0, ev.ExponentialTopKDpEvent(0.1, 5)),
        step_event(0.01, 1.0, ev.NoisyMaxTopKDpEvent(0.1, 5)),
        ev.SelfComposedDpEvent(ev.LaplaceDpEvent(2.0), 3),
        ev.SparseVectorDpEvent(10.0, 20.0, None, 4, 1.0, 1e-6),
        ev.NoOpDpEvent(),
    ]
    for e in events:
        assert ev.event_from_dict(ev.event_to_dict(e)) == e
    with pytest.raises(ValueError, match="unknown event type"):
        ev.event_from_dict({"type": "MadeUpDpEvent"})
    with pytest.raises(ValueError, match="epsilon_per_draw"):
        ev.ExponentialTopKDpEvent(-1.0, 3)


def test_numeric_sparse_emits_the_event_calibration_assumes():
    from widedp.accounting.calibration import svt_event
    from widedp.selection import numeric_sparse

    sel = numeric_sparse([3, 9], [5.0, 0.1], 20, 1.0, 2, 4.0, 1e-5, 1.0, np.random.default_rng(0))
    # numeric_sparse defaults to releasing values; svt_event takes the mode explicitly (no default).
    assert sel.event == svt_event(4.0, 1e-5, 2, release_values=True)
    expected_round = (2 * 0.95 + 0.05 / 2) * 4.0 / math.sqrt(32 * 2 * math.log(2 / 1e-5))
    assert sel.event.epsilon_per_round == pytest.approx(expected_round)
    # Selection-only (what the trainer runs): ε1 = ε, no value noise.
    sel = numeric_sparse([3, 9], [5.0, 0.1], 20, 1.0, 2, 4.0, 1e-5, 1.0, np.random.default_rng(0), release_values=False)
    assert sel.event == svt_event(4.0, 1e-5, 2, release_values=False) and sel.event.value_noise is None
    assert sel.event.epsilon_per_round == pytest.approx(2 * 4.0 / math.sqrt(32 * 2 * math.log(2 / 1e-5)))
    with pytest.raises(TypeError):
        svt_event(4.0, 1e-5, 2)  # the mode must be named: a default once split the CLI from the trainer


def test_default_orders_match_opacus():
    assert list(DEFAULT_ORDERS) == list(RDPAccountant.DEFAULT_ALPHAS)


# ---- the accounting contract: structural `supports`, neighbouring relation, registry, PRV via Opacus's API --

import warnings  # noqa: E402
from typing import ClassVar  # noqa: E402

import attr  # noqa: E402
from dp_accounting import NeighboringRelation  # noqa: E402

from widedp.accounting import PrivacyLedger  # noqa: E402
from widedp.accounting import base  # noqa: E402
from widedp.accounting.calibration import svt_event  # noqa: E402

PARTITION = ev.GaussianPartitionSelectionDpEvent(4.0, 1e-9)
ACCOUNTANT_NAMES = ("rdp", "pld", "prv", "paper")


@attr.s(frozen=True, slots=True, auto_attribs=True)
class MadeUpDpEvent(ev.DpEvent):
    """A custom event no accountant knows."""

    strength: float


@attr.s(frozen=True, slots=True)
class ReplaceOneTopKDpEvent(ev.ExponentialTopKDpEvent):
    """The exponential mechanism stated for replace-one neighbours (sensitivities double)."""

    neighboring_relation: ClassVar[NeighboringRelation] = NeighboringRelation.REPLACE_ONE


_SVT = svt_event(1.0, 1e-6, 4, release_values=False)
# name -> (event, supported by (rdp, pld, prv, paper))
SUPPORT_TABLE = {
    "gaussian": (ev.GaussianDpEvent(1.0), (1, 1, 1, 0)),
    "composed_gaussians": (ev.ComposedDpEvent([ev.GaussianDpEvent(1.0), ev.GaussianDpEvent(2.0)]), (1, 1, 1, 0)),
    "sampled_gaussian": (ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(1.0)), (1, 1, 1, 1)),
    "sampled_threshold_step": (step_event(0.01, 1.0, ev.GaussianDpEvent(2.0)), (1, 1, 1, 1)),
    "sampled_em_step": (step_event(0.01, 1.0, ev.ExponentialTopKDpEvent(0.1, 3)), (1, 0, 0, 1)),
    "sampled_noisy_max_step": (step_event(0.01, 1.0, ev.NoisyMaxTopKDpEvent(0.1, 3)), (1, 0, 0, 1)),
    "sampled_random_step": (step_event(0.01, 1.0, ev.NoOpDpEvent()), (1, 1, 1, 1)),
    "svt_step": (step_event(0.01, 1.0, _SVT), (1, 0, 0, 1)),
    "partition": (PARTITION, (1, 1, 1, 0)),
    "partition_in_composed": (ev.ComposedDpEvent([PARTITION, ev.GaussianDpEvent(2.0)]), (1, 1, 1, 0)),
    "partition_self_composed": (ev.SelfComposedDpEvent(PARTITION, 2), (1, 1, 1, 0)),
    "partition_sampled": (ev.PoissonSampledDpEvent(0.1, PARTITION), (0, 0, 0, 0)),
    "partition_deep": (ev.ComposedDpEvent([ev.PoissonSampledDpEvent(
        0.1, ev.ComposedDpEvent([ev.GaussianDpEvent(1.0), PARTITION]))]), (0, 0, 0, 0)),
    "em": (ev.ExponentialTopKDpEvent(0.1, 3), (1, 0, 0, 0)),
    "svt": (_SVT, (1, 0, 0, 0)),
    "laplace_self_composed": (ev.SelfComposedDpEvent(ev.LaplaceDpEvent(2.0), 3), (1, 0, 0, 0)),
    "nonprivate": (ev.NonPrivateDpEvent(), (1, 0, 0, 0)),  # rdp: ε = inf, an honest answer
    "sampled_nonprivate": (ev.PoissonSampledDpEvent(0.01, ev.NonPrivateDpEvent()), (1, 0, 0, 0)),
    "noop": (ev.NoOpDpEvent(), (1, 1, 1, 0)),  # paper: a history of NoOps alone has no step
    "zero_noise_step": (step_event(0.01, 0.0), (1, 0, 0, 0)),  # rdp: ε = inf; pld/prv: "not private"
    "custom": (MadeUpDpEvent(1.0), (0, 0, 0, 0)),
    "randomized_response": (dpe.RandomizedResponseDpEvent(0.5, 3), (0, 0, 0, 0)),
    "replace_one_em": (ReplaceOneTopKDpEvent(0.1, 3), (0, 0, 0, 0)),
    "replace_one_in_step": (step_event(0.01, 1.0, ReplaceOneTopKDpEvent(0.1, 3)), (0, 0, 0, 0)),
    "rate_above_one": (ev.PoissonSampledDpEvent(1.5, ev.GaussianDpEvent(1.0)), (0, 0, 0, 0)),
    "negative_noise": (ev.GaussianDpEvent(-1.0), (0, 0, 0, 0)),
    "negative_self_composition": (ev.SelfComposedDpEvent(ev.GaussianDpEvent(1.0), -2), (0, 0, 0, 0)),
}


@pytest.mark.parametrize("name", ACCOUNTANT_NAMES)
def test_supports_agrees_with_epsilon_raising(name):
    """`supports` is decided structurally, and exactly when `epsilon` would refuse; `check` names
    the accountant and the offending event type. (The paper accountant's numerical validity
    conditions raise InvalidBoundError, not UnsupportedEventError: they are not `supports`' business.)"""
    acc = make_accountant(name)
    column = ACCOUNTANT_NAMES.index(name)
    for label, (event, expected) in SUPPORT_TABLE.items():
        supported = acc.supports(event)
        assert supported is bool(expected[column]), (name, label)
        try:
            acc.epsilon([(event, 1)], 1e-5)
            refused = False
        except UnsupportedEventError:
            refused = True
        except InvalidBoundError:
            assert name == "paper", label
            refused = False
        assert refused is not supported, (name, label)
        if supported:
            acc.check([(event, 1)])
        else:
            with pytest.raises(UnsupportedEventError) as info:
                acc.check([(event, 1)])
            message = str(info.value)
            assert message.startswith(f"{name} accountant"), message
            assert info.value.accountant == name
            offending = info.value.event  # None: a property of the whole history (paper: no step at all)
            if offending is not None:
                assert type(offending).__name__ in message, message


def test_unsupported_messages_name_the_nested_offender():
    with pytest.raises(UnsupportedEventError, match=r"pld accountant .*ExponentialTopKDpEvent.*Gaussian-reducible"):
        make_accountant("pld").check([(SUPPORT_TABLE["sampled_em_step"][0], 10)])
    with pytest.raises(UnsupportedEventError, match=r"rdp accountant .*MadeUpDpEvent"):
        make_accountant("rdp").check([(GAUSS_STEP, 10), (MadeUpDpEvent(1.0), 1)])
    with pytest.raises(UnsupportedEventError, match=r"paper accountant: .*identical steps"):
        make_accountant("paper").check([(step_event(0.01, 20.0), 5), (step_event(0.02, 20.0), 5)])


def test_paper_numerical_conditions_are_invalid_bounds_not_unsupported_events():
    """Structurally fine; whether Theorem 3 holds depends on δ (here: below the selection's own δ)."""
    step = step_event(0.01, 10.0, svt_event(1.0, 0.5, 3, release_values=False))
    acc = make_accountant("paper")
    assert acc.supports(step)
    with pytest.raises(InvalidBoundError, match="own δ"):
        acc.epsilon([(step, 100)], 1e-6)


def _no_epsilon(*args, **kwargs):
    raise AssertionError("a structural check computed ε")


@pytest.mark.parametrize("name", ACCOUNTANT_NAMES)
def test_record_and_check_never_compute_epsilon(name, monkeypatch):
    """Spy: with every ε entry point of the accountant (and Opacus / dp_accounting underneath) made
    to fail, `supports`, `check` and `PrivacyLedger.record` still work — and still refuse."""
    import widedp.accounting.paper
    import widedp.accounting.pld
    import widedp.accounting.prv
    import widedp.accounting.rdp
    acc = make_accountant(name)
    monkeypatch.setattr(type(acc), "epsilon", _no_epsilon)
    monkeypatch.setattr(type(acc), "details", _no_epsilon)
    monkeypatch.setattr(widedp.accounting.rdp.opacus_rdp, "compute_rdp", _no_epsilon)
    monkeypatch.setattr(widedp.accounting.rdp, "rdp_curve", _no_epsilon)
    monkeypatch.setattr(widedp.accounting.pld, "gaussian_pld", _no_epsilon)
    monkeypatch.setattr(widedp.accounting.prv, "OpacusPRV", _no_epsilon)
    monkeypatch.setattr(widedp.accounting.paper, "gaussian_epsilon", _no_epsilon)
    monkeypatch.setattr(widedp.accounting.paper, "poisson_amplification", _no_epsilon)
    ledger = PrivacyLedger(acc, delta=1e-6)
    step = step_event(0.01, 1.0, ev.GaussianDpEvent(2.0))
    for _ in range(200):
        ledger.record(step)
    assert ledger.steps == 200 and acc.supports(step)
    acc.check(ledger.history)
    with pytest.raises(UnsupportedEventError):
        ledger.record(MadeUpDpEvent(1.0))
    assert ledger.steps == 200


def test_events_and_accountants_state_their_neighbouring_relation():
    for cls in (ev.ExponentialTopKDpEvent, ev.NoisyMaxTopKDpEvent, ev.SparseVectorDpEvent,
                ev.GaussianPartitionSelectionDpEvent):
        assert cls.neighboring_relation is NeighboringRelation.ADD_OR_REMOVE_ONE
        assert "neighboring_relation" not in {f.name for f in attr.fields(cls)}  # class-level, not serialized
    assert ev.relation_of(ev.GaussianDpEvent(1.0)) is None  # dp_accounting's events: relation-agnostic
    assert ev.relation_of(ReplaceOneTopKDpEvent(0.1, 3)) is NeighboringRelation.REPLACE_ONE
    for name in ACCOUNTANT_NAMES:
        assert make_accountant(name).neighboring_relation is NeighboringRelation.ADD_OR_REMOVE_ONE


@pytest.mark.parametrize("name", ACCOUNTANT_NAMES)
def test_accountants_refuse_events_stated_for_another_relation(name):
    acc = make_accountant(name)
    for event in (ReplaceOneTopKDpEvent(0.1, 3), step_event(0.01, 1.0, ReplaceOneTopKDpEvent(0.1, 3))):
        assert not acc.supports(event)
        with pytest.raises(UnsupportedEventError, match="ReplaceOneTopKDpEvent.*REPLACE_ONE.*ADD_OR_REMOVE_ONE"):
            acc.epsilon([(event, 1)], 1e-6)
    ledger = PrivacyLedger(acc, delta=1e-6)
    with pytest.raises(UnsupportedEventError, match="REPLACE_ONE"):
        ledger.record(step_event(0.01, 1.0, ReplaceOneTopKDpEvent(0.1, 3)))
    assert ledger.steps == 0


def test_register_refuses_silent_overwrite(monkeypatch):
    monkeypatch.setattr(base, "ACCOUNTANTS", dict(base.ACCOUNTANTS))
    make_accountant("rdp")  # all four registered
    rdp_cls = base.ACCOUNTANTS["rdp"]

    class Impostor(rdp_cls):
        name = "rdp"

    with pytest.raises(ValueError, match="'rdp' is already registered"):
        base.register(Impostor)
    assert base.ACCOUNTANTS["rdp"] is rdp_cls
    assert base.register(rdp_cls) is rdp_cls  # the very same class again: idempotent
    assert base.ACCOUNTANTS["rdp"] is rdp_cls

    class Fresh(rdp_cls):
        name = "rdp-fresh"

    assert base.register(Fresh) is Fresh and isinstance(make_accountant("rdp-fresh"), Fresh)

    class Other(rdp_cls):
        name = "rdp-fresh"

    with pytest.raises(ValueError, match="rdp-fresh"):
        base.register(Other)

    class Nameless(rdp_cls):
        name = ""

    with pytest.raises(ValueError, match="non-empty"):
        base.register(Nameless)
    with pytest.raises(TypeError):
        base.register(object)


def test_prv_goes_through_opacus_public_api():
    """Our PRV ε equals Opacus's PRVAccountant driven step by step through `step()`."""
    history = [(ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(1.0)), 30),
               (ev.PoissonSampledDpEvent(0.05, ev.GaussianDpEvent(2.0)), 20)]
    ref = PRVAccountant()
    for _ in range(30):
        ref.step(noise_multiplier=1.0, sample_rate=0.01)
    for _ in range(20):
        ref.step(noise_multiplier=2.0, sample_rate=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = ref.get_epsilon(1e-6, eps_error=0.01)
    assert make_accountant("prv").epsilon(history, 1e-6) == pytest.approx(expected, rel=1e-12)


def test_prv_silences_only_the_known_benign_opacus_warnings(monkeypatch):
    import widedp.accounting.prv as prv_module

    acc = make_accountant("prv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.epsilon([(ev.GaussianDpEvent(10.0), 1)], 1e-5)  # q = 1: Opacus's log(1 - q) = -inf
        acc.epsilon([(step_event(0.01, 4.0), 1)], 1e-6)  # Opacus's RDP domain sizing at the edge of its orders

    class Noisy(prv_module.OpacusPRV):
        def get_epsilon(self, delta, **kwargs):
            warnings.warn("an unrelated warning", UserWarning)
            warnings.warn("divide by zero encountered in log", RuntimeWarning)  # right text, wrong module
            warnings.warn("Optimal order is the largest alpha.", UserWarning)  # right text, wrong module
            return super().get_epsilon(delta, **kwargs)

    monkeypatch.setattr(prv_module, "OpacusPRV", Noisy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.epsilon([(ev.GaussianDpEvent(10.0), 1)], 1e-5)
    messages = {str(w.message) for w in caught}
    assert {"an unrelated warning", "divide by zero encountered in log", "Optimal order is the largest alpha."} <= messages


@pytest.mark.parametrize("sigma,q,steps,delta,edge", [
    (20.0, 0.01, 300, 1e-5, "largest"),  # tiny ε per step: the best order is far above 63
    (0.1, 1.0, 50, 1e-5, "smallest"),    # huge ε: the best order is near 1
])
def test_rdp_searches_past_the_grid_edge_without_a_warning(sigma, q, steps, delta, edge):
    """Where Opacus's grid puts the optimum on its edge (and Opacus warns "Optimal order is the
    largest/smallest alpha"), ours searches beyond it: never larger than Opacus's ε, strictly
    smaller here, no warning; interior optima stay equal to Opacus's (the test above)."""
    import warnings

    hist = [(ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(sigma)), steps)]
    opacus = RDPAccountant()
    opacus.history = [(sigma, q, steps)]
    with pytest.warns(UserWarning, match=f"Optimal order is the {edge} alpha"):
        theirs = opacus.get_epsilon(delta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        details = make_accountant("rdp").details(hist, delta)
    assert details["epsilon"] < theirs
    assert (details["order"] > max(DEFAULT_ORDERS)) if edge == "largest" else (details["order"] < min(DEFAULT_ORDERS))
