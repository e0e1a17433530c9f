"""Learning-rate schedules (trainer/config/lr_schedule.py): the multipliers, the registry, the config
key, and that the run loop gives the engine step t of T the schedule's multiplier; the training
practice settings' bad values (schedule, averaging, validation split). That the
engine applies a multiplier exactly as the slow reference does (every optimizer, every write
path): tests/test_engine.py §4c."""

from __future__ import annotations

import math

import pytest

from widedp.trainer.config import ConfigError, load_config
from widedp.trainer.config.lr_schedule import LR_SCHEDULES, lr_multiplier, register_lr_schedule
from widedp.trainer.run.train import build_run

from test_train_cli import TINY


def test_multipliers_of_each_schedule():
    assert [lr_multiplier("constant", t, 4) for t in range(4)] == [1.0] * 4
    assert [lr_multiplier("linear", t, 4) for t in range(4)] == [1.0, 0.75, 0.5, 0.25]
    cos = [lr_multiplier("cosine", t, 4) for t in range(4)]
    assert cos == pytest.approx([1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2])
    # past the planned end (a resumed run given more steps) the last multiplier is kept, never 0 or negative
    assert lr_multiplier("linear", 10, 4) == 0.25


def test_registry_refuses_a_second_schedule_of_the_same_name_and_unknown_names():
    with pytest.raises(ValueError, match="already registered"):
        register_lr_schedule("linear")(lambda t, total: 1.0)
    assert set(LR_SCHEDULES) >= {"constant", "linear", "cosine"}
    with pytest.raises(ValueError, match="train.lr_schedule"):
        lr_multiplier("step", 0, 4)


@pytest.mark.parametrize("setting,message", [
    ("train.lr_schedule=exponential", r"train.lr_schedule must be one of \['constant', 'cosine', 'linear'\]"),
    ("train.ema_decay=1.0", r"train.ema_decay must be in \[0, 1\), got 1.0"),
    ("train.ema_decay=-0.1", r"train.ema_decay must be in \[0, 1\), got -0.1"),
    ("data.validation_fraction=1.0", r"data.validation_fraction must be in \[0, 1\), got 1.0"),
])
def test_config_names_the_bad_training_practice_setting(setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.path=x", setting]).validate()


def test_an_averaging_shard_refuses_an_update_that_does_not_say_its_step():
    """The lazy average needs each write's step; without it the average would silently be wrong."""
    import numpy as np

    from widedp.trainer.engine.layout import FeatureSpec, ShardLayout, TableSpec
    from widedp.trainer.engine.shard import EmbeddingShard

    layout = ShardLayout((TableSpec("t", 8, 4),), (FeatureSpec("f", "t", "sum"),), 1)
    shard = EmbeddingShard(layout, 0, optimizer="sgd", lr=1.0, ema_decay=0.9)
    with pytest.raises(ValueError, match="every update must say its step"):
        shard.call("apply_rows", np.array([0]), np.array([0]), np.zeros((1, shard.storage.layout.dim)))
    shard.call("apply_rows", np.array([0]), np.array([0]), np.zeros((1, shard.storage.layout.dim)), 1.0, 1)  # with a step: fine


class _Scales:
    def __init__(self):
        self.scales = []

    def on_step(self, engine, stats, seconds):
        self.scales.append(engine.lr_scale)


def test_run_loop_sets_each_step_s_multiplier(ctr_dir):
    cfg = load_config(None, [f"data.path={ctr_dir}", *TINY, "train.steps=4", "train.lr_schedule=linear",
                             "privacy.noise_multiplier=1.0", "privacy.selection_epsilon=0.05",
                             "privacy.target_epsilon=1e9"]).validate()
    with build_run(cfg) as run:
        seen = _Scales()
        run.run(2, [seen])
        run.run(4, [seen])  # a second call continues the same schedule
        assert seen.scales == [1.0, 0.75, 0.5, 0.25]
