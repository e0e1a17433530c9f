"""Smoke run of benchmarks/user_level.py at a tiny size (300 users, 2 days, 2 steps, target
ε = 8, sparse at both privacy units plus the nonprivate floor), and its checks on hand-made
records. The smoke run fixes every σ (no calibration: a PLD calibration alone takes seconds)
and reports ε by RDP; the 2 steps spend far less than the target."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import user_level  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_benchmark_user_level")
FIXED_NOISE = [x for kv in ("privacy.accountant=rdp", "privacy.noise_multiplier=2.0", "privacy.selection_sigma=4.0",
                            "privacy.fest_noise_multiplier=20.0", "privacy.recalibration_noise_multiplier=20.0")
               for x in ("--set", kv)]


def test_user_level_smoke_writes_every_number(tmp_path):
    out = tmp_path / "user_level.json"
    code = user_level.main(["--quick", "--steps", "2", "--modes", "sparse", "--threads", "0",
                            *FIXED_NOISE, "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    doc = json.loads(out.read_text())
    assert code == 0, doc["checks"]
    assert doc["checks"]["ok"] and not doc["checks"]["failures"]
    data = doc["data"]
    assert data["users"] > 0 and 1 <= data["mean_contribution"] <= data["k"] == 16
    assert doc["reference"]["bayes_auc"] > 0.5  # truth.json of the generated logs was found
    match = doc["matching"]
    assert match["user_batch"] == max(1, round(match["examples_per_step"] / data["mean_contribution"]))
    records = {r["name"]: r for r in doc["records"]}
    assert set(records) == {"nonprivate", "sparse-example-eps8", "sparse-user-eps8"}
    for name, r in records.items():
        assert "error" not in r, r
        assert r["privacy_unit"] == r["unit"], name  # what the run's summary.json says it protects
        summary = json.loads((REPO / r["run_dir"] / "summary.json").read_text())
        assert summary["privacy_unit"] == r["unit"]
        for key in ("auc", "logloss", "ece", "base_rate_logloss"):
            assert math.isfinite(r["test_metrics"][key]), (name, key)
        assert r["step_time_ms_median"] > 0 and r["norms_ms_median"] is not None and r["norms_ms_median"] >= 0
    user, example = records["sparse-user-eps8"], records["sparse-example-eps8"]
    assert user["batch_unit"] == "users" and user["batch_size"] == match["user_batch"]
    assert example["batch_size"] == match["examples_per_step"]
    assert example["lr"] == pytest.approx(user["lr"] * match["example_lr_scale"], rel=1e-5)
    assert user["epsilon"] <= 8 + 1e-6 and example["epsilon"] <= 8 + 1e-6
    assert user["sample_rate"] == pytest.approx(match["user_batch"] / data["users"])
    (cost,) = doc["costs"]["rows"]
    assert cost["step_ratio"] == pytest.approx(user["step_time_ms_median"] / example["step_time_ms_median"])
    assert math.isfinite(cost["norms_ratio"]) and doc["costs"]["floor_step_ms"] > 0
    (group,) = doc["group_privacy"]
    assert [g["m"] for g in group["groups"]] == [round(data["examples_per_user"]["median"]),
                                                 data["examples_per_user"]["max"]]
    assert group["groups"][1]["epsilon"] == pytest.approx(data["examples_per_user"]["max"] * example["epsilon"])


def test_checks_fail_a_run_whose_summary_does_not_name_the_unit():
    good = {"name": "sparse-user-eps8", "mode": "sparse", "unit": "user", "target_epsilon": 8.0, "epsilon": 7.99,
            "privacy_unit": "user",
            "test_metrics": {"auc": 0.6, "logloss": 0.35, "ece": 0.01, "base_rate_logloss": 0.36}}
    example = {**good, "name": "sparse-example-eps8", "unit": "example", "privacy_unit": "example"}
    assert user_level.checks([good, example], {})["ok"]
    missing = {k: v for k, v in good.items() if k != "privacy_unit"}
    res = user_level.checks([missing, example], {})
    assert not res["ok"] and "privacy_unit None" in res["failures"][0]
    nan = {**good, "test_metrics": {**good["test_metrics"], "auc": float("nan")}}
    assert not user_level.checks([nan], {})["ok"]
    over = {**good, "epsilon": 8.5}
    assert not user_level.checks([over], {})["ok"]
    better = {**good, "test_metrics": {**good["test_metrics"], "auc": 0.7}}  # user level far above example level
    res = user_level.checks([better, example], {})
    assert res["ok"] and any("above example level" in f for f in res["flags"])
