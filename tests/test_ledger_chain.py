"""The ledger only grows (docs/DESIGN.md §1): a hash chain over the charged events, recorded in
every checkpoint; `widedp train --resume` refuses a ledger.json that is missing, truncated,
rolled back, replaced or edited — each of which the resume used to accept, forgetting released
steps or accounting a σ that never ran. There is no flag past it: the error says to start a new run."""

import json
import shutil

import pytest
import torch

from widedp.accounting import PrivacyLedger
from widedp.accounting import events as ev
from widedp.accounting.ledger import CHAIN_SEED
from widedp.trainer.cli import main

from test_train_cli import TINY as CLI_TINY

# No recalibration: the chain of the steps alone (its event after the last step is tested in
# test_recalibration.py).
TINY = [*CLI_TINY, "train.steps=6", "privacy.noise_multiplier=0.9", "privacy.selection_epsilon=0.05",
        "train.recalibrate=false"]
STEP = ev.PoissonSampledDpEvent(0.02, ev.GaussianDpEvent(1.1))


def _sets(*items):
    return [x for item in items for x in ("--set", item)]


def _argv(data, run_dir, *extra):
    """`widedp train` of TINY on `data` into `run_dir` (a config file beside it holds data.path)."""
    config = run_dir.parent / f"{run_dir.name}.toml"
    config.write_text(f'[data]\npath = "{data}"\n')
    return ["train", "--config", str(config), "--run-dir", str(run_dir), "--no-progress", *_sets(*TINY, *extra)]


def _train(capsys, ctr_dir, run_dir, *extra):
    code = main(_argv(ctr_dir, run_dir, *extra))
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def _resume(capsys, run_dir, *extra):
    code = main(["train", "--resume", str(run_dir), "--no-progress", *_sets(*extra)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def run(capsys, tmp_path, ctr_dir):
    """A finished 6-step run (checkpoint and ledger at 6 charged events)."""
    run_dir = tmp_path / "run"
    _train(capsys, ctr_dir, run_dir)
    return run_dir


def _refused(capsys, run_dir, *match, steps=8):
    before = (run_dir / "checkpoint.pt").read_bytes()
    code, out, err = _resume(capsys, run_dir, f"train.steps={steps}")
    assert code == 2 and out == "", err
    for m in match:
        assert m in err, err
    assert "new run" in err and len(err.strip().splitlines()) == 1
    assert (run_dir / "checkpoint.pt").read_bytes() == before  # nothing trained, nothing lost


# ---- the chain itself --------------------------------------------------------------------------------

def test_the_chain_is_per_charged_event_whatever_the_run_length_encoding():
    one_by_one, at_once = PrivacyLedger(), PrivacyLedger()
    for _ in range(5):
        one_by_one.record(STEP)
    at_once.record(STEP, 5)
    assert one_by_one.digest == at_once.digest != CHAIN_SEED
    older = one_by_one.chain()
    one_by_one.record(ev.GaussianDpEvent(3.0))
    one_by_one.record(STEP, 2)
    assert one_by_one.extends(older) and one_by_one.digest_at(5) == older["digest"]
    assert one_by_one.digest_at(3) != older["digest"] and one_by_one.digest_at(0) == CHAIN_SEED
    other = PrivacyLedger()
    other.record(ev.PoissonSampledDpEvent(0.02, ev.GaussianDpEvent(50.0)), 5)
    assert not other.extends(older)


def test_a_saved_ledger_whose_events_were_edited_does_not_load(tmp_path):
    ledger = PrivacyLedger("rdp", 1e-6)
    ledger.record(STEP, 7)
    path = tmp_path / "ledger.json"
    ledger.save(path)
    assert PrivacyLedger.load(path).digest == ledger.digest
    state = json.loads(path.read_text())
    state["history"][0]["event"]["event"]["noise_multiplier"] = 50.0
    path.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="ledger.json.*does not hash"):
        PrivacyLedger.load(path)
    state = ledger.state_dict()
    state["history"][0]["count"] = 3  # a shortened count with the digests left as they were
    path.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="does not hash"):
        PrivacyLedger.load(path)


# ---- resume refusals ----------------------------------------------------------------------------------

def test_a_resume_without_ledger_json_is_refused(capsys, run):
    (run / "ledger.json").unlink()
    _refused(capsys, run, "ledger.json: missing", "6 charged events")


def test_copying_only_checkpoint_pt_elsewhere_cannot_resume(capsys, tmp_path, run, ctr_dir):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(run / "checkpoint.pt", elsewhere / "checkpoint.pt")
    config = tmp_path / "c.toml"
    config.write_text(f'[data]\npath = "{ctr_dir}"\n')
    code = main(["train", "--config", str(config), "--resume", str(elsewhere), "--no-progress", *_sets(*TINY)])
    _, err = capsys.readouterr()
    assert code == 2 and "ledger.json: missing" in err and "new run" in err


def test_a_rolled_back_ledger_is_refused(capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run, "train.steps=3")
    old = (run / "ledger.json").read_bytes()
    code, _, err = _resume(capsys, run, "train.steps=6")
    assert code == 0, err
    (run / "ledger.json").write_bytes(old)  # an older copy restored: 3 events, the checkpoint records 6
    _refused(capsys, run, "ledger.json", "fewer than the 6", "rolled back")


def test_a_truncated_ledger_is_refused(capsys, run):
    text = (run / "ledger.json").read_bytes()
    (run / "ledger.json").write_bytes(text[: len(text) // 2])
    _refused(capsys, run, "ledger.json", "not a valid ledger file")


def test_a_hand_edited_sigma_is_refused(capsys, run):
    """The issue's case: σ changed to 50 in ledger.json was accepted and ε = 7.39 reported."""
    state = json.loads((run / "ledger.json").read_text())
    step = state["history"][-1]["event"]
    step["event"]["events"][-1]["noise_multiplier"] = 50.0
    (run / "ledger.json").write_text(json.dumps(state))
    _refused(capsys, run, "ledger.json", "does not hash")


def test_an_edited_ledger_with_a_recomputed_chain_is_not_an_extension_of_the_checkpoint(capsys, run):
    ledger = PrivacyLedger.load(run / "ledger.json")
    forged = PrivacyLedger(ledger.accountant.name, ledger.delta)
    for event, count in ledger.history:
        if isinstance(event, ev.PoissonSampledDpEvent):
            event = ev.PoissonSampledDpEvent(event.sampling_probability, ev.GaussianDpEvent(50.0))
        forged.record(event, count)
    forged.save(run / "ledger.json")
    _refused(capsys, run, "ledger.json", "differ from those", "checkpoint.pt")


def test_another_runs_ledger_is_refused(capsys, tmp_path, ctr_dir, run):
    other = tmp_path / "other"
    _train(capsys, ctr_dir, other, "train.steps=4", "privacy.noise_multiplier=1.3")
    shutil.copy(other / "ledger.json", run / "ledger.json")
    _refused(capsys, run, "ledger.json")


def test_events_past_the_checkpoint_must_be_ones_the_run_planned(capsys, run):
    """A chain-consistent extension of the checkpoint whose extra step used a σ no session of
    the run planned (a forged tail) is refused; the planned step charged again is accepted."""
    ledger = PrivacyLedger.load(run / "ledger.json")
    planned_step = ledger.history[-1][0]
    forged = PrivacyLedger.load(run / "ledger.json")
    forged.record(ev.PoissonSampledDpEvent(planned_step.sampling_probability, ev.GaussianDpEvent(50.0)))
    forged.save(run / "ledger.json")
    _refused(capsys, run, "ledger.json", "no session of this run planned")
    ledger.record(planned_step, 2)  # two steps released after the checkpoint (a crash): legitimate
    ledger.save(run / "ledger.json")
    code, out, err = _resume(capsys, run, "train.steps=8")
    assert code == 0, err
    assert json.loads(out)["events_charged"] == 6 + 2 + 2  # the two released steps stay charged


def test_a_checkpoint_records_the_chain_and_the_data_set(capsys, run):
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    ledger = PrivacyLedger.load(run / "ledger.json")
    assert state["ledger_chain"] == {"events": 6, "digest": ledger.digest}
    assert set(state["dataset"]) >= {"dataset_json_sha256", "num_examples"}
    assert state["planned_events"]["step"] == [ev.event_to_dict(ledger.history[-1][0])]


def test_a_ledgers_header_is_bound_into_its_chain(tmp_path):
    """What a run's ε means (trainer/config/semantics.py) sits in the ledger's header: an edited
    header no longer extends the chain a checkpoint recorded; it is fixed before the first event."""
    ledger = PrivacyLedger("rdp", 1e-6, header={"semantics": {"privacy.unit": "user"}})
    assert ledger.digest != CHAIN_SEED
    ledger.record(STEP, 3)
    recorded = ledger.chain()
    with pytest.raises(ValueError, match="fixed before its first event"):
        ledger.set_header({"semantics": {}})
    path = tmp_path / "ledger.json"
    ledger.save(path)
    assert PrivacyLedger.load(path).header == {"semantics": {"privacy.unit": "user"}}
    state = json.loads(path.read_text())
    state["header"]["semantics"]["privacy.unit"] = "example"
    path.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="does not hash"):
        PrivacyLedger.load(path)  # its stored digests were computed from the original header
    for entry in state["history"]:
        entry.pop("digest")
    state.pop("digest")
    state["version"] = 4
    edited = PrivacyLedger("rdp", 1e-6, header=state["header"])
    edited.record(STEP, 3)
    assert not edited.extends(recorded)  # a recomputed chain is not the recorded one
