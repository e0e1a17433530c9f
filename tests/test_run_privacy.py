"""The guarantee of a whole run (docs/THREAT_MODEL.md): secret randomness by default, nothing
un-noised about the training data in what a run writes or prints unless the user opted in,
safe defaults. Each test fails against a trainer that seeds sampling/noise from the config
or writes raw training statistics."""

import json
import re

import numpy as np
import pytest
import torch

from widedp.trainer.cli import main
from widedp.trainer.config import load_config
from widedp.trainer.engine.randomness import PrivacyRandomness
from widedp.trainer.run.outputs import DEBUG_STEP_KEYS, DEBUG_SUMMARY_KEYS
from widedp.trainer.run.train import build_run, default_delta

from test_train_cli import TINY as CLI_TINY

# The end-to-end CLI tests' tiny run (data: conftest.ctr_dir), with an explicit σ: no calibration, so the
# runs are quick and their privacy parameters equal.
TINY = [*CLI_TINY, "train.steps=6", "privacy.noise_multiplier=0.9", "privacy.selection_epsilon=0.05"]


def _sets(*items):
    return [x for item in items for x in ("--set", item)]


def _cfg(ctr_dir, *extra):
    return load_config(None, [f"data.path={ctr_dir}", *TINY, *extra]).validate()


def _train(capsys, ctr_dir, run_dir, *extra, progress=False):
    config = run_dir.parent / f"{run_dir.name}.toml"
    config.write_text(f'[data]\npath = "{ctr_dir}"\n')
    args = ["train", "--config", str(config), "--run-dir", str(run_dir), *_sets(*TINY, *extra)]
    code = main(args + ([] if progress else ["--no-progress"]))
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out), err


def _final_tables(run_dir):
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)["engine"]
    return np.concatenate([np.concatenate([s["weights"][t] for s in state["shards"]]).ravel()
                           for t in range(len(state["shards"][0]["weights"]))])


def _batches(engine, count=5):
    return [engine.sampler.sample().tolist() for _ in range(count)]


# ---- secret randomness ------------------------------------------------------------------------------

def test_two_builds_of_one_config_draw_different_batches_and_noise(ctr_dir):
    cfg = _cfg(ctr_dir)
    a, b = build_run(cfg).engine, build_run(cfg).engine
    try:
        assert _batches(a) != _batches(b)
        assert not torch.equal(a.noise_gen.standard_normal(8), b.noise_gen.standard_normal(8))
        assert a.selection_rng.random() != b.selection_rng.random()
        assert a.dpsgd_noise_key != b.dpsgd_noise_key
    finally:
        a.shards.shutdown()
        b.shards.shutdown()


def test_sampler_stream_is_not_a_function_of_the_config(ctr_dir):
    """Whatever config.json says (train.seed, data.seed included), the batches are not those
    of any generator seeded from it — in particular not the old `PoissonSampler(n, q, train.seed)`."""
    from widedp.trainer.data import PoissonSampler

    cfg = _cfg(ctr_dir, "train.seed=0")
    run = build_run(cfg)
    engine, train_set = run.engine, run.train_set
    try:
        batches = _batches(engine)
        old = PoissonSampler(len(train_set), engine.q, seed=cfg.train.seed)
        assert batches != [old.sample().tolist() for _ in range(5)]
    finally:
        engine.shards.shutdown()


def test_reproducible_mode_replays_and_says_the_seed_must_stay_secret(ctr_dir):
    cfg = _cfg(ctr_dir, "privacy.reproducible=true", "privacy.noise_seed=17")
    a, b = build_run(cfg).engine, build_run(cfg).engine
    try:
        assert _batches(a) == _batches(b)
        assert torch.equal(a.noise_gen.standard_normal(8), b.noise_gen.standard_normal(8))
        assert "only while that seed stays secret" in a.randomness.describe()
    finally:
        a.shards.shutdown()
        b.shards.shutdown()


def test_the_root_secret_never_appears_in_repr():
    r = PrivacyRandomness.fresh()
    assert str(r.root) not in repr(r) and "root" not in repr(r)


def test_two_runs_of_one_config_release_different_models(capsys, tmp_path, ctr_dir):
    _train(capsys, ctr_dir, tmp_path / "a")
    _train(capsys, ctr_dir, tmp_path / "b")
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == json.loads((tmp_path / "b" / "config.json").read_text())
    assert not np.array_equal(_final_tables(tmp_path / "a"), _final_tables(tmp_path / "b"))


def test_a_secret_run_checkpoints_no_generator_state(capsys, tmp_path, ctr_dir):
    _train(capsys, ctr_dir, tmp_path / "run")
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["engine"]
    assert "rng" not in state and not state["reproducible"]
    text = repr({k: v for k, v in state.items() if k not in ("model", "shards", "dense_optimizer")})
    assert not re.search(r"bit_generator|noise_gen|selection_rng|dpsgd_noise_key|NoiseKey", text)


def test_a_resumed_secret_run_draws_fresh_noise_and_charges_replayed_steps_again(capsys, tmp_path, ctr_dir,
                                                                                   monkeypatch):
    """A crash after step 4 with the last checkpoint at step 3: resuming replays step 4 with
    fresh noise, so the ledger keeps the released step 4 and charges the replay too."""
    from run_crash import train_and_die

    run = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(f'[data]\npath = "{ctr_dir}"\n')
    argv = ["train", "--config", str(config), "--run-dir", str(run), "--no-progress",
            *_sets(*TINY, "train.checkpoint_every=3")]
    train_and_die(monkeypatch, main, argv, step=4)
    capsys.readouterr()
    assert torch.load(run / "checkpoint.pt", weights_only=False)["engine"]["step"] == 3
    ledger_after_4 = json.loads((run / "ledger.json").read_text())
    assert sum(e["count"] for e in ledger_after_4["history"]) == 4  # released before the crash
    code = main(["train", "--resume", str(run), "--no-progress", "--set", "train.steps=6"])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out)
    assert summary["steps"] == 6
    # steps 1-4 released before, then 4, 5, 6 again and the recalibration after step 6
    assert summary["events_charged"] == 4 + 3 + 1


def test_a_reproducible_resume_that_changes_the_computation_is_refused(capsys, tmp_path, ctr_dir):
    """Reusing the checkpoint's noise on different values would break the guarantee."""
    run = tmp_path / "run"
    _train(capsys, ctr_dir, run, "privacy.reproducible=true", "train.steps=3")
    code = main(["train", "--resume", str(run), "--no-progress", "--set", "train.steps=5", "--set", "train.lr=0.5"])
    out, err = capsys.readouterr()
    assert code == 2 and "train.lr" in err and "same noise" not in out
    code = main(["train", "--resume", str(run), "--no-progress", "--set", "train.steps=5"])
    out, err = capsys.readouterr()
    assert code == 0, err


# ---- what a run writes and prints ------------------------------------------------------------------------

FORBIDDEN_BY_DEFAULT = set(DEBUG_STEP_KEYS) | set(DEBUG_SUMMARY_KEYS)


def test_default_outputs_carry_no_raw_training_statistics(capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    summary, err = _train(capsys, ctr_dir, run, "train.eval_every=3", progress=True)
    assert not FORBIDDEN_BY_DEFAULT & set(summary)
    on_disk = json.loads((run / "summary.json").read_text())
    assert not FORBIDDEN_BY_DEFAULT & set(on_disk) and not on_disk["debug_metrics"]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines and all(not FORBIDDEN_BY_DEFAULT & set(line) for line in lines)
    assert [x["step"] for x in lines if "test_metrics" in x] == [3, 6]  # held-out metrics instead
    assert "eps=" in err and "loss" not in err  # the progress bar
    assert any("n is treated as public" in c for c in on_disk["privacy_caveats"])
    assert on_disk["examples_per_sec"] > 0 and on_disk["expected_batch_size"] == pytest.approx(64.0)


def test_validation_split_is_held_out_of_training_and_its_metrics_are_labelled(capsys, tmp_path, ctr_dir):
    plain, _ = _train(capsys, ctr_dir, tmp_path / "plain")
    summary, _ = _train(capsys, ctr_dir, tmp_path / "valid", "data.validation_fraction=0.25")
    assert "validation_metrics" not in plain and "auc" in summary["validation_metrics"]
    # the held-out examples are not training data: n, so the sampling rate b/n, changes with them
    assert summary["sample_rate"] == pytest.approx(plain["sample_rate"] * 4 / 3, rel=0.01)
    assert any("validation_metrics" in c for c in summary["privacy_caveats"])
    assert not any("validation_metrics" in c for c in plain["privacy_caveats"])
    # a data set without a privacy-unit column: the unit is the example, with no group caveat
    assert plain["privacy_unit"] == "example" and not any("group of m" in c for c in plain["privacy_caveats"])


def test_debug_metrics_opt_in_writes_raw_values_and_voids_the_report_for_them(capsys, tmp_path, ctr_dir):
    run = tmp_path / "run"
    summary, err = _train(capsys, ctr_dir, run, "train.debug_metrics=true", progress=True)
    assert summary["debug_metrics"] and set(DEBUG_SUMMARY_KEYS) <= set(summary)
    assert summary["bytes_to_shards"] > 0 and summary["examples"] > 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(set(DEBUG_STEP_KEYS) <= set(line) for line in lines)
    assert "loss=" in err
    assert any("VOID" in c for c in summary["privacy_caveats"])


# ---- defaults -----------------------------------------------------------------------------------------

def test_default_delta_is_clearly_below_one_over_n(ctr_dir):
    run = build_run(_cfg(ctr_dir))
    engine, train_set = run.engine, run.train_set
    try:
        n = len(train_set)
        assert engine.ledger.delta == pytest.approx(default_delta(n)) == pytest.approx(0.1 / n)
        assert default_delta(10**12) == pytest.approx(1e-12 ** 1.1)  # o(1/n) as n grows
    finally:
        engine.shards.shutdown()


def test_secure_mode_refuses_a_reproducible_seed(ctr_dir):
    with pytest.raises(ValueError, match="secure_mode"):
        _cfg(ctr_dir, "privacy.secure_mode=true", "privacy.reproducible=true")


# ---- private vocabularies reach the training ledger ------------------------------------------------------

def test_a_private_vocabulary_is_charged_to_the_training_ledger_before_the_first_step(capsys, tmp_path):
    from widedp.accounting import PrivacyLedger
    from widedp.accounting import events as ev
    from widedp.trainer.data import convert_text

    words = [f"w{i}" for i in range(12)]
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words, size=6)) for _ in range(1500)] + ["w0 w1 zyzzyva w2 w3"]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    convert_text(tmp_path / "corpus.txt", tmp_path / "text", vocab=12, window=2, negatives=2)
    config = tmp_path / "cbow.toml"
    config.write_text(f'[data]\npath = "{tmp_path / "text"}"\n[model]\nname = "cbow"\nembedding_dim = 4\n')
    run = tmp_path / "run"
    code = main(["train", "--config", str(config), "--run-dir", str(run), "--no-progress",
                 *_sets("train.steps=3", "train.batch_size=32", "privacy.k=6", "cluster.backend=local",
                        "train.selection=threshold", "privacy.target_epsilon=4",
                        "privacy.table_default=sparse")])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out)
    ledger = PrivacyLedger.load(run / "ledger.json")
    first, count = ledger.history[0]
    assert isinstance(first, ev.GaussianPartitionSelectionDpEvent) and count == 1
    assert ledger.steps == 1 + 3 and summary["events_charged"] == 4
    # calibration left room for it: the whole history, vocabulary included, is within the target
    assert summary["epsilon"] == pytest.approx(ledger.epsilon()) and summary["epsilon"] <= 4.0 + 1e-9
    without = PrivacyLedger(ledger.accountant, ledger.delta)
    for event, c in ledger.history[1:]:
        without.record(event, c)
    assert without.epsilon() < ledger.epsilon()
    assert any("vocabulary" in c for c in summary["privacy_caveats"])
    # `widedp epsilon --dataset DIR` charges the same one-time event: CLI and ledger agree
    code = main(["epsilon", "--noise-multiplier", repr(summary["noise_multiplier"]), "--sample-rate",
                 repr(summary["sample_rate"]), "--steps", "3", "--delta", repr(summary["delta"]),
                 "--selection", "threshold", "--selection-sigma", repr(summary["selection_sigma"]),
                 "--accountant", summary["accountant"], "--dataset", str(tmp_path / "text")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["epsilon"] == pytest.approx(summary["epsilon"], rel=1e-12)
