"""The default accountant "auto" (accounting/auto.py): PLD's ε where PLD applies, RDP's
elsewhere, chosen structurally; the merge of identical Gaussian pieces that makes an unmerged
history as cheap as a merged one (accounting/gaussian_reduction.py); agreement of pld, prv and
rdp kept under test on a small grid; the ledger under "auto"."""

import json
import warnings

import pytest

from widedp.accounting import PrivacyLedger, UnsupportedEventError, make_accountant, step_event
from widedp.accounting import base
from widedp.accounting import events as ev
from widedp.accounting.auto import AutoAccountant, resolve
from widedp.accounting.gaussian_reduction import GaussianReducibleAccountant, merge_pieces
from widedp.accounting.modelmix import ModelMixDpEvent
from tests.test_accounting import SUPPORT_TABLE, MadeUpDpEvent

DELTA = 1e-6


@pytest.fixture(autouse=True)
def _quiet_order_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Optimal order is the (smallest|largest) alpha")
        yield


def _dpsgd(q, sigma, steps, one_time=False):
    """T DP-SGD steps, after a one-time Gaussian (e.g. a private vocabulary) if asked."""
    head = [(ev.GaussianDpEvent(20.0), 1)] if one_time else []
    return head + [(ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(sigma)), steps)]


# ---- 1. identical pieces are merged ------------------------------------------------------------

def test_merge_pieces_sums_counts_in_first_appearance_order():
    pieces = [(0.01, 1.0, 1, 1), (1.0, 50.0, 1, 1), (0.01, 1.0, 3, 1), (0.02, 1.0, 2, 1), (0.01, 1.0, 1, 1),
              (0.01, 1.0, 2, 3)]  # the last: a sampled group of 3, another mechanism
    assert merge_pieces(pieces) == [(0.01, 1.0, 5, 1), (1.0, 50.0, 1, 1), (0.02, 1.0, 2, 1), (0.01, 1.0, 2, 3)]
    assert merge_pieces([]) == []


@pytest.mark.parametrize("name", ["pld", "prv"])
def test_a_split_history_costs_what_the_merged_one_does(name, monkeypatch):
    """400 steps given as 400 (event, 1) entries: the same ε as one (event, 400) entry, and the
    accountant composes the same two pieces (it used to compose 401: minutes, not a second)."""
    step = ev.PoissonSampledDpEvent(0.00256, ev.GaussianDpEvent(1.074))
    merged = [(ev.GaussianDpEvent(50.0), 1), (step, 400)]
    split = [(ev.GaussianDpEvent(50.0), 1)] + [(step, 1)] * 400
    acc = make_accountant(name)
    assert isinstance(acc, GaussianReducibleAccountant)
    seen = []
    original = type(acc).pieces_epsilon

    def spy(self, pieces, delta):
        seen.append(list(pieces))
        return original(self, pieces, delta)

    monkeypatch.setattr(type(acc), "pieces_epsilon", spy)
    eps_merged = acc.epsilon(merged, 2.5e-7)
    eps_split = acc.epsilon(split, 2.5e-7)
    assert eps_split == eps_merged
    assert seen[0] == seen[1] == [(1.0, 50.0, 1, 1), (0.00256, 1.074, 400, 1)]


# ---- 2. what "auto" resolves to -------------------------------------------------------------------

def test_auto_is_registered_and_add_remove_one():
    assert "auto" in base.accountant_names()
    acc = make_accountant("auto")
    assert isinstance(acc, AutoAccountant) and acc.name == "auto"
    assert acc.neighboring_relation is ev.NeighboringRelation.ADD_OR_REMOVE_ONE
    assert acc.pld.neighboring_relation is acc.rdp.neighboring_relation is acc.neighboring_relation


def test_support_is_pld_or_rdp_and_structural():
    """On the accounting tests' support table: auto supports exactly what pld or rdp supports,
    resolves to pld wherever pld supports it, and every event pld supports rdp supports too (so
    a ledger checking entries one by one never holds a history neither supports)."""
    auto, pld, rdp = (make_accountant(n) for n in ("auto", "pld", "rdp"))
    for label, (event, _) in SUPPORT_TABLE.items():
        by_pld, by_rdp = pld.supports(event), rdp.supports(event)
        assert not by_pld or by_rdp, label
        assert auto.supports(event) is (by_pld or by_rdp), label
        if by_pld or by_rdp:
            assert auto.resolve([(event, 1)]) == ("pld" if by_pld else "rdp"), label
        else:
            with pytest.raises(UnsupportedEventError, match=r"^auto accountant .*rdp: .*pld: ") as info:
                auto.check([(event, 1)])
            assert info.value.accountant == "auto"


def test_rdp_only_histories_resolve_to_rdp():
    """Selections PLD cannot compose (EM, SVT), ModelMix, and a pld-able history with one such
    event anywhere: the whole history goes to RDP, and ε is exactly RDP's."""
    auto, rdp = make_accountant("auto"), make_accountant("rdp")
    em_step = step_event(0.01, 1.0, ev.ExponentialTopKDpEvent(0.1, 3))
    modelmix = ev.PoissonSampledDpEvent(0.01, ModelMixDpEvent(1.0, 0.5))
    histories = {
        "em": [(em_step, 500)],
        "modelmix": [(modelmix, 200)],
        "gaussian_then_em_one_time": [(ev.ExponentialTopKDpEvent(0.5, 2), 1)] + _dpsgd(0.01, 1.0, 300),
    }
    for label, history in histories.items():
        assert resolve(history) == "rdp" == auto.resolve(history), label
        details = auto.details(history, DELTA)
        assert details["accountant_used"] == "rdp", label
        assert details["epsilon"] == auto.epsilon(history, DELTA) == rdp.epsilon(history, DELTA), label
        assert details["order"] == rdp.details(history, DELTA)["order"], label


def test_unsupported_by_both_names_both_reasons():
    with pytest.raises(UnsupportedEventError, match=r"MadeUpDpEvent.*rdp: no RDP bound.*pld: only Gaussian-reducible"):
        make_accountant("auto").epsilon(_dpsgd(0.01, 1.0, 10) + [(MadeUpDpEvent(1.0), 1)], DELTA)
    with pytest.raises(ValueError, match="delta"):
        make_accountant("auto").epsilon(_dpsgd(0.01, 1.0, 10), 1.0)


# ---- 3. agreement, kept under test (one PLD, PRV and RDP evaluation per case) -----------------------

#: (q, σ, T, one-time Gaussian): every q ∈ {0.001, 0.01, 0.1}, σ ∈ {0.6, 1, 2}, T ∈ {100, 1000} and
#: both heads appear; small on purpose (PLD costs 0.1–2 s per case on 2 cores).
GRID = [(0.001, 2.0, 1000, False), (0.001, 0.6, 100, True), (0.001, 1.0, 1000, True), (0.01, 1.0, 100, True),
        (0.01, 2.0, 1000, False), (0.1, 2.0, 100, True), (0.1, 2.0, 1000, False)]
#: Where auto's ε is also computed by the PLD accountant directly (cheap cases).
CHECKED_AGAINST_PLD = {(0.001, 2.0, 1000, False), (0.01, 2.0, 1000, False)}
#: Opacus PRV reports an upper estimate ε + eps_error (0.01 here): measured on the full 36-case grid,
#: prv − pld ∈ [0.0099, 0.0126] (ε from 0.019 to 85), pld ≤ prv throughout; allowed: 0.01 + 1%·prv.
PRV_SLACK_ABS, PRV_SLACK_REL = 0.01, 0.01


def test_pld_rdp_prv_agree_and_auto_is_pld():
    auto, pld, prv, rdp = (make_accountant(n) for n in ("auto", "pld", "prv", "rdp"))
    assert prv.eps_error == PRV_SLACK_ABS
    for q, sigma, steps, one_time in GRID:
        history = _dpsgd(q, sigma, steps, one_time)
        details = auto.details(history, DELTA)  # PLD's ε (checked against the PLD accountant below)
        e_pld, e_prv, e_rdp = details["epsilon"], prv.epsilon(history, DELTA), rdp.epsilon(history, DELTA)
        case = dict(q=q, sigma=sigma, steps=steps, one_time=one_time, pld=e_pld, prv=e_prv, rdp=e_rdp)
        assert details == {"epsilon": e_pld, "accountant_used": "pld"}, case
        if (q, sigma, steps, one_time) in CHECKED_AGAINST_PLD:
            assert e_pld == pld.epsilon(history, DELTA), case
        assert e_pld <= e_rdp * (1 + 1e-6), case
        assert abs(e_pld - e_prv) <= PRV_SLACK_ABS + PRV_SLACK_REL * e_prv, case


# ---- 4. the ledger under "auto" -------------------------------------------------------------------

def test_ledger_records_and_reloads_with_auto(tmp_path):
    ledger = PrivacyLedger("auto", delta=DELTA)
    ledger.record(ev.GaussianDpEvent(20.0))
    for _ in range(50):
        ledger.record(ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(1.0)))
    assert ledger.epsilon() == make_accountant("pld").epsilon(ledger.history, DELTA)
    state = ledger.state_dict()
    assert state["accountant"] == "auto" and state["neighboring_relation"] == "ADD_OR_REMOVE_ONE"
    assert json.loads(json.dumps(state)) == state
    again = PrivacyLedger("rdp", delta=0.5)
    again.load_state_dict(state)
    assert again.accountant.name == "auto" and again.delta == DELTA and again.history == ledger.history
    assert again.chain() == ledger.chain() and again.epsilon() == ledger.epsilon()
    ledger.save(tmp_path / "ledger.json")
    loaded = PrivacyLedger.load(tmp_path / "ledger.json")
    assert loaded.accountant.name == "auto" and loaded.state_dict() == state
    # An RDP-only event recorded later: the same ledger now resolves to rdp.
    loaded.record(step_event(0.01, 1.0, ev.ExponentialTopKDpEvent(0.1, 3)))
    assert loaded.accountant.resolve(loaded.history) == "rdp"
    assert loaded.epsilon() == make_accountant("rdp").epsilon(loaded.history, DELTA)
    with pytest.raises(UnsupportedEventError, match="auto accountant"):
        loaded.record(MadeUpDpEvent(1.0))


# ---- 5. calibration with PLD: a coarse guide, finished and verified on the accountant itself -------

def _spy_pld(monkeypatch):
    from widedp.accounting.pld import PldAccountant

    calls = []
    original = PldAccountant.pieces_epsilon

    def spy(self, pieces, delta):
        calls.append((self.value_discretization_interval, pieces))
        return original(self, pieces, delta)

    monkeypatch.setattr(PldAccountant, "pieces_epsilon", spy)
    return calls


def test_pld_calibration_is_tight_verified_and_mostly_coarse(monkeypatch):
    from widedp.accounting.calibration import COARSE_PLD_INTERVAL, calibrate_with_epsilon

    calls = _spy_pld(monkeypatch)
    build = lambda s: ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(s))  # noqa: E731
    extra = [(ev.GaussianDpEvent(20.0), 1)]
    sigma, spent = calibrate_with_epsilon(build, 1.0, DELTA, steps=100, extra_history=extra)  # default: auto
    fine = [c for c in calls if c[0] == 1e-4]
    assert len(fine) <= 8 and len(calls) - len(fine) >= 10  # the search ran on the coarse twin
    assert all(c[0] in (1e-4, COARSE_PLD_INTERVAL) for c in calls)
    pld = make_accountant("pld")
    assert spent == pld.epsilon(extra + [(build(sigma), 100)], DELTA) <= 1.0
    assert pld.epsilon(extra + [(build(sigma * (1 - 1e-5)), 100)], DELTA) > 1.0  # tight: less noise overspends


def test_pld_calibration_tries_no_budget_beyond_its_ceiling(monkeypatch):
    """A target no useful σ needs (5e7, e.g. a fraction of target_epsilon = 1e9) used to drive
    the PLD search to σ ~ 1e-4 and a 15 GiB grid; now it stops at RHO_CEILING_GRID."""
    from widedp.accounting.calibration import RHO_CEILING_GRID, calibrate_with_epsilon, sigma_of_rho
    from widedp.accounting.pld import PldAccountant

    calls = _spy_pld(monkeypatch)
    acc = PldAccountant(value_discretization_interval=1e-2)  # coarse itself: cheap at every σ tried
    sigma, spent = calibrate_with_epsilon(ev.GaussianDpEvent, 5e7, DELTA, accountant=acc)
    assert sigma == sigma_of_rho(RHO_CEILING_GRID) and spent == acc.epsilon([(ev.GaussianDpEvent(sigma), 1)], DELTA)
    assert min(pieces[0][1] for _, pieces in calls) >= sigma_of_rho(RHO_CEILING_GRID)
    # RDP needs no ceiling (its cost does not grow with ρ)
    sigma_rdp, spent_rdp = calibrate_with_epsilon(ev.GaussianDpEvent, 5e7, DELTA, accountant="rdp")
    assert sigma_rdp < sigma and spent_rdp <= 5e7
