"""README walkthroughs run as written (tests/readme_blocks.py), and the data.path / data.synth
rule they rely on (trainer/run/train.py, `_ensure_dataset`): a converted data set at data.path is
trained on as it is even though the shipped configs name a synthetic set; a synthetic set other
than the one asked for is refused with a message that says how to fix it.

The two-node cluster walkthrough is run by tests/test_cluster.py (it starts the cluster the other
cluster tests use).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from readme_blocks import Walkthrough

from widedp.trainer.config import load_config
from widedp.trainer.data.convert.criteo import convert_criteo
from widedp.trainer.data.synthetic.synth import synth_ctr
from widedp.trainer.run.train import _ensure_dataset

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent  # the venv running the tests (not resolved: .venv itself)


def _criteo_tsv(path: Path, lines: int, seed: int = 0) -> None:
    """Criteo's format: label, 13 integer features, 26 hex ids, tab-separated; some fields empty."""
    rng = np.random.default_rng(seed)
    vocab = [[f"{int(v):08x}" for v in rng.integers(0, 2**32, size=40)] for _ in range(26)]
    out = []
    for _ in range(lines):
        dense = ["" if rng.random() < 0.2 else str(int(rng.integers(-2, 500))) for _ in range(13)]
        cats = ["" if rng.random() < 0.1 else vocab[j][min(int(rng.zipf(1.5)) - 1, 39)] for j in range(26)]
        out.append("\t".join([str(int(rng.random() < 0.25))] + dense + cats))
    path.write_text("\n".join(out) + "\n")


def test_own_data_walkthrough_runs_as_written(tmp_path):
    """README "Train a shipped config on your converted data", in a fresh directory holding only
    the user's TSV (named as the README names it) and links to the repository's configs/ and
    .venv/ (the block's relative paths then land in that directory). No substitution."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / ".venv").symlink_to(VENV)
    _criteo_tsv(tmp_path / "day_0.tsv", 3000)
    walkthrough = Walkthrough("own-data")
    convert = walkthrough.commands()[0]
    assert convert.startswith(".venv/bin/widedp convert criteo day_0.tsv "), \
        "the test writes the user's TSV as day_0.tsv: keep the README's name or change the test with it"
    hash_size = int(re.search(r"--hash-size (\d+)", convert).group(1))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    out = subprocess.run(["bash", "-c", walkthrough.bash()], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=400)
    assert out.returncode == 0, f"README walkthrough 'own-data' failed ({out.returncode}):\n{out.stderr[-5000:]}"

    data = json.loads((tmp_path / "runs/data/day_0/dataset.json").read_text())
    assert data["num_examples"] == 3000 and set(data["table_sizes"].values()) == {hash_size}
    summary = json.loads((tmp_path / "runs/ctr_day_0_try/summary.json").read_text())
    assert math.isfinite(summary["epsilon"]) and 0 < summary["epsilon"] <= 8.0 + 1e-9
    assert summary["steps"] == 10 and summary["selection"] == "fest-threshold" and summary["bayes_auc"] is None
    assert f'"epsilon": {json.dumps(summary["epsilon"])}' in out.stdout  # the block's json.tool line
    assert "error" not in out.stderr.lower(), out.stderr[-3000:]


def test_user_logs_walkthrough_runs_as_written(tmp_path):
    """README "User-level privacy": synthetic logs with users, converted with the last day as the
    test split, a sparse and a dpsgd try of the shipped user-level configs, export and budget —
    as printed, in a fresh directory (links to configs/ and .venv/)."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / ".venv").symlink_to(VENV)
    walkthrough = Walkthrough("user-logs")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    out = subprocess.run(["bash", "-c", walkthrough.bash()], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=500)
    assert out.returncode == 0, f"README walkthrough 'user-logs' failed ({out.returncode}):\n{out.stderr[-5000:]}"
    for run, mode in (("logs_try", "sparse"), ("logs_dpsgd_try", "dpsgd")):
        summary = json.loads((tmp_path / "runs" / run / "summary.json").read_text())
        assert summary["mode"] == mode and summary["privacy_unit"] == "user" and summary["steps"] == 10
        assert summary["test_split"] == "timestamp>=2026-11-03T00:00:00Z"
        assert math.isfinite(summary["epsilon"]) and summary["epsilon"] <= summary["target_epsilon"] + 1e-9
    assert "one user" in (tmp_path / "runs/logs_model/PRIVACY.md").read_text()
    budget = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["privacy_unit"] for r in budget["runs"]] == ["user", "user"]
    assert math.isfinite(budget["user_total_epsilon"])


def _ctr_config(path: Path, *overrides: str):
    return load_config(str(ROOT / "configs" / "ctr.toml"),
                       [f"data.path={path}", "cluster.backend=local", *overrides]).validate()


@contextlib.contextmanager
def _train_log():
    """The messages trainer/run/train.py logs at INFO and above (whatever the 'widedp' logger's setup)."""
    logger = logging.getLogger("widedp.trainer.run.train")
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def test_converted_data_is_used_as_it_is_under_a_synthetic_config(tmp_path):
    tsv = tmp_path / "in.tsv"
    _criteo_tsv(tsv, 200)
    convert_criteo(tsv, tmp_path / "criteo", hash_size=64)
    with _train_log() as messages:
        train, test = _ensure_dataset(_ctr_config(tmp_path / "criteo"))
    assert len(train) + len(test) == 200 and set(train.meta.table_sizes.values()) == {64}
    assert messages == [f"data.path {tmp_path / 'criteo'} holds a converted data set (criteo {tsv}), not a "
                        f"synthetic one: training on it as it is (data.synth = 'ctr' ignored)"]


def test_a_different_synthetic_set_is_refused_saying_how_to_fix_it(tmp_path, capsys):
    from widedp.trainer.cli import main

    path = tmp_path / "synth"
    synth_ctr(path, num_examples=300, table_sizes=50, seed=0)
    same = ("data.synth_examples=300", "data.synth_table_size=50", "data.seed=0")
    with _train_log() as messages:
        train, _ = _ensure_dataset(_ctr_config(path, *same))  # the one asked for: no word
    assert len(train) > 0 and messages == []

    with pytest.raises(ValueError) as err:
        _ensure_dataset(_ctr_config(path, "data.synth_examples=400", "data.synth_table_size=50", "data.seed=0"))
    msg = str(err.value)
    assert msg.startswith(f"data.path {path} holds a synthetic data set (made by synth_ctr) other than the one "
                          f"data.synth = 'ctr' and the config's data.synth_* keys ask for: "
                          f"synth_examples=300 (config: 400);"), msg
    assert "point data.path elsewhere" in msg and "--set data.synth= (empty) to train on that data set as it is" in msg

    # The advice works: with data.synth empty the set is used as it is, silently.
    with _train_log() as messages:
        train, _ = _ensure_dataset(_ctr_config(path, "data.synth=", "data.synth_examples=400"))
    assert len(train) > 0 and messages == []

    # Through the CLI: one line, exit 2, before any Ray or model work.
    code = main(["train", "--config", str(ROOT / "configs" / "ctr.toml"), "--run-dir", str(tmp_path / "run"),
                 "--set", f"data.path={path}", "--set", "cluster.backend=local", "--set", "data.synth_examples=400"])
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err_lines) == 1 and err_lines[0].startswith("widedp: error: data.path "), err_lines
    assert "--set data.synth=" in err_lines[0]
