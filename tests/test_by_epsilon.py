"""Values that depend on the target ε: a config's [by_epsilon] rows, and DP-FEST's one-time σ
sized from the data's public shape and the target ε (privacy.fest_noise_multiplier = "auto")."""

from __future__ import annotations

from pathlib import Path

import pytest

from widedp.trainer.config import ConfigError, config_from_dict, load_config, pick_epsilon_row, saved_config

RAW = {
    "train": {"mode": "sparse", "lr": 10.0, "dense_lr": 1.0},
    "privacy": {"target_epsilon": 8.0},
    "by_epsilon": {"1": {"train": {"lr": 3.0}}, "3": {"train": {"lr": 5.0, "dense_lr": 2.0}}},
}


@pytest.mark.parametrize("target, lr, dense_lr, row", [
    (1.0, 3.0, 1.0, 1.0),    # its own row
    (2.0, 3.0, 1.0, 1.0),    # the largest row at or below the target (tuned for more noise)
    (3.0, 5.0, 2.0, 3.0),
    (8.0, 5.0, 2.0, 3.0),
    (0.5, 3.0, 1.0, 1.0),    # below every row: the smallest
])
def test_the_row_for_the_target_epsilon_is_applied(target, lr, dense_lr, row):
    cfg = config_from_dict(RAW, "x.toml", [f"privacy.target_epsilon={target}"])
    assert (cfg.train.lr, cfg.train.dense_lr, cfg.tuned_for_epsilon) == (lr, dense_lr, row)


def test_a_key_given_with_set_wins_over_the_row():
    cfg = config_from_dict(RAW, "x.toml", ["privacy.target_epsilon=1", "train.lr=7"])
    assert cfg.train.lr == 7.0 and cfg.tuned_for_epsilon == 1.0


def test_a_nonprivate_run_applies_no_row():
    cfg = config_from_dict(RAW, "x.toml", ["train.mode=nonprivate"])
    assert cfg.train.lr == 10.0 and cfg.tuned_for_epsilon is None


def test_a_saved_config_keeps_its_applied_values_and_row():
    cfg = config_from_dict(RAW, "x.toml", ["privacy.target_epsilon=1"])
    again = saved_config(cfg.to_dict(), "config.json", ["privacy.target_epsilon=3"])
    assert again.train.lr == 3.0 and again.tuned_for_epsilon == 1.0  # not re-picked on resume


@pytest.mark.parametrize("table, message", [
    ({"1": {"data": {"path": "x"}}}, r"by_epsilon\.1: a row may set keys of"),
    ({"0": {"train": {"lr": 1.0}}}, r"by_epsilon\.0: a row's key is a target ε > 0"),
    ({"abc": {"train": {"lr": 1.0}}}, r"by_epsilon\.abc: a row's key"),
    ({"1": {"train": {"lrr": 1.0}}}, r"by_epsilon\.1: unknown key train\.lrr"),
    ({"1": {"train": {"lr": "fast"}}}, r"by_epsilon\.1: train\.lr must be a number"),
    ({"1": {"privacy": {"target_epsilon": 2.0}}}, r"privacy\.target_epsilon cannot be set per ε"),
    ({"1": {"train": {"mode": "dpsgd"}}}, r"train\.mode cannot be set per ε"),
])
def test_a_bad_row_is_refused_naming_the_file_row_and_key(table, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"by_epsilon": table}, "x.toml")


def test_rows_are_not_set_from_the_command_line():
    with pytest.raises(ConfigError, match="not set from the command line"):
        config_from_dict(RAW, "x.toml", ["by_epsilon.1.train.lr=2"])


def test_a_files_table_replaces_its_bases_whole(tmp_path: Path):
    (tmp_path / "base.toml").write_text('[train]\nlr = 1.0\n[by_epsilon.1.train]\nlr = 2.0\ndense_lr = 5.0\n')
    (tmp_path / "child.toml").write_text('base = "base.toml"\n[by_epsilon.8.train]\nlr = 4.0\n')
    cfg = load_config(str(tmp_path / "child.toml"), ["privacy.target_epsilon=1"])
    assert set(cfg.by_epsilon) == {"8"} and cfg.train.lr == 4.0 and cfg.train.dense_lr != 5.0
    inherited = load_config(str(tmp_path / "base.toml"), ["privacy.target_epsilon=1"])
    assert inherited.train.lr == 2.0 and inherited.train.dense_lr == 5.0


def test_pick_epsilon_row_tolerates_float_keys():
    assert pick_epsilon_row({"0.5": {}, "2": {}, "10": {}}, 2.0 * (1 - 1e-15)) == "2"
    assert pick_epsilon_row({"0.5": {}, "2": {}, "10": {}}, 100) == "10"


@pytest.mark.parametrize("path", sorted(Path("configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_resolves_at_each_grid_epsilon(path):
    for eps in (1, 3, 8):
        cfg = load_config(str(path), [f"privacy.target_epsilon={eps}"])
        if cfg.by_epsilon and cfg.train.mode != "nonprivate":
            assert cfg.tuned_for_epsilon == float(pick_epsilon_row(cfg.by_epsilon, eps))


# ---- DP-FEST's one-time σ ("auto") ------------------------------------------------------------

def test_auto_fest_sigma_is_the_larger_of_usefulness_and_the_budget_share():
    from widedp.accounting import make_accountant
    from widedp.accounting.events import GaussianDpEvent
    from widedp.selection.fest import auto_fest_noise_multiplier

    big, rule_big = auto_fest_noise_multiplier(400_000, 16, 4000, 8.0, 1e-7, "rdp")
    assert big == pytest.approx(0.1 * 400_000 * 4 / 4000) and "n·L/k" in rule_big
    small, rule_small = auto_fest_noise_multiplier(5_000, 16, 100, 1.0, 1e-6, "rdp")
    assert small > 0.1 * 5_000 * 4 / 100 and "ε alone" in rule_small
    assert make_accountant("rdp").epsilon([(GaussianDpEvent(small), 1)], 1e-6) <= 0.05 * (1 + 1e-9)
    with pytest.raises(ValueError, match="n, L, k >= 1"):
        auto_fest_noise_multiplier(0, 16, 100, 1.0, 1e-6, "rdp")


def test_planning_sizes_an_auto_fest_sigma_and_keeps_an_explicit_one():
    from widedp.trainer.config.planning import plan_privacy

    base = ["train.mode=sparse", "train.selection=fest-threshold", "privacy.k=50", "train.steps=20",
            "train.batch_size=100", "privacy.target_epsilon=2", "model.name=cbow", "data.path=x"]
    from widedp.selection.fest import auto_fest_noise_multiplier

    cfg = load_config(None, base)
    _, info = plan_privacy(cfg, 20_000, 5_000)
    want, rule = auto_fest_noise_multiplier(20_000, cfg.privacy.fest_max_rows_per_example, 50, 2.0, info.delta,
                                            cfg.privacy.accountant)
    assert info.selection_params["fest_noise_multiplier"] == want and info.fest_noise_rule == rule
    _, explicit = plan_privacy(load_config(None, base + ["privacy.fest_noise_multiplier=7"]), 20_000, 5_000)
    assert explicit.selection_params["fest_noise_multiplier"] == 7.0 and explicit.fest_noise_rule is None
