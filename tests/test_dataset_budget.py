"""A data set's privacy budget across runs (trainer/run/budget.py): every run on it appends
its spending to DATASET/privacy_budget.jsonl, which only grows, and `widedp budget DATASET`
shows every run and the basic-composition total — two models at ε each are not "ε" together."""

import json
import math

import pytest

from widedp.trainer.run import budget as dataset_budget
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
    dataset_budget.append(data, dict(record, run_id="y", lineage=["y"], mode="nonprivate", status="finished"))
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


# ---- models, not directory names (issue 47) -----------------------------------------------------------

def _models(capsys, data):
    budget = _budget(capsys, data)
    return budget, [r["lineage"] for r in budget["runs"]]


def test_a_run_directory_copied_and_resumed_in_two_places_is_two_models(capsys, tmp_path, data):
    """The issue's case: both copies shared one run_id and `budget` counted one run at the later ε,
    where the two models compose to more."""
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    _train(capsys, data, a, "train.steps=3")
    shutil.copytree(a, b)
    code, out_a, err = _resume(capsys, a, "train.steps=5")
    assert code == 0, err
    code, out_b, err = _resume(capsys, b, "train.steps=5")
    assert code == 0, err
    budget, lineages = _models(capsys, data)
    assert budget["num_runs"] == 2 and lineages[0][0] == lineages[1][0] and lineages[0] != lineages[1]
    eps_a, eps_b = json.loads(out_a)["epsilon"], json.loads(out_b)["epsilon"]
    assert budget["total_epsilon"] == pytest.approx(eps_a + eps_b)
    assert len({r["run_id"] for r in budget["runs"]}) == 1  # one start, two models


def test_a_run_copied_while_it_went_on_is_two_models(capsys, tmp_path, data, monkeypatch):
    """A copy taken while the original trained forks from the original's state at that moment
    (4 of 6 steps); the original's later steps make a model the copy's ledger does not hold:
    both count."""
    from run_crash import copy_at_step

    a, b = tmp_path / "a", tmp_path / "b"
    with monkeypatch.context() as m:
        copy_at_step(m, a, b, step=4)
        original = _train(capsys, data, a, "train.steps=6", "train.checkpoint_every=2")
    code, out, err = _resume(capsys, b, "train.steps=5")
    assert code == 0, err
    budget, lineages = _models(capsys, data)
    assert budget["num_runs"] == 2 and sorted(map(len, lineages)) == [1, 2]
    assert budget["total_epsilon"] == pytest.approx(original["epsilon"] + json.loads(out)["epsilon"])


def _line(run_dir, lineage, status, events, base, **kw):
    return dataset_budget.run_record(run_id=lineage[0], run_dir=run_dir, mode="sparse", target_epsilon=3.0, delta=1e-6,
                                     accountant="rdp", epsilon=0.1 * events, events_charged=events, steps=events,
                                     started="t", status=status, lineage=lineage, base_events=base, **kw)


def test_a_crashed_session_resumed_in_its_own_journal_is_the_same_model(tmp_path):
    """A "running" line is superseded only by a session that continued it in the same journal
    file on the same machine (whose lock the crashed session held while it trained); a copy —
    another directory, or the same path on another machine or volume — is a model of its own,
    counted at its target."""
    x, y = str(tmp_path / "x"), str(tmp_path / "y")
    here, copy = {"machine": "m1", "dev": 1, "ino": 7}, {"machine": "m2", "dev": 1, "ino": 7}
    crashed = [_line(x, ["s0"], "running", 0, 0, dir_identity=here)]
    same = dataset_budget.models(crashed + [_line(x, ["s0", "s1"], "running", 4, 4, dir_identity=here),
                                            _line(x, ["s0", "s1"], "finished", 9, 4, dir_identity=here)])
    assert [r["lineage"] for r in same] == [["s0", "s1"]]
    elsewhere = dataset_budget.models(crashed + [_line(y, ["s0", "s1"], "finished", 9, 4, dir_identity=here)])
    assert [r["lineage"] for r in elsewhere] == [["s0"], ["s0", "s1"]]
    same_path_other_volume = dataset_budget.models(crashed + [_line(x, ["s0", "s1"], "running", 100, 100,
                                                                    dir_identity=copy)])
    assert len(same_path_other_volume) == 2
    finished = [_line(x, ["s0"], "finished", 6, 0)]
    continued = dataset_budget.models(finished + [_line(y, ["s0", "s1"], "finished", 9, 6)])
    assert [r["lineage"] for r in continued] == [["s0", "s1"]]  # started where s0 ended
    forked_early = dataset_budget.models(finished + [_line(y, ["s0", "s1"], "finished", 9, 3)])
    assert len(forked_early) == 2  # s0 released 3 events the fork's ledger does not hold


def test_debug_reproducible_and_broken_audit_runs_void_the_total(capsys, tmp_path, data):
    """The issue's case: `audit --broken noise-off` and a debug run were counted at finite ε."""
    from test_audit_run import AUDIT

    _train(capsys, data, tmp_path / "plain", "train.steps=3")
    assert _budget(capsys, data)["total_epsilon"] < math.inf
    config = tmp_path / "audit.toml"
    config.write_text(f'[data]\npath = "{data}"\n')
    sets = [x for item in [*AUDIT, "train.steps=3"] for x in ("--set", item)]
    assert main(["audit", "--config", str(config), *sets, "--canaries", "40", "--broken", "noise-off",
                 "--out", str(tmp_path / "audit")]) == 0
    capsys.readouterr()
    _train(capsys, data, tmp_path / "seeded", "train.steps=3", "privacy.reproducible=true")
    assert _budget(capsys, data)["total_epsilon"] is None  # strict JSON: infinite is null, with voided_by
    budget = dataset_budget.summary(data)
    assert budget["total_epsilon"] == math.inf and budget["num_runs"] == 3
    reasons = [r for v in budget["voided_by"] for r in v["reasons"]]
    assert any("--broken noise-off" in r for r in reasons) and any("privacy.reproducible" in r for r in reasons)
    assert [r["epsilon_bound"] == math.inf for r in budget["runs"]] == [False, True, True]


# ---- the budget file only grows, and its loss is detected -------------------------------------------------

def test_a_deleted_budget_file_is_detected_by_the_next_train_and_by_budget(capsys, tmp_path, data):
    """The issue's case: the next train re-created it and the total dropped from 8.3 to 2.8."""
    _train(capsys, data, tmp_path / "a", "train.steps=3")
    (data / dataset_budget.BUDGET_FILE).unlink()
    code = main(["budget", str(data)])
    err = capsys.readouterr().err
    assert code == 2 and "privacy_budget.jsonl: missing" in err and "restore it" in err
    config = tmp_path / "b.toml"
    config.write_text(f'[data]\npath = "{data}"\n')
    from test_ledger_chain import TINY

    code = main(["train", "--config", str(config), "--run-dir", str(tmp_path / "b"), "--no-progress",
                 *[x for item in TINY for x in ("--set", item)]])
    err = capsys.readouterr().err
    assert code == 2 and "privacy_budget.jsonl: missing" in err
    assert not (tmp_path / "b").exists() and not (data / dataset_budget.BUDGET_FILE).exists()
    # the run whose checkpoint recorded the budget's head refuses too, even with the head gone
    (data / dataset_budget.HEAD_FILE).unlink()
    code, _, err = _resume(capsys, tmp_path / "a", "train.steps=5")
    assert code == 2 and "does not hold this run's earlier spending" in err


@pytest.mark.parametrize("damage", ["truncated", "edited", "head deleted"])
def test_a_truncated_or_edited_budget_file_is_refused(capsys, tmp_path, data, damage):
    _train(capsys, data, tmp_path / "a", "train.steps=3")
    path = data / dataset_budget.BUDGET_FILE
    lines = path.read_text().splitlines(keepends=True)
    if damage == "truncated":
        path.write_text("".join(lines[:1]))
    elif damage == "edited":
        record = json.loads(lines[-1])
        record["epsilon"] = 0.001
        path.write_text("".join(lines[:-1]) + json.dumps(record, sort_keys=True) + "\n")
    else:
        (data / dataset_budget.HEAD_FILE).unlink()
    code = main(["budget", str(data)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert {"truncated": "fewer than the 2", "edited": "do not hash", "head deleted": "head was deleted"}[damage] in err


def test_a_copy_of_the_data_set_does_not_take_a_resume(capsys, tmp_path, data):
    """The issue's case: the spending of a resume landed only in the copy's budget."""
    import shutil

    run = tmp_path / "run"
    early = tmp_path / "early_copy"
    shutil.copytree(data, early)  # before the run's lines
    _train(capsys, data, run, "train.steps=3")
    late = tmp_path / "late_copy"
    shutil.copytree(data, late)  # with them
    for copy, message in ((early, "does not hold this run's earlier spending"), (late, f"is a copy of {data}")):
        code, _, err = _resume(capsys, run, "train.steps=5", f"data.path={copy}")
        assert code == 2 and message in err, err
    moved = tmp_path / "moved"
    data.rename(moved)  # a data set that moved (nothing left at the old path) resumes where it is now
    code, _, err = _resume(capsys, run, "train.steps=5", f"data.path={moved}")
    assert code == 0, err
    assert len(dataset_budget.read(moved)) == 4


def _append_many(args):
    data, who, count = args
    for i in range(count):
        dataset_budget.append(data, _line("/r", [f"{who}{i}"], "finished", 1, 0))


def test_concurrent_appends_keep_one_chain(tmp_path, data):
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_append_many, [(str(data), "a", 15), (str(data), "b", 15)])
    records = dataset_budget.read(data)  # verified: one chain, the head at its end
    assert len(records) == 30 and dataset_budget.head(data)["lines"] == 30


def test_a_torn_last_budget_line_is_not_a_record_and_the_next_append_drops_it(capsys, tmp_path, data):
    """A machine crash during the write of a line (its head not yet replaced) must not block every
    later run on the data set."""
    _train(capsys, data, tmp_path / "a", "train.steps=3")
    path = data / dataset_budget.BUDGET_FILE
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"run_id": "CUT-OFF-LINE", "lin')
    assert _budget(capsys, data)["lines"] == 2
    _train(capsys, data, tmp_path / "b", "train.steps=3")
    assert path.read_bytes().startswith(whole) and b"CUT-OFF-LINE" not in path.read_bytes()
    assert _budget(capsys, data)["num_runs"] == 2


def test_a_crash_between_the_first_line_and_its_head_leaves_a_budget_that_reads(tmp_path, data, monkeypatch):
    """The head is written before the first chained line, so a crash after the line (before the
    head is advanced) leaves the head one line behind — accepted — never chained lines without a
    head, which are refused as a deleted head."""
    import widedp.accounting.atomic as atomic

    real, calls = atomic.atomic_write_bytes, []

    def crash_after_the_line(path, payload):
        calls.append(path)
        if len(calls) == 2:  # the head after the line: the machine goes down
            raise OSError("power lost")
        return real(path, payload)

    monkeypatch.setattr(atomic, "atomic_write_bytes", crash_after_the_line)
    record = dataset_budget.run_record(run_id="x", run_dir=tmp_path / "r", mode="sparse", target_epsilon=3.0,
                                       delta=1e-6, accountant="prv", epsilon=0.0, events_charged=0, steps=0,
                                       started=dataset_budget.now(), status="running")
    with pytest.raises(dataset_budget.BudgetError, match="power lost"):
        dataset_budget.append(data, record)
    monkeypatch.setattr(atomic, "atomic_write_bytes", real)
    assert [r["run_id"] for r in dataset_budget.read(data)] == ["x"]  # the line counts; the head is behind it
    assert dataset_budget.append(data, dict(record, run_id="y", lineage=["y"]))["lines"] == 2
