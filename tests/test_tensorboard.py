"""train.tensorboard (issue 28): RUN_DIR/tensorboard/ holds exactly what metrics.jsonl holds —
the same (tag, step, value)s, read back with TensorBoard's own EventAccumulator — under the
same privacy rules (raw training statistics only with train.debug_metrics), with no per-step
wall-clock times; a resume adds an event file and continues the steps; the package is imported
only when asked for, and its absence is one line at start naming the extra to install."""

import json
import math
import subprocess
import sys
import textwrap
import warnings

import pytest

from widedp.trainer.cli import main
from widedp.trainer.config import load_config
from widedp.trainer.run.outputs import CAVEAT_DEBUG_TENSORBOARD, DEBUG_STEP_KEYS, TENSORBOARD_MISSING, RunRecorder

from test_run_privacy import _train

TB = "train.tensorboard=true"


def _jsonl_scalars(path):
    """metrics.jsonl as sorted (tag, step, value): each key but "step" is a tag, a table's keys
    are "outer/inner"."""
    out = []
    for line in map(json.loads, path.read_text().splitlines()):
        for key, value in line.items():
            if key == "step":
                continue
            pairs = [(f"{key}/{k}", v) for k, v in value.items()] if isinstance(value, dict) else [(key, value)]
            out += [(tag, line["step"], v) for tag, v in pairs if v is not None]
    return sorted(out)


def _events(path):
    """Every scalar event in `path` (a directory of event files or one file) as sorted
    (tag, step, value), and the set of the events' wall times."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, TENSORS, EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(path), size_guidance={SCALARS: 0, TENSORS: 0}, purge_orphaned_data=False)
    acc.Reload()
    tags = acc.Tags()
    events = [(t, e) for t in tags["tensors"] for e in acc.Tensors(t)]
    out = [(t, e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for t, e in events]
    old_style = [(t, e) for t in tags["scalars"] for e in acc.Scalars(t)]
    out += [(t, e.step, e.value) for t, e in old_style]
    return sorted(out), {e.wall_time for _, e in events + old_style}


def _epsilon_without_last_event(run_dir):
    """ε of run_dir's ledger.json without its last event (at the ledger's δ, by its accountant)."""
    from widedp.accounting.ledger import PrivacyLedger

    saved = PrivacyLedger.load(run_dir / "ledger.json")
    history = saved.history
    last, count = history[-1]
    history = history[:-1] + ([(last, count - 1)] if count > 1 else [])
    return float(saved.accountant.epsilon(history, saved.delta))


def _tags(scalars):
    return {tag for tag, _, _ in scalars}


def test_event_files_hold_exactly_the_records_of_metrics_jsonl(capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary, _ = _train(capsys, ctr_dir, run, TB, "train.eval_every=3")
    records = _jsonl_scalars(run / "metrics.jsonl")
    events, wall_times = _events(run / "tensorboard")
    assert events == records  # same tags, steps and values, each once: nothing more, nothing less
    assert {"epsilon", "rows_selected", "test_metrics/auc"} <= _tags(records)
    assert not set(DEBUG_STEP_KEYS) & _tags(events)  # no raw training statistic without debug_metrics
    # the last step's record carries ε after step 6; train.recalibrate's release is charged after it,
    # so the summary's ε is the ledger's whole history and the record's is that history less its last event
    assert summary["recalibration"]["applied"]
    assert max((step, v) for tag, step, v in events if tag == "epsilon") == (6, pytest.approx(_epsilon_without_last_event(run)))
    assert summary["epsilon"] > _epsilon_without_last_event(run)
    assert len(wall_times) == 1  # no per-step timings (metrics.jsonl has none)
    assert CAVEAT_DEBUG_TENSORBOARD not in summary["privacy_caveats"]
    from_tensorboard = [w for w in caught if "tensorboard" in w.filename or "protobuf" in w.filename
                        or "tensorboard" in str(w.message).lower()]
    assert not from_tensorboard, [str(w.message) for w in from_tensorboard]


def test_with_debug_metrics_the_raw_statistics_are_mirrored_and_the_report_voids_them(capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    summary, _ = _train(capsys, ctr_dir, run, TB, "train.debug_metrics=true")
    events, _ = _events(run / "tensorboard")
    assert events == _jsonl_scalars(run / "metrics.jsonl")
    assert set(DEBUG_STEP_KEYS) <= _tags(events)
    assert CAVEAT_DEBUG_TENSORBOARD in summary["privacy_caveats"]


def test_resume_adds_an_event_file_and_continues_the_steps(capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run, TB, "train.steps=4")
    before = {p.name: p.read_bytes() for p in (run / "tensorboard").iterdir()}
    assert len(before) == 1
    code = main(["train", "--resume", str(run), "--no-progress", "--set", "train.steps=8"])
    _, err = capsys.readouterr()
    assert code == 0, err
    after = {p.name: p for p in (run / "tensorboard").iterdir()}
    assert all(after[name].read_bytes() == data for name, data in before.items())  # earlier file untouched
    (new,) = set(after) - set(before)
    new_events, _ = _events(after[new])
    assert sorted(step for tag, step, _ in new_events if tag == "epsilon") == [6, 8]
    events, _ = _events(run / "tensorboard")
    assert events == _jsonl_scalars(run / "metrics.jsonl")
    assert sorted(step for tag, step, _ in events if tag == "epsilon") == [2, 4, 6, 8]


def test_turned_on_at_resume_it_mirrors_the_whole_run(capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run, "train.steps=4")
    assert not (run / "tensorboard").exists()
    code = main(["train", "--resume", str(run), "--no-progress", "--set", "train.steps=6", "--set", TB])
    _, err = capsys.readouterr()
    assert code == 0, err
    events, _ = _events(run / "tensorboard")
    assert events == _jsonl_scalars(run / "metrics.jsonl")
    assert sorted(step for tag, step, _ in events if tag == "epsilon") == [2, 4, 6]


def _recorder(tmp_path, debug=False):
    return RunRecorder(expected_batch_size=8, metrics_path=tmp_path / "metrics.jsonl", debug_metrics=debug,
                       randomness_note="", reproducible=False, private=True, tensorboard_dir=tmp_path / "tb")


def test_the_equality_check_catches_a_record_only_one_sink_got(tmp_path):
    recorder = _recorder(tmp_path)
    recorder.log({"step": 2, "epsilon": 0.5, "rows_selected": 7})
    recorder.log({"step": 2, "test_metrics": {"auc": 0.625, "logloss": 0.25}})
    jsonl, tensorboard = recorder.sinks
    tensorboard.writer.flush()
    assert _events(tmp_path / "tb")[0] == _jsonl_scalars(tmp_path / "metrics.jsonl")
    tensorboard.write({"step": 4, "epsilon": 0.75})  # a record TensorBoard got and metrics.jsonl did not
    tensorboard.writer.flush()
    assert _events(tmp_path / "tb")[0] != _jsonl_scalars(tmp_path / "metrics.jsonl")
    jsonl.write({"step": 4, "epsilon": 0.75})
    assert _events(tmp_path / "tb")[0] == _jsonl_scalars(tmp_path / "metrics.jsonl")
    jsonl.write({"step": 6, "epsilon": 1.0})  # and the other way round
    assert _events(tmp_path / "tb")[0] != _jsonl_scalars(tmp_path / "metrics.jsonl")
    recorder.close()


def test_a_value_metrics_jsonl_holds_as_null_is_no_event_either(tmp_path):
    """metrics.jsonl is strict JSON (a non-finite number is null: a nonprivate run's ε = inf, a
    NaN loss); TensorBoard gets the record as metrics.jsonl holds it."""
    recorder = _recorder(tmp_path, debug=True)
    for step in (2, 4):  # a session's first record and a later one
        recorder.log({"step": step, "epsilon": math.inf, "rows_selected": 7, "loss": math.nan})
    recorder.close()
    assert _events(tmp_path / "tb")[0] == _jsonl_scalars(tmp_path / "metrics.jsonl") == [("rows_selected", 2, 7),
                                                                                        ("rows_selected", 4, 7)]


def test_catching_up_copies_no_raw_statistic_into_a_session_without_debug_metrics(tmp_path):
    """An earlier debug session left loss lines in metrics.jsonl: a later session without
    train.debug_metrics mirrors the rest of them, not the raw statistics."""
    lines = [{"step": 2, "epsilon": 0.5, "rows_selected": 7, "loss": 0.69, "batch_size": 9, "rows_touched": 40}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    recorder = _recorder(tmp_path, debug=False)
    recorder.log({"step": 4, "epsilon": 0.75, "rows_selected": 6})
    recorder.close()
    assert _events(tmp_path / "tb")[0] == [("epsilon", 2, 0.5), ("epsilon", 4, 0.75),
                                           ("rows_selected", 2, 7.0), ("rows_selected", 4, 6.0)]


def test_without_the_package_it_fails_at_start_in_one_line_and_otherwise_is_never_imported(
        capsys, tmp_path, ctr_dir, monkeypatch):
    for name in ("tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` of it raises ImportError
    _train(capsys, ctr_dir, tmp_path / "off")  # the default run never imports it
    assert not (tmp_path / "off" / "tensorboard").exists()
    config = tmp_path / "on.toml"
    config.write_text(f'[data]\npath = "{ctr_dir}"\n')
    code = main(["train", "--config", str(config), "--run-dir", str(tmp_path / "on"), "--no-progress", "--set", TB])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert TENSORBOARD_MISSING in err and "pip install 'widedp[tensorboard]'" in err
    assert not (tmp_path / "on").exists()


def test_the_key_defaults_off_and_changes_no_computation():
    from widedp.trainer.run.train import changed_computation_keys

    off, on = load_config(None, []), load_config(None, [TB])
    assert not off.train.tensorboard and on.train.tensorboard
    older = json.loads(json.dumps(off.to_dict()))
    del older["train"]["tensorboard"]  # a run saved before the key existed
    assert changed_computation_keys(older, on.to_dict()) == []


def test_importing_and_writing_with_tensorboard_raises_no_warning(tmp_path):
    """In a fresh interpreter (import-time warnings happen once per process) with every warning
    an error: the sink's import of torch.utils.tensorboard, a record, the read-back."""
    script = textwrap.dedent(f"""
        from pathlib import Path
        from widedp.trainer.run.outputs import RunRecorder
        tmp = Path({str(tmp_path)!r})
        r = RunRecorder(expected_batch_size=8, metrics_path=tmp / "m.jsonl", debug_metrics=False, randomness_note="",
                        reproducible=False, private=True, tensorboard_dir=tmp / "tb")
        r.log({{"step": 1, "epsilon": 0.5}})
        r.close()
        r = RunRecorder(expected_batch_size=8, metrics_path=tmp / "m.jsonl", debug_metrics=False, randomness_note="",
                        reproducible=False, private=True, tensorboard_dir=tmp / "tb")
        r.log({{"step": 2, "epsilon": 0.6}})
        r.close()
    """)
    done = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr
    assert len(list((tmp_path / "tb").iterdir())) == 2
