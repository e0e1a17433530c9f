"""`widedp wide-linear` (trainer/run/wide_linear.py): seed A's Algorithm 2 on a widedp data set."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from dp_accounting import dp_event

from widedp.accounting.events import event_to_dict
from widedp.trainer.cli import main
from widedp.trainer.data.format.dataset import open_dataset
from widedp.trainer.run.wide_linear import run_wide_linear, wide_features


def _cli(capsys, *args):
    code = main(["wide-linear", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_features_are_one_unit_row_per_example_with_a_column_per_table_id(ctr_dir):
    train, _ = open_dataset(ctr_dir, test_fraction=0.2, seed=0)
    X, y = wide_features(train)
    meta = train.meta
    F = len(meta.features)
    assert X.shape == (len(train), sum(meta.table_sizes[t] for t in meta.tables))
    np.testing.assert_allclose(np.sqrt(X.multiply(X).sum(axis=1)).A1, 1.0)
    assert set(np.unique(y)) <= {0.0, 1.0}
    # The slow obvious construction for a few examples.
    offsets = np.cumsum([0] + [meta.table_sizes[t] for t in meta.tables])
    for i in (0, 7, len(train) - 1):
        batch = train.take(np.array([i]))
        expected = np.zeros(X.shape[1])
        for feature in meta.features:
            for row_id in batch.sparse[feature].values().numpy():
                expected[offsets[meta.tables.index(meta.feature_tables[feature])] + row_id] += 1 / math.sqrt(F)
        np.testing.assert_allclose(X[i].toarray().ravel(), expected)


def test_cli_trains_writes_summary_and_model_and_spends_exactly_the_target(ctr_dir, tmp_path, capsys):
    code, out, err = _cli(capsys, "--data", str(ctr_dir), "--epsilon", "2", "--steps", "20", "--threshold", "0.05",
                          "--seed", "3", "--run-dir", str(tmp_path / "run"))
    assert code == 0, err
    printed = json.loads(out)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["algorithm"] == "alg2" and summary["steps"] == 20
    assert summary["num_groups"] == math.ceil(10 * math.sqrt(20)) and summary["theorem1_condition_met"]
    assert summary["epsilon"] == pytest.approx(2.0, rel=1e-3) and summary["epsilon"] <= 2.0 + 1e-9
    assert summary["accounting"]["rdp"] == summary["epsilon"]
    assert "reproducible" in summary["randomness"]
    assert {"auc", "logloss", "ece", "base_rate_logloss"} <= set(summary["test_metrics"])
    assert printed["test_metrics"] == summary["test_metrics"]
    w = np.load(tmp_path / "run" / "model.npz")["w"]
    assert w.shape == (summary["features"],) and np.isfinite(w).all()


def test_the_data_sets_own_privacy_events_are_charged(ctr_dir, tmp_path):
    """A data set whose building released something private (here a Gaussian of σ = 2) must be
    charged on top of the run: the reported ε exceeds the run's own target."""
    data = tmp_path / "charged"
    shutil.copytree(ctr_dir, data, ignore=shutil.ignore_patterns(".widedp-cache"))
    meta = json.loads((data / "dataset.json").read_text())
    meta["privacy_events"] = [{"description": "private vocabulary (test)",
                               "event": event_to_dict(dp_event.GaussianDpEvent(2.0))}]
    (data / "dataset.json").write_text(json.dumps(meta))
    plain = run_wide_linear(str(ctr_dir), epsilon=1.0, steps=10, threshold=0.05, seed=1)
    charged = run_wide_linear(str(data), epsilon=1.0, steps=10, threshold=0.05, seed=1)
    assert plain["data_events"] == 0 and charged["data_events"] == 1 and charged["accountant"] == "rdp"
    assert plain["epsilon"] <= 1.0 + 1e-9 < 1.2 < charged["epsilon"]


def test_nonprivate_is_the_regularized_minimizer_and_claims_no_privacy(ctr_dir):
    out = run_wide_linear(str(ctr_dir), algorithm="nonprivate", l2=1e-2)
    assert out["epsilon"] == math.inf and out["accountant"] is None
    assert 0.5 < out["test_metrics"]["auc"] <= 1.0


def test_bad_arguments_are_refused_naming_them(ctr_dir, tmp_path, capsys):
    for args, name in ((["--delta", "2"], "--delta"), (["--steps", "0"], "--steps"),
                       (["--test-fraction", "1.5"], "--test-fraction"), (["--algorithm", "alg9"], "--algorithm")):
        code, _, err = _cli(capsys, "--data", str(ctr_dir), *args)
        assert code == 2 and name in err, (args, err)
    code, _, err = _cli(capsys, "--data", str(tmp_path / "nowhere"))
    assert code == 2 and "dataset.json" in err
