"""The forecast before training (trainer/config/forecast.py): f_min = σ·√D / (b·√T) from public
values, a warning above the measured threshold, in every run's first lines and summary; and the
benchmark that checks it against the measured grids (benchmarks/forecast_check.py)."""

import json
import math
import sys
from pathlib import Path

import pytest

from widedp.trainer.config.forecast import WARN_MIN_UNIT_SHARE, forecast

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_the_forecast_is_the_formula_and_flags_above_the_threshold():
    f = forecast(noise_multiplier=12.11, expected_batch_size=64, steps=300, embedding_dim=16, units=278, unit="user")
    assert f["min_unit_share"] == pytest.approx(12.11 * 4 / (64 * math.sqrt(300)))
    assert f["row_snr"] == pytest.approx(1 / f["min_unit_share"]) and f["min_units"] == pytest.approx(
        f["min_unit_share"] * 278)
    assert f["unlikely_to_learn"] and "unlikely to learn" in f["warning"] and "users" in f["warning"]
    # 18,407 users at ε = 1 (σ = 0.82): learned, not flagged
    g = forecast(noise_multiplier=0.82, expected_batch_size=64, steps=300, embedding_dim=16, units=18407, unit="user")
    assert not g["unlikely_to_learn"] and "warning" not in g and g["min_unit_share"] <= WARN_MIN_UNIT_SHARE
    # more steps, a larger batch, less noise or narrower rows: never a larger f_min
    base = dict(noise_multiplier=2.0, expected_batch_size=100, steps=400, embedding_dim=16, units=10_000)
    for key, value in (("steps", 1600), ("expected_batch_size", 400), ("noise_multiplier", 1.0), ("embedding_dim", 4)):
        assert forecast(**{**base, key: value})["min_unit_share"] < forecast(**base)["min_unit_share"]
    assert forecast(**{**base, "noise_multiplier": None}) == {"unlikely_to_learn": False,
                                                             "rule": "non-private: no noise to forecast"}
    with pytest.raises(ValueError, match="b > 0"):
        forecast(**{**base, "expected_batch_size": 0})


def test_a_run_warns_in_its_first_lines_and_reports_the_forecast(capsys, tmp_path, ctr_dir):
    from widedp.trainer.cli import main

    from test_train_cli import TINY

    config = tmp_path / "c.toml"
    config.write_text(f'[data]\npath = "{ctr_dir}"\n')
    argv = ["train", "--config", str(config), "--run-dir", str(tmp_path / "r"), "--no-progress"]
    sets = [x for s in [*TINY, "train.steps=3", "train.recalibrate=false", "train.mode=dpsgd"] for x in ("--set", s)]
    code = main([*argv, *sets])
    out, err = capsys.readouterr()
    assert code == 0, err
    f = json.loads(out)["forecast"]
    assert f["unlikely_to_learn"]  # 3 steps at b = 64: nothing can outgrow its noise
    assert "unlikely to learn" in err  # the CLI's warning, before the first step's output
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["forecast"]["min_unit_share"] == pytest.approx(f["min_unit_share"])


def _grid_doc(tmp_path, records):
    doc = {"data": {"users": 300, "train_examples": 1200, "tag": "logs_u300"}, "records": records}
    path = tmp_path / "user_level_test.json"
    path.write_text(json.dumps(doc))
    return path


def _record(name, sigma, excess):
    return {"name": name, "config": "configs/logs.toml", "overrides": ["data.path=/x", "train.steps=300"],
            "noise_multiplier": sigma, "batch_size": 64, "batch_unit": "users", "steps": 300, "target_epsilon": 1.0,
            "test_metrics": {"logloss": 0.3 + excess, "base_rate_logloss": 0.3, "auc": 0.6}}


@pytest.mark.parametrize("sigma_learned, status", [(0.5, "**met**"), (12.0, "**missed**")])
def test_the_check_counts_false_alarms_and_misses_from_the_grids(tmp_path, sigma_learned, status):
    import forecast_check

    path = _grid_doc(tmp_path, [_record("a", sigma_learned, -0.01), _record("b", 12.0, 0.2), _record("c", 0.5, 0.1),
                                {"name": "nonprivate", "noise_multiplier": None, "test_metrics": {}}])
    doc = forecast_check.check([path])
    assert len(doc["runs"]) == 3 and doc["flagged_failed"] == 1 and doc["unflagged_failed"] == 1
    assert doc["flagged_learned"] == (1 if sigma_learned == 12.0 else 0)
    lines, goals = forecast_check.results_section(doc)
    assert goals[0][2] == status and goals[1][2] == "**missed**"  # run "c" (300 users, ε = 1) is not flagged
    assert any("logs_u300 c" in line for line in lines)
