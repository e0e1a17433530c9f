"""A data set's privacy budget across runs (trainer/dataset_budget.py): every run on it appends
its spending to DATASET/privacy_budget.jsonl, which only grows, and `widedp budget DATASET`
shows every run and the basic-composition total — two models at ε each are not "ε" together."""

import json
import math

import pytest

from widedp.trainer import dataset_budget
from widedp.trainer.cli import main
from widedp.trainer.data import synth_ctr

from test_ledger_chain import _resume, _train


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data"
    synth_ctr(path, num_examples=3000, table_sizes=500, seed=3)
    return path


def _budget(capsys, data):
    code = main(["budget", str(data)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_a_data_set_without_runs_has_spent_nothing(capsys, data):
    budget = _budget(capsys, data)
    assert budget["runs"] == [] and budget["total_epsilon"] == 0


def test_every_run_on_a_data_set_is_counted_and_the_file_only_grows(capsys, tmp_path, data):
    a = _train(capsys, data, tmp_path / "a", "train.steps=3")
    after_a = (data / dataset_budget.BUDGET_FILE).read_bytes()
    b = _train(capsys, data, tmp_path / "b", "train.steps=4")
    after_b = (data / dataset_budget.BUDGET_FILE).read_bytes()
    assert after_b.startswith(after_a) and len(after_b) > len(after_a)  # appended, never rewritten
    budget = _budget(capsys, data)
    runs = {r["run_dir"]: r for r in budget["runs"]}
    assert set(runs) == {str((tmp_path / "a").absolute()), str((tmp_path / "b").absolute())}
    ra, rb = runs[str((tmp_path / "a").absolute())], runs[str((tmp_path / "b").absolute())]
    assert ra["status"] == rb["status"] == "finished" and not ra["audit"]
    assert ra["epsilon"] == pytest.approx(a["epsilon"]) and rb["epsilon"] == pytest.approx(b["epsilon"])
    assert ra["events_charged"] == 3 and rb["steps"] == 4 and ra["run_id"] != rb["run_id"]
    assert budget["total_epsilon"] == pytest.approx(a["epsilon"] + b["epsilon"])
    assert budget["total_delta"] == pytest.approx(a["delta"] + b["delta"])
    assert "basic composition" in budget["composition"] and "upper bound" in budget["composition"]


def test_a_resumed_run_appends_an_updated_line_for_the_same_run(capsys, tmp_path, data):
    run = tmp_path / "run"
    _train(capsys, data, run, "train.steps=3")
    code, out, err = _resume(capsys, run, "train.steps=5")
    assert code == 0, err
    lines = [json.loads(x) for x in (data / dataset_budget.BUDGET_FILE).read_text().splitlines()]
    assert len({x["run_id"] for x in lines}) == 1
    assert [x["status"] for x in lines] == ["running", "finished", "running", "finished"]
    budget = _budget(capsys, data)
    assert budget["num_runs"] == 1 and budget["runs"][0]["steps"] == 5
    assert budget["total_epsilon"] == pytest.approx(json.loads(out)["epsilon"])


def test_a_run_that_may_still_be_training_counts_at_its_target(tmp_path, data):
    """A crash leaves the "running" line: the run may have spent up to its target."""
    record = dataset_budget.run_record(run_id="x", run_dir=tmp_path / "r", mode="sparse", target_epsilon=3.0,
                                       delta=1e-6, accountant="rdp", epsilon=0.2, events_charged=1, steps=0,
                                       started=dataset_budget.now(), status="running")
    dataset_budget.append(data, record)
    dataset_budget.append(data, dict(record, run_id="y", mode="nonprivate", status="finished"))
    summary = dataset_budget.summary(data)
    assert [r["epsilon_bound"] for r in summary["runs"]] == [3.0, math.inf]


def test_a_damaged_budget_file_is_reported_by_line(capsys, data):
    (data / dataset_budget.BUDGET_FILE).write_text('{"run_id": "a"}\n{not json\n')
    code = main(["budget", str(data)])
    _, err = capsys.readouterr()
    assert code == 2 and "privacy_budget.jsonl: line 2" in err


def test_an_audit_run_counts_too(capsys, tmp_path, data):
    from test_audit_run import AUDIT

    config = tmp_path / "audit.toml"
    config.write_text(f'[data]\npath = "{data}"\n')
    sets = [x for item in [*AUDIT, "train.steps=3"] for x in ("--set", item)]
    out = tmp_path / "audit"
    assert main(["audit", "--config", str(config), *sets, "--canaries", "40", "--out", str(out)]) == 0
    claimed = json.loads(capsys.readouterr().out)["claimed_epsilon"]
    (run,) = _budget(capsys, data)["runs"]
    assert run["audit"] and run["epsilon"] == pytest.approx(claimed) and run["run_dir"] == str(out.absolute())
