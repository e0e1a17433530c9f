"""Smoke run of benchmarks/user_level.py at a tiny size (300 users, 2 days, 2 steps, target
ε = 8, sparse at both privacy units plus the nonprivate floor), and its checks on hand-made
records. The smoke run fixes every σ (no calibration: a PLD calibration alone takes seconds)
and reports ε by RDP; the 2 steps spend far less than the target. A second smoke run sweeps k
(users sampled at k = 2, 4; example sampling at k = 4; each point twice) by the PLD accountant
(example sampling is accounted by PLD only), on the first run's data."""

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
FIXED_SIGMAS = [x for kv in ("privacy.noise_multiplier=2.0", "privacy.selection_sigma=4.0",
                             "privacy.fest_noise_multiplier=20.0", "privacy.recalibration_noise_multiplier=20.0")
                for x in ("--set", kv)]
FIXED_NOISE = ["--set", "privacy.accountant=rdp", *FIXED_SIGMAS]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """One work directory for the module: the quick data set is made once."""
    return tmp_path_factory.mktemp("user_level") / "work"


def test_user_level_smoke_writes_every_number(tmp_path, work):
    out = tmp_path / "user_level.json"
    code = user_level.main(["--quick", "--steps", "2", "--modes", "sparse", "--threads", "0",
                            *FIXED_NOISE, "--work-dir", str(work), "--out", str(out)])
    doc = json.loads(out.read_text())
    assert code == 0, doc["checks"]
    assert doc["checks"]["ok"] and not doc["checks"]["failures"]
    data = doc["data"]
    assert data["users"] > 0 and 1 <= data["mean_contribution"] <= data["k"] == 16
    assert doc["reference"]["bayes_auc"] > 0.5  # truth.json of the generated logs was found
    match = doc["matching"]
    assert match["user_batch"] == max(1, round(match["examples_per_step"] / data["mean_contribution"]))
    records = {r["name"]: r for r in doc["records"]}
    assert set(records) == {"nonprivate", "sparse-example-eps8", "sparse-user-k16-eps8"}
    assert doc["benchmark"] == "user_level" and "k_comparison" not in doc  # one k, one run: the old output
    for name, r in records.items():
        assert "error" not in r, r
        assert r["privacy_unit"] == r["unit"], name  # what the run's summary.json says it protects
        summary = json.loads((REPO / r["run_dir"] / "summary.json").read_text())
        assert summary["privacy_unit"] == r["unit"]
        for key in ("auc", "logloss", "ece", "base_rate_logloss"):
            assert math.isfinite(r["test_metrics"][key]), (name, key)
        assert r["step_time_ms_median"] > 0 and r["norms_ms_median"] is not None and r["norms_ms_median"] >= 0
    assert records["sparse-user-k16-eps8"]["k"] == 16 and records["sparse-example-eps8"]["k"] is None
    user, example = records["sparse-user-k16-eps8"], records["sparse-example-eps8"]
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


def test_user_level_k_sweep_with_repeats(tmp_path, work):
    out = tmp_path / "user_level_k.json"
    code = user_level.main(["--quick", "--steps", "2", "--modes", "sparse", "--units", "user,user-examples",
                            "--no-nonprivate", "--user-k", "4,2", "--example-sampling-k", "4", "--repeats", "2",
                            "--threads", "1", *FIXED_SIGMAS, "--work-dir", str(work), "--out", str(out)])
    doc = json.loads(out.read_text())
    assert code == 0, doc["checks"]
    assert doc["benchmark"] == "user_level_k" and doc["repeats"] == 2
    assert doc["user_k"] == [2, 4] and doc["example_sampling_k"] == [4]
    records = {r["name"]: r for r in doc["records"]}
    points = [("user", 2), ("user", 4), ("user-examples", 4)]
    assert set(records) == {f"sparse-{u}-k{k}-eps8{s}" for u, k in points for s in ("", "-r1")}
    assert len({r["run_dir"] for r in records.values()}) == 6  # every k and repeat in its own run
    B, ks = doc["matching"]["examples_per_step"], doc["k_statistics"]
    for name, r in records.items():
        assert "error" not in r, r
        assert r["repeat"] == (1 if name.endswith("-r1") else 0) and f"-k{r['k']}-" in name
        cfg = json.loads((REPO / r["run_dir"] / "config.json").read_text())
        assert cfg["privacy"]["max_examples_per_user"] == r["k"]  # the run trained at its k
        assert cfg["privacy"]["user_sampling"] == ("examples" if r["unit"] == "user-examples" else "users")
        c_bar = ks[str(r["k"])]["mean_contribution"]
        assert r["batch_size"] == (B if r["unit"] == "user-examples" else max(1, round(B / c_bar)))
        assert r["privacy_unit"] == "user" and r["epsilon"] <= 8 + 1e-6
    for u, k in points:  # fresh secret noise per repeat: the two runs of a point differ
        a, b = records[f"sparse-{u}-k{k}-eps8"], records[f"sparse-{u}-k{k}-eps8-r1"]
        assert a["test_metrics"]["logloss"] != b["test_metrics"]["logloss"], (u, k)
    pts = {(p["unit"], p["k"]): p for p in doc["points"]}
    assert set(pts) == set(points)
    for (u, k), p in pts.items():
        aucs = [records[n]["test_metrics"]["auc"] for n in p["runs"]]
        assert len(aucs) == 2 and p["auc"]["mean"] == pytest.approx(sum(aucs) / 2)
        assert p["auc"]["min"] == min(aucs) and p["auc"]["max"] == max(aucs)
    (row,) = doc["k_comparison"]  # both methods ran at k = 4 only
    assert (row["mode"], row["target_epsilon"], row["k"]) == ("sparse", 8.0, 4)
    assert row["auc_difference"] == pytest.approx(pts[("user", 4)]["auc"]["mean"] - pts[("user-examples", 4)]["auc"]["mean"])
    assert row["better_auc"].split()[0] == ("user" if row["auc_difference"] > 0 else "user-examples")
    assert row["examples_kept"] == pytest.approx(1 - ks["4"]["examples_beyond_k"])
    lines, _ = user_level.results_section(doc)
    text = "\n".join(lines)
    assert "2 runs per point" in text and "AUC min–max" in text and "| better AUC |" in text
    with pytest.raises(SystemExit):
        user_level.main(["--quick", "--user-k", "0,4"])


def test_same_mechanism_note_only_where_q_and_sigma_agree():
    row = {"mode": "sparse", "target_epsilon": 8.0, "k": 1, "sigma": [0.65, 0.65], "sample_rate": [0.02, 0.02],
           "lr": [1.75, 10.0625], "auc_difference": -0.07}
    note = user_level.same_mechanism_note([row, {**row, "k": 4, "sigma": [0.5, 0.7]}])
    assert note is not None and "5.75×" in note and "sparse ε = 8: -0.0700" in note and "ε = 4" not in note
    assert user_level.same_mechanism_note([{**row, "sigma": [0.65, 0.9]}]) is None


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


def test_public_data_goals_miss_on_one_run_over_the_base_rate_and_on_a_systematically_low_auc():
    def rec(mode, unit, auc, logloss):
        return {"mode": mode, "unit": unit, "target_epsilon": 1.0,
                "test_metrics": {"auc": auc, "logloss": logloss, "base_rate_logloss": 0.69}}

    records = [rec("nonprivate", "example", 0.7, 0.6),
               rec("dpsgd", "user", 0.52, 0.69), rec("dpsgd", "user", 0.50, 0.70),  # one run +0.01 over
               rec("sparse", "user", 0.47, 0.69), rec("sparse", "user", 0.48, 0.69), rec("sparse", "user", 0.46, 0.69)]
    goals = {g[0]: g[2] for g in user_level.public_data_goals(records, "set")}
    assert len(goals) == 4  # the nonprivate run has no goal
    assert goals["set, dpsgd, user level, ε = 1: no run's log loss above the base rate + 0.005"] == "**missed**"
    assert goals["set, dpsgd, user level, ε = 1: AUC not systematically below 0.5"] == "**met**"
    assert goals["set, sparse, user level, ε = 1: no run's log loss above the base rate + 0.005"] == "**met**"
    assert goals["set, sparse, user level, ε = 1: AUC not systematically below 0.5"] == "**missed**"
