"""The opt-in keyed ledger (trainer/run/ledger_key.py): with WIDEDP_LEDGER_KEY_FILE, a run's records
are signed, and a forgery that recomputes every hash chain — the issue's "ten lines of Python"
that made the export print ε 0.785 for a true 2.807 — is refused by whoever holds the key."""

from __future__ import annotations

import hashlib
import json
import secrets

import pytest
import torch

from widedp.accounting import PrivacyLedger
from widedp.accounting import events as ev
from widedp.trainer.cli import main
from widedp.trainer.run.ledger_key import KEY_ENV, LedgerKey, LedgerKeyError, read_key
from widedp.trainer.run.journal import JOURNAL_FILE, JOURNAL_SEED

from test_ledger_chain import _train

pytestmark = pytest.mark.xdist_group("ledger_key")


def _key(path):
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def _cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _rewrite_journal(run, forged) -> dict:
    """journal.jsonl with every signature dropped and its charges and chain recomputed for the
    `forged` ledger (sha256 is public: no key needed); returns its new head."""
    lines, d = [], JOURNAL_SEED
    for raw in (run / JOURNAL_FILE).read_text().splitlines():
        record = json.loads(raw)
        record.pop("mac", None)
        if record["kind"] == "charge":
            record["digest"] = forged.digest_at(record["events"])
        record["prev"] = d
        line = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        d = hashlib.sha256(bytes.fromhex(d) + hashlib.sha256(line).digest()).hexdigest()
        lines.append(line.decode())
    (run / JOURNAL_FILE).write_text("\n".join(lines) + "\n")
    return {"lines": len(lines), "digest": d}


def _forge(run):
    """Every record rewritten with σ = 50 in the steps' events and every chain recomputed (no key)."""
    honest = PrivacyLedger.load(run / "ledger.json")
    forged = PrivacyLedger(honest.accountant.name, honest.delta, header=honest.header)
    for event, count in honest.history:
        if isinstance(event, ev.PoissonSampledDpEvent):
            event = ev.PoissonSampledDpEvent(event.sampling_probability, ev.GaussianDpEvent(50.0))
        forged.record(event, count)
    forged.save(run / "ledger.json")
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    state["ledger_chain"] = forged.chain()
    state["engine"]["ledger"] = forged.state_dict()
    state["journal_head"] = _rewrite_journal(run, forged)
    torch.save(state, run / "checkpoint.pt")
    return forged


def test_without_a_key_a_forger_who_recomputes_every_chain_passes_which_the_threat_model_states(
        capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    honest = _train(capsys, ctr_dir, run)
    forged = _forge(run)
    code, out, err = _cli(capsys, "verify", str(run))
    assert code == 0, err
    shown = json.loads(out)["epsilon"]
    assert shown == pytest.approx(forged.epsilon()) and shown < honest["epsilon"]
    threat_model = (__import__("pathlib").Path(__file__).parents[1] / "docs" / "THREAT_MODEL.md").read_text()
    assert "recomputes" in threat_model and KEY_ENV in threat_model


def test_a_keyed_run_refuses_the_same_forgery_and_any_other_key(capsys, tmp_path, ctr_dir, monkeypatch):
    key = _key(tmp_path / "ledger.key")
    monkeypatch.setenv(KEY_ENV, str(key))
    run = tmp_path / "run"
    summary = _train(capsys, ctr_dir, run, "train.steps=3")
    key_id = read_key(key).key_id
    assert summary["ledger_key_id"] == key_id
    assert "mac" in json.loads((run / "ledger.json").read_text())
    assert all("mac" in json.loads(line) for line in (run / JOURNAL_FILE).read_text().splitlines())
    code, out, err = _cli(capsys, "verify", str(run))
    assert code == 0 and json.loads(out)["keyed"] and json.loads(out)["ledger_key_id"] == key_id, err
    code, out, err = _cli(capsys, "export", str(run), str(tmp_path / "out"))
    assert code == 0, err
    assert key_id in (tmp_path / "out" / "PRIVACY.md").read_text()

    monkeypatch.delenv(KEY_ENV)
    for argv in (["verify", str(run)], ["export", str(run), str(tmp_path / "out2")],
                 ["train", "--resume", str(run), "--no-progress", "--set", "train.steps=4"]):
        code, _, err = _cli(capsys, *argv)
        assert code == 2 and f"key id {key_id}" in err and KEY_ENV in err, (argv, err)
    monkeypatch.setenv(KEY_ENV, str(_key(tmp_path / "other.key")))
    code, _, err = _cli(capsys, "verify", str(run))
    assert code == 2 and f"signed with ledger key id {key_id}" in err

    monkeypatch.setenv(KEY_ENV, str(key))
    _forge(run)
    for argv in (["verify", str(run)], ["export", str(run), str(tmp_path / "out3")],
                 ["train", "--resume", str(run), "--no-progress", "--set", "train.steps=4"]):
        code, _, err = _cli(capsys, *argv)
        assert code == 2 and ("not signed by the ledger key" in err or "does not verify" in err
                              or "not signed" in err), (argv, err)
    assert not (tmp_path / "out3").exists()


def test_a_keyed_run_resumes_with_its_key(capsys, tmp_path, ctr_dir, monkeypatch):
    monkeypatch.setenv(KEY_ENV, str(_key(tmp_path / "ledger.key")))
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run, "train.steps=3")
    code, out, err = _cli(capsys, "train", "--resume", str(run), "--no-progress", "--set", "train.steps=5")
    assert code == 0, err
    assert _cli(capsys, "verify", str(run))[0] == 0


def test_an_unkeyed_run_cannot_become_keyed_at_resume(capsys, tmp_path, ctr_dir, monkeypatch):
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run, "train.steps=3")
    monkeypatch.setenv(KEY_ENV, str(_key(tmp_path / "ledger.key")))
    code, _, err = _cli(capsys, "train", "--resume", str(run), "--no-progress", "--set", "train.steps=5")
    assert code == 2 and "ledger.key_id was None when the run started" in err


def test_a_key_must_be_long_enough_and_outside_the_run_directory(tmp_path):
    short = tmp_path / "short.key"
    short.write_bytes(b"too short")
    with pytest.raises(LedgerKeyError, match="at least 32 bytes"):
        read_key(short)
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(LedgerKeyError, match="inside the run directory"):
        read_key(_key(run / "k"), run)
    key = LedgerKey(b"k" * 32)
    signed = key.sign({"a": 1})
    key.verify(signed, "x")
    with pytest.raises(LedgerKeyError, match="does not verify"):
        key.verify({**signed, "a": 2}, "x")
    assert "kkkk" not in repr(key)


def _strip(run):
    """A keyed run's records rewritten as an unkeyed run's (no key needed): every signature
    dropped, the key id erased from the checkpoint's semantics and the ledger's header, every
    chain recomputed."""
    honest = PrivacyLedger.load(run / "ledger.json")
    header = honest.header
    header["semantics"]["ledger.key_id"] = None
    forged = PrivacyLedger(honest.accountant.name, honest.delta, header=header)
    for event, count in honest.history:
        forged.record(event, count)
    forged.save(run / "ledger.json")
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    state["semantics"]["ledger.key_id"] = None
    state.pop("records_mac")
    state["ledger_chain"] = forged.chain()
    state["engine"]["ledger"] = forged.state_dict()
    state["journal_head"] = _rewrite_journal(run, forged)
    torch.save(state, run / "checkpoint.pt")


def test_a_keyed_run_rewritten_as_an_unkeyed_one_is_refused_by_the_signer_and_by_the_budget(
        capsys, tmp_path, monkeypatch):
    from widedp.trainer.data import synth_ctr

    data = tmp_path / "data"
    synth_ctr(data, num_examples=3000, table_sizes=500, seed=3)
    key = _key(tmp_path / "ledger.key")
    monkeypatch.setenv(KEY_ENV, str(key))
    run = tmp_path / "run"
    _train(capsys, data, run, "train.steps=3")
    _strip(run)
    code, _, err = _cli(capsys, "verify", str(run))
    assert code == 2 and "holds a ledger key" in err and "not signed" in err
    monkeypatch.delenv(KEY_ENV)  # no key at hand: the data set's budget still knows the run was keyed
    for argv in (["verify", str(run)], ["export", str(run), str(tmp_path / "out")]):
        code, _, err = _cli(capsys, *argv)
        assert code == 2 and "unsigned, but" in err and "privacy_budget.jsonl" in err, (argv, err)


def test_a_new_run_never_overwrites_a_run_that_finished_in_its_directory_while_it_loaded(
        capsys, tmp_path, ctr_dir, monkeypatch):
    """The directory is checked when a run starts, and again once it holds the run's journal
    (created exclusively): a run that started and finished there in between is refused, not
    overwritten."""
    from widedp.trainer.run import train as train_module

    from test_ledger_chain import _argv

    run = tmp_path / "run"
    fits = train_module._check_a_step_fits
    raced: list = []

    def another_run_first(*args, **kwargs):
        if not raced:
            raced.append(True)
            with monkeypatch.context() as m:
                m.setattr(train_module, "_check_a_step_fits", fits)
                assert main(_argv(ctr_dir, run, "train.steps=3")) == 0
        return fits(*args, **kwargs)

    monkeypatch.setattr(train_module, "_check_a_step_fits", another_run_first)
    code = main(_argv(ctr_dir, run, "train.steps=4"))
    out, err = capsys.readouterr()
    assert raced and code == 2 and "holds a run" in err
    assert json.loads((run / "summary.json").read_text())["steps"] == 3  # the first run's, untouched
    assert _cli(capsys, "verify", str(run))[0] == 0
