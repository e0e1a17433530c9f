"""`widedp epsilon` / `widedp calibrate` and the trainer agree, selection by selection.

The trainer's side is built with the trainer's own code: `trainer.run.train.plan_privacy` turns a
Config into the PrivacyPlan, `trainer.engine.plan.step_event_of` (the engine's own function, no
data) or a tiny in-process engine that really trains (engine_fixtures) builds and records the
events in a PrivacyLedger. The CLI's side is `trainer.cli.main([...])` with the arguments a user
would type for the same run, its JSON read from stdout. If either side changes how it builds an
event (a default, a budget split, a one-time charge), these tests fail.

Regression: `widedp epsilon --selection svt` used to account value-releasing NumericSparse
(ε split 0.95/0.05) while the trainer runs selection-only SVT. At σ = 0.8733, Alg 1 ε = 6.982,
c = 20, q = 0.01, T = 500, δ = 4e-5 (default_delta(n) for n = 2500) the training ledger says
4.00 and the old CLI said 3.81.
"""

import dataclasses
import json

import pytest

from widedp.accounting import PrivacyLedger
from widedp.accounting import events as ev
from engine_fixtures import make_engine, tiny_ctr
from widedp.trainer.cli import main
from widedp.trainer.config import Config
from widedp.trainer.engine.plan import step_event_of
from widedp.trainer.run.train import plan_privacy

SELECTIONS = ("none", "em", "noisy-max", "svt", "threshold", "random", "fest")


def _config(selection, *, sigma, n_batch, steps, delta, accountant="rdp", k=50, selection_epsilon="auto",
            selection_sigma="auto", fest_sigma=5.0, target_epsilon=1e9, data_path="unused"):
    cfg = Config()
    cfg.data.path = data_path
    cfg.train.mode = "dpsgd" if selection == "none" else "sparse"
    cfg.train.selection = "em" if selection == "none" else selection
    cfg.train.batch_size, cfg.train.steps = n_batch, steps
    p = cfg.privacy
    p.noise_multiplier, p.delta, p.accountant, p.k = sigma, delta, accountant, k
    p.selection_epsilon, p.selection_sigma, p.fest_noise_multiplier = selection_epsilon, selection_sigma, fest_sigma
    p.target_epsilon = target_epsilon
    # The CLI's epsilon/calibrate describe the steps and the one-time selection; the trainer's
    # recalibration after the last step (its own event) is tested in test_recalibration.py.
    cfg.train.recalibrate = False
    return cfg.validate()


def _engine_step_event(cfg, plan, info):
    """The step event exactly as the engine builds it (its own function, no data needed)."""
    # every table selected (no dense table in these plans); user level by example sampling charges groups
    return step_event_of(cfg.train.mode, info.sample_rate, plan, cfg.train.mode == "sparse", info.group_size or 1)


def _cli_run_args(selection, plan, info, steps, accountant):
    """What a user types to ask `widedp` about the run `plan` describes (defaults left alone)."""
    args = ["--accountant", accountant, "--sample-rate", repr(info.sample_rate),
            "--steps", str(steps), "--delta", repr(info.delta), "--selection", selection]
    sp = plan.selection_params
    if selection in ("em", "noisy-max"):
        args += ["--selection-epsilon", repr(sp.epsilon_per_draw), "--k", str(sp.k)]
    elif selection == "svt":  # the trainer answers at most c = k rows per step
        args += ["--selection-epsilon", repr(sp.epsilon), "--max-answers", str(sp.max_answers)]
    elif selection == "threshold":
        args += ["--selection-sigma", repr(sp.noise_multiplier)]
    elif selection == "fest":
        args += ["--fest-sigma", repr(sp.noise_multiplier)]
    return args


def _cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def _cli_epsilon(capsys, selection, plan, info, steps, accountant, *extra):
    return _cli(capsys, "epsilon", "--noise-multiplier", repr(plan.noise_multiplier),
                *_cli_run_args(selection, plan, info, steps, accountant), *extra)


# (selection, accountant, config kwargs): realistic sizes; n = batch/q.
CASES = {
    "none": ("rdp", dict(sigma=1.0, n_batch=100, steps=1000, delta=1e-6)),
    "em": ("rdp", dict(sigma=1.0, n_batch=100, steps=1000, delta=1e-6, selection_epsilon=0.05)),
    "noisy-max": ("rdp", dict(sigma=1.0, n_batch=100, steps=1000, delta=1e-6, selection_epsilon=0.05)),
    # The measured regression case (n = 2500 ⇒ q = 0.01, δ = default_delta(2500) = 4e-5).
    "svt": ("rdp", dict(sigma=0.8733, n_batch=25, steps=500, delta=4e-5, k=20, selection_epsilon=6.982)),
    "threshold": ("rdp", dict(sigma=1.2, n_batch=100, steps=1000, delta=1e-6, selection_sigma=2.0)),
    "random": ("rdp", dict(sigma=1.0, n_batch=100, steps=1000, delta=1e-6)),
    "fest": ("rdp", dict(sigma=1.0, n_batch=100, steps=1000, delta=1e-6, fest_sigma=5.0)),
}
N = {"svt": 2500}
# Other accountants where the trainer would use them: paper (Theorem 3 with the corrected
# amplification, in its valid range) and the Gaussian-only ones.
EXTRA_CASES = [
    ("em", "paper", dict(sigma=10.0, n_batch=100, steps=10_000, delta=1e-6, k=1, selection_epsilon=0.1), 1_000_000),
    ("none", "paper", dict(sigma=10.0, n_batch=100, steps=10_000, delta=1e-6), 1_000_000),
    ("threshold", "pld", dict(sigma=1.2, n_batch=100, steps=1000, delta=1e-6, selection_sigma=2.0), 10_000),
    ("fest", "prv", dict(sigma=1.0, n_batch=100, steps=1000, delta=1e-6, fest_sigma=5.0), 10_000),
]
ALL_CASES = [(s, acc, kw, N.get(s, 10_000)) for s, (acc, kw) in CASES.items()] + EXTRA_CASES


@pytest.mark.parametrize("selection,accountant,kwargs,n", ALL_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in ALL_CASES])
def test_cli_epsilon_equals_the_training_ledger(capsys, selection, accountant, kwargs, n):
    cfg = _config(selection, accountant=accountant, **kwargs)
    plan, info = plan_privacy(cfg, n, vocabulary=10_000)
    assert plan.selection == selection and not info.calibrated
    ledger = PrivacyLedger(info.accountant, info.delta)
    if selection == "fest":  # Engine.prepare_fest charges this before the steps (real path: next test)
        ledger.record(ev.GaussianDpEvent(plan.selection_params.noise_multiplier))
    ledger.record(_engine_step_event(cfg, plan, info), count=cfg.train.steps)
    trainer_eps = ledger.epsilon()
    cli = _cli_epsilon(capsys, selection, plan, info, cfg.train.steps, accountant)
    assert cli["epsilon"] == pytest.approx(trainer_eps, rel=1e-12)
    assert cli["delta"] == info.delta
    if accountant == "paper":
        assert cli["valid"] is True and cli["epsilon_seed_lemma_literal"] < cli["epsilon"]


def test_svt_regression_case_reproduces_the_measured_numbers(capsys):
    acc, kwargs = CASES["svt"]
    cfg = _config("svt", accountant=acc, **kwargs)
    plan, info = plan_privacy(cfg, 2500, vocabulary=10_000)
    assert info.sample_rate == 0.01 and info.delta == 4e-5 and plan.selection_params.max_answers == 20
    ledger = PrivacyLedger(acc, info.delta)
    ledger.record(_engine_step_event(cfg, plan, info), count=500)
    assert round(ledger.epsilon(), 2) == 4.00
    cli = _cli_epsilon(capsys, "svt", plan, info, 500, acc)
    assert round(cli["epsilon"], 2) == 4.00 and cli["svt_release_values"] is False
    # The old CLI's event (value-releasing NumericSparse) is still available, opt-in, and it is
    # a different mechanism: 3.81, more than 1% off the ledger.
    old = _cli_epsilon(capsys, "svt", plan, info, 500, acc, "--svt-release-values")
    assert round(old["epsilon"], 2) == 3.81 and old["svt_release_values"] is True
    assert abs(old["epsilon"] / ledger.epsilon() - 1) > 0.01


def test_fest_spelled_as_random_plus_fest_sigma_is_the_same_run(capsys):
    acc, kwargs = CASES["fest"]
    plan, info = plan_privacy(_config("fest", accountant=acc, **kwargs), 10_000, vocabulary=10_000)
    fest = _cli_epsilon(capsys, "fest", plan, info, 1000, acc)
    as_random = _cli(capsys, "epsilon", "--noise-multiplier", repr(plan.noise_multiplier),
                     *_cli_run_args("random", plan, info, 1000, acc), "--fest-sigma", repr(plan.selection_params.noise_multiplier))
    plain = _cli_epsilon(capsys, "random", plan, info, 1000, acc)
    assert fest["epsilon"] == pytest.approx(as_random["epsilon"], rel=1e-12)
    assert fest["epsilon"] > plain["epsilon"]  # the one-time FEST Gaussian is charged


# ---- a tiny engine that really trains: the recorded events, not just the builders ---------------

TINY_STEPS = 3
TINY_PARAMS = {
    "none": dict(sigma=1.1),
    "em": dict(sigma=1.1, selection_epsilon=0.7),
    "noisy-max": dict(sigma=1.1, selection_epsilon=0.7),
    "svt": dict(sigma=1.1, selection_epsilon=3.0),
    "threshold": dict(sigma=1.1, selection_sigma=1.5),
    "random": dict(sigma=1.1),
    "fest": dict(sigma=1.1, fest_sigma=3.0),
}


@pytest.mark.parametrize("selection", SELECTIONS)
def test_cli_epsilon_equals_a_running_engines_ledger(capsys, selection):
    ds = tiny_ctr(n=64)
    cfg = _config(selection, n_batch=16, steps=TINY_STEPS, delta=1e-5, k=5, **TINY_PARAMS[selection])
    plan, info = plan_privacy(cfg, len(ds), vocabulary=sum(ds.meta.table_sizes.values()))
    engine = make_engine(ds, mode=cfg.train.mode, selection=plan.selection, q=info.sample_rate, k=info.k,
                         plan_overrides=dataclasses.asdict(plan))
    try:
        assert engine.ledger.delta == info.delta
        if selection == "fest":  # as trainer.run.train._start does
            engine.prepare_fest(ds.feature_rows)
        for _ in range(TINY_STEPS):
            assert engine.step() is not None
        assert engine.ledger.steps == TINY_STEPS + (selection == "fest")
        cli = _cli_epsilon(capsys, selection, plan, info, TINY_STEPS, "rdp")
        assert cli["epsilon"] == pytest.approx(engine.ledger.epsilon(), rel=1e-12)
    finally:
        engine.shards.shutdown()


# ---- calibration: `widedp calibrate` finds the σ the trainer calibrates ------------------------

@pytest.mark.parametrize("selection", SELECTIONS)
def test_cli_calibrate_equals_the_trainers_calibration(capsys, selection):
    cfg = _config(selection, sigma="auto", n_batch=100, steps=300, delta=1e-6, k=20, target_epsilon=3.0)
    cfg.privacy.selection_fraction = 0.3
    plan, info = plan_privacy(cfg, 10_000, vocabulary=10_000)
    assert info.calibrated
    argv = ["calibrate", "--target-epsilon", "3.0", *_cli_run_args(selection, plan, info, 300, "rdp")]
    if selection in ("em", "noisy-max", "svt"):  # calibrate takes the budget split, not an ε
        i = argv.index("--selection-epsilon")
        del argv[i:i + 2]
    if selection == "threshold":
        i = argv.index("--selection-sigma")
        del argv[i:i + 2]
    if selection not in ("none", "random", "fest"):
        argv += ["--selection-fraction", "0.3"]
    cli = _cli(capsys, *argv)
    assert cli["noise_multiplier"] == pytest.approx(plan.noise_multiplier, rel=1e-12)
    sp = cli["selection_params"]
    assert sp.get("epsilon_per_draw", sp.get("epsilon", 0.0)) == pytest.approx(info.selection_epsilon or 0.0, rel=1e-12)
    assert sp.get("noise_multiplier", 0.0) == pytest.approx(info.selection_sigma or 0.0, rel=1e-12)
    for name, value in sp.items():  # the trainer's selector parameters are the calibrated ones
        assert getattr(plan.selection_params, name) == pytest.approx(value, rel=1e-12)
    if selection == "svt":
        assert sp["release_values"] is False


# ---- train.recalibrate: its one release after the last step, on both sides ------------------------

def test_cli_charges_the_recalibration_the_trainer_plans(capsys):
    """A private run of a binary model plans its recalibration inside the target: `widedp calibrate
    --recalibration-sigma auto` (with the data set's size) finds the trainer's σ and the
    histogram's σ, and `widedp epsilon` with both spends the target."""
    cfg = _config("none", sigma="auto", n_batch=100, steps=300, delta=1e-6, target_epsilon=3.0)
    cfg.train.recalibrate = True
    plan, info = plan_privacy(cfg, 10_000, vocabulary=10_000)
    assert info.recalibration is not None and info.calibrated
    recal_sigma = info.recalibration["noise_multiplier"]
    sampling = ["--batch-size", "100", "--dataset-size", "10000", "--epochs", "3", "--delta", "1e-06",
                "--accountant", "rdp"]
    cli = _cli(capsys, "calibrate", "--target-epsilon", "3.0", *sampling, "--recalibration-sigma", "auto")
    assert cli["recalibration_sigma"] == pytest.approx(recal_sigma, rel=1e-12)
    assert cli["noise_multiplier"] == pytest.approx(plan.noise_multiplier, rel=1e-12)
    without = _cli(capsys, "calibrate", "--target-epsilon", "3.0", *sampling)
    assert without["noise_multiplier"] < cli["noise_multiplier"]  # the histogram's share costs step noise
    spent = _cli(capsys, "epsilon", "--noise-multiplier", repr(cli["noise_multiplier"]), *sampling,
                 "--recalibration-sigma", repr(recal_sigma))
    assert spent["epsilon"] == pytest.approx(3.0, rel=1e-6) and spent["recalibration_sigma"] == recal_sigma
    assert _cli(capsys, "epsilon", "--noise-multiplier", repr(cli["noise_multiplier"]), *sampling)["epsilon"] < 3.0


def test_recalibration_sigma_auto_names_what_it_needs(capsys):
    assert main(["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-6",
                 "--recalibration-sigma", "auto"]) == 2
    assert "--recalibration-sigma auto needs a target ε" in capsys.readouterr().err
    assert main(["calibrate", "--target-epsilon", "1", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-6",
                 "--recalibration-sigma", "auto"]) == 2
    assert "--recalibration-sigma auto needs --dataset-size" in capsys.readouterr().err
    assert main(["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-6",
                 "--recalibration-sigma", "-3"]) == 2
    assert "--recalibration-sigma must be finite and > 0" in capsys.readouterr().err
