"""An unreachable target ε is refused by our own check, with the smallest reachable ε, on every
path that calibrates σ (issue 27, "Honest refusals").

Some ε costs nothing can remove: the one-time events charged before the steps (a private
vocabulary, DP-FEST's top-k) and, for the RDP accountant, the conversion to (ε, δ) itself
(about log(1/δ)/(α_max − 1) even at σ → ∞). A target below that used to end in the bisection
driving σ up until Opacus' RDP arithmetic failed ("The result of subtraction must be
non-negative."). Now `calibrate` stops at its least budget (`RHO_FLOOR`) and raises
`UnreachableTargetError` (a ValueError) saying the smallest ε it reaches; the train path names
`privacy.target_epsilon`.
"""

import math

import pytest

from widedp.accounting import make_accountant
from widedp.accounting import events as ev
from widedp.accounting.calibration import UnreachableTargetError
from widedp.selection.calibration import calibrate

# q = 0.01, 300 steps, δ = 1e-5: with RDP the steps alone never cost less than ≈ 0.0035 (the conversion's
# term at the largest order, 16384: accounting/rdp.py EDGE_ORDERS_ABOVE; 0.1029 with Opacus's orders ≤ 63)
RUN = dict(delta=1e-5, sample_rate=0.01, steps=300)


def test_rdp_calibration_refuses_a_target_below_its_conversion_floor_and_says_the_smallest_epsilon():
    with pytest.raises(UnreachableTargetError) as info:
        calibrate(0.001, **RUN, accountant="rdp")
    err = info.value
    assert isinstance(err, ValueError)
    assert err.target == 0.001 and err.smallest == pytest.approx(0.0035014, abs=1e-6)
    message = str(err)
    assert "target_epsilon = 0.001 is unreachable" in message
    assert "smallest ε this run can reach is 0.003501" in message
    assert "subtraction" not in message  # not Opacus' internal failure
    # the value the message suggests is reachable, and calibration spends no more than it
    suggested = float(message.split("to at least ")[1].split(",")[0])
    assert err.smallest <= suggested < err.smallest * 1.01
    assert calibrate(suggested, **RUN, accountant="rdp").epsilon <= suggested


def test_a_one_time_event_above_the_target_is_refused_with_its_cost_as_the_floor():
    # A one-time Gaussian (e.g. DP-FEST's top-k at σ = 1) spends ≈ 4.9 at δ = 1e-5 with PLD before
    # any step: a target of 1 cannot be met by any σ for the steps.
    one_time = [(ev.GaussianDpEvent(1.0), 1)]
    alone = make_accountant("pld").epsilon(one_time, RUN["delta"])
    with pytest.raises(UnreachableTargetError, match=r"target_epsilon = 1 is unreachable") as info:
        calibrate(1.0, **RUN, accountant="pld", extra_history=one_time)
    assert alone <= info.value.smallest <= alone * 1.001


def test_a_reachable_target_is_still_calibrated_exactly():
    out = calibrate(0.2, **RUN, accountant="rdp")
    assert 0.2 * (1 - 1e-6) <= out.epsilon <= 0.2 and math.isfinite(out.noise_multiplier)


def test_the_train_plan_names_privacy_target_epsilon():
    from widedp.trainer.config import load_config
    from widedp.trainer.config.planning import plan_privacy

    cfg = load_config(None, ["data.path=/nonexistent", "train.mode=sparse", "train.selection=threshold",
                             "privacy.k=40", "train.steps=300", "train.batch_size=27",
                             "privacy.target_epsilon=0.001", "privacy.delta=1e-5", "privacy.accountant=rdp"])
    with pytest.raises(ValueError, match=r"privacy\.target_epsilon = 0\.001 is unreachable: the smallest ε this run "
                                         r"can reach is 0\.003\d+.*set privacy\.target_epsilon to at least 0\.003"):
        plan_privacy(cfg, 2700, vocabulary=26 * 500)


def test_widedp_calibrate_names_its_flag(capsys):
    """The CLI's refusal names --target-epsilon and the smallest reachable ε, exit 2, one line."""
    from widedp.trainer.cli import main

    code = main(["calibrate", "--target-epsilon", "0.001", "--delta", "1e-5", "--sample-rate", "0.01",
                 "--steps", "300", "--accountant", "rdp"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "--target-epsilon = 0.001 is unreachable: the smallest ε this run can reach is 0.003501" in err
