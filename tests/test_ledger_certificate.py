"""Per-step privacy accounting at the speed of a step: the ledger's budget certificate and ε
cache (accounting/ledger.py), the engine's use of them (trainer/engine/engine.py `would_exceed_budget`,
the lazy `StepStats.epsilon`), and the recorder reading ε only where it writes it."""

import math
import warnings
from typing import Optional

import pytest

from widedp.accounting import PrivacyLedger, make_accountant, step_event
from widedp.accounting import events as ev
from widedp.accounting.base import Accountant, History, Unsupported
from widedp.trainer.run.outputs import RunRecorder

from engine_fixtures import make_engine, tiny_ctr

STEP = step_event(0.01, 1.0)
OTHER = step_event(0.02, 1.0)
DELTA = 1e-6


class Counting(Accountant):
    """Another accountant's ε, counting the calls (not registered)."""

    name = "counting"

    def __init__(self, inner: str = "rdp"):
        self.inner = make_accountant(inner)
        self.calls = 0

    def unsupported(self, history: History):
        return self.inner.unsupported(history)

    def _event_problem(self, event) -> Optional[Unsupported]:
        return self.inner._event_problem(event)

    def epsilon(self, history: History, delta: float) -> float:
        self.calls += 1
        return self.inner.epsilon(history, delta)


@pytest.fixture(autouse=True)
def _quiet_order_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Optimal order is the (smallest|largest) alpha")
        yield


def _ledger():
    acc = Counting()
    ledger = PrivacyLedger(acc, delta=DELTA)
    ledger.record(ev.GaussianDpEvent(20.0))  # a one-time event first, as a run charges it
    return ledger, acc


# ---- the certificate --------------------------------------------------------------------------

def test_a_certificate_answers_without_the_accountant_until_it_is_used_up():
    ledger, acc = _ledger()
    target = make_accountant("rdp").epsilon(ledger.history + [(STEP, 100)], DELTA)
    assert ledger.certify(STEP, 100, target)
    assert acc.calls == 1 and ledger.certificate.count == 100
    for _ in range(100):
        assert not ledger.would_exceed(STEP, target)
        ledger.record(STEP)
    assert acc.calls == 1  # 100 budget checks, no ε computed
    assert ledger.certified(STEP, target, count=0) and not ledger.certified(STEP, target)
    assert ledger.would_exceed(STEP, target)  # the 101st: computed, and over
    assert acc.calls == 2


def test_a_certificate_for_fewer_steps_than_asked_is_not_used():
    ledger, acc = _ledger()
    target = 1e9
    assert ledger.certify(STEP, 3, target) and acc.calls == 1
    assert not ledger.would_exceed(STEP, target, count=5)  # 5 > 3 certified: computed
    assert acc.calls == 2
    for _ in range(3):
        ledger.record(STEP)
    assert not ledger.certified(STEP, target)
    ledger.would_exceed(STEP, target)
    assert acc.calls == 3


def test_another_event_target_delta_or_accountant_voids_the_certificate():
    ledger, acc = _ledger()
    target = make_accountant("rdp").epsilon(ledger.history + [(STEP, 50)], DELTA)
    assert ledger.certify(STEP, 50, target)
    assert not ledger.certified(OTHER, target)  # another event
    assert not ledger.certified(STEP, target * 0.999)  # a target below the certified ε
    assert ledger.certified(STEP, target * 2)  # a larger target: still within it
    assert not ledger.certified(STEP, target, delta=DELTA / 2)  # another δ
    ledger.record(STEP)
    assert ledger.certified(STEP, target)
    ledger.record(OTHER)  # something it did not certify was spent
    assert ledger.certificate is None
    calls = acc.calls
    ledger.would_exceed(STEP, target)
    assert acc.calls == calls + 1  # recomputed
    assert ledger.certify(STEP, 1, 1e9)
    ledger.load_state_dict(ledger.state_dict())  # a reload (resume) forgets it
    assert ledger.certificate is None
    assert ledger.certify(STEP, 1, 1e9)
    ledger.accountant = make_accountant("rdp")  # certified by another accountant
    assert not ledger.certified(STEP, 1e9)


def test_a_certificate_that_does_not_fit_is_refused_and_certify_most_finds_the_room():
    acc = Counting()
    ledger = PrivacyLedger(acc, delta=DELTA)
    rdp = make_accountant("rdp")
    eps = [rdp.epsilon([(STEP, t)], DELTA) for t in range(1, 41)]
    target = 0.5 * (eps[29] + eps[30])  # 30 steps fit, 31 do not
    assert not ledger.certify(STEP, 31, target) and ledger.certificate is None
    assert ledger.certify_most(STEP, 1000, target) == 30
    assert ledger.certificate.count == 30 and acc.calls <= 2 + math.ceil(math.log2(1000))
    assert ledger.certify_most(STEP, 1000, eps[0] / 2) == 0  # not even one step
    assert ledger.certificate.count == 30  # unchanged
    # Certified counts are exactly the per-step answers.
    for t in range(30):
        assert not ledger.would_exceed(STEP, target)
        ledger.record(STEP)
    assert ledger.would_exceed(STEP, target)
    with pytest.raises(ValueError, match="count"):
        ledger.certify(STEP, 0, target)


def test_certify_refuses_where_the_bound_does_not_hold():
    """The paper accountant's Theorem 3 can be invalid for many steps (InvalidBoundError): no
    certificate, not an error — the per-step check then decides, as before."""
    ledger = PrivacyLedger("paper", delta=1e-6)
    step = step_event(1e-4, 5.0, ev.ExponentialTopKDpEvent(0.05, 1))
    assert not ledger.certify(step, 10**9, 1e9)
    assert ledger.certificate is None


# ---- the ε cache ---------------------------------------------------------------------------------

def test_epsilon_is_cached_by_history_and_a_snapshot_keeps_its_step():
    ledger, acc = _ledger()
    for _ in range(10):
        ledger.record(STEP)
    first = ledger.epsilon()
    assert ledger.epsilon() == first and acc.calls == 1
    snap = ledger.epsilon_snapshot()  # ε after 11 events, computed only when called
    assert acc.calls == 1
    ledger.record(STEP)
    assert snap() == first and acc.calls == 1  # cached: same events, same digest
    after = ledger.epsilon()
    assert after > first and acc.calls == 2
    assert ledger.epsilon(DELTA / 10) > after and acc.calls == 3  # another δ: its own entry
    assert PrivacyLedger("rdp").epsilon_snapshot()() == 0.0


# ---- the engine ----------------------------------------------------------------------------------

def _engine(target, accountant):
    return make_engine(tiny_ctr(), mode="dpsgd", q=0.25, sigma=1.5, target_epsilon=target, accountant=accountant)


def test_the_engine_certifies_the_planned_steps_once_and_computes_epsilon_only_when_read():
    acc = Counting()
    engine = _engine(1e9, acc)
    engine.budget.plan_steps(8)
    stats = [engine.step() for _ in range(8)]
    assert all(s is not None for s in stats)
    assert acc.calls == 1  # one certificate for the 8 steps; no per-step ε
    assert all(s.epsilon_if_computed is None for s in stats)
    # Read later, each step's ε is still that step's (not the ledger's latest).
    rdp = make_accountant("rdp")
    assert stats[2].epsilon == pytest.approx(rdp.epsilon([(engine.step_event, 3)], engine.ledger.delta), rel=1e-12)
    assert stats[-1].epsilon == pytest.approx(rdp.epsilon([(engine.step_event, 8)], engine.ledger.delta), rel=1e-12)
    assert acc.calls == 3
    assert engine.ledger.epsilon() == stats[-1].epsilon and acc.calls == 3  # the summary's ε: cached
    assert stats[-1].epsilon_if_computed == stats[-1].epsilon


@pytest.mark.parametrize("planned", [None, 20])
def test_the_engine_still_stops_exactly_before_the_step_that_would_exceed(planned):
    """With certificates the engine refuses exactly the step the per-step check refused, with a
    few accountant calls in all (bisection), not one per step."""
    probe = _engine(1e9, "rdp")
    rdp = make_accountant("rdp")
    eps = [rdp.epsilon([(probe.step_event, t)], probe.ledger.delta) for t in range(1, 21)]
    target = 0.5 * (eps[10] + eps[11])  # 11 steps fit
    acc = Counting()
    engine = _engine(target, acc)
    if planned is not None:
        engine.budget.plan_steps(planned)
    taken = 0
    while engine.step() is not None:
        taken += 1
        assert taken <= 11
    assert taken == 11 and engine.ledger.steps == 11
    assert engine.step() is None  # and stays refused
    assert engine.ledger.epsilon() <= target
    wanted = planned if planned is not None else engine.budget.BUDGET_CHUNK
    assert acc.calls <= 1 + math.ceil(math.log2(wanted)) + 3


def test_plan_steps_checks_its_argument():
    engine = _engine(1e9, "rdp")
    with pytest.raises(ValueError, match="total_steps"):
        engine.budget.plan_steps(-1)


# ---- the recorder ----------------------------------------------------------------------------------

def test_the_recorder_computes_epsilon_only_for_metrics_lines(tmp_path):
    from widedp.trainer.engine import StepStats

    calls = []

    def spent():
        calls.append(1)
        return 0.25

    recorder = RunRecorder(expected_batch_size=4.0, metrics_path=tmp_path / "metrics.jsonl", debug_metrics=False,
                           randomness_note="", reproducible=False, private=True)
    stats = StepStats(1, 4, 0.5, 3, 2, spent)
    recorder.on_step(stats, 0.01)
    assert recorder.progress_postfix(stats, 1.0)["eps"] == "-" and not calls
    assert recorder.metrics_line(stats)["epsilon"] == 0.25 and len(calls) == 1
    later = StepStats(2, 4, 0.5, 3, 2, spent)
    assert recorder.progress_postfix(later, 1.0)["eps"] == "0.250" and len(calls) == 1  # the last logged ε
    assert recorder.progress_postfix(StepStats(3, 4, 0.5, 3, 2, 0.5), 1.0)["eps"] == "0.500"
