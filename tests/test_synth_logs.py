"""`widedp synth logs`: raw day-partitioned click logs with users (heavy-tailed examples per
user, a planted per-user model), truth.json and a `convert table` schema that converts them
with the last day as the test split (trainer/data/synthetic/synth_logs.py)."""

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from widedp.trainer.cli import main
from widedp.trainer.data import DataError, auc, expected_auc, open_dataset
from widedp.trainer.data.synthetic import synth_logs as sl
from widedp.trainer.data.convert.table import convert_table

DAY = 86_400
DATES = ["2026-11-01", "2026-11-02", "2026-11-03"]
LOG_COLUMNS = {"user_id": pa.string(), "ts": pa.timestamp("ms", tz="UTC"), "label": pa.int8(),
               "price": pa.float64(), "position": pa.int32(), "session_depth": pa.int32(),
               "account_age_days": pa.float64(), "ad_id": pa.string(), "campaign": pa.int64(),
               "device": pa.string(), "history": pa.list_(pa.string())}


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _logs(root: Path, date: str) -> pa.Table:
    return pa.concat_tables(pq.read_table(f) for f in sorted((root / f"day={date}").glob("*.parquet")))


def _truth_rows(root: Path, date: str) -> pa.Table:
    return pa.concat_tables(pq.read_table(f) for f in sorted((root / "truth" / f"day={date}").glob("*.parquet")))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """The defaults (2,000 users, 3 days), written by the CLI: (directory, printed result)."""
    root = tmp_path_factory.mktemp("synth_logs") / "logs"
    code = main(["synth", "logs", str(root)])
    assert code == 0
    return root


@pytest.fixture(scope="module")
def converted(logs, tmp_path_factory):
    """The logs converted by the shipped schema, the last day as the test split."""
    out = tmp_path_factory.mktemp("converted") / "ds"
    meta = convert_table([str(logs / "day=*" / "*.parquet")], out, schema=logs / "schema.toml",
                         test_after=DATES[-1])
    return out, meta


def _all_logs(root):
    return pa.concat_tables(_logs(root, d) for d in DATES)


# ---- the files ------------------------------------------------------------------------------------

def test_the_cli_writes_day_partitioned_logs_truth_and_schema(tmp_path, capsys):
    root = tmp_path / "logs"
    code, out, err = _run(["synth", "logs", str(root), "--users", "300", "--days", "3", "--seed", "5"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["kind"] == "logs" and result["out_dir"] == str(root) and result["num_users"] == 300
    assert result["days"] == 3 and result["test_day"] == DATES[-1]
    assert "--test-after 2026-11-03" in result["convert_command"]
    assert sorted(p.name for p in root.iterdir()) == ["day=2026-11-01", "day=2026-11-02", "day=2026-11-03",
                                                      "device_vocab.txt", "schema.toml", "truth", "truth.json"]
    for date in DATES:
        assert [p.name for p in (root / f"day={date}").iterdir()] == ["part-0.parquet"]
        schema = pq.read_schema(root / f"day={date}" / "part-0.parquet")
        assert {f.name: f.type for f in schema} == LOG_COLUMNS
    truth = json.loads((root / "truth.json").read_text())
    assert truth["seed"] == 5 and truth["params"]["users"] == 300 and truth["num_users"] == 300
    assert [d["date"] for d in truth["days"]] == DATES
    total = sum(len(_logs(root, d)) for d in DATES)
    assert truth["num_examples"] == total == result["num_examples"]
    assert [d["examples"] for d in truth["days"]] == [len(_logs(root, d)) for d in DATES]
    assert truth["evaluation_day"]["examples"] == len(_logs(root, DATES[-1])) == result["test_examples"]
    assert 0.02 < truth["base_rate"] < 0.3
    assert not list(tmp_path.glob(".*"))  # no temporary directory left beside it


def test_default_size_is_small_and_fast(logs):
    truth = json.loads((logs / "truth.json").read_text())
    assert truth["num_users"] == 2000 and len(truth["days"]) == 3
    assert 10_000 < truth["num_examples"] < 60_000
    assert truth["seconds"] < 5


def test_columns_have_the_promised_content(logs):
    t = _all_logs(logs).to_pydict()
    assert set(t["label"]) == {0, 1}
    assert set(t["device"]) == set(sl.DEVICES) and set(t["position"]) <= set(range(1, 9))
    price, depth = np.array(t["price"]), np.array(t["session_depth"])
    assert (price > 0).all() and price.max() > 20 * np.median(price)  # heavy-tailed: log1p makes sense
    assert depth.min() >= 1 and depth.max() > 50 * np.median(depth)
    age = t["account_age_days"]
    assert 0.03 < sum(a is None for a in age) / len(age) < 0.3  # some nulls (users of unknown age)
    items = {f"i{i}" for i in range(20_000)}
    assert set(t["ad_id"]) <= items
    hist = t["history"]
    assert all(len(h) <= 20 for h in hist) and {x for h in hist for x in h} <= items
    lengths = np.array([len(h) for h in hist])
    assert (lengths == 0).any() and (lengths == 20).any() and len(set(lengths.tolist())) > 15
    # history reveals the user's taste: most of its items are of the user's topic (item % topics)
    users = pq.read_table(logs / "truth" / "users.parquet").to_pydict()
    topic = dict(zip(users["user_id"], users["topic"]))
    same = [int(x[1:]) % 20 == topic[u] for u, h in zip(t["user_id"], hist) for x in h]
    assert np.mean(same) > 0.7


# ---- users: heavy-tailed counts, time order -----------------------------------------------------

def test_examples_per_user_are_heavy_tailed_and_match_users_truth(logs):
    t = _all_logs(logs)
    ids, counts = np.unique(np.array(t.column("user_id").to_pylist()), return_counts=True)
    users = pq.read_table(logs / "truth" / "users.parquet").to_pydict()
    assert len(ids) == 2000 and list(ids) == users["user_id"]  # every user has >= 1 example
    assert counts.tolist() == users["examples"]
    assert counts.max() >= 40 * np.median(counts)  # most users have a few, some hundreds
    assert np.sort(counts)[-20:].sum() > 0.1 * counts.sum()  # the top 1% hold > 10% of the examples
    assert counts.max() <= 5000
    per_day = np.array(users["examples_per_day"])
    assert per_day.sum(axis=1).tolist() == users["examples"]
    for d, date in enumerate(DATES):
        got = dict(zip(*np.unique(_logs(logs, date).column("user_id").to_pylist(), return_counts=True)))
        assert [got.get(u, 0) for u in users["user_id"]] == per_day[:, d].tolist()
    truth = json.loads((logs / "truth.json").read_text())
    assert truth["examples_per_user"]["max"] == counts.max()
    assert truth["examples_per_user"]["median"] == np.median(counts)


def test_max_examples_per_user_clips(tmp_path):
    truth = sl.synth_logs(tmp_path / "l", users=500, days=2, max_examples_per_user=30)
    t = pa.concat_tables(pq.read_table(f) for f in sorted(tmp_path.glob("l/day=*/*.parquet")))
    _, counts = np.unique(t.column("user_id").to_pylist(), return_counts=True)
    assert counts.max() == 30 and truth["examples_per_user"]["clipped_at_max"] == (counts == 30).sum() > 10


def test_time_order_within_files_and_per_user_histories_follow_one_view_stream(logs):
    seqs = defaultdict(list)
    for d, date in enumerate(DATES):
        for f in sorted((logs / f"day={date}").glob("*.parquet")):
            t = pq.read_table(f)
            ts = t.column("ts").cast(pa.int64()).to_numpy() // 1000
            start = 1793491200 + d * DAY  # 2026-11-01T00:00:00Z
            assert (np.diff(ts) >= 0).all() and ts.min() >= start and ts.max() < start + DAY
            for u, h in zip(t.column("user_id").to_pylist(), t.column("history").to_pylist()):
                seqs[u].append(h)
    # a user's histories, in time order, are windows of one stream of views (most recent first):
    # a later one is the k items viewed in between (k ~ Poisson(views_per_impression = 1), so
    # k <= 12 here), then the start of the earlier one, min(20, len(a) + k) long in all
    new_views = []
    for hists in seqs.values():
        for a, b in zip(hists, hists[1:]):
            ks = [k for k in range(min(12, len(b)) + 1) if len(b) == min(20, len(a) + k) and b[k:] == a[:len(b) - k]]
            assert ks, (a, b)
            if len(b) < 20:
                new_views += ks
    assert len(new_views) > 1000 and abs(np.mean(new_views) - 1.0) < 0.1


# ---- determinism -------------------------------------------------------------------------------

def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "truth.json"}


def _truth(root: Path) -> dict:
    t = json.loads((root / "truth.json").read_text())
    for k in ("seconds", "convert_command"):
        t.pop(k)
    return t


def test_same_seed_same_files_other_seed_other_files(tmp_path):
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        sl.synth_logs(tmp_path / name, users=400, days=2, seed=seed)
    a, b, c = (_files(tmp_path / n) for n in "abc")
    assert a == b and _truth(tmp_path / "a") == _truth(tmp_path / "b")
    assert a.keys() == c.keys()
    assert all(a[k] != c[k] for k in a if "day=" in k)
    assert _truth(tmp_path / "a")["evaluation_day"] != _truth(tmp_path / "c")["evaluation_day"]


def test_several_user_blocks_write_several_parts_per_day(tmp_path, monkeypatch):
    monkeypatch.setattr(sl, "USER_BLOCK", 128)
    truth = sl.synth_logs(tmp_path / "l", users=300, days=2)
    for date in ("2026-11-01", "2026-11-02"):
        assert sorted(p.name for p in (tmp_path / "l" / f"day={date}").iterdir()) == [
            "part-0.parquet", "part-1.parquet", "part-2.parquet"]
    assert truth["files"]["user_blocks"] == 3
    users = pq.read_table(tmp_path / "l" / "truth" / "users.parquet").column("user_id").to_pylist()
    assert users == [f"u{i:08d}" for i in range(300)]
    part1 = set(pq.read_table(tmp_path / "l" / "day=2026-11-01" / "part-1.parquet").column("user_id").to_pylist())
    assert part1 <= set(users[128:256])


# ---- the schema converts; the converted set ---------------------------------------------------

def test_the_schema_converts_with_the_last_day_as_test_split(logs, converted):
    out, meta = converted
    cutoff = 1793491200 + 2 * DAY
    assert meta.unit_column and meta.timestamp_column and meta.list_features == ["history"]
    assert meta.feature_tables == {"ad": "item", "history": "item", "campaign": "campaign", "device": "device"}
    assert meta.num_dense == 4 and "privacy_events" not in meta.extra  # public statistics only: nothing charged
    assert meta.test_split == "timestamp>=2026-11-03T00:00:00Z"
    assert meta.num_examples == len(_logs(logs, DATES[0])) + len(_logs(logs, DATES[1]))
    assert meta.test_examples == len(_logs(logs, DATES[2]))
    train = pq.read_table(out / "data.parquet")
    test = pq.read_table(out / "test.parquet")
    assert train.column("timestamp").to_numpy().max() < cutoff
    assert cutoff <= test.column("timestamp").to_numpy().min() and test.column("timestamp").to_numpy().max() < cutoff + DAY
    assert test.column("label").to_pylist() == _logs(logs, DATES[2]).column("label").to_pylist()
    # one unit per user; the histories are bags of the shared item table, up to 20 long
    users = set(_all_logs(logs).column("user_id").to_pylist())
    units = set(train.column("unit").to_pylist()) | set(test.column("unit").to_pylist())
    assert len(units) == len(users) == 2000
    lengths = [len(h) for h in test.column("history").to_pylist()]
    assert max(lengths) == 20 and min(lengths) == 0
    train_set, test_set = open_dataset(out)
    assert len(train_set) == meta.num_examples and len(test_set) == meta.test_examples
    assert len(np.unique(train_set.units())) < len(train_set)


def test_the_converted_features_are_the_planted_model_s_features(logs, converted):
    """Recompute every row's true logit from the truth files, with the dense part from the
    CONVERTED dense features: the schema's transforms are the model's f_j."""
    out, _ = converted
    truth = json.loads((logs / "truth.json").read_text())
    p, m = truth["params"], truth["model"]
    raw = _logs(logs, DATES[-1]).to_pydict()
    dense = np.array(pq.read_table(out / "test.parquet").column("dense").to_pylist(), dtype=np.float64)
    users = pq.read_table(logs / "truth" / "users.parquet").to_pydict()
    items = pq.read_table(logs / "truth" / "items.parquet").to_pydict()
    uidx = {u: i for i, u in enumerate(users["user_id"])}
    u = np.array([uidx[x] for x in raw["user_id"]])
    ad = np.array([int(x[1:]) for x in raw["ad_id"]])
    assert (np.array(items["campaign"])[ad] == np.array(raw["campaign"])).all()
    weights = [m["dense_features"][k]["weight"] for k in ("price", "position", "session_depth", "account_age_days")]
    logit = (p["bias"] + np.array(users["offset"])[u] + np.array(items["effect"])[ad]
             + np.array(items["campaign_effect"])[ad] + np.array([m["device_effect"][d] for d in raw["device"]])
             + p["interaction_scale"] * np.einsum("ij,ij->i", np.array(users["latent"])[u], np.array(items["latent"])[ad])
             + dense @ np.array(weights))
    true = _truth_rows(logs, DATES[-1])
    # float32 latents and dense features: agreement to ~1e-5
    np.testing.assert_allclose(logit, true.column("logit").to_numpy(), atol=1e-4)
    np.testing.assert_allclose(true.column("p").to_numpy(), 1 / (1 + np.exp(-true.column("logit").to_numpy())),
                               rtol=1e-12)
    # a spot check of the transforms themselves on the raw values
    price = np.array(raw["price"])
    f = m["dense_features"]["price"]
    np.testing.assert_allclose(dense[:, 0], (np.log1p(price) - f["mean"]) / f["std"], rtol=1e-5, atol=1e-5)
    age = np.array([0.0 if a is None else a for a in raw["account_age_days"]])
    np.testing.assert_allclose(dense[:, 3], np.clip(np.log1p(age), 0, 10), rtol=1e-5, atol=1e-5)


def test_public_standardization_statistics_are_the_generator_s_moments():
    mean, std = sl.price_statistics(sl.LogsParams())
    x = np.log1p(np.exp(np.random.default_rng(0).normal(2.0, 1.0, 2_000_000)))
    assert mean == pytest.approx(x.mean(), abs=2e-3) and std == pytest.approx(x.std(), abs=2e-3)


# ---- truth: the Bayes AUC is real -------------------------------------------------------------

def test_bayes_auc_is_well_above_chance_and_consistent_with_the_labels(logs):
    truth = json.loads((logs / "truth.json").read_text())
    ev = truth["evaluation_day"]
    p = _truth_rows(logs, DATES[-1]).column("p").to_numpy()
    y = _logs(logs, DATES[-1]).column("label").to_numpy().astype(np.float64)
    assert ev["bayes_auc"] > 0.75 and ev["bayes_auc"] == pytest.approx(expected_auc(p), abs=1e-12)
    # the scorer that knows the true p reaches that AUC on the sampled labels (within sampling error)
    assert ev["empirical_auc"] == pytest.approx(auc(p, y), abs=1e-12)
    assert abs(auc(p, y) - ev["bayes_auc"]) < 0.03
    assert ev["bayes_logloss"] == pytest.approx(np.mean(-(p * np.log(p) + (1 - p) * np.log1p(-p))), rel=1e-9)
    assert abs(ev["empirical_logloss"] - ev["bayes_logloss"]) < 0.02
    assert abs(y.mean() - p.mean()) < 4 * math.sqrt(p.mean() / len(p))  # calibrated
    # the per-user offset matters: without it the true model ranks worse
    assert 0.55 < ev["auc_without_user_offset"] < ev["bayes_auc"] - 0.01
    for day in truth["days"]:
        assert abs(day["base_rate"] - day["expected_base_rate"]) < 0.02


def test_expected_auc_of_scores_is_expected_auc_for_scores_p():
    p = np.random.default_rng(1).beta(1, 5, 3000)
    p[:100] = p[100:200]  # ties
    assert sl._expected_auc_of_scores(p, p) == pytest.approx(expected_auc(p), abs=1e-12)
    assert sl._expected_auc_of_scores(-p, p) == pytest.approx(1 - expected_auc(p), abs=1e-12)


# ---- refusals --------------------------------------------------------------------------------------

def test_an_existing_non_empty_out_dir_is_refused(tmp_path, capsys):
    root = tmp_path / "logs"
    root.mkdir()
    (root / "keep.txt").write_text("mine")
    code, out, err = _run(["synth", "logs", str(root), "--users", "50"], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"widedp: error: {root}: not empty") and "new directory" in err
    assert [p.name for p in root.iterdir()] == ["keep.txt"] and not list(tmp_path.glob(".*"))
    (tmp_path / "file").write_text("x")
    code, _, err = _run(["synth", "logs", str(tmp_path / "file"), "--users", "50"], capsys)
    assert code == 2 and "exists and is not a directory" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _run(["synth", "logs", str(empty), "--users", "50"], capsys)
    assert code == 0, err
    assert (empty / "truth.json").is_file()


@pytest.mark.parametrize("args, message", [
    (["--days", "1"], "--days must be >= 2"),
    (["--users", "0"], "--users must be >= 1"),
    (["--examples-per-user-median", "0"], "--examples-per-user-median must be > 0"),
    (["--examples-per-user-median", "nan"], "--examples-per-user-median must be finite"),
    (["--max-examples-per-user", "3", "--examples-per-user-median", "4"],
     "--max-examples-per-user (3) must be >= --examples-per-user-median (4)"),
    (["--start-date", "11/01/2026"], "--start-date must be an ISO date YYYY-MM-DD"),
    (["--topics", "30", "--items", "20"], "--topics (30) must be <= --items (20)"),
    (["--items", str(sl.MAX_ITEMS + 1)], "--items must be an integer from 2 to"),
    (["--history-length", "0"], "--history-length must be >= 1"),
])
def test_bad_options_are_one_line_errors_and_write_nothing(tmp_path, capsys, args, message):
    code, out, err = _run(["synth", "logs", str(tmp_path / "logs"), *args], capsys)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_too_few_rows_for_a_split_is_an_error_leaving_nothing(tmp_path, capsys):
    code, _, err = _run(["synth", "logs", str(tmp_path / "a" / "logs"), "--users", "1", "--days", "50",
                         "--examples-per-user-median", "1", "--examples-per-user-sigma", "0"], capsys)
    assert code == 2 and ("no rows on the last day" in err or "no training rows" in err), err
    assert list(tmp_path.iterdir()) == []  # the parent it created is gone too


def test_a_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    calls = []
    real = sl._day_rows

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(sl, "_day_rows", failing)
    with pytest.raises(OSError):
        sl.synth_logs(tmp_path / "logs", users=100, days=3)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError):
        sl.synth_logs(tmp_path / "logs", sl.LogsParams(), users=3)
    with pytest.raises(DataError):
        (tmp_path / "x").mkdir()
        (tmp_path / "x" / "f").write_text("")
        sl.synth_logs(tmp_path / "x", users=10)
