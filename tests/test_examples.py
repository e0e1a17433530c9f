"""examples/ runs as written, at smoke size (STEPS=5): a user's own CSV log through convert table
to a verified, exported user-level model; the notebook API. The cluster example is checked, not
run (its `ray stop` would stop the suite's other Ray processes): its syntax, and that it starts
and submits as the cluster guide's walkthrough does, which tests/test_cluster.py runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
pytestmark = pytest.mark.xdist_group("examples")


def _env() -> dict:
    return {**os.environ, "STEPS": "5", "WIDEDP": str(Path(sys.executable).parent / "widedp"),
            "PYTHON": sys.executable}


def test_own_data_example_converts_trains_verifies_and_exports(tmp_path):
    out = tmp_path / "own"
    run = subprocess.run(["bash", str(EXAMPLES / "own_data.sh"), str(out)], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["privacy_unit"] == "user" and summary["epsilon"] <= 3.0 + 1e-9
    assert (out / "model" / "PRIVACY.md").is_file() and "one user" in (out / "model" / "PRIVACY.md").read_text()
    budget = json.loads((out / "budget.json").read_text())
    assert budget["num_runs"] == 1 and "per-user total" in run.stdout


def test_notebook_example_runs(tmp_path):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    run = subprocess.run([sys.executable, str(EXAMPLES / "notebook.py"), str(tmp_path / "nb")], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "ε = " in run.stdout and "σ = 1.0 spends" in run.stdout
    assert (tmp_path / "nb-release" / "PRIVACY.md").is_file()


def test_cluster_example_parses_and_submits_as_the_tested_walkthrough():
    script = (EXAMPLES / "cluster.sh").read_text()
    assert subprocess.run(["bash", "-n", str(EXAMPLES / "cluster.sh")]).returncode == 0
    guide = (REPO / "docs" / "guide" / "cluster.md").read_text()
    for shared in ("RAY_AUTH_MODE=token", "get-auth-token --generate", "--num-cpus 0", "--temp-dir",
                   "job submit --address http://127.0.0.1:", "--runtime-env deploy/runtime_env.yaml"):
        assert shared in script and shared in guide, shared


@pytest.mark.parametrize("script,metric", [("dcn_ranking.py", "auc"), ("two_tower_retrieval.py", "recall@10"),
                                           ("sasrec_sequential.py", "hit@10"), ("transformer_lm.py", "perplexity")])
def test_own_model_examples_run_at_smoke_size(script, metric, tmp_path):
    """The full-size numbers are RESULTS §20–20d's (benchmarks/own_model.py: the same scripts
    without --quick; the language model on 50,000 words of public text, here a synthetic one)."""
    data = [] if script == "transformer_lm.py" else ["--data", str(tmp_path / "logs")]
    run = subprocess.run([sys.executable, str(EXAMPLES / script), "--quick", *data],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(out["runs"]) == {"sparse", "dpsgd", "nonprivate"}
    # a rate in [0, 1]; a full softmax over V words has a perplexity in (1, ~V] (far above V: a broken evaluation)
    low, high = (1.0, 2.0 * out["vocabulary"]) if metric == "perplexity" else (0.0, 1.0)
    for mode, by_eps in out["runs"].items():
        for eps, row in by_eps.items():
            assert low <= row[metric][0] <= high
            assert row["epsilon"][2] <= (0 if mode == "nonprivate" else float(eps) + 1e-9)
