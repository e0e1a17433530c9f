"""What a run's ε means is fixed when the run first starts (docs/DESIGN.md §1, issue 47): every
config key is classified (trainer/config/semantics.py), a resume that changes what the ε means is
refused naming the key and both values, settings whose weaker meaning outlives their session
(debug outputs) are reported for the whole run, every output reports ε at the ledger's δ, and a
resume never charges fewer events than were released (the journal, trainer/run/journal.py).

Each case here was accepted before (exit 0) with an ε that described a guarantee that never held."""

from __future__ import annotations

import fcntl
import json
import os

import pytest
import torch

from widedp.accounting import PrivacyLedger
from widedp.trainer.run import budget as dataset_budget
from widedp.trainer.config import semantics as run_semantics
from widedp.trainer.cli import main
from widedp.trainer.config import Config
from widedp.trainer.run.journal import JOURNAL_FILE, ReleaseJournal
from widedp.trainer.run.outputs import CAVEAT_DEBUG

from run_crash import train_and_die
from test_ledger_chain import _argv, _resume, _train

pytestmark = pytest.mark.xdist_group("run_semantics")


def _snapshot(run_dir):
    return {name: (run_dir / name).read_bytes() for name in ("checkpoint.pt", "ledger.json", JOURNAL_FILE)
            if (run_dir / name).exists()}


# ---- the classification ----------------------------------------------------------------------------

def test_every_config_key_is_classified_and_no_class_names_a_key_that_is_gone():
    keys = set(run_semantics.config_keys(Config().to_dict()))
    classified = set(run_semantics.KEY_CLASSES)
    assert keys - classified == set(), "a new config key must be classified in trainer/config/semantics.py"
    assert classified - keys == set(), "a classified key no longer exists"
    assert set(run_semantics.KEY_CLASSES.values()) <= set(run_semantics.CLASSES)
    fixed = {k for k, c in run_semantics.KEY_CLASSES.items() if c == run_semantics.FIXED}
    assert fixed == set(run_semantics.FIXED_REASONS) and all(run_semantics.FIXED_REASONS.values())
    # what the issue names as changing what ε means
    assert {"privacy.unit", "privacy.user_sampling", "privacy.max_examples_per_user", "privacy.reproducible",
            "privacy.noise_seed", "privacy.delta", "privacy.accountant", "privacy.secure_mode",
            "data.path"} <= fixed
    assert run_semantics.KEY_CLASSES["train.debug_metrics"] == run_semantics.STICKY


def test_the_semantics_record_compares_resolved_values_and_the_data_by_identity():
    from widedp.trainer.config import load_config

    a = run_semantics.semantics(load_config(None, ["data.path=/a"]), 1e-5, {"sha": "x"}, None)
    moved = run_semantics.semantics(load_config(None, ["data.path=/b"]), 1e-5, {"sha": "x"}, None)
    assert run_semantics.changed_semantics(a, moved) == []  # a data set may move
    other = run_semantics.semantics(load_config(None, ["data.path=/a", "privacy.delta=1e-5"]), 1e-5, {"sha": "y"}, None)
    assert [k for k, _, _ in run_semantics.changed_semantics(a, other)] == ["data.identity"]
    unit = run_semantics.semantics(load_config(None, ["data.path=/a", "privacy.unit=user"]), 2e-5, {"sha": "x"}, "k1")
    assert [(k, was, now) for k, was, now in run_semantics.changed_semantics(a, unit)] == [
        ("privacy.unit", "example", "user"), ("privacy.user_sampling", None, "users"),
        ("privacy.max_examples_per_user", None, 16), ("privacy.delta", 1e-5, 2e-5), ("ledger.key_id", None, "k1")]
    assert "privacy.noise_seed" not in run_semantics.public_semantics(a)


# ---- refused at resume -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def finished(tmp_path_factory, ctr_dir):
    """A finished 6-step secret run at example level."""
    run_dir = tmp_path_factory.mktemp("semantics") / "run"
    code = main(_argv(ctr_dir, run_dir))
    assert code == 0
    return run_dir


@pytest.mark.parametrize("change, key, was, now", [
    ("privacy.reproducible=true", "privacy.reproducible", "False", "True"),
    ("privacy.secure_mode=true", "privacy.secure_mode", "False", "True"),
    ("privacy.delta=1e-12", "privacy.delta", None, "1e-12"),
    ("privacy.accountant=pld", "privacy.accountant", "'auto'", "'pld'"),
    ("train.mode=dpsgd", "train.mode", "'sparse'", "'dpsgd'"),
    ("data.test_fraction=0.2", "data.test_fraction", "0.1", "0.2"),
    ("data.seed=7", "data.seed", "0", "7"),
])
def test_a_resume_that_changes_what_the_epsilon_means_is_refused_naming_both_values(
        capsys, finished, change, key, was, now):
    before = _snapshot(finished)
    code, out, err = _resume(capsys, finished, "train.steps=8", change)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"{key} was " in err and "when the run started, now" in err, err
    if was is not None:
        assert f"{key} was {was} when the run started, now {now}" in err, err
    assert "fixed when it first starts" in err
    assert _snapshot(finished) == before  # nothing trained, charged or journaled


def test_a_delta_changed_at_resume_is_refused_and_every_output_reports_the_ledgers_delta(capsys, finished):
    """The issue's case: δ 1e-12 at resume printed the ε computed at the ledger's δ under δ 1e-12."""
    ledger = PrivacyLedger.load(finished / "ledger.json")
    code, _, err = _resume(capsys, finished, "train.steps=8", "privacy.delta=1e-12")
    assert code == 2 and f"privacy.delta was {ledger.delta!r}" in err and "now 1e-12" in err
    summary = json.loads((finished / "summary.json").read_text())
    assert summary["delta"] == ledger.delta and summary["epsilon"] == pytest.approx(ledger.epsilon())


def test_a_reproducible_run_cannot_be_resumed_as_a_secret_one(capsys, tmp_path, ctr_dir):
    """The issue's case: the summary then said "secret: fresh OS entropy" for a run whose first
    steps' noise came from the seed in config.json. Refused; the message no longer suggests it."""
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run, "privacy.reproducible=true", "train.steps=3")
    code, _, err = _resume(capsys, run, "train.steps=5", "privacy.reproducible=false")
    assert code == 2 and "privacy.reproducible was True when the run started, now False" in err
    code, _, err = _resume(capsys, run, "train.steps=5", "train.lr=0.5")  # a reproducible replay on other values
    assert code == 2 and "train.lr" in err and "unset privacy.reproducible" not in err


def test_a_reproducible_resume_may_not_change_the_steps_an_auto_sigma_was_calibrated_for(capsys, tmp_path, ctr_dir):
    """σ = "auto" is calibrated for train.steps: the replayed step would draw the same stream
    positions at another σ on other values. With an explicit σ (TINY's) steps may change."""
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run, "privacy.reproducible=true", "train.steps=3", "privacy.noise_multiplier=auto",
           "privacy.selection_epsilon=auto", "privacy.target_epsilon=5")
    code, _, err = _resume(capsys, run, "train.steps=5")
    assert code == 2 and "train.steps 3 -> 5" in err and "noise_multiplier" in err, err
    explicit = tmp_path / "explicit"
    _train(capsys, ctr_dir, explicit, "privacy.reproducible=true", "train.steps=3")
    code, _, err = _resume(capsys, explicit, "train.steps=5")
    assert code == 0, err
    code, _, err = _resume(capsys, explicit, "train.steps=6", "train.lr_schedule=cosine")
    assert code == 2 and "train.lr_schedule" in err


def test_a_resume_that_changes_the_unit_of_privacy_is_refused(capsys, tmp_path, user_logs_dir):
    """The issue's case: 6 steps at example level, resumed at user level, exported as "(ε, δ)-DP,
    unit of privacy: one user" — while the first steps protected a user only as a group."""
    run = tmp_path / "run"
    small = ["privacy.accountant=rdp", "privacy.max_examples_per_user=4", "train.recalibrate=false"]
    _train(capsys, user_logs_dir, run, *small)
    code, out, err = _resume(capsys, run, "train.steps=8", "privacy.unit=user")
    assert code == 2 and out == ""
    assert "privacy.unit was 'example' when the run started, now 'user'" in err
    assert "whom the ε protects" in err
    user = tmp_path / "user"
    _train(capsys, user_logs_dir, user, *small, "privacy.unit=user")
    for change, key in (("privacy.max_examples_per_user=3", "privacy.max_examples_per_user was 4"),
                        ("privacy.user_sampling=examples", "privacy.user_sampling was 'users'")):
        code, _, err = _resume(capsys, user, "train.steps=8", change,
                               *(["privacy.accountant=pld"] if "examples" in change else []))
        assert code == 2 and key in err, err


# ---- sticky: once on, for the whole run ------------------------------------------------------------

def test_debug_metrics_once_on_voids_the_report_for_the_whole_run(capsys, tmp_path):
    """The issue's case: debug on, then off at resume: the export said debug_metrics: false while
    metrics.jsonl still held raw losses. Now every output is the run's: void, with the reason."""
    from widedp.trainer.data import synth_ctr

    data = tmp_path / "data"
    synth_ctr(data, num_examples=3000, table_sizes=500, seed=3)
    run = tmp_path / "run"
    _train(capsys, data, run, "train.debug_metrics=true", "train.steps=3")
    code, out, err = _resume(capsys, run, "train.steps=5", "train.debug_metrics=false")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["debug_metrics"] is True and CAVEAT_DEBUG in summary["privacy_caveats"]
    assert "train_loss_mean" not in summary  # this session wrote no raw statistics
    assert any("loss" in json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    capsys.readouterr()
    report = json.loads((tmp_path / "out" / "privacy_report.json").read_text())
    assert report["debug_metrics"] is True and any("debug_metrics" in c for c in report["not_covered"])
    budget = dataset_budget.summary(data)
    assert budget["total_epsilon"] == float("inf") and budget["num_runs"] == 1
    assert any("debug_metrics" in r for v in budget["voided_by"] for r in v["reasons"])


def test_debug_metrics_turned_on_at_resume_is_reported_for_the_whole_run(capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run, "train.steps=3")
    code, out, err = _resume(capsys, run, "train.steps=4", "train.debug_metrics=true")
    assert code == 0, err
    code, out, err = _resume(capsys, run, "train.steps=5", "train.debug_metrics=false")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["debug_metrics"] is True and CAVEAT_DEBUG in summary["privacy_caveats"]


# ---- a resume never charges fewer events than were released ------------------------------------------

def test_a_ledger_rolled_back_to_exactly_the_checkpoints_length_is_refused(capsys, tmp_path, ctr_dir, monkeypatch):
    """The issue's case: kill -9 at step 6 with the checkpoint at step 4, the checkpoint-time
    ledger restored: accepted, and steps 5-6 were charged once although released twice. The
    journal records both charges: refused by resume, export and verify."""
    run = tmp_path / "run"
    argv = _argv(ctr_dir, run, "train.checkpoint_every=4", "train.steps=8")
    train_and_die(monkeypatch, main, argv, step=6)
    capsys.readouterr()
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    assert state["engine"]["step"] == 4
    at_checkpoint = PrivacyLedger(state["engine"]["ledger"]["accountant"], state["engine"]["ledger"]["delta"])
    at_checkpoint.load_state_dict(state["engine"]["ledger"])
    assert at_checkpoint.chain() == state["ledger_chain"]
    at_checkpoint.save(run / "ledger.json")  # the checkpoint-time copy, restored
    code, out, err = _resume(capsys, run, "train.steps=8")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "holds 4 charged events" in err and "journal.jsonl records 6 charged" in err and "rolled back" in err
    code = main(["verify", str(run)])
    assert code == 2 and "rolled back" in capsys.readouterr().err


def test_an_honest_crash_resumes_and_charges_the_replayed_steps_again(capsys, tmp_path, ctr_dir, monkeypatch):
    run = tmp_path / "run"
    train_and_die(monkeypatch, main, _argv(ctr_dir, run, "train.checkpoint_every=4", "train.steps=8"), step=6)
    capsys.readouterr()
    code, out, err = _resume(capsys, run, "train.steps=8")
    assert code == 0, err
    assert json.loads(out)["events_charged"] == 6 + 4  # 1-6 released, 5-8 after the checkpoint at 4
    journal = ReleaseJournal.open(run / JOURNAL_FILE)
    assert [r["kind"] for r in journal.records].count("session") == 2 and journal.charges == 10
    assert json.loads(out)["lineage"] == journal.segments


def test_a_deleted_or_edited_journal_is_refused(capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run, "train.steps=3")
    text = (run / JOURNAL_FILE).read_bytes()
    (run / JOURNAL_FILE).unlink()
    code, _, err = _resume(capsys, run, "train.steps=5")
    assert code == 2 and "journal.jsonl: missing" in err
    lines = text.split(b"\n")
    (run / JOURNAL_FILE).write_bytes(b"\n".join([lines[0], *lines[2:]]))  # a charge removed
    code, _, err = _resume(capsys, run, "train.steps=5")
    assert code == 2 and "hash chain" in err


def test_one_session_at_a_time_holds_a_run_directory(capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run, "train.steps=3")
    fd = os.open(run / JOURNAL_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another session holds it
        before = _snapshot(run)
        code, _, err = _resume(capsys, run, "train.steps=5")
        assert code == 2 and "another process is training this run" in err
        assert _snapshot(run) == before
    finally:
        os.close(fd)


# ---- honest refusals ----------------------------------------------------------------------------------

def test_export_of_a_truncated_checkpoint_names_the_file(capsys, tmp_path, finished):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished, run)
    path = run / "checkpoint.pt"
    path.write_bytes(path.read_bytes()[:2000])
    code = main(["export", str(run), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and f"{path}: not a readable widedp checkpoint" in err
    assert not (tmp_path / "out").exists()


def test_the_smallest_reachable_epsilon_named_is_one_the_next_run_accepts():
    """The issue's case: target 1e-7 named 9.73e-07, and setting that was refused naming 1.015e-06
    (the recalibration's auto σ is sized as a share of the target). The value named is planned."""
    from widedp.trainer.config import load_config
    from widedp.trainer.config.planning import plan_privacy

    base = ["data.path=/nonexistent", "train.mode=dpsgd", "train.steps=300", "train.batch_size=27",
            "privacy.delta=1e-5", "privacy.accountant=rdp"]
    with pytest.raises(ValueError, match="is unreachable") as info:
        plan_privacy(load_config(None, [*base, "privacy.target_epsilon=1e-7"]), 2700, vocabulary=26 * 500)
    suggested = str(info.value).split("to at least ")[1].split(",")[0]
    smallest = str(info.value).split("the smallest ε this run can reach is ")[1].split(" ")[0]
    assert float(smallest) == pytest.approx(float(suggested), rel=1e-3)  # the smallest named plans too
    plan, planned = plan_privacy(load_config(None, [*base, f"privacy.target_epsilon={suggested}"]), 2700,
                                 vocabulary=26 * 500)
    assert planned.recalibration is not None  # the target-dependent one-time event is in the plan
    assert plan is not None and planned.noise_multiplier > 0


def test_a_run_directory_restored_whole_to_an_earlier_state_is_a_fork_the_budget_counts(
        capsys, tmp_path, monkeypatch):
    """ledger.json, journal.jsonl and checkpoint.pt copied during a session and restored after it
    ended are consistent with each other: the restored run is a fork from that state, its own
    ledger states its model's ε exactly, and the data set's budget (outside the run directory)
    counts the session it forked from as a model of its own — nothing released is forgotten."""
    import shutil

    from run_crash import copy_at_step
    from widedp.trainer.data import synth_ctr

    data = tmp_path / "data"
    synth_ctr(data, num_examples=3000, table_sizes=500, seed=3)
    run, snapshot = tmp_path / "run", tmp_path / "snapshot"
    with monkeypatch.context() as m:
        copy_at_step(m, run, snapshot, step=4)
        finished = _train(capsys, data, run, "train.checkpoint_every=2")
    shutil.rmtree(run)
    shutil.copytree(snapshot, run)
    code, out, err = _resume(capsys, run, "train.steps=6")
    assert code == 0, err
    fork = json.loads(out)
    assert fork["events_charged"] == 4 + 2  # its own ledger: steps 1-4, then 5-6 of the fork
    budget = dataset_budget.summary(data)
    assert budget["num_runs"] == 2  # the finished 6-step model and the fork
    assert budget["total_epsilon"] == pytest.approx(finished["epsilon"] + fork["epsilon"])


def test_user_level_outputs_state_the_number_of_users_not_of_examples(capsys, tmp_path, user_logs_dir):
    """The issue's case: summary.json and the export published the exact training-example count,
    which changes by m_u when a user is removed."""
    import re

    from widedp.trainer.data.format.dataset import open_dataset

    train_split, _ = open_dataset(user_logs_dir)
    examples = len(train_split)
    run = tmp_path / "run"
    summary = _train(capsys, user_logs_dir, run, "privacy.unit=user", "privacy.max_examples_per_user=4",
                     "privacy.accountant=rdp", "train.recalibrate=false")
    assert set(summary["user_level"]) == {"users", "max_examples_per_user", "user_sampling", "group_size"}
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    capsys.readouterr()
    for text in [(run / "summary.json").read_text(), *(p.read_text() for p in (tmp_path / "out").glob("*.md")),
                 (tmp_path / "out" / "privacy_report.json").read_text()]:
        assert not re.search(rf"\b{examples}\b", text)
