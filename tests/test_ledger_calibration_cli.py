"""Ledger (record-before-release, budget stop, persistence), calibration and the CLI."""

import json
import math
import os
import subprocess
import sys

import pytest

from widedp.accounting import PrivacyLedger, UnsupportedEventError, make_accountant, step_event
from widedp.accounting import events as ev
from widedp.selection.calibration import calibrate
from widedp.trainer.cli import main

STEP = step_event(0.01, 1.0)


def test_ledger_matches_accountant_and_run_length_encodes():
    ledger = PrivacyLedger("rdp", delta=1e-6)
    assert ledger.epsilon() == 0.0
    for _ in range(1000):
        ledger.record(STEP)
    assert ledger.steps == 1000 and len(ledger.history) == 1
    assert ledger.epsilon() == pytest.approx(make_accountant("rdp").epsilon([(STEP, 1000)], 1e-6))


def test_budget_stop_triggers_exactly_before_the_step_that_would_exceed():
    acc = make_accountant("rdp")
    target = 1.0
    # The first T with ε(T) > target, found independently of the ledger.
    first_over = next(t for t in range(1, 5000) if acc.epsilon([(STEP, t)], 1e-6) > target)
    ledger = PrivacyLedger(acc, delta=1e-6)
    released = 0
    while not ledger.would_exceed(STEP, target):
        ledger.record(STEP)
        released += 1
    assert released == first_over - 1
    assert ledger.epsilon() <= target < acc.epsilon([(STEP, released + 1)], 1e-6)


def test_ledger_refuses_unaccountable_event_before_recording():
    ledger = PrivacyLedger("pld", delta=1e-6)
    with pytest.raises(UnsupportedEventError):
        ledger.record(step_event(0.01, 1.0, ev.ExponentialTopKDpEvent(0.1, 3)))
    assert ledger.steps == 0


def test_ledger_save_load_round_trip_is_atomic(tmp_path):
    ledger = PrivacyLedger("rdp", delta=1e-5)
    ledger.record(ev.GaussianDpEvent(3.0))  # e.g. a DP-FEST pass
    ledger.record(step_event(0.02, 1.1, ev.ExponentialTopKDpEvent(0.05, 10)), count=40)
    ledger.record(step_event(0.02, 1.1, ev.NoOpDpEvent()), count=7)
    path = tmp_path / "run" / "ledger.json"
    ledger.save(path)
    assert sorted(os.listdir(path.parent)) == ["ledger.json"]  # no temp file left behind
    restored = PrivacyLedger.load(path)
    assert restored.history == ledger.history
    assert restored.epsilon() == ledger.epsilon()
    # A state_dict round trip in memory too (what a checkpoint embeds).
    other = PrivacyLedger("pld", delta=0.1)
    other.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert other.accountant.name == "rdp" and other.delta == 1e-5 and other.history == ledger.history


def test_ledger_load_errors_name_the_file_and_entry(tmp_path):
    bad = tmp_path / "ledger.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="ledger.json"):
        PrivacyLedger.load(bad)
    state = PrivacyLedger("rdp").state_dict()
    state["history"] = [{"event": {"type": "GaussianDpEvent", "noise_multiplier": 1.0}, "count": 1},
                        {"event": {"type": "Nope"}, "count": 1}]
    bad.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="entry 1"):
        PrivacyLedger.load(bad)


@pytest.mark.parametrize("selection", ["none", "em", "svt", "noisy-max", "threshold", "random"])
def test_calibration_spends_the_target_and_no_more(selection):
    target = 2.0
    out = calibrate(target, 1e-6, 0.005, 2000, selection=selection, fraction=0.25, k=50, max_answers=50,
                    accountant="rdp")
    assert target * (1 - 1e-6) <= out.epsilon <= target
    # Re-account the returned parameters independently of the calibrator.
    params = out.selection_params
    sel = {
        "none": None,
        "random": ev.NoOpDpEvent(),
        "em": ev.ExponentialTopKDpEvent(params.get("epsilon_per_draw", 1.0), 50),
        "noisy-max": ev.NoisyMaxTopKDpEvent(params.get("epsilon_per_draw", 1.0), 50),
        "threshold": ev.GaussianDpEvent(params.get("noise_multiplier", 1.0)),
        "svt": None,
    }[selection]
    if selection != "svt":
        eps = make_accountant("rdp").epsilon([(step_event(0.005, out.noise_multiplier, sel), 2000)], 1e-6)
        assert eps == pytest.approx(out.epsilon, rel=1e-9)


def test_threshold_split_keeps_one_gaussian():
    plain = calibrate(3.0, 1e-6, 0.01, 1000, accountant="rdp")
    split = calibrate(3.0, 1e-6, 0.01, 1000, selection="threshold", fraction=0.3, accountant="rdp")
    s_sel, s_noise = split.selection_params["noise_multiplier"], split.noise_multiplier
    assert s_sel**-2 + s_noise**-2 == pytest.approx(split.effective_noise_multiplier ** -2)
    assert split.effective_noise_multiplier == pytest.approx(plain.noise_multiplier, rel=1e-6)
    assert s_sel**-2 == pytest.approx(0.3 * plain.noise_multiplier ** -2, rel=1e-5)


def test_pld_and_prv_calibration_hit_target():
    for name in ("pld", "prv"):
        out = calibrate(3.0, 1e-6, 0.01, 1000, accountant=name)
        assert 3.0 * 0.999 <= out.epsilon <= 3.0
        assert out.noise_multiplier < calibrate(3.0, 1e-6, 0.01, 1000, accountant="rdp").noise_multiplier  # tighter than RDP


def test_paper_calibration_hits_target_and_reports_validity():
    out = calibrate(0.1, 1e-6, 1e-4, 10_000, selection="em", fraction=0.2, k=1, accountant="paper")
    assert out.epsilon == pytest.approx(0.1, rel=1e-6) and out.epsilon <= 0.1
    assert out.valid, out.violations
    # Calibrated to the corrected amplification: re-accounting gives the target, and the seed's
    # literal Lemma 1 would have claimed less for the same parameters (so it would under-noise).
    step = step_event(1e-4, out.noise_multiplier, ev.ExponentialTopKDpEvent(out.selection_params["epsilon_per_draw"], 1))
    d = make_accountant("paper").details([(step, 10_000)], 1e-6)
    assert d["epsilon"] == pytest.approx(out.epsilon, rel=1e-12)
    assert out.epsilon_seed_lemma_literal == pytest.approx(d["epsilon_seed_lemma_literal"], rel=1e-12)
    assert out.epsilon_seed_lemma_literal < 0.1 * 0.99


@pytest.mark.parametrize("kwargs,match", [
    (dict(selection="em", fraction=0.2), "k >= 1"),
    (dict(selection="em", fraction=1.5, k=3), "fraction"),
    (dict(selection="bogus"), "unknown selection"),
])
def test_calibration_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        calibrate(1.0, 1e-6, 0.01, 100, **kwargs)


def _cli(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_epsilon_prints_one_json_object(capsys):
    code, out, err = _cli(capsys, "epsilon", "--accountant", "rdp", "--noise-multiplier", "1.0",
                          "--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-6")
    assert code == 0
    data = json.loads(out)
    assert data["epsilon"] == pytest.approx(2.4367, abs=1e-3)
    assert {"epsilon", "delta", "accountant"} <= set(data)
    code, out, _ = _cli(capsys, "epsilon", "--accountant", "paper", "--noise-multiplier", "10",
                        "--sample-rate", "1e-4", "--steps", "10000", "--delta", "1e-6",
                        "--selection", "em", "--selection-epsilon", "0.1", "--k", "1")
    data = json.loads(out)
    assert code == 0 and data["valid"] is True and data["epsilon"] > data["epsilon_kov"]
    # The seed's literal Lemma 1 value is still printed, flagged, and below the corrected one.
    assert data["epsilon_seed_lemma_literal"] < data["epsilon"] and "NOT a DP guarantee" in data["seed_lemma_literal_note"]


def test_cli_svt_is_selection_only_unless_asked(capsys):
    """Default: the trainer's selection-only SVT; --svt-release-values: Alg 1 releasing values."""
    run = ["--sample-rate", "0.01", "--steps", "500", "--delta", "4e-5", "--selection", "svt", "--max-answers", "20"]
    sigma, eps_sel = 0.8733, 6.982
    from widedp.accounting import svt_event

    for flag, release in (([], False), (["--svt-release-values"], True)):
        code, out, err = _cli(capsys, "epsilon", "--noise-multiplier", str(sigma), "--selection-epsilon", str(eps_sel),
                              *run, *flag)
        assert code == 0, err
        data = json.loads(out)
        expected = make_accountant("rdp").epsilon(
            [(step_event(0.01, sigma, svt_event(eps_sel, 4e-5, 20, release_values=release)), 500)], 4e-5)
        assert data["svt_release_values"] is release and data["epsilon"] == pytest.approx(expected, rel=1e-12)
        code, out, err = _cli(capsys, "calibrate", "--target-epsilon", "4", "--selection-fraction", "0.3", *run, *flag)
        assert code == 0, err
        cal = json.loads(out)
        ref = calibrate(4.0, 4e-5, 0.01, 500, selection="svt", fraction=0.3, max_answers=20, svt_release_values=release)
        assert cal["selection_params"]["release_values"] is release
        assert cal["noise_multiplier"] == pytest.approx(ref.noise_multiplier, rel=1e-12)
    assert calibrate(4.0, 4e-5, 0.01, 500, selection="svt", fraction=0.3, max_answers=20).selection_params[
        "release_values"] is False  # the library default is the trainer's mode too


def test_cli_calibrate(capsys):
    code, out, _ = _cli(capsys, "calibrate", "--target-epsilon", "3", "--delta", "1e-6", "--sample-rate", "0.001",
                        "--steps", "10000", "--selection", "em", "--selection-fraction", "0.2", "--k", "1000")
    data = json.loads(out)
    assert code == 0 and data["noise_multiplier"] > 0 and data["epsilon"] <= 3
    assert data["selection_params"]["k"] == 1000


@pytest.mark.parametrize("args,match", [
    (["--noise-multiplier", "-1"], "noise-multiplier"),
    (["--sample-rate", "0"], "sample-rate"),
    (["--sample-rate", "1.5"], "sample-rate"),
    (["--delta", "1"], "delta"),
    (["--steps", "0"], "steps"),
    (["--accountant", "pld", "--selection", "em", "--selection-epsilon", "1", "--k", "3"], "Gaussian-reducible"),
    (["--selection", "em"], "needs --selection-epsilon"),
    (["--accountant", "paper", "--selection", "svt", "--selection-epsilon", "1", "--max-answers", "3",
      "--selection-delta", "0.5"], "own δ"),
    (["--selection", "em", "--selection-epsilon", "1", "--k", "3", "--svt-release-values"], "only to --selection svt"),
    (["--selection", "fest"], "needs --fest-sigma"),
])
def test_cli_bad_arguments_exit_2_with_one_line(capsys, args, match):
    base = {"--noise-multiplier": "1.0", "--sample-rate": "0.01", "--steps": "100", "--delta": "1e-6"}
    for i in range(0, len(args), 1):
        if args[i] in base and i + 1 < len(args):
            base.pop(args[i])
    argv = ["epsilon"] + [x for kv in base.items() for x in kv] + args
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and match in err


def test_console_script_is_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "widedp")
    proc = subprocess.run([exe, "epsilon", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "10",
                           "--delta", "1e-6", "--accountant", "pld"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert math.isfinite(json.loads(proc.stdout)["epsilon"])


# ---- ledger format v2 (neighbouring relation) and the Calibration result ----------------------

V1_LEDGER = {"version": 1, "accountant": "rdp", "delta": 1e-5, "history": [
    {"event": {"type": "GaussianDpEvent", "noise_multiplier": 3.0}, "count": 1},
    {"event": {"type": "PoissonSampledDpEvent", "sampling_probability": 0.02,
               "event": {"type": "ComposedDpEvent", "events": [
                   {"type": "ExponentialTopKDpEvent", "epsilon_per_draw": 0.05, "k": 10},
                   {"type": "GaussianDpEvent", "noise_multiplier": 1.1}]}}, "count": 40}]}


def test_ledger_stores_its_neighbouring_relation_and_reads_version_1(tmp_path):
    from widedp.accounting import NeighboringRelation

    ledger = PrivacyLedger("rdp", delta=1e-5)
    assert ledger.neighboring_relation is NeighboringRelation.ADD_OR_REMOVE_ONE
    state = ledger.state_dict()
    assert state["version"] == 4 and state["neighboring_relation"] == "ADD_OR_REMOVE_ONE"
    # A version 1 file (written before the relation was stored) means add/remove one and loads.
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps(V1_LEDGER))
    old = PrivacyLedger.load(path)
    assert old.steps == 41 and old.neighboring_relation is NeighboringRelation.ADD_OR_REMOVE_ONE
    assert old.history[1] == (step_event(0.02, 1.1, ev.ExponentialTopKDpEvent(0.05, 10)), 40)
    assert old.state_dict()["version"] == 4  # re-saved in the current format
    restored = PrivacyLedger("pld", delta=0.1)
    restored.load_state_dict(json.loads(json.dumps(old.state_dict())))
    assert restored.history == old.history and restored.accountant.name == "rdp"


@pytest.mark.parametrize("relation,match", [("REPLACE_ONE", "REPLACE_ONE"), ("REPLACE_SPECIAL", "REPLACE_SPECIAL"),
                                            ("add/remove", "not one of"), (None, "not one of")])
def test_ledger_refuses_another_neighbouring_relation(tmp_path, relation, match):
    state = dict(V1_LEDGER, version=2, neighboring_relation=relation)
    ledger = PrivacyLedger("pld", delta=0.1)
    ledger.record(STEP, 3)
    with pytest.raises(ValueError, match=match):
        ledger.load_state_dict(state)
    # nothing changed: the ledger is still the one it was
    assert ledger.accountant.name == "pld" and ledger.delta == 0.1 and ledger.history == [(STEP, 3)]
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="ledger.json"):
        PrivacyLedger.load(path)


def test_calibration_is_frozen_and_to_dict_keeps_the_json_keys():
    import dataclasses

    from widedp.selection.calibration import Calibration

    base_keys = ["noise_multiplier", "selection", "selection_params", "selection_fraction", "epsilon",
                 "target_epsilon", "delta", "sample_rate", "steps", "accountant"]
    out = calibrate(2.0, 1e-6, 0.005, 200, selection="em", fraction=0.25, k=50, accountant="rdp")
    assert isinstance(out, Calibration)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.noise_multiplier = 1.0
    with pytest.raises(TypeError):
        out.selection_params["k"] = 3
    d = out.to_dict()
    assert list(d) == base_keys and type(d["selection_params"]) is dict
    assert d["selection_params"] == {"epsilon_per_draw": out.selection_params["epsilon_per_draw"], "k": 50}
    assert json.loads(json.dumps(d)) == d
    assert hash(out) == hash(dataclasses.replace(out))  # frozen and hashable
    threshold = calibrate(2.0, 1e-6, 0.005, 200, selection="threshold", fraction=0.25, accountant="rdp").to_dict()
    assert list(threshold) == base_keys + ["effective_noise_multiplier"]
    auto = calibrate(2.0, 1e-6, 0.005, 200, selection="em", fraction=0.25, k=50)  # the default: "auto"
    assert list(auto.to_dict()) == base_keys + ["accountant_used"]
    assert (auto.accountant, auto.accountant_used, auto.noise_multiplier) == ("auto", "rdp", out.noise_multiplier)
    paper = calibrate(0.1, 1e-6, 1e-4, 1000, selection="em", fraction=0.2, k=1, accountant="paper")
    assert list(paper.to_dict()) == base_keys + ["valid", "violations", "delta_prime", "epsilon_seed_lemma_literal",
                                                 "seed_lemma_literal_note"]
    assert isinstance(paper.violations, tuple) and type(paper.to_dict()["violations"]) is list


def test_cli_calibrate_prints_exactly_to_dict(capsys):
    code, out, _ = _cli(capsys, "calibrate", "--target-epsilon", "3", "--delta", "1e-6", "--sample-rate", "0.01",
                        "--steps", "300", "--selection", "threshold", "--selection-fraction", "0.3")
    assert code == 0
    ref = calibrate(3.0, 1e-6, 0.01, 300, selection="threshold", fraction=0.3)
    assert out == json.dumps(ref.to_dict(), default=float) + "\n"
