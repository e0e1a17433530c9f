"""`widedp export RUN_DIR OUT_DIR`: the released artifact scores the test split exactly like
`widedp evaluate` in a Python that cannot import widedp, carries no generator state or secret,
and reports the run's privacy. Tiny in-process runs (cluster.backend = local)."""

import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from widedp.trainer.config import load_config
from widedp.trainer.release.export import export_run
from widedp.trainer.run.train import evaluate, train

# make test runs on two xdist workers (--dist loadgroup): the module's trained runs stay on one worker.
pytestmark = pytest.mark.xdist_group("test_export")

WIDEDP_PACKAGES = ("widedp", "trainer", "selection", "accounting", "auditing", "sparse_learners", "adaptive_clipping")
FORBIDDEN_KEYS = {"rng", "generator", "bit_generator", "noise_gen", "selection_rng", "sampler", "noise_seed",
                  "dpsgd_noise_key", "NoiseKey", "root", "address", "run_dir", "dense_optimizer", "adam", "adagrad",
                  "fixed_rows"}
COMMON = ["cluster.backend=local", "train.log_every=1", "train.eval_batch_size=100"]


def _run(tmp: Path, name: str, data: Path, *sets: str) -> Path:
    cfg = load_config(None, [f"data.path={data}", *COMMON, *sets])
    train(cfg, tmp / name, progress=False)
    return tmp / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from widedp.trainer.data import convert_text, synth_ctr

    tmp = tmp_path_factory.mktemp("export")
    ctr = tmp / "ctr"
    synth_ctr(ctr, num_examples=1200, table_sizes=101, seed=3)  # 101 rows over 3 shards: blocks 34, 34, 33
    dlrm = _run(tmp, "dlrm", ctr, "model.embedding_dim=4", "model.bottom_mlp=[8]", "model.top_mlp=[8]",
                "train.batch_size=64", "train.steps=3", "train.optimizer=adagrad", "cluster.num_shards=3",
                "train.ema_decay=0.8",  # the released model is the average of the iterates
                "privacy.k=40", "privacy.noise_multiplier=1.0", "privacy.selection_epsilon=0.05",
                # a reproducible debug run: its checkpoint holds generator states and its metrics raw statistics
                "privacy.reproducible=true", "privacy.noise_seed=1234", "train.debug_metrics=true")
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(24)]
    (tmp / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(500)) + "\n")
    text = tmp / "text"  # a privately chosen vocabulary: vocab.tsv + a privacy event in dataset.json
    convert_text(tmp / "corpus.txt", text, vocab=20, negatives=3, vocab_noise_multiplier=1.0,
                 vocab_max_words_per_line=8, vocab_noise_seed=5)
    cbow = _run(tmp, "cbow", text, "model.name=cbow", "model.embedding_dim=8", "train.batch_size=32",
                "train.steps=3", "train.mode=sparse", "train.selection=threshold", "privacy.threshold=2.0",
                "privacy.noise_multiplier=1.0", "privacy.selection_sigma=2.0", "privacy.k=10",
                # the private vocabulary (σ = 1) alone spends more than the default target: a run
                # whose first step cannot fit is refused, so this one has room for its 3 steps
                "privacy.target_epsilon=100",
                "cluster.num_shards=2", "cluster.address=ray://secret-host:10001")
    return {"tmp": tmp, "dlrm": dlrm, "cbow": cbow, "ctr": ctr, "text": text}


@pytest.fixture(scope="module")
def exports(runs):
    tmp = runs["tmp"]
    return {name: (export_run(runs[name], tmp / f"out_{name}"), tmp / f"out_{name}") for name in ("dlrm", "cbow")}


def _split_npz(run_dir: Path, path: Path) -> None:
    """The run's test split as plain arrays, read with widedp's own dataset reader."""
    from widedp.trainer.data import open_dataset

    cfg = json.loads((run_dir / "config.json").read_text())
    _, test = open_dataset(cfg["data"]["path"], test_fraction=cfg["data"]["test_fraction"], seed=cfg["data"]["seed"])
    batch = test.take(np.arange(len(test)))
    arrays = {"dense": batch.dense.numpy(), "labels": batch.labels.numpy()}
    for f in test.meta.features:
        offsets, values = test.feature_rows(f)
        arrays[f"values/{f}"], arrays[f"offsets/{f}"] = values, offsets
    np.savez(path, features=np.array(test.meta.features), **arrays)


BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    sys.dont_write_bytecode = True  # leave the export directories as they are
    class _NoWidedp(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in __PACKAGES__:
                raise ImportError("widedp is not available here: " + name)
            return None
    sys.meta_path.insert(0, _NoWidedp())
    sys.path = [p for p in sys.path if p not in ("", ".", __REPO__)]
""")

SCORER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    try:
        from widedp import trainer
    except ImportError:
        pass
    else:
        raise SystemExit("the import blocker does not work")
    jobs = json.loads(sys.argv[1])
    for job in jobs:
        sys.path.insert(0, job["export"])
        sys.modules.pop("load_model", None)
        from load_model import load
        model = load(job["export"])
        sys.path.pop(0)
        data = np.load(job["data"])
        features = {}
        for f in data["features"]:
            offsets = torch.from_numpy(data["offsets/" + str(f)])
            # both offset conventions: B + 1 entries (total last) and EmbeddingBag's B entries
            features[str(f)] = (torch.from_numpy(data["values/" + str(f)]), offsets if job["with_last"] else offsets[:-1])
        with torch.no_grad():
            out = model(features, torch.from_numpy(data["dense"]))
        np.save(job["out"], out.numpy())
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in __PACKAGES__)
    print(json.dumps({"leaked": leaked}))
""")


def _isolated_python(tmp: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    repo = str(Path(__file__).resolve().parents[1])
    script = tmp / "isolated.py"
    script.write_text((BLOCKER + body).replace("__PACKAGES__", repr(WIDEDP_PACKAGES)).replace("__REPO__", repr(repo)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    return subprocess.run([sys.executable, "-I", str(script), *args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=120)


def test_export_scores_the_test_split_like_evaluate_without_widedp(runs, exports, tmp_path):
    from widedp.trainer.models import MODELS

    # Control: the editable install makes widedp importable from an isolated Python (so the
    # blocker below is what keeps it out).
    control = subprocess.run([sys.executable, "-I", "-c", "import widedp.trainer"], cwd=tmp_path, capture_output=True)
    assert control.returncode == 0
    jobs = []
    for name, (_, out_dir) in exports.items():
        src = (out_dir / "load_model.py").read_text()
        assert not any(f"import {p}" in src or f"from {p}" in src for p in WIDEDP_PACKAGES)
        _split_npz(runs[name], tmp_path / f"{name}.npz")
        jobs.append({"export": str(out_dir), "data": str(tmp_path / f"{name}.npz"),
                     "out": str(tmp_path / f"{name}_out.npy"), "with_last": name == "dlrm"})
    proc = _isolated_python(tmp_path, SCORER, json.dumps(jobs))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"leaked": []}
    for name in ("dlrm", "cbow"):
        outputs = torch.from_numpy(np.load(tmp_path / f"{name}_out.npy"))
        labels = torch.from_numpy(np.load(tmp_path / f"{name}.npz")["labels"])
        spec = json.loads((exports[name][1] / "model.json").read_text())
        model = MODELS[spec["model"]](features=[f["name"] for f in spec["features"]], embedding_dim=spec["embedding_dim"],
                                      num_dense=spec["num_dense"], bottom_mlp=spec.get("bottom_mlp", [8]),
                                      top_mlp=spec.get("top_mlp", [8]), interaction=spec.get("interaction") or "dot")
        got = model.metrics(outputs, labels)  # widedp's metric code on the isolated process's outputs
        want = evaluate(runs[name])["test_metrics"]
        assert set(want) == set(got) and set(want) >= ({"auc", "logloss"} if name == "dlrm" else {"loss"})
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), name
    assert outputs.shape[1] == 1 + 3  # cbow: target + 3 negatives


def test_weights_are_whole_tables_in_row_order(runs, exports):
    for name in ("dlrm", "cbow"):
        out_dir = exports[name][1]
        weights = torch.load(out_dir / "weights.pt", weights_only=True)
        state = torch.load(runs[name] / "checkpoint.pt", weights_only=False)["engine"]
        spec = json.loads((out_dir / "model.json").read_text())
        # dlrm trained with train.ema_decay: the export is the average, not the last iterate
        averaged = name == "dlrm"
        assert spec["parameters"].startswith("exponential moving average") == averaged
        key, model_key = ("averaged_weights", "averaged_model") if averaged else ("weights", "model")
        moved: list = []
        for t, table in enumerate(spec["tables"]):
            # block bucketing: shard s holds a contiguous block, so concatenation is row order
            full = np.concatenate([s[key][t] for s in state["shards"]])
            assert full.shape == (table["num_rows"], table["dim"])
            np.testing.assert_array_equal(weights[f"embeddings.{table['name']}"].numpy(), full)
            last = np.concatenate([s["weights"][t] for s in state["shards"]])
            moved.append(not np.allclose(full, last, rtol=0, atol=1e-6))
        assert any(moved) == averaged  # the average is not the last iterate
        dense = {k[len("dense."):]: v for k, v in weights.items() if k.startswith("dense.")}
        assert dense.keys() == {k for k, v in state[model_key].items() if v.numel()}
        for k, v in dense.items():
            torch.testing.assert_close(v, state[model_key][k], rtol=0, atol=0)
        assert set(weights) == {f"embeddings.{t['name']}" for t in spec["tables"]} | {f"dense.{k}" for k in dense}
    assert len(json.loads((exports["dlrm"][1] / "model.json").read_text())["tables"]) == 26
    assert dense == {}  # cbow has no dense parameters
    cbow = json.loads((exports["cbow"][1] / "model.json").read_text())
    assert {(f["table"], f["pooling"]) for f in cbow["features"]} == {("input", "mean"), ("output", "sum")}


def test_a_recalibrated_export_clamps_its_logit_to_the_fitted_range(runs, exports):
    """The dlrm run was recalibrated: its released model computes a·clip(z, ±8) + b, and the
    exported program does too — pooled inputs a thousand times too large (logits far beyond the
    histogram's range) come out inside model.json's stated range, at its ends, as the run's own
    evaluation gives them; the program without the clamp (the fold alone) does not."""
    summary = json.loads((runs["dlrm"] / "summary.json").read_text())
    recal = summary["recalibration"]
    assert recal["applied"]
    low, high = recal["b"] - 8 * recal["a"], recal["b"] + 8 * recal["a"]
    spec = json.loads((exports["dlrm"][1] / "model.json").read_text())
    assert spec["output"]["range"] == pytest.approx([low, high]) and "clip(z, ±8)" in spec["output"]["description"]
    program = torch.export.load(str(exports["dlrm"][1] / "dense.pt2")).module()
    assert any("clamp" in str(node.target) for node in program.graph.nodes)
    F = len(spec["features"])
    gen = torch.Generator().manual_seed(0)
    pooled = 1000 * torch.randn(64, F, spec["embedding_dim"], generator=gen)
    dense = 1000 * torch.randn(64, spec["num_dense"], generator=gen)
    with torch.no_grad():
        out = program(pooled, dense).ravel()
    assert out.min() >= low - 1e-5 and out.max() <= high + 1e-5
    assert ((out - low).abs() < 1e-5).any() or ((out - high).abs() < 1e-5).any()
    from widedp.trainer.release.export import _dense_model
    from widedp.trainer.data import open_dataset

    state = torch.load(runs["dlrm"] / "checkpoint.pt", weights_only=False)
    config = state["config"]
    meta = open_dataset(config["data"]["path"], test_fraction=config["data"]["test_fraction"],
                        seed=config["data"]["seed"])[0].meta
    folded_only = _dense_model(config, meta, state["engine"]["averaged_model"])  # no clamp installed
    with torch.no_grad():
        unclamped = folded_only(pooled, dense).ravel()
    assert unclamped.min() < low - 1.0 or unclamped.max() > high + 1.0
    torch.testing.assert_close(out, unclamped.clamp(low, high), rtol=1e-5, atol=1e-5)


def _walk_json(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"{path}.{k}", k
            yield from _walk_json(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk_json(v, f"{path}[{i}]")


def _only_plain(obj) -> bool:
    if isinstance(obj, torch.Tensor) or obj is None or isinstance(obj, (str, int, float, bool)):
        return True
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _only_plain(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_only_plain(v) for v in obj)
    return False


def _bad_key(key: str) -> bool:
    k = key.lower()
    return k in FORBIDDEN_KEYS or "rng" in k or "generator" in k or ("seed" in k and k != "seed")


def test_export_holds_no_rng_state_or_secret(runs, exports):
    state = torch.load(runs["dlrm"] / "checkpoint.pt", weights_only=False)["engine"]
    assert "rng" in state  # the reproducible run's checkpoint does carry generator states ...
    for name, (_, out_dir) in exports.items():
        files = sorted(p.name for p in out_dir.iterdir())
        expected = {"weights.pt", "dense.pt2", "load_model.py", "model.json", "config.json",
                    "privacy_report.json", "PRIVACY.md", "README.md"}
        assert set(files) == expected | ({"vocab.tsv"} if name == "cbow" else set())
        for path in out_dir.iterdir():
            if path.suffix == ".json":
                bad = [p for p, k in _walk_json(json.loads(path.read_text())) if _bad_key(k)]
                assert not bad, (path.name, bad)
            elif path.suffix == ".pt":
                assert _only_plain(torch.load(path, weights_only=True))
            elif path.suffix == ".pt2":
                with zipfile.ZipFile(path) as z:
                    for member in z.namelist():
                        data = z.read(member)
                        if member.endswith(".json"):
                            assert not [p for p, k in _walk_json(json.loads(data)) if _bad_key(k)], member
                        elif member.endswith(".pt"):
                            assert _only_plain(torch.load(io.BytesIO(data), weights_only=True)), member
        # ... the export does not, nor the noise seed or the cluster address anywhere
        blob = b"".join(p.read_bytes() for p in out_dir.iterdir())
        assert b"secret-host" not in blob and not re.search(rb"noise_seed\W{0,3}\d", blob)
        config = json.loads((out_dir / "config.json").read_text())
        assert "noise_seed" not in config["privacy"] and "address" not in config["cluster"] and "run_dir" not in config
        original = json.loads((runs[name] / "config.json").read_text())
        for section in ("data", "model", "train"):
            assert config[section] == original[section]
    assert exports["dlrm"][0]["weights"] == "weights.pt"  # safetensors is not a dependency


def test_privacy_report(runs, exports):
    from widedp.accounting import PrivacyLedger

    dlrm = json.loads((exports["dlrm"][1] / "privacy_report.json").read_text())
    summary = json.loads((runs["dlrm"] / "summary.json").read_text())
    ledger = json.loads((runs["dlrm"] / "ledger.json").read_text())
    assert dlrm["epsilon"] == pytest.approx(PrivacyLedger.load(runs["dlrm"] / "ledger.json").epsilon(), rel=1e-12)
    assert dlrm["epsilon"] == pytest.approx(summary["epsilon"], rel=1e-9) and 0 < dlrm["epsilon"] < 3
    assert dlrm["history"] == ledger["history"] and dlrm["delta"] == summary["delta"]
    assert (dlrm["mode"], dlrm["selection"], dlrm["steps"]) == ("sparse", "em", 3)
    assert dlrm["accountant"] == summary["accountant"] == ledger["accountant"]  # the config's (default: auto)
    assert dlrm["noise_multiplier"] == 1.0 and dlrm["sample_rate"] == summary["sample_rate"]
    assert dlrm["target_epsilon"] == 3.0 and dlrm["covered"] and dlrm["unit_of_privacy"].startswith("one training example")
    assert dlrm["reproducible"] and dlrm["debug_metrics"]
    text = " ".join(dlrm["not_covered"])
    assert "only while the noise seed stays secret" in text and "VOID" in text
    assert set(summary["privacy_caveats"]) <= set(dlrm["not_covered"]) and dlrm["caveats"] == summary["privacy_caveats"]
    md = (exports["dlrm"][1] / "PRIVACY.md").read_text()
    assert "differential privacy" in md and "noise seed stays secret" in md

    cbow = json.loads((exports["cbow"][1] / "privacy_report.json").read_text())
    assert len(cbow["data_preparation_events"]) == 1 and "private vocabulary" in cbow["data_preparation_events"][0]
    assert cbow["history"][0]["event"]["type"] == "GaussianPartitionSelectionDpEvent"  # charged before step 1
    assert cbow["vocabulary"]["status"] == "private" and "releasable" in cbow["vocabulary"]["note"]
    assert (exports["cbow"][1] / "vocab.tsv").read_text() == (runs["text"] / "vocab.tsv").read_text()
    assert not cbow["reproducible"] and not cbow["debug_metrics"]
    # the converter's note names the (test-only) vocabulary seed mode, never its value
    assert "--vocab-noise-seed" in cbow["data_preparation_events"][0]
    assert not any("=5" in c for c in cbow["not_covered"] + cbow["data_preparation_events"])
    spec = json.loads((exports["cbow"][1] / "model.json").read_text())
    assert spec["output"]["kind"] == "scores" and spec["dense"]["format"] == "torch.export"
    assert json.loads((exports["dlrm"][1] / "model.json").read_text())["output"]["kind"] == "logit"


def test_nonprivate_export_through_the_cli(runs, tmp_path, capsys, monkeypatch):
    import widedp.trainer.cli as cli
    from widedp.trainer.data import synth_text

    data = tmp_path / "text"
    synth_text(data, num_examples=400, vocab=50, seed=1, negatives=2)
    (data / "vocab.tsv").write_text("".join(f"word{i}\n" for i in range(50)))
    run = _run(tmp_path, "run", data, "model.name=cbow", "model.embedding_dim=4", "train.batch_size=16",
               "train.steps=2", "train.mode=nonprivate")
    assert cli.COMMAND_HELP["export"][0] == "widedp.trainer.cli.export"  # `widedp export` is a registered command
    assert cli.main(["export", str(run), str(tmp_path / "out")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["epsilon"] is None and printed["private"] is False and printed["mode"] == "nonprivate"
    report = json.loads((tmp_path / "out" / "privacy_report.json").read_text())
    assert report["epsilon"] is None and report["private"] is False and report["guarantee"] == "no privacy guarantee"
    assert report["history"] == [] and not report["covered"] and "no privacy guarantee" in report["not_covered"][0]
    assert report["vocabulary"]["status"] == "public" and "taken as public" in report["vocabulary"]["note"]
    assert "No privacy guarantee" in (tmp_path / "out" / "PRIVACY.md").read_text()
    # through the CLI, errors are one line and exit code 2; --run-dir/--out-dir as `widedp evaluate` spells it
    assert cli.main(["export", str(run), str(tmp_path / "out")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli.main(["export", "--run-dir", str(run), "--out-dir", str(tmp_path / "out2")]) == 0
    assert json.loads(capsys.readouterr().out)["out_dir"] == str(tmp_path / "out2")
    assert cli.main(["export", str(run), str(tmp_path / "out3"), "--run-dir", str(run)]) == 2
    assert "not both" in capsys.readouterr().err


def test_bad_inputs(runs, tmp_path, monkeypatch):
    import widedp.trainer.release.export as export

    partial = tmp_path / "partial"
    partial.mkdir()
    for f in ("summary.json", "config.json"):
        shutil.copy(runs["dlrm"] / f, partial / f)
    with pytest.raises(ValueError, match="checkpoint.pt"):
        export_run(partial, tmp_path / "o1")
    (partial / "summary.json").unlink()
    with pytest.raises(ValueError, match="checkpoint.pt, summary.json"):
        export_run(partial, tmp_path / "o1")
    assert not (tmp_path / "o1").exists()

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        export_run(runs["dlrm"], occupied)
    assert [p.name for p in occupied.iterdir()] == ["keep.txt"] and (occupied / "keep.txt").read_text() == "mine"

    empty = tmp_path / "empty"
    empty.mkdir()  # an existing empty directory is fine
    export_run(runs["cbow"], empty)
    assert (empty / "model.json").exists()

    def boom(*_):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export, "privacy_markdown", boom)  # after the weights and dense part are written
    parent = tmp_path / "fail"
    parent.mkdir()
    with pytest.raises(RuntimeError, match="disk full"):
        export_run(runs["cbow"], parent / "out")
    assert list(parent.iterdir()) == []  # no OUT_DIR, no temporary directory left


def test_export_reports_privacy_only_from_a_ledger_that_extends_the_checkpoints(runs, tmp_path):
    """The privacy report's ε comes from ledger.json, which must be there and extend the ledger
    the checkpoint embeds: a deleted or rolled-back ledger.json is refused (the checkpoint's copy
    misses the steps released after it), as `--resume` refuses it."""
    from widedp.accounting import PrivacyLedger

    run = tmp_path / "run"
    shutil.copytree(runs["dlrm"], run)
    (run / "ledger.json").unlink()
    with pytest.raises(ValueError, match="ledger.json: missing"):
        export_run(run, tmp_path / "o1")
    shutil.copy(runs["dlrm"] / "ledger.json", run / "ledger.json")
    ledger = PrivacyLedger.load(run / "ledger.json")
    shorter = PrivacyLedger(ledger.accountant.name, ledger.delta)
    for event, count in ledger.history[:-1]:
        shorter.record(event, count)
    shorter.save(run / "ledger.json")
    with pytest.raises(ValueError, match="rolled back|differ from those"):
        export_run(run, tmp_path / "o2")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
