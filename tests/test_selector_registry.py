"""The selector registry (selection/registry.py): one place that knows the selectors.

- a name is registered once; "none" (DP-SGD) is not a selector;
- "record what ran": every selector's `event(params)` is the `Selection.event` its `select`
  returns (the engine checks the same equality every step before recording anything);
- `from_budget` reproduces today's calibration numbers;
- config and CLI choices are the registry's names;
- a toy selector registered here (and removed afterwards) is accepted by config validation, the
  CLI, calibration and `Engine` without touching any other file.
"""

import dataclasses
import json
import math

import numpy as np
import pytest

from widedp.accounting import PrivacyLedger, step_event
from widedp.accounting import events as ev
from engine_fixtures import PLAN_DEFAULTS, make_engine, make_plan, tiny_ctr
from widedp.selection.calibration import calibrate
from widedp.selection.registry import (NO_SELECTION, BudgetInputs, SelectionContext, Selector, get_selector, param,
                                register_selector, selector_names, unregister_selector)
from widedp.selection.result import Selection
from widedp.trainer.cli import build_parser, main, selection_choices
from widedp.trainer.config import Config

BUILT_IN = ("em", "svt", "noisy-max", "threshold", "random", "fest")


def test_built_in_selectors_in_config_order():
    assert selector_names()[:len(BUILT_IN)] == BUILT_IN  # a new selector file adds its name after these


def test_registry_refuses_overwriting_a_name():
    class Again(Selector):
        Params = get_selector("em").Params

    with pytest.raises(ValueError, match=r"'em' is already registered as ExponentialSelector.*Again"):
        register_selector("em")(Again)
    assert type(get_selector("em")).__name__ == "ExponentialSelector"
    with pytest.raises(ValueError, match="DP-SGD"):
        register_selector(NO_SELECTION)(Again)


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown selection 'bogus'"):
        get_selector("bogus")


# ---- record what ran ---------------------------------------------------------------------------

def _context(num_rows=50, seed=0):
    rng = np.random.default_rng(seed)
    touched = np.sort(rng.choice(num_rows, size=12, replace=False)).astype(np.int64)
    offsets = np.array([0, 3, 5, 9], dtype=np.int64)
    ids = rng.choice(touched, size=9).astype(np.int64)
    return SelectionContext(num_rows=num_rows, touched_ids=touched, row_norms=rng.random(12) * 0.2, clip_norm=1.0,
                            expected_batch_size=4.0, example_rows=lambda: (offsets, ids),
                            fixed_rows=np.array([1, 4, 7], dtype=np.int64))


@pytest.mark.parametrize("name", selector_names())  # every registered selector, new ones included
def test_event_is_what_select_returns(name):
    plan = make_plan(name, k=5)
    selector, params = get_selector(name), plan.selection_params
    assert isinstance(params, selector.Params)
    for seed in range(3):
        got = selector.select(_context(seed=seed), params, np.random.default_rng(seed))
        assert isinstance(got, Selection)
        assert got.event == selector.event(params)
        assert np.all((got.ids >= 0) & (got.ids < 50))
    one_time = selector.one_time_event(params)
    if one_time is not None:  # fest: the one-time selection reports the event charged for it
        ctx = _context()
        offsets, ids = ctx.example_rows()
        assert selector.one_time_select(offsets, ids, 50, params, np.random.default_rng(0)).event == one_time


def test_params_hold_only_their_fields():
    em, svt = get_selector("em").Params, get_selector("svt").Params
    assert [f.name for f in dataclasses.fields(em)] == ["epsilon_per_draw", "k", "score_clip"]
    assert [f.name for f in dataclasses.fields(svt)] == ["epsilon", "delta", "max_answers", "release_values",
                                                           "threshold", "score_clip"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        em(0.1, 3).k = 4


# ---- calibration -------------------------------------------------------------------------------

# calibrate(3.0, 1e-6, q=0.01, T=300, fraction=0.3, k=c=20), recorded before the registry existed.
TODAY = {
    "none": (0.8153109008339386, {}),
    "em": (1.0233871292966505, {"epsilon_per_draw": 0.2860794449171682, "k": 20}),
    "noisy-max": (1.013811627741142, {"epsilon_per_draw": 0.14439073979496383, "k": 20}),
    "svt": (1.0138116277411422, {"epsilon": 6.9568549868857685, "delta": 1e-06, "max_answers": 20,
                                 "release_values": False}),
    "threshold": (0.9744829141789203, {"noise_multiplier": 1.4885472392220191}),
    "random": (0.8153109008339386, {}),
}


@pytest.mark.parametrize("name", list(TODAY))
def test_from_budget_reproduces_todays_calibration(name):
    sigma, params = TODAY[name]
    out = calibrate(3.0, 1e-6, 0.01, 300, selection=name, fraction=0.3, k=20, max_answers=20, accountant="rdp")
    assert out.noise_multiplier == pytest.approx(sigma, rel=1e-9)
    assert dict(out.selection_params).keys() == params.keys()
    for key, value in params.items():
        assert out.selection_params[key] == pytest.approx(value, rel=1e-9)
    if name in (NO_SELECTION, "random"):
        return
    # The selection's share of ρ, from the calibrated σ: 1/(2σ²) = (1 - f)ρ.
    rho = 1.0 / (2.0 * (1 - 0.3) * out.noise_multiplier ** 2)
    selector = get_selector(name)
    mine = selector.from_budget(0.3 * rho, BudgetInputs(k=20, max_answers=20, delta=1e-6))
    assert selector.record(mine).keys() == params.keys()
    for key, value in params.items():
        assert selector.record(mine)[key] == pytest.approx(value, rel=1e-9)


def test_fest_calibrates_as_free_steps_plus_its_one_time_event():
    fest = get_selector("fest")
    one_time = [(fest.one_time_event(fest.Params(noise_multiplier=5.0)), 1)]
    a = calibrate(3.0, 1e-6, 0.01, 300, selection="fest", extra_history=one_time, accountant="rdp")
    b = calibrate(3.0, 1e-6, 0.01, 300, selection="random", extra_history=one_time, accountant="rdp")
    assert a.noise_multiplier == b.noise_multiplier and dict(a.selection_params) == {}


# ---- config and CLI read the registry ----------------------------------------------------------

def test_config_and_cli_choices_are_the_registry():
    assert selection_choices() == (NO_SELECTION, *selector_names())
    parser = build_parser()
    epsilon = parser._subparsers._group_actions[0].choices["epsilon"]  # type: ignore[union-attr]
    action = next(a for a in epsilon._actions if a.dest == "selection")
    assert tuple(action.choices) == selection_choices()
    for name in selector_names():
        cfg = Config()
        cfg.data.path, cfg.train.mode, cfg.train.selection = "unused", "sparse", name
        cfg.validate()
    cfg.train.selection = "bogus"
    with pytest.raises(ValueError, match=r"train.selection must be one of \('em', 'svt'"):
        cfg.validate()


# ---- a new selector is one registration ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ToyParams:
    noise_multiplier: float = param(config="selection_sigma", cli="selection_sigma", budget=True, record=True)
    k: int = param(0, config="k")


class ToySelector(Selector):
    """The k touched rows of largest norm, plus a Gaussian event (a toy: not a real mechanism)."""

    Params = ToyParams

    def event(self, params):
        return ev.GaussianDpEvent(params.noise_multiplier)

    def select(self, context, params, rng):
        top = np.argsort(-context.row_norms, kind="stable")[: params.k]
        return Selection(np.sort(context.touched_ids[top]), ev.GaussianDpEvent(params.noise_multiplier))

    def from_budget(self, rho, inputs):
        return ToyParams(noise_multiplier=1.0 / math.sqrt(2.0 * rho))


class LyingToy(ToySelector):
    """Reports a different event from the one it was budgeted for."""

    def select(self, context, params, rng):
        return Selection(super().select(context, params, rng).ids, ev.NoOpDpEvent())


@pytest.fixture
def toy():
    register_selector("toy")(ToySelector)
    register_selector("lying-toy")(LyingToy)
    try:
        yield get_selector("toy")
    finally:
        unregister_selector("toy")
        unregister_selector("lying-toy")
    assert "toy" not in selector_names()


def test_toy_selector_is_accepted_everywhere(toy, capsys):
    cfg = Config()
    cfg.data.path, cfg.train.mode, cfg.train.selection = "unused", "sparse", "toy"
    cfg.validate()
    assert "toy" in selection_choices()

    from widedp.trainer.run.train import plan_privacy

    cfg.privacy.noise_multiplier, cfg.privacy.selection_sigma, cfg.privacy.k = 1.0, 2.0, 4
    plan, info = plan_privacy(cfg, 1000, vocabulary=100)
    assert plan.selection == "toy" and plan.selection_params == ToyParams(noise_multiplier=2.0, k=4)
    cfg.privacy.noise_multiplier = "auto"  # calibrated through toy.from_budget
    plan, info = plan_privacy(cfg, 1000, vocabulary=100)
    assert info.calibrated and plan.selection_params.noise_multiplier > 0

    code = main(["epsilon", "--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-6",
                 "--selection", "toy", "--selection-sigma", "2.0", "--accountant", "rdp"])
    out, err = capsys.readouterr()
    assert code == 0, err
    ledger = PrivacyLedger("rdp", 1e-6)
    ledger.record(step_event(0.01, 1.0, ToySelector().event(ToyParams(noise_multiplier=2.0))), count=10)
    assert json.loads(out)["epsilon"] == pytest.approx(ledger.epsilon(), rel=1e-12)
    code = main(["epsilon", "--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-6",
                 "--selection", "toy"])
    assert code == 2 and "--selection toy needs --selection-sigma" in capsys.readouterr().err

    ds = tiny_ctr(n=32)
    engine = make_engine(ds, selection="toy", k=3, q=0.5, plan_overrides={"selection_sigma": 2.0})
    try:
        assert engine.plan.selection_params == ToyParams(noise_multiplier=2.0, k=3)
        stats = engine.step()
        assert stats is not None and stats.rows_selected <= 3
        assert engine.ledger.history[-1][0] == engine.step_event and engine.ledger.steps == 1
        inner = engine.step_event.event
        assert inner.events[0] == ev.GaussianDpEvent(2.0)
    finally:
        engine.shards.shutdown()


def test_engine_refuses_a_selector_whose_select_reports_another_event(toy):
    engine = make_engine(tiny_ctr(n=32), selection="lying-toy", k=3, q=0.5, plan_overrides={"selection_sigma": 2.0})
    try:
        with pytest.raises(RuntimeError, match="nothing was recorded or released"):
            engine.step()
        assert engine.ledger.steps == 0
    finally:
        engine.shards.shutdown()


def test_plan_defaults_cover_every_config_key():
    """engine_fixtures.make_plan can build every built-in selector from PLAN_DEFAULTS + k."""
    known = set(PLAN_DEFAULTS) | {"k", "delta"}
    for name in selector_names():
        assert set(get_selector(name).config_fields().values()) <= known, name
