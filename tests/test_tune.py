"""`widedp tune` end to end (trainer/run/tune.py): the best of a secret random number of private
trials, released with the whole tuning's ε, charged once to the data set's budget; the trials
that were not chosen are gone, a trial is never resumed nor exported unless chosen, and bad
input is refused before anything runs. The mechanism's own statistical test (a toy tuning and
its broken variant that picks on the un-noised score) is tests/test_private_tuning.py."""

import json
import math

import numpy as np
import pytest

from widedp.trainer.cli import main
from widedp.trainer.run import budget as dataset_budget
from widedp.trainer.run import tune as tune_mod

from test_train_cli import TINY

STEPS = [*TINY, "train.steps=6", "train.recalibrate=false", "train.mode=dpsgd"]
pytestmark = pytest.mark.xdist_group("tune")  # the module's tuning (a fixture) runs once, on one worker


def _sets(*items):
    return [x for item in items for x in ("--set", item)]


def _config(tmp_path, data):
    config = tmp_path / "base.toml"
    config.write_text(f'[data]\npath = "{data}"\n')
    return config


def _tune(capsys, config, run_dir, *extra, sets=STEPS):
    code = main(["tune", "--config", str(config), "--run-dir", str(run_dir), "--no-progress", *_sets(*sets), *extra])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, ctr_dir):
    """One tuning on the shared CTR set: two learning rates, E[K] = 2, target ε = 4."""
    import contextlib
    import io

    tmp = tmp_path_factory.mktemp("tune")
    config = _config(tmp, ctr_dir)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["tune", "--config", str(config), "--run-dir", str(tmp / "t"), "--no-progress", *_sets(*STEPS),
                     "--grid", "train.lr=1,3", "--target-epsilon", "4", "--expected-trials", "2"])
    assert code == 0
    return json.loads(out.getvalue()), tmp / "t", ctr_dir, config


def test_the_tuning_releases_one_trial_with_the_whole_tunings_epsilon(tuned):
    result, run_dir, _, _ = tuned
    assert result["epsilon"] <= result["target_epsilon"] == 4.0
    assert result["trial_epsilon"] < result["epsilon"]  # K trials cost more than one
    assert result["candidates"] == [["train.lr=1"], ["train.lr=3"]]
    chosen = result["chosen"]
    assert chosen["candidate"] in result["candidates"] and math.isfinite(chosen["noised_validation_score"])
    trials = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("trial-"))
    assert trials == [chosen["run_dir"].rsplit("/", 1)[1]]  # the others were deleted
    assert "K" not in result and "num_trials" not in result and "trials_run" not in result
    summary = json.loads((run_dir / trials[0] / "summary.json").read_text())
    assert summary["tuning"]["tuning_id"] == result["tuning_id"]
    assert "validation_metrics" not in summary  # the validation part is scored only with noise
    assert json.loads((run_dir / trials[0] / "config.json").read_text())["privacy"]["target_epsilon"] == pytest.approx(
        result["trial_epsilon"])


def test_the_data_sets_budget_counts_the_tuning_once_not_each_trial(tuned, capsys):
    result, run_dir, data, _ = tuned
    code = main(["budget", str(data)])
    budget = json.loads(capsys.readouterr().out)
    assert code == 0
    tunings = [r for r in budget["runs"] if r.get("kind") == "tuning" and r["run_id"] == result["tuning_id"]]
    assert len(tunings) == 1 and tunings[0]["status"] == "finished"
    assert tunings[0]["epsilon_bound"] == pytest.approx(result["epsilon"])
    assert not any(r.get("tuning_id") == result["tuning_id"] for r in budget["runs"])
    lines = dataset_budget.read(data)
    assert any(r.get("tuning_id") == result["tuning_id"] for r in lines)  # the trials' own lines are on record


def test_the_chosen_trial_exports_with_the_tunings_epsilon_and_no_other_trial_does(tuned, tmp_path):
    from widedp.trainer.release.export import ExportError, export_run

    result, run_dir, _, _ = tuned
    export_run(result["chosen"]["run_dir"], tmp_path / "export")
    report = json.loads((tmp_path / "export" / "privacy_report.json").read_text())
    assert report["epsilon"] == pytest.approx(result["epsilon"]) and report["trial_epsilon"] < report["epsilon"]
    assert report["tuning"]["candidate"] == result["chosen"]["candidate"]
    assert "Chosen by `widedp tune`" in (tmp_path / "export" / "PRIVACY.md").read_text()
    # a trial its tuning did not choose (here: the chosen one without its tuning.json) is not released
    import shutil

    copy = tmp_path / "t2" / "trial-copy"
    shutil.copytree(result["chosen"]["run_dir"], copy)
    (copy / tune_mod.TUNING_FILE).unlink()
    with pytest.raises(ExportError, match="did not choose"):
        export_run(copy, tmp_path / "export2")


def test_a_trial_is_never_resumed(tuned, capsys):
    result, _, _, _ = tuned
    code = main(["train", "--resume", result["chosen"]["run_dir"], "--no-progress"])
    assert code == 2 and "cannot be resumed" in capsys.readouterr().err


@pytest.mark.parametrize("extra, sets, message", [
    (["--grid", "privacy.target_epsilon=1,2"], STEPS, "fixed for the whole tuning"),
    (["--grid", "train.lr"], STEPS, "expected SECTION.KEY=V1,V2"),
    (["--grid", "train.lrx=1,2"], STEPS, "--grid candidate train.lrx=1"),
    (["--distribution", "uniform"], STEPS, "--distribution must be one of"),
    (["--expected-trials", "1"], STEPS, "--expected-trials must be in"),
    (["--score", "brier"], [*STEPS, "privacy.reproducible=true", "privacy.noise_seed=3"], "privacy.reproducible"),
    ([], [*STEPS[:-1], "train.mode=nonprivate"], "private runs only"),
])
def test_bad_input_is_refused_before_anything_runs(capsys, tmp_path, ctr_dir, extra, sets, message):
    before = dataset_budget.read(ctr_dir) if (ctr_dir / dataset_budget.BUDGET_FILE).exists() else []
    code, _, err = _tune(capsys, _config(tmp_path, ctr_dir), tmp_path / "t", *extra, sets=sets)
    assert code == 2 and message in err, err
    assert not (tmp_path / "t").exists()
    after = dataset_budget.read(ctr_dir) if (ctr_dir / dataset_budget.BUDGET_FILE).exists() else []
    assert len(after) == len(before)


def test_user_level_by_example_sampling_is_refused_with_the_accountants_reason(capsys, tmp_path, user_logs_dir):
    before = len(dataset_budget.read(user_logs_dir)) if (user_logs_dir / dataset_budget.BUDGET_FILE).exists() else 0
    code, _, err = _tune(capsys, _config(tmp_path, user_logs_dir), tmp_path / "t", "--expected-trials", "2",
                         sets=[*STEPS, "privacy.unit=user", "privacy.user_sampling=examples"])
    assert code == 2 and "RDP accountant" in err and "privacy.user_sampling" in err, err
    assert not (tmp_path / "t").exists()
    after = len(dataset_budget.read(user_logs_dir)) if (user_logs_dir / dataset_budget.BUDGET_FILE).exists() else 0
    assert after == before


def test_a_tuning_never_writes_into_a_directory_that_holds_anything(capsys, tuned):
    _, run_dir, data, config = tuned
    code, _, err = _tune(capsys, config, run_dir)
    assert code == 2 and "not empty" in err


def test_a_failed_tuning_is_charged_in_full_and_releases_nothing(capsys, tmp_path, ctr_dir, monkeypatch):
    import widedp.trainer.run.train as train_mod

    real, calls = train_mod.train, []

    def fails_in_the_first_trial(cfg, run_dir, resume=False, progress=True, trial=None):
        calls.append(run_dir)
        real(cfg, run_dir, resume, progress, trial)
        raise RuntimeError("a trial failed")

    monkeypatch.setattr(train_mod, "train", fails_in_the_first_trial)
    with pytest.raises(RuntimeError, match="a trial failed"):
        main(["tune", "--config", str(_config(tmp_path, ctr_dir)), "--run-dir", str(tmp_path / "t"), "--no-progress",
              *_sets(*STEPS), "--target-epsilon", "3", "--expected-trials", "2"])
    assert calls and not list((tmp_path / "t").glob("trial-*"))
    assert (tmp_path / "t" / "ledger.json").exists() and not (tmp_path / "t" / tune_mod.TUNING_FILE).exists()
    mine = [r for r in dataset_budget.summary(ctr_dir)["runs"] if r.get("kind") == "tuning"
            and r["run_dir"] == str((tmp_path / "t").absolute())]
    assert len(mine) == 1 and mine[0]["status"] == "failed" and 0 < mine[0]["epsilon_bound"] <= 3.0


def test_the_split_puts_each_unit_wholly_on_one_side_with_the_asked_probability():
    rng = np.random.default_rng(0)
    units = rng.integers(0, 2000, size=20000)
    train, held = tune_mod.split_units(units.size, units, 0.2, np.random.default_rng(1))
    assert np.intersect1d(units[train], units[held]).size == 0
    assert np.union1d(train, held).size == units.size
    assert abs(np.unique(units[held]).size / np.unique(units).size - 0.2) < 0.03
    train, held = tune_mod.split_units(10000, None, 0.3, np.random.default_rng(2))
    assert abs(held.size / 10000 - 0.3) < 0.02 and np.intersect1d(train, held).size == 0


def test_one_unit_moves_the_validation_sum_by_at_most_the_clip():
    rng = np.random.default_rng(3)
    scores = rng.uniform(0, 1, size=500)
    units = rng.integers(0, 60, size=500)
    total, count = tune_mod.sum_per_unit(scores, units)
    for u in np.unique(units)[:20]:
        keep = units != u
        without, fewer = tune_mod.sum_per_unit(scores[keep], units[keep])
        assert fewer == count - 1 and 0 <= total - without <= 1.0 + 1e-12
    # example level: the plain sum
    assert tune_mod.sum_per_unit(scores, None) == (pytest.approx(scores.sum()), 500)


@pytest.mark.parametrize("tuned_auc, worst_excess, status", [(0.60, -0.01, "**met**"), (0.58, 0.02, "**missed**")])
def test_the_benchmarks_results_section_reads_its_goals_from_the_json(tuned_auc, worst_excess, status):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import private_tuning

    tuned = [{"auc": tuned_auc, "logloss": 0.3 + worst_excess, "base_rate_logloss": 0.3, "candidate": ["train.lr=1"]},
             {"auc": tuned_auc, "logloss": 0.29, "base_rate_logloss": 0.3, "candidate": ["train.lr=3"]}]
    doc = {"users": 2000, "days": 4, "seed": 11, "config": "configs/logs.toml", "grid": ["train.lr=1,3"],
           "expected_trials": 10.0, "repeats": 2, "headers": ["row", "AUC"], "rows": [["tuned", "0.6"]],
           "records": {"nonprivate_validation": {"chosen": {"auc": 0.605}}, "eps8": {"default": [], "tuned": tuned}}}
    lines, goals = private_tuning.results_section(doc)
    assert "| tuned | 0.6 |" in lines
    assert [g[2] for g in goals] == [status, status]
    assert f"{tuned_auc:.4f} vs 0.6050" == goals[0][1]
