"""`widedp report`, the RESULTS generator, and smoke runs of the benchmark scripts at their
smallest configurations (each under ~20 s; phase_breakdown needs Ray actors and is slower,
so it is not run here). Benchmarks write their data under a temporary WIDEDP_BENCH_DATA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from widedp.trainer.cli import main

# make test runs on two xdist workers (--dist loadgroup): the module's trained runs stay on one worker.
pytestmark = pytest.mark.xdist_group("test_benchmarks_report")

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["model.embedding_dim=4", "model.bottom_mlp=[8]", "model.top_mlp=[8]", "train.batch_size=64",
        "train.log_every=2", "privacy.k=50", "cluster.backend=local", "cluster.num_shards=2"]


def _sets(items):
    return [x for item in items for x in ("--set", item)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from widedp.trainer.data import synth_ctr

    root = tmp_path_factory.mktemp("report")
    synth_ctr(root / "data", num_examples=2000, table_sizes=300, seed=1)
    config = root / "run.toml"
    config.write_text(f'[data]\npath = "{root / "data"}"\n[train]\nsteps = 6\neval_every = 2\n')
    out = {}
    for mode in ("sparse", "nonprivate"):
        code = main(["train", "--config", str(config), "--run-dir", str(root / mode), "--no-progress",
                     *_sets(TINY + [f"train.mode={mode}"])])
        assert code == 0
        out[mode] = root / mode
    return out


def _is_png(path: Path) -> bool:
    return path.exists() and path.read_bytes()[:8] == PNG_MAGIC


def test_report_one_run_writes_plots_and_markdown(runs, capsys):
    capsys.readouterr()
    assert main(["report", str(runs["sparse"]), "--curve-points", "3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    out = runs["sparse"] / "report"
    assert Path(printed["markdown"]) == out / "report.md"
    for name in ("loss.png", "epsilon.png", "phases.png"):
        assert _is_png(out / name), name
        assert str(out / name) in printed["plots"]
    md = (out / "report.md").read_text()
    summary = json.loads((runs["sparse"] / "summary.json").read_text())
    assert "sparse/em" in md and "![loss.png](loss.png)" in md
    # numbers in the markdown are the summary's, and the ledger is re-accounted per accountant
    assert f"{summary['epsilon']:.4g} ({summary['accountant']})" in md  # the accountant the run recorded with
    assert "| sparse | " in md and "unsupported" in md  # PLD/PRV cannot bound the EM event


def test_report_several_runs_overlays_and_marks_nonprivate(runs, capsys, tmp_path):
    assert main(["report", str(runs["sparse"]), str(runs["nonprivate"]), "--out", str(tmp_path / "r"),
                 "--curve-points", "2"]) == 0
    capsys.readouterr()
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| nonprivate | nonprivate |" in md and "(non-private)" in md
    assert _is_png(tmp_path / "r" / "loss.png")


def test_report_rejects_a_directory_without_summary(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "summary.json" in capsys.readouterr().err


# ---- the RESULTS generator -----------------------------------------------------------------------

def _machine():
    return {"cpu": "TestCPU 9000", "logical_cores": 64, "physical_cores": 32, "torch_threads": 64,
            "torch_interop_threads": 32, "memory_gib": 512.0, "gpu": False, "platform": "Linux", "python": "3.11",
            "versions": {"torch": "x"}, "load_average_start": [0.1, 0, 0], "load_average_end": [0.2, 0, 0]}


def _engine_result(rows, mode, ms, **extra):
    return {"rows": rows, "mode": mode, "step_ms_median": ms, "step_ms_min": ms, "examples_per_sec": 1000 / ms * 1000,
            "rows_touched_mean": 5000.0, "rows_selected_mean": 1000.0 if mode == "sparse" else float(rows),
            "bytes_to_shards_per_step": 1e6, "bytes_from_shards_per_step": 2e6, "peak_tree_rss_bytes": 3e9,
            "phase_ms_median": {"lookup": ms / 2, "write_back": ms / 4}, "selection": "em" if mode == "sparse" else None,
            "config": "configs/ctr.toml", "backend": "ray", "vocabulary_size": rows, "batch_mean": 1000.0, **extra}


def test_results_generator_reads_its_numbers_from_the_json(tmp_path):
    sys.path.insert(0, str(BENCH))
    import make_results

    res = tmp_path / "results"
    res.mkdir()
    scaling = {"benchmark": "table_scaling", "quick": False, "machine": _machine(), "config": "configs/ctr.toml",
               "batch": 777, "k": 333, "dim": 16, "optimizer": "sgd", "steps": 10, "skipped": [],
               "results": [_engine_result(10**4, "sparse", 123.25), _engine_result(10**7, "sparse", 135.5),
                           _engine_result(10**4, "dpsgd", 150.0), _engine_result(10**7, "dpsgd", 98765.0)],
               "ratios": {"sparse_1e7_over_1e4": {"ratio": 135.5 / 123.25, "goal": 1.3, "met": True},
                          "dpsgd_largest_over_smallest": {"rows": [10**4, 10**7], "ratio": 98765.0 / 150.0},
                          "dpsgd_1e7_over_1e4": {"ratio": 98765.0 / 150.0, "goal": 1.3, "met": False}}}
    overhead = {"benchmark": "privacy_overhead", "quick": True, "machine": _machine(),
                "results": [dict(_engine_result(10**5, "sparse", 40.0)), dict(_engine_result(10**5, "nonprivate", 10.0))],
                "ratios": {"configs/ctr.toml": {"sparse_over_nonprivate": 0.25, "goal": 0.5, "met": False}}}
    (res / "table_scaling.json").write_text(json.dumps(scaling))
    (res / "quick").mkdir()
    (res / "quick" / "privacy_overhead.json").write_text(json.dumps(overhead))
    path = make_results.render(res, tmp_path / "docs")
    md = make_results.read_rendered(path)
    assert "TestCPU 9000, 64 logical cores (32 physical), torch threads 64" in md
    assert "| 10^7 | dpsgd | 98,765 |" in md and "123" in md and "expected batch 777, k = 333" in md
    assert "| Sparse step time at 10^7 rows ≤ 1.3× its time at 10^4 | 1.1× (medians) | **met**" in md
    assert "sparse / nonprivate throughput ≥ 0.5 | 0.25 | **missed**" in md
    dpsgd_goal = next(line for line in md.splitlines() if line.startswith("| dpsgd (lazy noise) step time at 10^7"))
    assert "**missed**" in dpsgd_goal, dpsgd_goal
    assert "privacy_overhead are `--quick` runs" in md  # the fallback to quick/ is labelled
    assert "Not run yet: `python benchmarks/opacus_compare.py`" in md
    assert _is_png(tmp_path / "docs" / "plots" / "step_time_vs_rows.png")
    assert "![step_time_vs_rows](../plots/step_time_vs_rows.png)" in md  # on the section's own page
    summary = path.read_text()
    # The summary links every section (one line each) and lists the goal rows of those with data:
    # short, but it grows by a line per section (27 sections and this test's few rows: ~80).
    assert "(results/1-step-time-versus-table-size.md)" in summary and len(summary.splitlines()) < 90


# ---- smoke runs of the benchmark scripts (smallest configurations) --------------------------------

def _bench(script, args, tmp_path, timeout=120):
    env = dict(os.environ, WIDEDP_BENCH_DATA=str(tmp_path / "data"))
    out = tmp_path / f"{script}.json"
    proc = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), *args, "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_communication_smoke_and_results_round_trip(tmp_path):
    doc, stdout = _bench("communication", ["--rows", "2000", "--examples", "2000", "--modes", "sparse,nonprivate",
                                           "--backend", "local", "--steps", "1", "--batch", "64", "--k", "50"], tmp_path)
    by = {r["mode"]: r for r in doc["results"]}
    assert "error" not in by["sparse"], by["sparse"]
    assert by["sparse"]["rows_selected_mean"] == 50
    # write-back of the 50 selected rows: int64 table + int64 row id + dim float32 values per row,
    # plus each shard's two scalars (the step's lr multiplier and its step index)
    dim, shards = doc["dim"], by["sparse"]["num_shards"]
    assert by["sparse"]["bytes_per_step"]["apply_rows"]["to"] == 50 * (16 + 4 * dim) + shards * 2 * 8
    assert doc["summary"]["dense_write_back_bytes"] == 2000 * dim * 4
    assert "dense / sparse write-back" in stdout and doc["machine"]["logical_cores"] == os.cpu_count()
    sys.path.insert(0, str(BENCH))
    import make_results

    res = tmp_path / "res"
    res.mkdir()
    (res / "communication.json").write_text(json.dumps(doc))
    md = make_results.read_rendered(make_results.render(res, tmp_path / "docs"))
    ratio = doc["summary"]["dense_over_sparse_write_back"]
    assert f"= **{make_results.f(ratio)}×**" in md


def test_table_scaling_smoke(tmp_path):
    doc, stdout = _bench("table_scaling", ["--min-exp", "3", "--max-exp", "3", "--modes", "sparse,nonprivate",
                                           "--backend", "local", "--steps", "1", "--warmup", "0", "--examples", "2000",
                                           "--batch", "64", "--k", "50"], tmp_path)
    assert {r["mode"] for r in doc["results"] if "error" not in r} == {"sparse", "nonprivate"}
    assert "sparse / nonprivate throughput at 1e+03 rows" in stdout
    assert all(r["peak_tree_rss_bytes"] > 0 and r["ru_maxrss_bytes"] > 0 for r in doc["results"])


def test_opacus_compare_smoke(tmp_path):
    doc, _ = _bench("opacus_compare", ["--vocabs", "1000", "--systems", "opacus-ghost,widedp-sparse-inprocess",
                                       "--steps", "1", "--warmup", "1", "--examples", "2000"], tmp_path)
    by = {r["system"]: r for r in doc["results"]}
    assert "error" not in by["opacus-ghost"], by["opacus-ghost"]
    assert "error" not in by["widedp-sparse-inprocess"], by["widedp-sparse-inprocess"]
    assert by["opacus-ghost"]["vocab"] == 1000 and by["opacus-ghost"]["examples_per_sec"] > 0


def test_privacy_utility_smoke(tmp_path):
    (tmp_path / "tuning").mkdir()
    (tmp_path / "tuning" / "cbow_sparse_eps8.json").write_text(json.dumps(
        {"set": ["data.validation_fraction=0.1"], "chosen_on": "validation",
         "best": {"overrides": ["data.validation_fraction=0.1", "train.lr=0.25"]}}))
    doc, stdout = _bench("privacy_utility", ["--datasets", "cbow", "--eps", "8", "--seeds", "0", "--modes",
                                             "sparse,dpsgd", "--selections", "em-count,random", "--steps", "3", "--examples", "1000",
                                             "--backend", "local", "--runs-dir", str(tmp_path / "runs"),
                                             "--tuning-dir", str(tmp_path / "tuning"), "--jobs", "2"], tmp_path)
    assert not [r for r in doc["records"] if "error" in r]
    modes = {(p["mode"], p["selection"]) for p in doc["points"]}
    assert modes == {("sparse", "em-count"), ("sparse", "random"), ("dpsgd", None)}
    for r in doc["records"]:  # the sparse sweep's lr for every selector; no dpsgd sweep
        assert r["tuned"] == (["train.lr=0.25"] if r["mode"] == "sparse" else [])
        cfg = json.loads((REPO / r["run_dir"] / "config.json").read_text())  # run_dir: relative to REPO or absolute
        assert (cfg["train"]["lr"] == 0.25) == (r["mode"] == "sparse")
    rec = next(r for r in doc["records"] if r["mode"] == "sparse")
    assert rec["epsilon"] <= 8 + 1e-6 and "rdp" in rec["accountants"] and "paper" in rec["accountants"]
    assert "cbow: sparse/em-count <= dpsgd (loss) at every ε" in stdout
    assert "cbow: best sparse within 0 of dpsgd (loss) at every ε" in stdout
    sparse = next(p for p in doc["points"] if p["mode"] == "sparse")
    dpsgd = next(p for p in doc["points"] if p["mode"] == "dpsgd")
    assert dpsgd["rows_noised_median"] == 2000  # every row of the 2 × 1000-row tables
    assert sparse["rows_noised_ratio"] == pytest.approx(2000 / sparse["rows_noised_median"])
    assert set(doc["goals"]["cbow"]["em_beats_random"]) == {"em-count"}  # em (norm utility) was not run
    assert "cbow: em-count beats random at every ε:" in stdout
    sys.path.insert(0, str(BENCH))
    import make_results

    res = tmp_path / "res"
    res.mkdir()
    (res / "privacy_utility.json").write_text(json.dumps({**doc, "machine": _machine()}))
    md = make_results.read_rendered(make_results.render(res, tmp_path / "docs"))
    assert "| cbow: sparse/em-count beats sparse/random at every ε |" in md
    assert "- cbow sparse ε = 8: `train.lr=0.25`" in md  # the tuned values and their sweep are stated
    assert "| cbow: best sparse within 0 of dpsgd test loss at every ε |" in md
    assert f"{make_results.f(sparse['rows_noised_ratio'])}×" in md


def test_privacy_utility_uses_only_sweeps_chosen_on_validation(tmp_path):
    sys.path.insert(0, str(BENCH))
    import privacy_utility

    sweep = {"set": ["cluster.backend=local", "data.validation_fraction=0.1"], "chosen_on": "validation",
             "best": {"overrides": ["cluster.backend=local", "data.validation_fraction=0.1", "train.lr=0.5",
                                    "train.dense_lr=2"]}}
    (tmp_path / "cbow_sparse_eps8.json").write_text(json.dumps(sweep))
    (tmp_path / "cbow_dpsgd_eps8.json").write_text(json.dumps({**sweep, "chosen_on": "test"}))
    tuned, source = privacy_utility.tuned_overrides("cbow", "sparse", 8.0, tmp_path)
    assert tuned == ["train.lr=0.5", "train.dense_lr=2"] and source.endswith("cbow_sparse_eps8.json")
    assert privacy_utility.tuned_overrides("cbow", "dpsgd", 8.0, tmp_path) == ([], None)  # chosen on test: ignored
    assert privacy_utility.tuned_overrides("cbow", "sparse", 1.0, tmp_path) == ([], None)
    assert privacy_utility.tuned_overrides("cbow", "nonprivate", None, tmp_path) == ([], None)


def test_tune_refuses_a_validation_fraction_outside_0_1(capsys):
    sys.path.insert(0, str(BENCH))
    import tune

    with pytest.raises(SystemExit):
        tune.main(["--config", "configs/ctr.toml", "--name", "x", "--validation-fraction", "1.5"])
    assert "--validation-fraction must be in [0, 1), got 1.5" in capsys.readouterr().err


@pytest.mark.parametrize("seeds", ["1,x", "-1", "3,3"])
def test_tune_refuses_seeds_that_are_not_distinct_nonnegative_integers(capsys, seeds):
    sys.path.insert(0, str(BENCH))
    import tune

    with pytest.raises(SystemExit):
        tune.main(["--config", "configs/ctr.toml", "--name", "x", "--seeds", seeds])
    assert f"--seeds {seeds!r}" in capsys.readouterr().err


def test_tune_chooses_on_the_median_over_seeds_and_a_failed_seed_fails_its_point():
    """One record per point: metrics are medians over its seeds with their ranges; the seed
    override is not part of the point (so `best` can be applied as it is); one failed seed makes
    the whole point a failure rather than a median of the others."""
    sys.path.insert(0, str(BENCH))
    import tune

    def run(lr, seed, auc, error=None):
        r = {"overrides": ["data.validation_fraction=0.1", f"train.lr={lr}", f"train.seed={seed}"], "run_dir": f"p{lr}_{seed}"}
        if error:
            return {**r, "error": error}
        return {**r, "validation_metrics": {"auc": auc, "logloss": 0.5}, "test_metrics": {"auc": auc - 0.01},
                "noise_multiplier": 4.0, "rows_selected_mean": 100.0 * seed, "wall_s": 1.0}

    points = tune.median_over_seeds([run(3, 0, 0.70), run(3, 1, 0.76), run(3, 2, 0.72),
                                     run(5, 0, 0.80), run(5, 1, 0.60), run(5, 2, 0.61),
                                     run(7, 0, 0.90), run(7, 1, 0.0, error="RuntimeError: diverged"), run(7, 2, 0.90)])
    by_lr = {p["overrides"][-1]: p for p in points}
    assert set(by_lr) == {"train.lr=3", "train.lr=5", "train.lr=7"}
    three = by_lr["train.lr=3"]
    assert three["overrides"] == ["data.validation_fraction=0.1", "train.lr=3"] and three["seeds"] == [0, 1, 2]
    assert three["validation_metrics"]["auc"] == 0.72 and three["validation_range"]["auc"] == [0.70, 0.76]
    assert three["test_metrics"]["auc"] == pytest.approx(0.71) and three["rows_selected_mean"] == 100.0
    assert by_lr["train.lr=5"]["validation_metrics"]["auc"] == 0.61  # the median, not the best seed's 0.80
    assert "validation_metrics" not in by_lr["train.lr=7"] and "train.seed=1" in by_lr["train.lr=7"]["error"]


@pytest.mark.parametrize("script, argv, message", [
    ("trainer_scaling", ["--repeats", "0"], "--repeats must be >= 1, got 0"),
    ("text_large", ["--jobs", "0"], "--jobs must be >= 1, got 0")])
def test_repeat_and_job_counts_below_one_are_refused_naming_the_flag(capsys, script, argv, message):
    """Refused before any data is built or downloaded, naming the flag and the value."""
    sys.path.insert(0, str(BENCH))
    module = __import__(script)
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_paper_fig1_smoke(tmp_path):
    doc, _ = _bench("paper_fig1", ["--runs", "sparse em,nonprivate", "--steps", "5", "--examples", "2000",
                                   "--eval-examples", "200", "--points", "2"], tmp_path)
    runs = {r["name"]: r for r in doc["runs"]}
    assert "error" not in runs["sparse em"], runs["sparse em"]
    em = runs["sparse em"]
    assert em["k"] == 2  # γ = 0.001 of 2 × 1000 rows
    assert em["curve"]["step"][0] == 0 and em["curve"]["step"][-1] == 5
    assert em["accountants"]["rdp"]["epsilon"] <= 30 + 1e-6
    assert set(em["epsilon_curves"]) >= {"steps", "rdp", "paper"}


def test_privacy_overhead_smoke(tmp_path):
    doc, _ = _bench("privacy_overhead", ["--configs", "configs/cbow.toml", "--modes", "sparse,nonprivate", "--backend",
                                         "local", "--steps", "1", "--warmup", "0", "--set", "data.synth_examples=2000",
                                         "--set", f"data.path={tmp_path / 'data' / 'po'}"], tmp_path)
    assert "configs/cbow.toml" in doc["ratios"]
    assert doc["ratios"]["configs/cbow.toml"]["sparse_over_nonprivate"] > 0


def test_tune_sweep_smoke_and_results_section(tmp_path):
    from widedp.trainer.data import synth_ctr

    synth_ctr(tmp_path / "ctr", num_examples=1500, table_sizes=200, seed=2)
    config = tmp_path / "t.toml"
    config.write_text(f'[data]\npath = "{tmp_path / "ctr"}"\n[train]\nsteps = 3\n')
    doc, stdout = _bench("tune", ["--config", str(config), "--name", "smoke", "--jobs", "1", "--runs-dir",
                                  str(tmp_path / "runs"), *_sets(TINY), "--grid", "train.lr=0.1,1"], tmp_path)
    assert [r["overrides"][len(TINY):] for r in doc["records"]] == [["data.validation_fraction=0.1", "train.lr=0.1"],
                                                                     ["data.validation_fraction=0.1", "train.lr=1"]]
    assert all("auc" in r["test_metrics"] and "auc" in r["validation_metrics"] for r in doc["records"])
    assert doc["metric"] == "auc" and doc["chosen_on"] == "validation"
    # chosen on the validation split, not on the test split
    assert doc["best"]["validation_metrics"]["auc"] == max(r["validation_metrics"]["auc"] for r in doc["records"])
    assert "best (highest validation auc)" in stdout
    sys.path.insert(0, str(BENCH))
    import make_results

    res = tmp_path / "res"
    (res / "tuning").mkdir(parents=True)
    (res / "tuning" / "smoke.json").write_text(json.dumps(doc))
    md = make_results.read_rendered(make_results.render(res, tmp_path / "docs"))
    assert "# 9. Hyperparameter tuning" in md and "**train.lr=" in md
    assert "best point chosen on the validation split" in md
    assert f"{doc['best']['validation_metrics']['auc']:.4f} | {doc['best']['test_metrics']['auc']:.4f}" in md


def test_dlrm_compare_smoke_and_results_section(tmp_path, monkeypatch):
    # one torch thread per worker: on a busy 2-core machine OpenMP spin-waiting makes tiny steps ~100x slower
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    systems = ["pytorch-nonprivate", "opacus-ghost", "widedp-sparse-inprocess"]
    doc, stdout = _bench("dlrm_compare", ["--quick", "--rows", "500", "--systems", ",".join(systems), "--steps", "2",
                                          "--warmup", "1"], tmp_path)
    assert doc["benchmark"] == "dlrm_compare" and doc["quick"] is True
    assert doc["rows"] == [500] and doc["tables"] == 26 and doc["batch"] == 64 and doc["systems"] == systems
    assert (doc["dim"], doc["bottom_mlp"], doc["top_mlp"], doc["interaction"]) == (16, [64], [64], "cat")
    by = {r["system"]: r for r in doc["results"]}
    assert set(by) == set(systems)
    for s in systems:
        assert "error" not in by[s], by[s]
        assert by[s]["rows"] == 500 and by[s]["step_ms_median"] > 0 and by[s]["steps_timed"] >= 1
        assert by[s]["peak_tree_rss_bytes"] > 0
    assert by["opacus-ghost"]["table_rows"] == [500] * 26
    assert by["widedp-sparse-inprocess"]["mode"] == "sparse" and by["widedp-sparse-inprocess"]["backend"] == "local"
    ratios = doc["summary"]["ratios"]["500"]
    assert set(ratios) == set(systems)
    assert ratios["pytorch-nonprivate"]["x_floor"] == 1.0 and ratios["opacus-ghost"]["opacus_over"] == 1.0
    goals = {g["goal"]: g for g in doc["summary"]["goals"]}
    assert len(goals) == 6
    ray = next(g for t, g in goals.items() if t.startswith("Ray sparse step ≤"))
    assert ray["met"] is None and ray["per_size"]["500"]["value"] is None  # Ray was not run
    assert "goals (measured in this run):" in stdout and "× floor" in stdout
    sys.path.insert(0, str(BENCH))
    import make_results

    res = tmp_path / "res"
    res.mkdir()
    (res / "dlrm_compare.json").write_text(json.dumps(doc))
    md = make_results.read_rendered(make_results.render(res, tmp_path / "docs"))
    assert "# 2b. DLRM-style CTR step" in md and "| 26 × 500 ms | × floor | Opacus / system |" in md
    assert f"| {make_results.f(ratios['widedp-sparse-inprocess']['step_ms'])} |" in md
    assert "| Ray sparse step ≤ 1.3× the in-process sparse step (same shards) at every size |" in md


def test_dlrm_compare_goals_from_step_times():
    sys.path.insert(0, str(BENCH))
    import dlrm_compare as dc

    sizes = [20000, 262144]

    def times(floor, opacus, sparse, ray, dpsgd, compiled=None):
        out = {}
        for rows in sizes:
            for system, ms in (("pytorch-nonprivate", floor), ("opacus-ghost", opacus), ("widedp-sparse-inprocess", sparse),
                               ("widedp-sparse-sharded", sparse), ("widedp-sparse-ray", ray), ("widedp-dpsgd", dpsgd),
                               ("widedp-sparse-ray-compiled", ray if compiled is None else compiled)):
                out[(system, rows)] = ms[rows] if isinstance(ms, dict) else ms
        return out

    fast = dc.evaluate_goals(times(10.0, {20000: 100.0, 262144: 2000.0}, 20.0, 25.0, 90.0), sizes)
    assert [g["met"] for g in fast] == [True, True, True, True, True, False]  # lazy dpsgd at 9x the floor
    lazy = dc.evaluate_goals(times(10.0, 1000.0, 20.0, 25.0, 28.0), sizes)[5]
    assert lazy["met"] is True and lazy["per_size"][20000] == {"value": 2.8, "target": 3.0, "met": True}
    # the compiled plane's goal tightens with the batch: 1.4x meets 1.5x at b = 1k, misses 1.2x at 16k
    assert dc.evaluate_goals(times(10.0, 1000.0, 20.0, 25.0, 90.0, compiled=28.0), sizes, 1024)[4]["met"] is True
    assert dc.evaluate_goals(times(10.0, 1000.0, 20.0, 25.0, 90.0, compiled=28.0), sizes, 16384)[4]["met"] is False
    assert fast[1]["per_size"][262144] == {"value": 100.0, "target": 50.0, "met": True}
    slow = dc.evaluate_goals(times(10.0, {20000: 100.0, 262144: 2000.0}, 40.0, 60.0, 2500.0, compiled=80.0), sizes)
    assert [g["met"] for g in slow] == [False, False, False, False, False, False]
    # each size is judged against its own target: 6x >= 5x at 20k, 40x < 50x at 262k
    mixed = dc.evaluate_goals(times(10.0, {20000: 60.0, 262144: 400.0}, 10.0, 12.0, 50.0), sizes)
    assert mixed[1]["per_size"][20000]["met"] is True and mixed[1]["per_size"][262144]["met"] is False
    assert mixed[1]["met"] is False
    assert mixed[2]["per_size"][20000]["met"] is True and mixed[2]["per_size"][262144]["met"] is True
    # a missing measurement is "not measured", unless a measured size already missed
    partial = {k: v for k, v in times(10.0, 1000.0, 20.0, 25.0, 90.0).items() if k[0] != "widedp-sparse-ray"}
    assert dc.evaluate_goals(partial, sizes)[3]["met"] is None
    partial[("widedp-sparse-ray", 20000)] = 100.0
    assert dc.evaluate_goals(partial, sizes)[3]["met"] is False
    # quick sizes: 5x at the smallest, 50x at the largest
    assert dc.speedup_goal(500, [500, 2000]) == 5.0 and dc.speedup_goal(2000, [500, 2000]) == 50.0
    assert ": missed — " in dc.goal_line(slow[0]) and ": met — " in dc.goal_line(fast[0])
    # the Ray goal compares Ray with the in-process run on the same shards, not with one shard
    placed = {**times(10.0, 1000.0, 20.0, 25.0, 90.0), **{("widedp-sparse-sharded", r): 40.0 for r in sizes}}
    assert dc.evaluate_goals(placed, sizes)[3]["per_size"][20000]["value"] == 25.0 / 40.0


def test_trainer_scaling_section_reports_work_per_trainer_from_the_json(tmp_path):
    """The RESULTS section of benchmarks/trainer_scaling.py: ratios per trainer against N = 1
    computed from the JSON, and the goal 'reported' only when N = 1, 2 and 4 were measured."""
    sys.path.insert(0, str(BENCH))
    import make_results

    def result(label, n, cpu, traffic, nodes):
        return {"label": label, "num_trainers": n, "step_ms_median": 100.0, "examples_per_sec": 1000.0 * n,
                "coordinator_bytes_per_step": {"to": 1000, "from": 2000},
                "trainers": [{"trainer": i, "node": nodes[i % len(nodes)], "cpu_ms_per_step": cpu,
                              "bytes_to_shards_per_step": traffic, "bytes_from_shards_per_step": 0} for i in range(n)]}

    doc = {"benchmark": "trainer_scaling", "quick": False, "machine": _machine(), "rows": 520000, "shards": 2, "nodes": 3,
           "selection": "threshold",
           "results": [result("in-process", 1, 50.0, 4e6, ["a"]), result("ray N=1", 1, 40.0, 4e6, ["a"]),
                       result("ray N=2", 2, 20.0, 2e6, ["a", "b"])]}
    res = tmp_path / "results"
    res.mkdir()
    (res / "trainer_scaling.json").write_text(json.dumps(doc))
    md = make_results.read_rendered(make_results.render(res, tmp_path / "docs"))
    assert "| ray N=2 | 100 | 2,000 | 2× | 20 / 20 | 0.5 |" in md
    assert "N = 2: CPU per trainer 0.5× and bytes per trainer 0.5× N = 1's" in md
    assert "not measured at every N" in md  # N = 4 is missing


def test_audit_section_marks_a_private_claim_exceeded_and_an_unflagged_broken_run(tmp_path):
    """The RESULTS section of benchmarks/privacy_audit.py reads its verdicts from the JSON: a
    private run whose bound exceeds its claim is VIOLATED and the goal missed; a broken run
    below 1 is 'not flagged'; with every verdict right both goals are met."""
    sys.path.insert(0, str(BENCH))
    import make_results

    def run(label, mode, claimed, bound, broken=None):
        return {"model": "ctr", "label": label, "mode": mode, "broken": broken, "claimed_epsilon": claimed,
                "epsilon_lower_bound": bound, "correct": 60, "guesses": 100, "members": 500,
                "member_score_quantiles": [0.0, 0.1, 0.2], "non_member_score_quantiles": [0.0, 0.0, 0.0]}

    good = [run("nonprivate", "nonprivate", float("inf"), 3.4), run("dpsgd", "dpsgd", 1.0, 0.0),
            run("sparse/em", "sparse", 1.0, 0.5), run("dpsgd BROKEN noise-off", "dpsgd", 1.0, 3.1, "noise-off")]
    res = tmp_path / "results"
    res.mkdir()
    for name, results in (("good", good), ("bad", [*good[:-1], run("sparse/em", "sparse", 1.0, 1.7),
                                                    run("sparse BROKEN noise-off", "sparse", 1.0, 0.2, "noise-off")])):
        doc = {"benchmark": "privacy_audit", "quick": False, "machine": _machine(), "canaries": 1000,
               "member_fraction": 0.1, "confidence": 0.95, "results": results}
        (res / "privacy_audit.json").write_text(json.dumps(doc))
        md = make_results.read_rendered(make_results.render(res, tmp_path / name))
        goals = [line for line in md.splitlines() if line.startswith("| One-run ε lower bound") or
                 line.startswith("| Non-private and broken runs")]
        assert len(goals) == 2
        if name == "good":
            assert all("**met**" in g for g in goals) and "VIOLATED" not in md
            assert "With all 100 guesses right the bound is 3.49" in md
        else:
            assert all("**missed**" in g for g in goals)
            assert "| ctr | sparse/em | 1 | 1.7 | 60/100 | 500 |" in md and "**VIOLATED**" in md
            assert "not flagged: ctr sparse BROKEN noise-off" in md


def test_exposure_section_reads_flags_and_goals_from_the_json(tmp_path):
    sys.path.insert(0, str(BENCH))
    import make_results

    def run(mode, n_c, p):
        return {"mode": mode, "insertions": n_c, "claimed_epsilon": 8.0 if mode != "nonprivate" else float("inf"),
                "p_value": p, "flagged": p < 0.01, "mean_exposure": 2.0, "median_exposure": 1.5,
                "ranks": list(range(1, 10001, 10))}

    doc = {"benchmark": "canary_exposure", "quick": False, "machine": _machine(), "config": "configs/cbow.toml",
           "canaries": 1000, "references": 10000,
           "results": [run("nonprivate", 3, 1e-9), run("dpsgd", 3, 0.4), run("sparse", 9, 0.002), run("sparse", 15, 1e-5)]}
    res = tmp_path / "results"
    res.mkdir()
    (res / "canary_exposure.json").write_text(json.dumps(doc))
    md = make_results.read_rendered(make_results.render(res, tmp_path / "docs"))
    assert "| 9 | sparse | 8 | 0.002 | yes |" in md
    assert "![canary_exposure](../plots/canary_exposure.png)" in md and (tmp_path / "docs/plots/canary_exposure.png").exists()
    # No "placement" in the json: the runs before --placement existed, phrases as lines.
    goal = "| Canary exposure (synthetic, placement line): "
    assert [line for line in md.splitlines() if line.startswith(goal + "non-private")][0].count("**met**") == 1
    assert "**missed**" in [line for line in md.splitlines() if line.startswith(goal + "DP runs")][0]
    assert "as a line of its own" in md


def test_audit_merge_replaces_the_rerun_rows_keeps_the_others_and_refuses_another_m(tmp_path):
    """`privacy_audit.py --only-broken … --merge`: the rows run now replace the same (model,
    label) rows of the results file, the others stay in their order, new rows are appended, the
    payload says what was rerun; a file made with another m is refused."""
    import importlib.util

    sys.path.insert(0, str(BENCH))
    # By path: `import privacy_audit` would find tests/privacy_audit.py (the statistical harness).
    spec = importlib.util.spec_from_file_location("bench_privacy_audit", BENCH / "privacy_audit.py")
    assert spec is not None and spec.loader is not None
    privacy_audit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(privacy_audit)

    def row(label, bound):
        return {"model": "ctr", "label": label, "epsilon_lower_bound": bound}

    old = {"canaries": 1000, "member_fraction": 0.1, "confidence": 0.95, "created": "earlier", "machine": {"cpu": "x"},
           "results": [row("nonprivate", 3.4), row("sparse BROKEN skip-untouched", 0.1), row("dpsgd", 0.0)]}
    path = tmp_path / "privacy_audit.json"
    path.write_text(json.dumps(old))
    new = {"canaries": 1000, "member_fraction": 0.1, "confidence": 0.95,
           "results": [row("sparse BROKEN skip-untouched", 2.0), row("cbow-only row", 1.0)]}
    merged = privacy_audit.merged(new, path)
    assert [(r["label"], r["epsilon_lower_bound"]) for r in merged["results"]] == [
        ("nonprivate", 3.4), ("sparse BROKEN skip-untouched", 2.0), ("dpsgd", 0.0), ("cbow-only row", 1.0)]
    assert sorted(merged["merged"]["rerun"]) == ["ctr cbow-only row", "ctr sparse BROKEN skip-untouched"]
    assert merged["merged"]["other_rows_created"] == "earlier"
    with pytest.raises(SystemExit, match="canaries"):
        privacy_audit.merged({**new, "canaries": 400}, path)


def test_noise_generators_smoke_and_results_section(tmp_path):
    """Both generations of each family are timed in one run, and the section divides each by its
    own family's "before"."""
    sys.path.insert(0, str(BENCH))
    import noise_generators

    doc, stdout = _bench("noise_generators", ["--rows", "300", "--selected", "50", "--repeats", "1"], tmp_path)
    assert [r["way"] for r in doc["rows"]] == ["before", "after", "before-secure", "after-secure"]
    assert all(r["dpsgd_every_row_ms"] > 0 and r["sparse_step_noise_ms"] > 0 for r in doc["rows"])
    lines, goals = noise_generators.results_section(doc)
    before, after = doc["rows"][0], doc["rows"][1]
    ratio = after["dpsgd_every_row_ms"] / before["dpsgd_every_row_ms"]
    assert any(line.startswith("| AES-128-CTR") and f"| {ratio:.2f} |" in line for line in lines)
    assert goals == []


# ---- privacy-utility calibration: logloss, ECE and the base-rate predictor beside AUC ------------

BASE_RATE = 0.5674


def _ctr_records(calibrated: bool = True) -> list:
    """Two seeds per point of a small CTR grid (medians: the values below). ε = 1: dpsgd's logloss
    is above the base rate; ε = 8: the best sparse logloss is 0.005 beyond dpsgd + 0.005."""
    grid = {("nonprivate", None, None): (0.76, 0.50, 0.01), ("dpsgd", None, 1.0): (0.73, 0.570, 0.05),
            ("sparse", "threshold", 1.0): (0.728, 0.560, 0.02), ("sparse", "random", 1.0): (0.71, 0.565, 0.03),
            ("dpsgd", None, 8.0): (0.75, 0.540, 0.01), ("sparse", "threshold", 8.0): (0.745, 0.550, 0.04),
            ("sparse", "random", 8.0): (0.72, 0.552, 0.02)}
    records = []
    for (mode, sel, eps), (auc, logloss, ece) in grid.items():
        for seed, d in ((0, -0.001), (1, 0.001)):
            metrics = {"logloss": logloss + d, "auc": auc + d}
            if calibrated:
                metrics.update(ece=ece + d / 10, base_rate_logloss=BASE_RATE)
            records.append({"dataset": "ctr", "mode": mode, "selection": sel, "target_epsilon": eps, "seed": seed,
                            "epsilon": eps if eps else float("inf"), "steps": 10, "test_metrics": metrics,
                            "bayes_auc": 0.8, "rows_selected_mean": 100.0 if mode == "sparse" else 5000.0,
                            "vocabulary_size": 5000, "tuned": [], "tuned_from": None})
    return records


def _utility_doc(records: list, goals: bool = True) -> dict:
    import privacy_utility

    points = privacy_utility.aggregate(records)
    doc = {"benchmark": "privacy_utility", "quick": False, "machine": _machine(), "eps": [1.0, 8.0], "seeds": [0, 1],
           "settings": {"ctr": {"config": "configs/ctr.toml", "overrides": []}}, "records": records, "points": points,
           "goals": privacy_utility.goals(points)}
    if not goals:  # results written before the calibration goals existed
        for g in doc["goals"].values():
            g.pop("calibration", None)
    return doc


def _goal_row(md: str, start: str) -> str:
    rows = [line for line in md.splitlines() if line.startswith(start)]
    assert len(rows) == 1, (start, rows)
    return rows[0]


def test_privacy_utility_calibration_goals_from_the_points():
    sys.path.insert(0, str(BENCH))
    import privacy_utility

    points = privacy_utility.aggregate(_ctr_records())
    dpsgd1 = next(p for p in points if p["mode"] == "dpsgd" and p["target_epsilon"] == 1.0)
    assert {"auc", "logloss", "ece", "base_rate_logloss"} <= set(dpsgd1["metrics"])
    assert dpsgd1["metrics"]["logloss"]["median"] == pytest.approx(0.570)
    cal = privacy_utility.goals(points)["ctr"]["calibration"]
    best = cal["best_sparse_logloss"]
    assert best["per_epsilon"]["1.0"]["selection"] == "threshold" and best["per_epsilon"]["1.0"]["ok"]
    assert best["per_epsilon"]["8.0"]["selection"] == "threshold" and not best["per_epsilon"]["8.0"]["ok"]
    assert best["all"] is False
    below = cal["below_base_rate"]
    assert below["per_epsilon"]["1.0"]["above"] == {"dpsgd": pytest.approx(0.570)}
    assert below["per_epsilon"]["1.0"]["worst"] == "dpsgd" and below["per_epsilon"]["1.0"]["models"] == 3
    assert below["per_epsilon"]["8.0"]["ok"] and below["all"] is False
    lines = privacy_utility.goal_lines(privacy_utility.goals(points))
    assert "ctr: best sparse logloss <= dpsgd + 0.005 at every ε: missed (ε=1.0: threshold 0.5600 vs 0.5700, " \
           "ε=8.0: threshold 0.5500 vs 0.5400)" in lines
    assert any(line.startswith("ctr: every private model's logloss below the base-rate predictor's at every ε: missed")
               for line in lines)
    # Every logloss below the base rate (shift all down): met.
    low = _ctr_records()
    for r in low:
        r["test_metrics"]["logloss"] -= 0.03
    assert privacy_utility.calibration_goals(privacy_utility.aggregate(low), "ctr")["below_base_rate"]["all"] is True
    # Old records (no ECE, no base rate): the base-rate goal is not measured, the logloss goal still is.
    old = privacy_utility.calibration_goals(privacy_utility.aggregate(_ctr_records(calibrated=False)), "ctr")
    assert old["below_base_rate"]["all"] is None and not old["below_base_rate"]["per_epsilon"]["1.0"]["measured"]
    assert old["best_sparse_logloss"]["all"] is False
    # One seed without the new keys (a reused old run beside a new one): the point still carries them.
    mixed = _ctr_records()
    for r in mixed:
        if r["seed"] == 0:
            del r["test_metrics"]["ece"]
    dp = next(p for p in privacy_utility.aggregate(mixed) if p["mode"] == "dpsgd" and p["target_epsilon"] == 1.0)
    assert dp["metrics"]["ece"]["n"] == 1 and dp["metrics"]["auc"]["n"] == 2


def test_results_show_logloss_and_ece_beside_auc_and_the_calibration_goals(tmp_path):
    sys.path.insert(0, str(BENCH))
    import make_results

    res = tmp_path / "results"
    res.mkdir()
    (res / "privacy_utility.json").write_text(json.dumps(_utility_doc(_ctr_records())))
    md = make_results.read_rendered(make_results.render(res, tmp_path / "docs"))
    assert "| test auc median | min | max | test logloss median | ECE median |" in md
    assert "| dpsgd | 1 | 2 | 0.7300 | 0.7290 | 0.7310 | 0.5700 | 0.0500 |" in md
    assert f"Base-rate log loss (always predicting the test split's mean label; a model's log loss must be below it): {BASE_RATE:.4f}." in md
    best = _goal_row(md, "| ctr: best sparse test logloss ≤ dpsgd's + 0.005 at every ε |")
    assert "ε=1: threshold 0.5600 vs 0.5700; ε=8: threshold 0.5500 vs 0.5400 | **missed** |" in best
    assert "ε=8: short by 0.0050 beyond the tolerance" in best and "ECE 0.040 vs 0.010" in best
    below = _goal_row(md, "| ctr: every private model's test logloss below the base-rate predictor's at every ε |")
    assert f"ε=1: worst dpsgd 0.5700 vs base rate {BASE_RATE:.4f}" in below and "| **missed** |" in below
    assert f"ε=1: 1 of 3 at or above: dpsgd +{0.570 - BASE_RATE:.4f} (ECE 0.050)" in below
    assert "ε=8: all 3 below" in below
    for name in ("auc_vs_eps_ctr", "logloss_vs_eps_ctr"):
        assert f"![{name}](../plots/{name}.png)" in md and _is_png(tmp_path / "docs" / "plots" / f"{name}.png")


def test_results_from_json_written_before_calibration_say_not_measured(tmp_path):
    sys.path.insert(0, str(BENCH))
    import make_results

    res = tmp_path / "results"
    res.mkdir()
    (res / "privacy_utility.json").write_text(json.dumps(_utility_doc(_ctr_records(calibrated=False), goals=False)))
    md = make_results.read_rendered(make_results.render(res, tmp_path / "docs"))
    assert "| dpsgd | 1 | 2 | 0.7300 | 0.7290 | 0.7310 | 0.5700 | — |" in md
    assert "predicting the test split's mean label; a model's log loss must be below it): — (not measured" in md
    below = _goal_row(md, "| ctr: every private model's test logloss below the base-rate predictor's at every ε |")
    assert "| ε=1: —; ε=8: — | **not measured** |" in below
    # the logloss goal needs only logloss, which old results carry: computed from their points
    assert "| **missed** |" in _goal_row(md, "| ctr: best sparse test logloss ≤ dpsgd's + 0.005 at every ε |")


def test_a_reused_run_without_ece_gets_the_missing_metrics_from_its_checkpoint(tmp_path, monkeypatch):
    sys.path.insert(0, str(BENCH))
    import privacy_utility

    import widedp.trainer.run.train as train_mod

    (tmp_path / "checkpoint.pt").write_bytes(b"")
    fresh = {"logloss": 0.5, "auc": 0.71, "ece": 0.02, "base_rate_logloss": 0.56}
    monkeypatch.setattr(train_mod, "evaluate", lambda run_dir: {"test_metrics": dict(fresh)})
    record = {"test_metrics": {"logloss": 0.5, "auc": 0.7}}
    privacy_utility._add_missing_metrics(record, tmp_path)
    assert record["test_metrics"] == {"logloss": 0.5, "auc": 0.7, "ece": 0.02, "base_rate_logloss": 0.56}
    assert record["metrics_from_checkpoint"] == ["ece", "base_rate_logloss"]
    other = {"test_metrics": {"logloss": 0.6, "auc": 0.7}}  # the checkpoint is not the summary's model
    privacy_utility._add_missing_metrics(other, tmp_path)
    assert other["test_metrics"] == {"logloss": 0.6, "auc": 0.7} and "not the summary's" in other["metrics_from_checkpoint_error"]


def test_a_crossover_needs_an_error_below_the_zero_estimates():
    """benchmarks/sparse_mean_estimation.py: beating the Gaussian mechanism while both errors
    exceed ‖z̄‖₂ (what answering 0 costs) is no crossover."""
    sys.path.insert(0, str(BENCH))
    import sparse_mean_estimation as sme

    rows = [{"d": 100, "gaussian": 0.5, "m": 2.0, "norm_zbar": 0.65}, {"d": 1000, "gaussian": 3.0, "m": 2.0, "norm_zbar": 0.65},
            {"d": 10000, "gaussian": 9.0, "m": 0.6, "norm_zbar": 0.65}]
    assert sme.measured_crossover(rows, "m") == 10000  # at 1000 it beats the Gaussian but not the zero estimate
    rows[2]["m"] = 0.7
    assert sme.measured_crossover(rows, "m") is None


@pytest.mark.parametrize("n2_rate, status", [(1200.0, "**met**"), (900.0, "**missed**")])
def test_trainer_wall_clock_goal_at_16k_from_examples_per_second(n2_rate, status):
    """Issue 31's goal 'N = 2 not slower than N = 1 at b = 16k' is computed from the two runs'
    examples/s, and only for a doc at that batch."""
    sys.path.insert(0, str(BENCH))
    import make_results

    def result(n, rate):
        return {"label": f"ray N={n}", "num_trainers": n, "examples_per_sec": rate,
                "trainers": [{"cpu_ms_per_step": 10.0 / n} for _ in range(n)]}

    ok = [result(1, 1000.0), result(2, n2_rate)]
    [(name, measured, got, _)] = make_results.trainer_wall_clock_goal({"batch": 16384}, ok)
    assert got == status and "16,384" in name and f"({make_results.f(n2_rate / 1000.0)}×)" in measured
    assert make_results.trainer_wall_clock_goal({"batch": 1024}, ok) == []
    [(_, _, missing, _)] = make_results.trainer_wall_clock_goal({"batch": 16384}, ok[:1])
    assert missing == "not measured"


@pytest.mark.parametrize("n2_medians, status", [([350.0, 380.0, 390.0], "**met**"), ([390.0, 410.0, 420.0], "**missed**")])
def test_trainer_wall_clock_goal_needs_most_interleaved_repeats_to_agree(n2_medians, status):
    """With interleaved repeats the pooled ratio alone does not meet the goal: at least half of
    the repeats must have N = 2 not slower (here the pooled rate favours N = 2 both times)."""
    sys.path.insert(0, str(BENCH))
    import make_results

    def result(n, rate, medians):
        return {"label": f"ray N={n}", "num_trainers": n, "examples_per_sec": rate, "repeat_step_ms_medians": medians,
                "trainers": [{"cpu_ms_per_step": 10.0 / n} for _ in range(n)]}

    ok = [result(1, 1000.0, [550.0, 400.0, 400.0]), result(2, 1030.0, n2_medians)]
    [(_, measured, got, why)] = make_results.trainer_wall_clock_goal({"batch": 16384}, ok)
    assert got == status and "3 interleaved repeats" in measured
    assert ("N = 2 not slower in 3 of 3 repeats" if status == "**met**" else "in 1 of 3 repeats") in why


def test_privacy_utility_merge_keeps_the_other_data_sets_rows_only(tmp_path):
    """`--merge`: the previous results' records of data sets not run now are kept; a data set run
    now replaces its old rows; nothing to merge without a previous file."""
    sys.path.insert(0, str(BENCH))
    import privacy_utility

    old = {"created": "then", "settings": {"ctr": {"config": "a"}, "criteo_like": {"config": "old"}},
           "records": [{"dataset": "ctr", "seed": 0}, {"dataset": "criteo_like", "seed": 0, "old": True}]}
    path = tmp_path / "privacy_utility.json"
    path.write_text(json.dumps(old))
    new = [{"dataset": "criteo_like", "seed": 0}]
    records, settings, merged = privacy_utility.merge_previous(path, new, {"criteo_like": {"config": "new"}})
    assert records == new + [{"dataset": "ctr", "seed": 0}]
    assert settings == {"ctr": {"config": "a"}, "criteo_like": {"config": "new"}}
    assert merged == {"rerun": ["criteo_like"], "other_rows_created": "then", "other_datasets": ["ctr"]}
    assert privacy_utility.merge_previous(tmp_path / "none.json", new, {"criteo_like": {}}) == (new, {"criteo_like": {}}, None)


def test_gap_levers_compare_each_sweeps_best_with_the_config_as_is_on_validation():
    """RESULTS §9a: each `{set}_{mode}_eps8_*` sweep's best validation point against the
    `_levers` sweep's constant-lr, no-EMA point; the goal is met only when a lever gains half the
    test-split gap to non-private; the clip-only sweep is shown but never counted as a lever."""
    sys.path.insert(0, str(BENCH))
    import make_results

    def rec(overrides, val, test=None):
        return {"overrides": ["privacy.target_epsilon=8", "data.validation_fraction=0.1", *overrides],
                "validation_metrics": {"auc": val}, "test_metrics": {"auc": test or val}}

    def doc(records, fixed=()):
        return {"metric": "auc", "set": ["privacy.target_epsilon=8", *fixed], "records": records}

    tuning = {
        "ctr_dpsgd_eps8_levers": doc([rec(["train.lr_schedule=constant", "train.ema_decay=0"], 0.740),
                                      rec(["train.lr_schedule=constant", "train.ema_decay=0.99"], 0.743)]),
        "ctr_dpsgd_eps8_batch4096": doc([rec(["train.lr=10"], 0.738)], ["train.batch_size=4096"]),
        "ctr_dpsgd_clip_only": doc([rec(["privacy.clip_norm=3"], 0.770)]),
    }
    points = [{"dataset": "ctr", "mode": "nonprivate", "selection": None, "target_epsilon": None,
               "metrics": {"auc": {"median": 0.770}}},
              {"dataset": "ctr", "mode": "dpsgd", "selection": None, "target_epsilon": 8.0,
               "metrics": {"auc": {"median": 0.750}}}]
    lines, goals = make_results.gap_levers(tuning, points)
    assert any("| levers | `train.lr_schedule=constant train.ema_decay=0.99` | 0.7430 | +0.0030 |" in ln for ln in lines)
    assert any("| batch4096 | `train.batch_size=4096 train.lr=10` | 0.7380 | -0.0020 |" in ln for ln in lines)
    assert any("clip only" in ln and "+0.0300" in ln for ln in lines)
    [(name, measured, status, why)] = goals
    assert status == "**missed**" and "best lever +0.0030" in measured and "half the gap 0.0100" in measured
    assert "clip only" not in why
    tuning["ctr_dpsgd_eps8_levers"]["records"].append(rec(["train.lr_schedule=cosine", "train.ema_decay=0"], 0.752))
    assert make_results.gap_levers(tuning, points)[1][0][2] == "**met**"


def test_gap_levers_render_into_results_md(tmp_path):
    """The §9a section and its goal row come out of a whole render (goal rows carry the benchmark);
    a data set the privacy-utility section does not draw ("toy") keeps the rest of the render small."""
    sys.path.insert(0, str(BENCH))
    import make_results

    rec = {"overrides": ["privacy.target_epsilon=8", "data.validation_fraction=0.1", "train.lr_schedule=constant",
                         "train.ema_decay=0"], "validation_metrics": {"auc": 0.74}, "test_metrics": {"auc": 0.74}}
    res = tmp_path / "results"
    (res / "tuning").mkdir(parents=True)
    (res / "tuning" / "toy_sparse_eps8_levers.json").write_text(json.dumps(
        {"name": "toy_sparse_eps8_levers", "config": "configs/ctr.toml", "metric": "auc", "better": "max",
         "chosen_on": "validation", "set": ["privacy.target_epsilon=8"], "records": [rec]}))
    points = [{"dataset": "toy", "mode": m, "selection": sel, "target_epsilon": e, "metrics": {"auc": {"median": v}}}
              for m, sel, e, v in (("nonprivate", None, None, 0.77), ("sparse", "fest-threshold", 8.0, 0.75))]
    (res / "privacy_utility.json").write_text(json.dumps({"benchmark": "privacy_utility", "quick": False,
                                                          "machine": _machine(), "points": points, "goals": {}}))
    md = make_results.read_rendered(make_results.render(res, tmp_path / "docs"))
    assert "# 9a. Levers against the gap to non-private at ε = 8" in md
    assert "| toy sparse: a lever closes half the gap to non-private at ε = 8 |" in md and "(results/9a-levers-against-the-gap-to-non-private-at-8.md) |" in md


@pytest.mark.parametrize("sparse_sigma, rows_ratio, same", [(0.8254, 1.0, True), (0.9, 1.0, False), (0.8254, 2.0, False)])
def test_a_sparse_miss_at_dpsgds_sigma_on_every_row_is_reported_as_the_same_mechanism(sparse_sigma, rows_ratio, same):
    """Where every table is dense by the public rule and σ is DP-SGD's, sparse mode runs DP-SGD's
    mechanism: a loss difference is the noise draw, and the reason says so; with another σ or fewer
    rows noised the two differ in method and the reason does not."""
    sys.path.insert(0, str(BENCH))
    import make_results

    def record(mode, sel, seed, loss, sigma):
        return {"dataset": "cbow", "mode": mode, "selection": sel, "target_epsilon": 1.0, "seed": seed,
                "noise_multiplier": sigma, "test_metrics": {"loss": loss}}

    records = [record("dpsgd", None, s, 3.05 + 0.01 * s, 0.8254) for s in range(3)]
    records += [record("sparse", "fest-threshold", s, 3.06 + 0.01 * s, sparse_sigma) for s in range(3)]
    points = [{"dataset": "cbow", "mode": "dpsgd", "selection": None, "target_epsilon": 1.0, "rows_noised_ratio": 1.0,
               "metrics": {"loss": {"median": 3.06, "min": 3.05, "max": 3.07}}},
              {"dataset": "cbow", "mode": "sparse", "selection": "fest-threshold", "target_epsilon": 1.0,
               "rows_noised_ratio": rows_ratio, "metrics": {"loss": {"median": 3.07, "min": 3.06, "max": 3.08}}}]
    reasons = make_results._UtilityReasons({"points": points, "records": records}, "cbow", "loss", "min")
    text = reasons.versus_dpsgd("fest-threshold", {"per_epsilon": {"1.0": {"ok": False, "sparse": 3.07, "dpsgd": 3.06}}})
    assert text.startswith("ε=1: short by 0.0100 (within the seed ranges)")
    assert ("sparse runs DP-SGD's mechanism here" in text) is same


def test_dlrm_compare_repeats_are_judged_on_the_median_of_their_steps_and_rendered(tmp_path):
    """--repeats: each (system, size) is the median over repeats of each repeat's median step, the
    goals are taken on those, and RESULTS lists every repeat's step (one outlier cannot decide a goal)."""
    sys.path.insert(0, str(BENCH))
    import dlrm_compare as dc

    steps = {"pytorch-nonprivate": [10, 11, 9], "widedp-sparse-sharded": [20, 31, 18],  # 31: a slow repeat
             "widedp-sparse-ray-compiled": [40, 44, 37]}
    results = [{"system": s, "rows": 20000, "tables": 26, "repeat": i, "step_ms_median": float(v)}
               for i in range(3) for s, vs in steps.items() for v in [vs[i]]]
    summary = dc.summarize(results, [20000], 1024)
    entry = summary["ratios"]["20000"]["widedp-sparse-ray-compiled"]
    assert entry["step_ms"] == 40.0 and entry["repeats_ms"] == [40.0, 44.0, 37.0]
    compiled_goal = next(g for g in summary["goals"] if "compiled" in g["goal"])
    assert compiled_goal["per_size"][20000]["value"] == pytest.approx(2.0)  # 40 / 20: not 44 / 31 or 37 / 18
    assert compiled_goal["met"] is False
    import make_results

    doc = {"config": "configs/ctr.toml", "rows": [20000], "tables": 26, "dim": 16, "bottom_mlp": [64], "top_mlp": [64],
           "interaction": "cat", "batch": 1024, "sigma": 1.0, "clip": 3.0, "lr": 10.0, "dense_lr": 1.0,
           "examples": 1000, "selection": "fest-threshold", "k": 1000, "num_shards": 4, "repeats": 3,
           "systems": list(steps), "labels": {}, "results": results, "summary": summary,
           "machine": {"versions": {"opacus": "1.6.0"}}}
    lines, goals = make_results.section_dlrm(doc)
    text = "\n".join(lines)
    assert "Every system ran 3 times, interleaved" in text
    assert "widedp-sparse-sharded 20 / 31 / 18" in text
    assert sum(ln.startswith("| widedp-sparse-sharded | 26 × 20,000 |") for ln in lines) == 1  # first repeat only
    compiled_why = next(g for g in goals if "compiled" in g[0])[3]
    assert compiled_why.startswith("20,000: the compiled plane adds 20 ms per step, 1.5× allows 10 ms")
    assert "no recorded rounds at this batch" in compiled_why
    import _common

    sent = [(7, "lookup", "compiled", 1.000, 1.012), (8, "add_clipped_row_sums", "compiled", 2.000, 2.009)]
    shards = [[(7, "lookup", 1.001, 1.004, 0.002), (8, "add_clipped_row_sums", 2.001, 2.003, 0.0015)],
              [(7, "lookup", 1.006, 1.010, 0.003), (8, "add_clipped_row_sums", 2.004, 2.008, 0.0035)]]
    breakdown = {"batch": 1024, "steps": 30, "machine": {"logical_cores": 2},
                 "runs": {"ray": {"call_timings": _common.summarize_call_timings({"sent": sent, "shards": shards})}}}
    _, goals = make_results.section_dlrm(doc, {1024: breakdown})
    compiled_why = next(g for g in goals if "compiled" in g[0])[3]
    assert "lookup 12 ms: shards begin 1–6 ms after it is sent, a shard's part 3.5 ms (CPU 2.5), 2 parts' CPU 5 ms" in compiled_why
    assert "With 2 single-threaded shard processes on 2 cores" in compiled_why
    _, goals = make_results.section_dlrm(doc, {16384: breakdown})  # recorded at another batch: not used
    assert "no recorded rounds at this batch" in next(g for g in goals if "compiled" in g[0])[3]


def test_round_timings_are_summarized_per_method_and_a_round_a_shard_missed_is_left_out():
    """Per method: medians over rounds of the first/median/last shard's start after the send, a
    shard's part, the parts' CPU summed, the return and the whole round (ms). A round that a
    replaced shard has no record of is not summarized with a shard missing."""
    sys.path.insert(0, str(BENCH))
    import _common

    sent = [(1, "lookup", "compiled", 10.0, 10.010), (2, "lookup", "compiled", 20.0, 20.020),
            (3, "lookup", "compiled", 30.0, 30.030), (4, "select_rows", "calls", 40.0, 40.5)]
    shards = [[(1, "lookup", 10.001, 10.002, 0.001), (2, "lookup", 20.001, 20.004, 0.002),
               (3, "lookup", 30.002, 30.005, 0.002), (4, "select_rows", 40.1, 40.2, 0.05)],
              [(1, "lookup", 10.003, 10.008, 0.004), (2, "lookup", 20.009, 20.018, 0.006)]]  # 3 and 4: none
    out = _common.summarize_call_timings({"sent": sent, "shards": shards})
    assert set(out) == {"lookup"}
    r = out["lookup"]
    assert r["rounds"] == 2 and r["shards"] == 2 and r["plane"] == "compiled"
    assert r["start_first_ms"] == pytest.approx(1.0) and r["start_last_ms"] == pytest.approx(6.0)  # medians of (1, 1), (3, 9)
    assert r["start_median_ms"] == pytest.approx(3.5)  # rounds' medians 2 and 5
    assert r["shard_wall_ms"] == pytest.approx(4.0)  # parts 1, 5, 3, 9
    assert r["shards_cpu_sum_ms"] == pytest.approx(6.5) and r["shard_cpu_ms"] == pytest.approx(3.0)
    assert r["return_ms"] == pytest.approx(2.0) and r["round_ms"] == pytest.approx(15.0)


def test_lazy_noise_goal_compares_the_median_auc_with_the_seed_spread():
    sys.path.insert(0, str(BENCH))
    import lazy_noise as ln

    def rec(mode, auc, e=8.0):
        return {"target_epsilon": e, "mode": mode, "seed": 0, "step_time_ms_median": 10.0,
                "test_metrics": {"auc": auc, "logloss": 0.5, "ece": 0.01}}

    close = ln.summarize([rec("lazy", 0.760), rec("lazy", 0.764), rec("eager", 0.761), rec("eager", 0.765)])
    (row,) = ln.auc_goal(close)
    assert row["met"] is True and row["difference"] == pytest.approx(-0.001) and row["spread"] == pytest.approx(0.004)
    far = ln.summarize([rec("lazy", 0.740), rec("lazy", 0.742), rec("eager", 0.761), rec("eager", 0.765)])
    assert ln.auc_goal(far)[0]["met"] is False
    assert ln.auc_goal(ln.summarize([rec("lazy", 0.74)]))[0]["met"] is None  # eager not run: not measured
    lines, goals = ln.results_section({"config": "c.toml", "seeds": [0, 1], "summary": far, "goal": ln.auc_goal(far)})
    assert "| 8 | lazy | 2 | 0.7410 [0.7400, 0.7420] |" in "\n".join(lines) and goals[0][2] == "**missed**"


def test_audit_power_goal_rows_follow_the_measured_bounds_and_can_be_missed():
    sys.path.insert(0, str(BENCH))
    import audit_power as ap

    def cell(eps, broken, gdp, eps_delta=None, threshold_gdp=0.0, model="DLRM", mode="dpsgd"):
        def stat(v):
            return {"median": v, "min": v, "max": v}
        return {"model": model, "mode": mode, "setting": "q = 1", "epsilon": eps, "observe": "steps",
                "broken": broken, "claimed_epsilon": eps, "value_claimed_epsilon": None if mode == "dpsgd" else 0.8 * eps,
                "sample_rate": 1.0, "gdp": stat(gdp), "epsilon_delta": stat(eps_delta or gdp),
                "threshold_gdp": stat(threshold_gdp), "threshold_epsilon_delta": stat(threshold_gdp / 2),
                "correct": stat(gdp), "guesses": 500, "seconds": 2.0, "runs": []}

    def doc(cells, exceed=0, exceed_threshold=0):
        alarm = {"model": "DLRM", "mode": "dpsgd", "runs": 10, "setting": "q = 1", "epsilon": 4.0, "observe": "steps",
                 "exceed_epsilon_delta": exceed, "exceed_gdp": exceed, "exceed_threshold_epsilon_delta": 0,
                 "exceed_threshold_gdp": exceed_threshold, "exceed_claim_threshold_gdp": 0,
                 "gdp_bounds": [2.0], "threshold_gdp_bounds": [3.0],
                 "epsilon_delta_bounds": [1.5], "claimed_epsilon": 4.0}
        return {"models": {"DLRM": "small DLRM"}, "canaries": 10_000, "member_fraction": 0.05, "repeats": 1,
                "cells": cells, "false_alarms": [alarm, {**alarm, "mode": "sparse value"}]}

    good = doc([cell(8.0, None, 4.2), cell(4.0, "sigma-over-2", 5.5)])
    lines, goals = ap.results_section(good)
    assert [g[2] for g in goals] == ["**met**"] * 3
    assert ("| DLRM | dpsgd | q = 1 | 4 | steps | sigma-over-2 | 4 | — | 5.5 | 5.5 (5.5–5.5) | 0 | 0 (0–0) | — | 1.38 | — "
            "| caught | 2 |") in lines
    weak = doc([cell(8.0, None, 3.0), cell(8.0, "sigma-over-2", 7.3)], exceed=2)
    lines, goals = ap.results_section(weak)
    assert [g[2] for g in goals] == ["**missed**"] * 3
    assert "not: DLRM dpsgd sigma-over-2 at ε = 8" in goals[1][1]
    # the threshold bound can carry a goal the one-run bounds miss, and its false alarms count
    rescued = doc([cell(8.0, None, 3.0, threshold_gdp=7.0), cell(8.0, "sigma-over-2", 7.3, threshold_gdp=15.0)],
                  exceed_threshold=2)
    lines, goals = ap.results_section(rescued)
    assert [g[2] for g in goals] == ["**met**", "**met**", "**met**"]  # 2 + 2 of 100 bounds: within 5%
    assert "DLRM dpsgd: threshold GDP 7 = 0.88·ε" in goals[0][1] and "by the one-run bounds alone 0" in goals[1][1]
    assert ("| DLRM | dpsgd | q = 1 | 8 | steps | correct | 8 | — | 3 | 3 (3–3) | 3.5 | 7 (7–7) | — | 0.88 | — | holds | 2 |"
            in lines)
    # every (model, mode) at ε = 8 must reach half its claim: one weak sparse value cell misses the goal
    one_weak = doc([cell(8.0, None, 3.0, threshold_gdp=7.0),
                    cell(8.0, None, 2.0, threshold_gdp=3.9, mode="sparse value")], exceed_threshold=5)
    lines, goals = ap.results_section(one_weak)
    assert [g[2] for g in goals] == ["**missed**", "**missed**", "**missed**"]  # no broken cells; 10 of 100 > 5%
    assert "DLRM sparse value: threshold GDP 3.9 = 0.49·ε" in goals[0][1]
    assert "| DLRM | sparse value | q = 1 | 8 | steps | correct | 8 | 6.4 |" in "\n".join(lines)
    # the selection channel as run is shown, not held to the goals: a weak or uncaught diagnostic cell misses nothing
    shown = doc([cell(8.0, None, 4.2), cell(4.0, "sigma-over-2", 5.5), cell(8.0, None, 0.1, mode="sparse as run"),
                 cell(8.0, "sigma-over-2", 0.2, mode="sparse as run")])
    lines, goals = ap.results_section(shown)
    assert [g[2] for g in goals] == ["**met**"] * 3 and "sparse as run" not in goals[0][1]
    assert any(line.startswith("| DLRM | sparse as run | q = 1 | 8 | steps | sigma-over-2 |") and "not caught" in line
               for line in lines)
    # the δ = 1/n block's goal: every broken run caught by the claim-threshold bound, no correct one above the claim
    def delta_run(bound, claimed=8.0):
        return {"claim_threshold_gdp": bound, "threshold_gdp": bound - 0.3, "claimed_epsilon": claimed,
                "noise_multiplier": 1.9, "delta": 1e-5}
    block = {"canaries": 40_000, "epsilon": 8.0, "setting": "q = 1", "observe": "steps",
             "runs": {"correct": [delta_run(7.7), delta_run(7.8)], "delta-one-over-n": [delta_run(8.6), delta_run(8.4)]}}
    lines, goals = ap.results_section({**good, "delta_one_over_n": block})
    assert goals[2][0].startswith("δ taken as 1/n") and goals[2][2] == "**met**" and goals[2][1].startswith("2 of 2")
    # the claim-curve goal at q ≈ ½: every broken cell's median ratio above 1, and a correct cell above 1 is an alarm
    def curved(c, ratio, setting="q ≈ ½"):
        return {**c, "setting": setting, "claim_curve_ratio": {"median": ratio, "min": ratio, "max": ratio}}
    half = doc([cell(8.0, None, 4.2), cell(4.0, "sigma-over-2", 5.5), curved(cell(4.0, "sigma-over-2", 1.0), 2.0),
                curved(cell(4.0, None, 1.0), 0.7)])
    lines, goals = ap.results_section(half)
    assert goals[2][0].startswith("Subtle breaks at q ≈ ½") and goals[2][2] == "**met**"
    assert any(line.startswith("| DLRM | dpsgd | q ≈ ½ | 4 | steps | sigma-over-2 |") and "| 2 (2–2) | caught |" in line
               for line in lines)
    half["cells"][2] = curved(cell(4.0, "sigma-over-2", 1.0), 0.9)
    half["cells"][3] = curved(cell(4.0, None, 1.0), 1.2)
    lines, goals = ap.results_section(half)
    assert goals[2][2] == "**missed**" and any("**above the claim**" in line for line in lines)
    block["runs"]["delta-one-over-n"][1] = delta_run(7.9)
    lines, goals = ap.results_section({**good, "delta_one_over_n": block})
    assert goals[2][2] == "**missed**" and "caught in 1 of 2 (the half-split threshold bound: 1)" in "\n".join(lines)


def test_audit_conformance_goal_rows_follow_the_runs_and_can_be_missed():
    sys.path.insert(0, str(BENCH))
    import audit_conformance as ac

    def block(mode, broken, refuted, runs):
        return {"mode": mode, "broken": broken, "runs": [{}] * runs, "refuted": refuted, "claimed_epsilon": 1.2,
                "best_bound_max": 0.4, "bound_above_claim": 0, "claim_curve_max": 0.5, "seconds": 0.5}

    def doc(blocks, shuffled=1.5):
        return {"delta": 1e-5, "oracle_canaries": 10_000, "canaries": 1000,
                "shuffle_oracle": [{"q": 0.1, "epochs": 1, "steps": 10, "sigma": 1.0, "claimed": 2.85,
                                    "poisson": 0.6, "shuffled": shuffled}],
                "selection_oracle": [{"steps": 10, "sigma_sel": 2.0, "claimed": 7.5, "correct": 2.5, "halved": 4.7,
                                      "halved_gaussian_claim": 17.9}],
                "blocks": blocks}

    good = doc([block("sparse", None, 8, 200), block("sparse", "shuffle-as-poisson", 20, 20),
                block("sparse", "selection-sigma-over-2", 20, 20)])
    lines, goals = ac.results_section(good)
    assert [g[2] for g in goals] == ["**met**", "**met**"]
    assert "in 2 of 2 simulated settings" in goals[0][3]
    assert "| sparse | selection-sigma-over-2 | 20 | 20 | 1.2 | 0.4 | 0 | 0.5 |" in lines
    bad = doc([block("sparse", None, 30, 200), block("sparse", "shuffle-as-poisson", 19, 20)], shuffled=3.0)
    lines, goals = ac.results_section(bad)
    assert [g[2] for g in goals] == ["**missed**", "**missed**"]  # 19 of 20; 30 of 200 is above 5% + 2 sd
    assert "in 1 of 2 simulated settings" in goals[0][3]


def test_coordinator_scaling_goal_rows_follow_the_coordinators_cpu_and_can_be_missed():
    """RESULTS §2c′ (benchmarks/trainer_scaling.py --dense-reduction coordinator,trainers): one goal
    row per reduction, met when the coordinator's CPU per step varies ≤ 1.3× over N (largest over
    smallest), missed otherwise; N = 1 (no reduction to choose) counts for both."""
    sys.path.insert(0, str(BENCH))
    import make_results

    def result(label, n, cpu):
        return {"label": label, "num_trainers": n, "step_ms_median": 100.0, "examples_per_sec": 1000.0,
                "coordinator_cpu_ms_per_step": cpu, "coordinator_bytes_per_step": {"to": 1000, "from": 2000},
                "trainers": []}

    doc = {"rows": 520000, "shards": 2, "nodes": 3, "batch": 1024, "repeats": 2, "partitioned": True,
           "results": [result("in-process", 1, 30.0), result("ray N=1", 1, 30.0),
                       result("ray N=2 (coordinator)", 2, 45.0), result("ray N=2 (trainers)", 2, 33.0),
                       result("ray N=4 (coordinator)", 4, 60.0), result("ray N=4 (trainers)", 4, 36.0)]}
    lines, goals = make_results.section_coordinator_scaling(doc)
    by_name = {g[0].rsplit("by the ", 1)[1]: g for g in goals}
    assert by_name["coordinator"][2] == "missed" and "(2×)" in by_name["coordinator"][1]
    assert by_name["trainers"][2] == "met" and "N = 4: 36 ms (1.2×)" in by_name["trainers"][1]
    assert "| ray N=4 (trainers) | 100 | 36 | – | 1.2× |" in "\n".join(lines)  # no main-thread split recorded
    doc["results"][-1]["coordinator_main_thread_cpu_ms_per_step"] = 20.0
    assert "| ray N=4 (trainers) | 100 | 36 | 20 | 1.2× |" in "\n".join(make_results.section_coordinator_scaling(doc)[0])
    doc["results"].append(result("ray N=8 (trainers)", 8, 25.0))  # falling by more than 1.3x is not flat either
    assert [g[2] for g in make_results.section_coordinator_scaling(doc)[1]] == ["missed", "missed"]
    doc["results"] = doc["results"][:2]
    assert all(g[2] == "not measured" for g in make_results.section_coordinator_scaling(doc)[1])


def test_partitioned_dry_run_goal_needs_ten_times_the_cap_and_the_coordinator_under_it():
    """RESULTS §2c″ (benchmarks/partitioned_dry_run.py): met only when the data set is ≥ 10× the
    coordinator's cap both on disk and decoded, and the coordinator's peak stayed under the cap."""
    sys.path.insert(0, str(BENCH))
    import make_results

    gib = 2 ** 30
    doc = {"examples": 60_000_000, "rows": 520000, "parts": 4, "trainers": 2, "trainer_parts": [[0, 2], [1, 3]],
           "shards": 2, "nodes": 3, "coordinator_cap_bytes": int(0.6 * gib), "cap_kind": "cgroup-v1",
           "data_bytes_on_disk": 7 * gib, "data_bytes_decoded": 15 * gib, "coordinator_peak_bytes_cgroup": int(0.5 * gib),
           "peak_rss_bytes": {"coordinator": int(0.7 * gib), "trainer": 3 * gib}, "processes": {"coordinator": 1},
           "peak_anon_bytes": {"coordinator": int(0.45 * gib), "trainer": gib}, "steps": 300, "steps_planned": 300, "examples_per_sec": 9000.0, "step_time_ms_median": 450.0,
           "sampled_bytes_per_trainer_per_step": 540672.0, "storage_read_bytes_per_trainer_per_step": [1e5, 2e5],
           "test_metrics": {"auc": 0.7, "logloss": 0.5}}
    lines, goals = make_results.section_partitioned_dry_run(doc)
    assert goals[0][2] == "met" and "11.7× the cap on disk" in goals[0][1]
    assert "| data set decoded (what holding it in memory takes) | 15.00 GiB (25.0× the cap) |" in lines
    assert make_results.section_partitioned_dry_run(dict(doc, data_bytes_on_disk=5 * gib))[1][0][2] == "missed"
    over = dict(doc, coordinator_peak_bytes_cgroup=int(0.61 * gib))
    assert make_results.section_partitioned_dry_run(over)[1][0][2] == "missed"
    assert make_results.section_partitioned_dry_run(dict(doc, steps=120))[1][0][2] == "missed"  # stopped early
