"""A run's lifecycle refuses honestly instead of losing or faking anything: a run directory is
never written by a new run, a data set directory is written once, a checkpoint resumes only on
the data it was trained on, a resume that cannot take a step says so, Ctrl-C and a damaged
checkpoint end with one line naming what to do. Each test failed on the trainer before this."""

import json
import os
import shutil
import signal

import pytest
import torch

from widedp.trainer.cli import main
from widedp.trainer.data import synth_ctr
from widedp.trainer.engine import Engine

from test_ledger_chain import TINY, _resume, _sets, _train


def _cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- runs are never overwritten --------------------------------------------------------------------------

def test_a_new_run_into_a_finished_run_directory_is_refused_and_nothing_is_lost(capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run)
    before = {name: (run / name).read_bytes() for name in ("ledger.json", "summary.json", "checkpoint.pt")}
    code, out, err = _cli(capsys, "train", "--config", str(tmp_path / "run.toml"), "--run-dir", str(run),
                          "--no-progress", *_sets(*TINY, "train.steps=3"))
    assert code == 2 and out == ""
    assert "holds a run" in err and f"--resume {run}" in err and "new directory" in err
    assert {name: (run / name).read_bytes() for name in before} == before


def test_a_failed_run_leaves_no_empty_run_directory(capsys, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[data]\npath = "{tmp_path / "no-data"}"\n')
    code, _, err = _cli(capsys, "train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress",
                        *_sets("cluster.backend=local"))
    assert code == 2 and "no dataset.json" in err
    assert not (tmp_path / "run").exists()


def test_convert_into_a_non_empty_directory_is_refused(capsys, tmp_path):
    tsv = tmp_path / "day.tsv"
    tsv.write_text("\n".join(["1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["a1"] * 26)] * 4) + "\n")
    out_dir = tmp_path / "data"
    code, _, err = _cli(capsys, "convert", "criteo", str(tsv), str(out_dir), "--hash-size", "16")
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out_dir.iterdir() if p.is_file()}
    code, out, err = _cli(capsys, "convert", "criteo", str(tsv), str(out_dir), "--hash-size", "32")
    assert code == 2 and out == "" and f"{out_dir}: not empty" in err
    assert {p.name: p.read_bytes() for p in out_dir.iterdir() if p.is_file()} == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, _, err = _cli(capsys, "convert", "criteo", str(tsv), str(other))
    assert code == 2 and "not empty" in err and sorted(os.listdir(other)) == ["notes.txt"]


def test_a_checkpoint_resumes_only_on_the_data_it_was_trained_on(capsys, tmp_path):
    data = tmp_path / "data"
    synth_ctr(data, num_examples=3000, table_sizes=500, seed=3)
    run = tmp_path / "run"
    _train(capsys, data, run, "train.steps=3")
    shutil.rmtree(data)
    synth_ctr(data, num_examples=3000, table_sizes=500, seed=4)  # other data at the same path
    code, out, err = _resume(capsys, run, "train.steps=6")
    assert code == 2 and out == ""
    assert "checkpoint.pt was trained on other data" in err and str(data) in err and "dataset_json_sha256" in err


# ---- a resume that cannot take a step -------------------------------------------------------------------

def test_a_resume_whose_budget_is_spent_exits_non_zero_naming_the_target(capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    budget = ["privacy.noise_multiplier=0.7", "privacy.selection_epsilon=0.02", "privacy.target_epsilon=3.0"]
    summary = _train(capsys, ctr_dir, run, "train.steps=500", *budget)
    assert summary["stopped_by_budget"] and summary["steps"] < 500
    code, out, err = _resume(capsys, run, "train.steps=500")
    assert code == 2 and out == ""
    assert f"cannot take step {summary['steps'] + 1}" in err and "privacy.target_epsilon = 3.0" in err
    assert "nothing was trained" in err and "budget of this run is spent" in err


def test_a_new_run_whose_first_step_exceeds_the_target_is_refused_before_anything_is_written(capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    (tmp_path / "run.toml").write_text(f'[data]\npath = "{ctr_dir}"\n')
    code, out, err = _cli(capsys, "train", "--config", str(tmp_path / "run.toml"), "--run-dir", str(run),
                          "--no-progress", *_sets(*TINY, "privacy.target_epsilon=0.5"))
    assert code == 2 and "one step at this noise already costs more" in err and "cannot take step 1" in err and "privacy.target_epsilon = 0.5" in err
    assert not run.exists()


# ---- Ctrl-C --------------------------------------------------------------------------------------------

def test_ctrl_c_finishes_the_step_saves_and_says_how_to_resume(capsys, tmp_path, ctr_dir, monkeypatch):
    run = tmp_path / "run"
    (tmp_path / "run.toml").write_text(f'[data]\npath = "{ctr_dir}"\n')
    real_step = Engine.step

    def step_then_ctrl_c(self):
        stats = real_step(self)
        if self.step_count == 2:
            os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C during step 2
        return stats

    monkeypatch.setattr(Engine, "step", step_then_ctrl_c)
    code, out, err = _cli(capsys, "train", "--config", str(tmp_path / "run.toml"), "--run-dir", str(run),
                          "--no-progress", *_sets(*TINY))
    assert code == 130 and out == ""
    assert err.strip().splitlines()[-1] == f"widedp: interrupted at step 2; resume with `widedp train --resume {run}`"
    assert "Traceback" not in err
    assert torch.load(run / "checkpoint.pt", weights_only=False)["engine"]["step"] == 2
    monkeypatch.setattr(Engine, "step", real_step)
    code, out, err = _resume(capsys, run)
    assert code == 0, err
    assert json.loads(out)["steps"] == 6


def test_an_interrupt_in_the_middle_of_a_step_saves_nothing_and_points_to_the_last_checkpoint(
        capsys, tmp_path, ctr_dir, monkeypatch):
    run = tmp_path / "run"
    (tmp_path / "run.toml").write_text(f'[data]\npath = "{ctr_dir}"\n')
    real_step = Engine.step

    def interrupted_in_step_5(self):
        if self.step_count == 4:
            raise KeyboardInterrupt  # a second Ctrl-C: delivered at once
        return real_step(self)

    monkeypatch.setattr(Engine, "step", interrupted_in_step_5)
    code, out, err = _cli(capsys, "train", "--config", str(tmp_path / "run.toml"), "--run-dir", str(run),
                          "--no-progress", *_sets(*TINY))
    assert code == 130 and "Traceback" not in err
    assert "interrupted at step 4" in err and f"widedp train --resume {run}" in err and "checkpoint at step 3" in err
    assert torch.load(run / "checkpoint.pt", weights_only=False)["engine"]["step"] == 3  # train.checkpoint_every = 3


# ---- damaged checkpoints -------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "not a torch file"])
def test_a_damaged_checkpoint_is_named_not_a_traceback(capsys, tmp_path, ctr_dir, damage):
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run, "train.steps=3")
    path = run / "checkpoint.pt"
    path.write_bytes(path.read_bytes()[:1000] if damage == "truncated" else b"hello, not a checkpoint\n")
    for argv in (["train", "--resume", str(run), "--no-progress"], ["evaluate", "--run-dir", str(run)]):
        code, out, err = _cli(capsys, *argv)
        assert code == 2 and out == "" and "Traceback" not in err
        assert f"{path}: not a readable widedp checkpoint" in err and len(err.strip().splitlines()) == 1


def test_a_checkpoint_that_does_not_match_the_config_says_so(capsys, tmp_path, ctr_dir):
    """A model of another shape is the run's fixed structure (trainer/config/semantics.py): the
    refusal names the key and both values before anything is loaded."""
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run, "train.steps=3")
    code, out, err = _resume(capsys, run, "train.steps=6", "model.embedding_dim=8")
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{run / 'checkpoint.pt'}: --resume would change" in err
    assert "model.embedding_dim was 4 when the run started, now 8" in err
