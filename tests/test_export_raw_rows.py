"""`widedp export` of a run on a `widedp convert table` data set carries the feature pipeline:
the exported load_model.py scores RAW Parquet/CSV rows (in a Python that cannot import widedp;
plain dicts without pyarrow) exactly as the engine scores the converted test split, row for row.
Mutant loaders (a string hash without its seed, lists truncated from the wrong end, CSV lists
split by the wrong separator) must disagree. Tiny in-process runs (cluster.backend = local)."""

import csv
import gzip
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from widedp.trainer.config import load_config
from widedp.trainer.release.export import export_run
from widedp.trainer.run.train import train

pytestmark = pytest.mark.xdist_group("test_export_raw_rows")

WIDEDP_PACKAGES = ("widedp", "trainer", "selection", "accounting", "auditing", "sparse_learners", "adaptive_clipping")
COMMON = ["cluster.backend=local", "train.log_every=1", "train.eval_batch_size=256", "model.embedding_dim=4",
          "model.bottom_mlp=[8]", "model.top_mlp=[8]", "train.batch_size=64", "train.steps=3"]

# The synthetic logs (user_id, ts, label, price, position, session_depth, account_age_days with
# nulls, ad_id text, campaign int64, device text, history list<text> most recent first) under a
# schema with every kind of feature: public and DP standardization, clip, fill, hashed text,
# hashed int, a hashed list truncated to 3 (shorter than most histories), a vocabulary with
# values that are not in it, and a vocabulary list whose unknown items stay in the bag as id 0.
LOGS_SCHEMA = """
format = "parquet"
label = "label"
unit = "user_id"
timestamp = "ts"

[dense.price]
transform = ["log1p", "standardize"]
mean = 2.0
std = 0.8

[dense.position]                 # mean/std estimated with DP (dataset.json dense_statistics)
transform = ["clip", "standardize"]
clip = [1.0, 8.0]

[dense.session_depth]
transform = ["log1p", "clip"]
clip = [0.0, 3.0]

[dense.account_age_days]         # null for some users -> fill
transform = ["log1p", "clip"]
clip = [0.0, 10.0]
fill = 30.0

[categorical.ad]
column = "ad_id"
table = "item"
hash_size = 4099

[categorical.history]
table = "item"
hash_size = 4099
list = true
pooling = "mean"
max_length = 3

[categorical.history_popular]
column = "history"
table = "popular"
vocabulary = "popular.txt"
list = true
max_length = 5

[categorical.campaign]
hash_size = 257

[categorical.device]
vocabulary = "devices.txt"
"""

CSV_SCHEMA = """
format = "csv"
label = "clicked"
unit = "uid"

[dense.amount]
transform = ["log1p", "standardize"]
mean = 1.5
std = 0.9
fill = 5.0

[dense.score]
transform = "clip"
clip = [-1.0, 4.0]

[categorical.ad]
hash_size = 97

[categorical.cat_int]
hash_size = 53

[categorical.tags]
hash_size = 31
list = true
separator = ";"
max_length = 2

[categorical.color]
vocabulary = "colors.txt"
"""


def _csv_rows(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    ads = ["42", "-7", "007", "+7", "0", "", "9223372036854775807", "héllo wörld, longer than 8 bytes", "x,y"]
    ads += [f"a{j}" for j in range(30)]
    tags = [f"t{j}" for j in range(20)] + ["42", "", "x,y", "ünï"]
    colors = ["red", "green", "blue", "purple", "", "42"]
    amounts = ["", "0", "1.5", "12", "1e3", "+2", ".5", "-3", "250.125"]
    rows = []
    for i in range(n):
        rows.append({
            "clicked": str(int(rng.random() < 0.3)),
            "uid": f"u{int(rng.integers(0, 60))}",
            "amount": amounts[int(rng.integers(0, len(amounts)))],
            "score": repr(float(np.round(rng.normal(1.0, 2.5), 3))),
            "ad": ads[int(rng.integers(0, len(ads)))],
            "cat_int": str(int(rng.integers(-20, 500))),
            "tags": ";".join(tags[int(j)] for j in rng.integers(0, len(tags), int(rng.integers(0, 6)))),
            "color": colors[int(rng.integers(0, len(colors)))],
        })
    return rows


def _write_csv(path: Path, rows: list) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    data = buf.getvalue().encode("utf-8")
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)


def _engine_outputs(run_dir: Path):
    """The engine's per-example outputs on the run's converted test split (what `widedp
    evaluate` computes its metrics on), in split order, and those metrics."""
    from widedp.trainer.config import saved_config
    from widedp.trainer.run.train import build_run, load_checkpoint

    state = load_checkpoint(run_dir / "checkpoint.pt")
    cfg = saved_config(state["config"], "checkpoint")
    cfg.cluster.backend = "local"
    with build_run(cfg) as run:
        run.engine.load_state_dict(state["engine"])
        outputs, labels = run.engine.outputs(run.test_set, cfg.train.eval_batch_size)
        metrics = run.evaluate()
        model = run.engine.model
        split = run.test_set
        converted = {f: split.feature_rows(f) for f in split.meta.features}
        dense = split.take(np.arange(len(split))).dense.numpy()
    return {"outputs": outputs, "labels": labels, "metrics": metrics, "model": model, "converted": converted,
            "dense": dense}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    from widedp.trainer.data.synthetic.synth_logs import synth_logs
    from widedp.trainer.data.convert.table import convert_table

    tmp = tmp_path_factory.mktemp("raw_rows_logs")
    truth = synth_logs(tmp / "logs", users=300, days=2, seed=4, items=2000, history_length=8)
    (tmp / "logs" / "popular.txt").write_text("".join(f"i{j}\n" for j in range(40)))
    (tmp / "logs" / "devices.txt").write_text("ios\nweb\n")  # android and tv are unknown -> id 0
    (tmp / "logs" / "raw_schema.toml").write_text(LOGS_SCHEMA)
    day = truth["evaluation_day"]["date"]
    meta = convert_table([str(tmp / "logs" / "day=*" / "*.parquet")], tmp / "data",
                         schema=tmp / "logs" / "raw_schema.toml", test_after=day, statistics_noise_seed=11)
    assert set(meta.extra["dense_statistics"]) == {"position"}
    test_files = sorted((tmp / "logs").glob(f"day={day}/*.parquet"))
    assert len(test_files) == 1  # one block of users: the last day's file is the test split, in order
    cfg = load_config(None, [f"data.path={tmp / 'data'}", *COMMON, "train.mode=dpsgd", "privacy.noise_multiplier=1.0",
                             "cluster.num_shards=2"])
    train(cfg, tmp / "run", progress=False)
    summary = export_run(tmp / "run", tmp / "export")
    assert summary["raw_rows"] is True
    return {"tmp": tmp, "meta": meta, "export": tmp / "export", "run": tmp / "run", "test_file": test_files[0],
            "engine": _engine_outputs(tmp / "run")}


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory):
    from widedp.trainer.data.convert.table import convert_table

    tmp = tmp_path_factory.mktemp("raw_rows_csv")
    (tmp / "colors.txt").write_text("red\ngreen\nblue\n42\n")
    (tmp / "schema.toml").write_text(CSV_SCHEMA)
    _write_csv(tmp / "train.csv", _csv_rows(400, 1))
    _write_csv(tmp / "test.csv.gz", _csv_rows(150, 2))
    meta = convert_table([tmp / "train.csv"], tmp / "data", schema=tmp / "schema.toml",
                         test_inputs=[tmp / "test.csv.gz"])
    cfg = load_config(None, [f"data.path={tmp / 'data'}", *COMMON, "train.mode=nonprivate"])
    train(cfg, tmp / "run", progress=False)
    assert export_run(tmp / "run", tmp / "export")["raw_rows"] is True
    return {"tmp": tmp, "meta": meta, "export": tmp / "export", "run": tmp / "run", "test_file": tmp / "test.csv.gz",
            "engine": _engine_outputs(tmp / "run")}


def _loader(export: Path, source: str | None = None):
    """The export's load_model.py (or `source` in its place) exec'd in a fresh namespace."""
    path = export / "load_model.py"
    namespace: dict = {"__name__": "_exported_loader", "__file__": str(path)}
    exec(compile(source if source is not None else path.read_text(), str(path), "exec"), namespace)
    return namespace


def _mutant(export: Path, old: str, new: str):
    source = (export / "load_model.py").read_text()
    if old:
        assert source.count(old) == 1, old  # the mutation applies to the shipped loader
        source = source.replace(old, new)
    return _loader(export, source)["load"](export)


def _raw_rows(path: Path) -> list:
    return pq.read_table(path).to_pylist()


BLOCKER = textwrap.dedent("""
    import importlib.abc, importlib.machinery, json, sys
    sys.dont_write_bytecode = True
    BLOCKED = set()
    class _Absent(importlib.abc.Loader):
        def create_module(self, spec):
            raise ModuleNotFoundError("not available here: " + spec.name)
        def exec_module(self, module):
            pass
    class _Block(importlib.abc.MetaPathFinder):
        # a spec without origin (torch probes optional packages with find_spec) whose import fails
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                return importlib.machinery.ModuleSpec(name, _Absent())
            return None
    sys.meta_path.insert(0, _Block())
    sys.path = [p for p in sys.path if p not in ("", ".", __REPO__)]
    leaked = []
    for job in json.loads(sys.argv[1]):  # each job with the packages it must do without
        BLOCKED.clear()
        BLOCKED.update(job["blocked"])
        try:
            import widedp  # noqa
        except ImportError:
            pass
        else:
            raise SystemExit("the import blocker does not work")
        sys.path.insert(0, job["export"])
        sys.modules.pop("load_model", None)
        import load_model
        sys.path.pop(0)
        if job["kind"] == "cli":
            assert load_model.main(job["argv"]) == 0
        else:  # plain dicts, read from JSON
            model = load_model.load(job["export"])
            rows = json.loads(open(job["rows"]).read())
            out = model.score_rows(rows, batch_size=100)
            with open(job["out"], "w") as fh:
                fh.write(json.dumps([float(x) for x in out.tolist()]))
        leaked += sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print(json.dumps(leaked))
""")


def _isolated(tmp: Path, jobs: list) -> list:
    """Run `jobs` in one Python (-I) that cannot import widedp (nor each job's "blocked"
    packages); returns the blocked modules that were imported anyway."""
    repo = str(Path(__file__).resolve().parents[1])
    script = tmp / "isolated.py"
    script.write_text(BLOCKER.replace("__REPO__", repr(repo)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    proc = subprocess.run([sys.executable, "-I", str(script), json.dumps(jobs)], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cli_scores(path: Path) -> np.ndarray:
    lines = path.read_text().splitlines()
    assert lines[0] == "logit,probability"
    return np.array([float(line.split(",")[0]) for line in lines[1:]], dtype=np.float32)


SCORE_RTOL, SCORE_ATOL = 1e-5, 1e-6


def _metric_tolerances(want: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """How far each metric can move when every score moves by at most the score tolerance:
    AUC is a rank statistic, so it moves by the share of (positive, negative) pairs whose
    scores lie within twice the tolerance of each other (any of them may swap; 0.5 per tie);
    ECE moves by at most 2/n for each example whose probability lies within the tolerance of a
    bin edge (it may change bins) plus the continuous part; logloss is continuous."""
    from widedp.trainer.models.calibration_metrics import ECE_BINS, sigmoid

    z = want.double().numpy()
    y = labels.double().numpy() > 0.5
    width = SCORE_ATOL + SCORE_RTOL * np.abs(z)
    neg = np.sort(z[~y])
    pos, pos_width = z[y], width[y]
    near_pairs = (np.searchsorted(neg, pos + 2 * pos_width + 2 * width.max(), side="right")
                  - np.searchsorted(neg, pos - 2 * pos_width - 2 * width.max(), side="left")).sum()
    auc_tol = near_pairs / max(1, len(pos) * len(neg))
    p_lo, p_hi = sigmoid(z - width), sigmoid(z + width)
    crosses = np.floor(p_lo * ECE_BINS) != np.floor(p_hi * ECE_BINS)
    ece_tol = 2 * crosses.sum() / max(1, len(z)) + float((p_hi - p_lo).max())
    return {"auc": auc_tol, "ece": ece_tol}


def _assert_scores(got, engine: dict) -> None:
    want = engine["outputs"]
    got = torch.as_tensor(np.asarray(got, dtype=np.float32))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=SCORE_RTOL, atol=SCORE_ATOL)
    # widedp's own metric code on the raw-row scores gives `widedp evaluate`'s test metrics, up
    # to what the score tolerance can move each metric by (AUC ranks: near-ties may swap)
    assert engine["model"].metrics(want, engine["labels"]) == pytest.approx(engine["metrics"], rel=1e-9, abs=1e-12)
    got_metrics = engine["model"].metrics(got, engine["labels"])
    tolerances = _metric_tolerances(want, engine["labels"])
    assert got_metrics.keys() == engine["metrics"].keys()
    for name, value in engine["metrics"].items():
        tol = tolerances.get(name, 0.0) + 1e-5 * abs(value) + 1e-6
        assert abs(got_metrics[name] - value) <= tol, (name, got_metrics[name], value, tol)


# ---- the specifications ----------------------------------------------------------------------------

def test_raw_rows_featurize_to_exactly_the_converted_test_split(logs, csv_run):
    """Ids, bags and float32 dense values of the raw test rows equal the converter's, bit for
    bit (Parquet rows as dicts, as a pyarrow Table, as a pandas DataFrame; CSV rows as text)."""
    import pandas as pd
    import pyarrow.csv as pa_csv

    for case, rows_variants in ((logs, None), (csv_run, None)):
        model = _loader(case["export"])["load"](case["export"])
        if case is logs:
            table = pq.read_table(case["test_file"])
            rows_variants = [table.to_pylist(), table, table.to_pandas()]
            assert isinstance(rows_variants[2], pd.DataFrame)
        else:
            convert = pa_csv.ConvertOptions(strings_can_be_null=False,
                                            column_types={c: "string" for c in _csv_rows(1, 0)[0]})
            rows_variants = [pa_csv.read_csv(case["test_file"], convert_options=convert).to_pylist()]
        engine = case["engine"]
        for rows in rows_variants:
            features, dense = model.featurize(rows)
            assert set(features) == set(engine["converted"])
            for name, (offsets, values) in engine["converted"].items():
                np.testing.assert_array_equal(features[name][0].numpy(), values, err_msg=name)
                np.testing.assert_array_equal(features[name][1].numpy(), offsets, err_msg=name)
            np.testing.assert_array_equal(dense.numpy(), engine["dense"])
    # the data exercise what they should: truncated histories, unknown vocabulary values (id 0)
    conv = logs["engine"]["converted"]
    raw = _raw_rows(logs["test_file"])
    assert max(len(r["history"]) for r in raw) > 3 and np.diff(conv["history"][0]).max() == 3
    assert (conv["device"][1] == 0).any() and (conv["device"][1] > 0).any()
    assert (conv["history_popular"][1] == 0).any()
    assert any(r["account_age_days"] is None for r in raw)
    csv_conv = csv_run["engine"]["converted"]
    assert np.diff(csv_conv["tags"][0]).max() == 2 and (csv_conv["color"][1] == 0).any()


def test_exported_loader_scores_raw_files_like_the_engine_without_widedp(logs, csv_run, tmp_path):
    """`python load_model.py --score-parquet/--score-csv` in a Python without widedp, and
    `model.score_rows(dicts)` with neither widedp nor pyarrow nor pandas importable, give the
    engine's outputs on the converted test split, row for row."""
    model_inputs = json.loads((logs["export"] / "model.json").read_text())["raw_rows"]["columns"]
    rows = [{c: r[c] for c in model_inputs} for r in _raw_rows(logs["test_file"])]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    no_pyarrow = [*WIDEDP_PACKAGES, "pyarrow", "pandas"]
    leaked = _isolated(tmp_path, [  # without pyarrow first: once imported it stays
        {"kind": "rows", "blocked": no_pyarrow, "export": str(logs["export"]), "rows": str(tmp_path / "rows.json"),
         "out": str(tmp_path / "rows_out.json")},
        {"kind": "cli", "blocked": no_pyarrow, "export": str(csv_run["export"]),
         "argv": [str(csv_run["export"]), "--score-csv", str(csv_run["test_file"]), "--out", str(tmp_path / "c.csv")]},
        {"kind": "cli", "blocked": list(WIDEDP_PACKAGES), "export": str(logs["export"]),
         "argv": [str(logs["export"]), "--score-parquet", str(logs["test_file"]), "--out", str(tmp_path / "p.csv")]}])
    assert leaked == []
    _assert_scores(_cli_scores(tmp_path / "p.csv"), logs["engine"])
    _assert_scores(json.loads((tmp_path / "rows_out.json").read_text()), logs["engine"])
    _assert_scores(_cli_scores(tmp_path / "c.csv"), csv_run["engine"])


MUTANTS = [  # (case, what, old, new): each changes what the loader computes on that case's test rows
    ("logs", "string hash without its seed", "h = splitmix64(len(data) ^ STRING_SEED)", "h = splitmix64(len(data))"),
    ("logs", "lists truncated from the wrong end", 'items = items[:int(c["max_length"])]',
     'items = items[-int(c["max_length"]):]'),
    ("logs", "dense fill ignored", 'x = np.array([self._number(r[col], float(d["fill"])) for r in rows], dtype=np.float64)',
     'x = np.array([self._number(r[col], 0.0) for r in rows], dtype=np.float64)'),
    ("logs", "vocabulary ids from 0", "self.vocab[ids[\"file\"]] = {v: i + 1 for i, v in enumerate(values)}",
     "self.vocab[ids[\"file\"]] = {v: i for i, v in enumerate(values)}"),
    ("csv", "CSV lists split by another separator", 'items = value.split(c["separator"])', 'items = value.split("|")'),
    ("csv", "empty list items kept", 'items = [v for v in items if v is not None and not (isinstance(v, str) and v == "")]',
     "items = [v for v in items if v is not None]"),
    ("csv", "canonical integer text hashed as text", "if CANONICAL_INT.fullmatch(value):", "if False:"),
]


def _featurized(model, run, case):
    """(ids and offsets per feature, dense) of the case's raw test rows by `model`'s pipeline."""
    pipeline = model._require_pipeline()
    reader = pipeline.read_parquet if case == "logs" else pipeline.read_csv
    rows = [r for chunk in reader(run["test_file"]) for r in chunk]
    return pipeline.featurize(rows)


@pytest.mark.parametrize("case, what, old, new", MUTANTS, ids=[m[1] for m in MUTANTS])
def test_mutant_loaders_disagree(logs, csv_run, case, what, old, new):
    """Each mutant's features of the raw test rows differ from the shipped loader's (which the
    tests above hold to the converted split); compared on the model's inputs, not its scores, so
    a run whose secret noise left the model insensitive to a feature cannot hide a mutant."""
    run = logs if case == "logs" else csv_run
    want_features, want_dense = _featurized(_mutant(run["export"], "", ""), run, case)
    try:
        got_features, got_dense = _featurized(_mutant(run["export"], old, new), run, case)
    except (ValueError, TypeError):
        return  # refusing the rows is disagreeing too
    same = torch.equal(got_dense, want_dense) and all(
        torch.equal(torch.as_tensor(got_features[f][i]), torch.as_tensor(want_features[f][i]))
        for f in want_features for i in (0, 1))
    assert not same, what


def test_features_json_names_the_pipeline_and_the_privacy_text_covers_it(logs, csv_run):
    from widedp.trainer.data._util import hash_string_py, splitmix64_py

    export, meta = logs["export"], logs["meta"]
    spec = json.loads((export / "model.json").read_text())
    feats = json.loads((export / "features.json").read_text())
    assert spec["raw_rows"]["available"] and spec["raw_rows"]["file"] == "features.json"
    assert (feats["label"], feats["unit"], feats["timestamp"]) == ("label", "user_id", "ts")
    assert not {"label", "user_id", "ts"} & set(feats["model_input_columns"])
    assert [d["name"] for d in feats["dense"]] == meta.extra["dense_features"]
    assert [c["name"] for c in feats["categorical"]] == [f["name"] for f in spec["features"]]
    position = next(d for d in feats["dense"] if d["name"] == "position")
    assert position["transforms"][-1] == {"op": "standardize", "statistics": "dp",
                                          "mean": meta.extra["dense_statistics"]["position"]["mean"],
                                          "std": meta.extra["dense_statistics"]["position"]["std"]}
    age = next(d for d in feats["dense"] if d["name"] == "account_age_days")
    assert age["fill"] == 30.0 and age["transforms"] == [{"op": "log1p"}, {"op": "clip", "lo": 0.0, "hi": 10.0}]
    history = next(c for c in feats["categorical"] if c["name"] == "history")
    assert history["max_length"] == 3 and history["list"] and history["ids"]["hash_size"] == 4099
    # the hash is named with its constants, and its examples match widedp's pure-Python reference
    h = feats["hash"]
    assert h["name"] == "widedp-stable-hash-v1" and h["string"]["seed"] == hex(0x6A09E667F3BCC909)
    for ex in h["examples"]:
        v = ex["value"]
        key = splitmix64_py(int(v) % (1 << 64)) if isinstance(v, int) or v in ("42", "-7") else hash_string_py(v.encode())
        assert ex["key"] == hex(key), ex
    # vocabularies ship byte for byte; the privacy text says they are public and the DP statistics released
    for c in feats["categorical"]:
        if c["ids"]["kind"] == "vocabulary":
            source = Path(meta.extra["vocabulary_files"][c["name"]]["path"])
            assert (export / c["ids"]["file"]).read_bytes() == source.read_bytes()
    report = json.loads((export / "privacy_report.json").read_text())
    assert report["feature_pipeline"]["dp_statistics"] == ["position"]
    privacy = (export / "PRIVACY.md").read_text()
    assert "PUBLIC" in privacy and "vocabularies/popular.txt" in privacy and "position" in privacy
    readme = (export / "README.md").read_text()
    assert "--score-parquet" in readme and "score_rows" in readme
    csv_feats = json.loads((csv_run["export"] / "features.json").read_text())
    assert csv_feats["input"]["delimiter"] == "," and csv_feats["input"]["header"] is True
    assert next(c for c in csv_feats["categorical"] if c["name"] == "tags")["separator"] == ";"
    # nothing secret-looking: no generator or seed-like keys besides the hash's public "seed"
    for name in ("features.json", "model.json"):
        keys = _keys(json.loads((export / name).read_text()))
        assert not [k for k in keys if "rng" in k.lower() or "generator" in k.lower()
                    or ("seed" in k.lower() and k != "seed")], name
    assert "/" not in json.dumps(feats["input"]) and str(logs["tmp"]) not in (export / "features.json").read_text()


def _keys(obj) -> list:
    if isinstance(obj, dict):
        return [k for k in obj] + [k2 for v in obj.values() for k2 in _keys(v)]
    if isinstance(obj, list):
        return [k for v in obj for k in _keys(v)]
    return []


def test_raw_rows_are_refused_where_the_pipeline_is_unknown(logs, tmp_path):
    """A data set not made by `convert table`, or one whose vocabulary file changed since its
    conversion, exports no pipeline: model.json says why and score_rows refuses."""
    import dataclasses

    from widedp.trainer.data import synth_ctr
    from widedp.trainer.data.format.meta import read_meta
    from widedp.trainer.release.export import feature_pipeline

    synth_ctr(tmp_path / "ctr", num_examples=50, table_sizes=11, seed=1)
    none = feature_pipeline(read_meta(tmp_path / "ctr"))
    assert none.spec is None and "convert table" in none.reason
    meta = logs["meta"]
    changed = tmp_path / "devices.txt"
    changed.write_text("web\nios\n")  # same size, other order: other ids
    files = {**meta.extra["vocabulary_files"], "device": {**meta.extra["vocabulary_files"]["device"], "path": str(changed)}}
    stale = feature_pipeline(dataclasses.replace(meta, extra={**meta.extra, "vocabulary_files": files}))
    assert stale.spec is None and "changed since" in stale.reason
    old = {k: v for k, v in meta.extra.items() if k != "vocabulary_files"}
    assert "re-convert" in feature_pipeline(dataclasses.replace(meta, extra=old)).reason
    assert feature_pipeline(meta).spec is not None
    # bad rows are refused naming the column
    model = _loader(logs["export"])["load"](logs["export"])
    row = _raw_rows(logs["test_file"])[0]
    with pytest.raises(TypeError, match="column 'ad_id'"):
        model.score_rows([{**row, "ad_id": 1.5}])
    with pytest.raises(ValueError, match="column 'price'.*not a number"):
        model.score_rows([{**row, "price": "1,5"}])
    with pytest.raises(ValueError, match="column 'history' missing"):
        model.score_rows([{k: v for k, v in row.items() if k != "history"}])
    # a loaded export without the pipeline refuses raw rows with the reason
    model.pipeline = None
    model.spec = {**model.spec, "raw_rows": {"available": False, "reason": none.reason}}
    with pytest.raises(ValueError, match="cannot score raw rows: the run's data set was not made by"):
        model.score_rows([{}])
