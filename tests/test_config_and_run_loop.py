"""The one config path (TOML, --set and a run's config.json share the type checks; "auto" and
"none" instead of magic zeros; sections validated against the registries), the one training
loop (`Run.run` with callbacks) and the shard group's public observer hook."""

import dataclasses
import json
from pathlib import Path

import pytest

from widedp.trainer.config import AUTO, Config, ConfigError, load_config, load_saved_config
from widedp.trainer.data.synthetic.generators import SYNTHETIC_DATASETS, SyntheticDataset, register_synthetic
from widedp.trainer.run.train import build_run

from test_train_cli import TINY

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_derived_values_are_spelled_auto_and_zero_is_refused():
    cfg = load_config(None, ["data.path=x"]).validate()
    p = cfg.privacy
    assert (p.delta, p.k, p.noise_multiplier, p.threshold, p.second_clip_norm) == (AUTO, AUTO, AUTO, AUTO, None)
    cfg = load_config(None, ["data.path=x", "privacy.delta=1e-7", "privacy.k=12", "privacy.second_clip_norm=0.5"])
    assert (cfg.privacy.delta, cfg.privacy.k, cfg.privacy.second_clip_norm) == (1e-7, 12, 0.5)
    for key in ("delta", "k", "noise_multiplier", "threshold", "selection_epsilon", "selection_sigma"):
        with pytest.raises(ConfigError, match=rf'--set: privacy.{key} must be > 0 or "auto" \(0 does not mean'):
            load_config(None, [f"privacy.{key}=0"])
    cfg = Config()
    cfg.data.path, cfg.privacy.noise_multiplier = "x", 0.0  # set from Python: validate() catches it too
    with pytest.raises(ConfigError, match='privacy.noise_multiplier must be > 0 or "auto"'):
        cfg.validate()


def test_saved_config_round_trips_through_the_same_loader(tmp_path):
    cfg = load_config(str(ROOT / "configs" / "cbow.toml"), ["privacy.delta=2e-6"])
    assert cfg.privacy.second_clip_norm is None and cfg.privacy.k == 600
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert load_saved_config(path) == cfg
    assert load_saved_config(path, ["train.steps=7"]).train.steps == 7


@pytest.mark.parametrize("section,key,value,match", [
    ("train", "steps", "ten", "train.steps must be an integer"),
    ("train", "steps", 2.5, "train.steps must be an integer"),
    ("train", "lr", [1], "train.lr must be a number"),
    ("privacy", "delta", 0.0, 'privacy.delta must be > 0 or "auto"'),
    ("train", "mode", 3, "train.mode must be a string"),
    ("train", "nope", 1, "unknown key train.nope"),
])
def test_config_json_gets_the_type_checks_a_toml_file_gets(tmp_path, section, key, value, match):
    """A resume reads RUN_DIR/config.json through `config_from_dict`: a damaged or hand-edited
    file is refused naming the file and the key (it used to be copied in unchecked)."""
    raw = Config().to_dict()
    raw[section][key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=match) as info:
        load_saved_config(path)
    assert str(path) in str(info.value)


def test_sections_validate_against_the_registries(monkeypatch):
    from widedp.accounting import base

    cfg = load_config(None, ["data.path=x", "privacy.accountant=toy"])
    with pytest.raises(ConfigError, match="privacy.accountant must be one of"):
        cfg.validate()

    class Toy(base.Accountant):
        name = "toy"

    monkeypatch.setattr(base, "ACCOUNTANTS", dict(base.ACCOUNTANTS))
    base.register(Toy)
    cfg.validate()  # a registered accountant is a valid config value, with no list to edit

    with pytest.raises(ConfigError, match="data.synth must be empty or one of"):
        load_config(None, ["data.path=x", "data.synth=imagenet"]).validate()
    with pytest.raises(ValueError, match="already registered"):
        register_synthetic(SyntheticDataset("ctr", lambda p, d: None, lambda d: {}, lambda r: {}))
    assert register_synthetic(SYNTHETIC_DATASETS["ctr"]) is SYNTHETIC_DATASETS["ctr"]  # idempotent


class _Collect:
    def __init__(self, stop_at=None):
        self.steps, self.stop_at = [], stop_at

    def on_step(self, engine, stats, seconds):
        assert seconds > 0 and stats.step == engine.step_count
        self.steps.append(stats.step)
        return stats.step == self.stop_at


def test_run_loop_feeds_every_callback_each_step_and_stops_on_request(ctr_dir):
    cfg = load_config(None, [f"data.path={ctr_dir}", *TINY, "train.steps=5", "privacy.noise_multiplier=1.0",
                             "privacy.selection_epsilon=0.05", "privacy.target_epsilon=1e9"]).validate()
    with build_run(cfg) as run:
        a, b = _Collect(), _Collect(stop_at=2)
        result = run.run(5, [a, b])
        assert (a.steps, b.steps) == ([1, 2], [1, 2]) and result.stopped_by_callback
        assert result.steps_taken == 2 and not result.stopped_by_budget
        result = run.run(4, [a])  # `steps` counts from the start of the run, not of the call
        assert a.steps == [1, 2, 3, 4] and result.steps_taken == 2
        assert run.privacy.selection_params["epsilon_per_draw"] == 0.05 and not run.privacy.calibrated


def test_run_loop_ends_when_the_budget_refuses_a_step(ctr_dir):
    cfg = load_config(None, [f"data.path={ctr_dir}", *TINY, "train.steps=500", "privacy.noise_multiplier=0.7",
                             "privacy.selection_epsilon=0.02", "privacy.target_epsilon=3.0"]).validate()
    with build_run(cfg) as run:
        seen = _Collect()
        result = run.run(500, [seen])
        assert result.stopped_by_budget and 0 < result.steps_taken == len(seen.steps) < 500
        assert run.engine.ledger.epsilon() <= 3.0


def test_shard_group_observer_sees_every_call_and_the_bytes_counted(ctr_dir):
    cfg = load_config(None, [f"data.path={ctr_dir}", *TINY, "privacy.noise_multiplier=1.0",
                             "privacy.selection_epsilon=0.05", "privacy.target_epsilon=1e9"]).validate()
    with build_run(cfg) as run:
        group = run.engine.shards
        calls = []
        remove = group.add_observer(calls.append)
        to0, from0 = group.bytes_to_shards, group.bytes_from_shards
        run.run(2)
        assert {"lookup", "clipped_row_sums", "apply_rows"} <= {c.method for c in calls}
        assert "example_sq_norms" not in {c.method for c in calls}  # the trainer computes the norms
        assert sum(c.bytes_to for c in calls) == group.bytes_to_shards - to0 > 0
        assert sum(c.bytes_from for c in calls) == group.bytes_from_shards - from0 > 0
        assert all(c.seconds >= 0 for c in calls)
        remove()
        count = len(calls)
        run.run(3)
        assert len(calls) == count


def test_privacy_info_is_typed_and_complete(ctr_dir):
    cfg = load_config(None, [f"data.path={ctr_dir}", *TINY, "train.selection=threshold", "privacy.target_epsilon=4"])
    with build_run(cfg.validate()) as run:
        info = run.privacy
        assert dataclasses.is_dataclass(info) and info.calibrated and info.threshold_rule
        assert info.selection_params["threshold"] == info.threshold > 0
        assert info.selection_epsilon is None and info.selection_sigma == info.selection_params["noise_multiplier"]
        with pytest.raises(dataclasses.FrozenInstanceError):
            info.delta = 1.0


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    """A config a user copies must at least parse and pass validation (keys, kinds, registries)."""
    load_config(str(path)).validate()


def test_changed_computation_keys_ignores_placement_logging_and_recovery_but_nothing_else():
    """What a benchmark may reuse a saved run for: the same computation, placed or logged
    differently. A key the saved config lacks (written before the key existed) counts as changed
    unless it is one of those."""
    from widedp.trainer.run.train import changed_computation_keys

    base = load_config("configs/quickstart.toml", []).to_dict()
    moved = load_config("configs/quickstart.toml", ["cluster.backend=local", "cluster.max_actor_restarts=3",
                                                     "train.log_every=7"]).to_dict()
    assert changed_computation_keys(base, moved) == []
    older = json.loads(json.dumps(base))
    del older["cluster"]["max_actor_restarts"]
    assert changed_computation_keys(older, base) == []
    del older["train"]["lr"]
    assert changed_computation_keys(older, base) == ["train.lr"]
    other = load_config("configs/quickstart.toml", ["train.steps=9", "privacy.k=3"]).to_dict()
    assert changed_computation_keys(base, other) == ["train.steps", "privacy.k"]


@pytest.mark.parametrize("key", ["fold_write_back", "unawaited_write_back", "data_plane", "compiled_wait"])
def test_when_the_write_back_is_sent_and_over_which_transport_is_not_a_change_of_computation(key):
    """The cluster's round scheduling (fold, unawaited write-back, data plane) orders and carries the
    same messages: a run saved before such a key existed, or with another value, computes the same
    steps (a benchmark reuses it; a reproducible resume may switch it)."""
    from widedp.trainer.run.train import _RESUME_FREE_KEYS, changed_computation_keys

    base = load_config("configs/quickstart.toml", []).to_dict()
    older = json.loads(json.dumps(base))
    del older["cluster"][key]
    assert changed_computation_keys(older, base) == []
    assert changed_computation_keys(older, base, _RESUME_FREE_KEYS) == []


def test_an_unknown_compiled_wait_is_refused_naming_the_key_and_the_choices():
    cfg = load_config("configs/quickstart.toml", ["cluster.compiled_wait=sleepy"])
    with pytest.raises(ConfigError, match=r"cluster.compiled_wait must be one of \('backoff', 'spin'\), got 'sleepy'"):
        cfg.validate()
