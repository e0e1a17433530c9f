"""`widedp convert table`: your own Parquet / CSV data by a TOML schema -> a ctr data set with
named, list-valued and shared-table features, unit and timestamp columns and an optional test
file (trainer/data/convert/table.py); and `convert criteo` over many / .gz files."""

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from widedp.trainer.cli import main
from widedp.trainer.data import DataError, convert_criteo, open_dataset, read_meta
from widedp.trainer.data.convert.table import convert_table

REPO = Path(__file__).resolve().parents[1]
M64 = (1 << 64) - 1


# ---- independent references of the id maps ---------------------------------------------------

def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _string_hash(s: str) -> int:
    b = s.encode()
    h = _splitmix64(len(b) ^ 0x6A09E667F3BCC909)
    for k in range(0, len(b), 8):
        h = _splitmix64(h ^ int.from_bytes(b[k:k + 8].ljust(8, b"\0"), "little"))
    return h


def _hash_id(value, n: int) -> int:
    """The documented id of a value in a hash_size = n table."""
    if value is None or value == "":
        return 0
    if isinstance(value, int) or (isinstance(value, str) and (value == "0" or (
            value.lstrip("-")[:1] in "123456789" and value.lstrip("-").isdigit() and value.count("-") <= 1
            and not value.startswith("+") and value[0] in "-123456789"))):
        return 1 + _splitmix64(int(value) & M64) % (n - 1)
    return 1 + _string_hash(value) % (n - 1)


def _rows(path):
    return pq.read_table(path).to_pylist()


def _schema(tmp_path, text, name="schema.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


# ---- Parquet: list<int64>, list<string>, a shared table ----------------------------------------

PARQUET_SCHEMA = """
format = "parquet"
label = "clicked"
unit = "user"
timestamp = "time"

[dense.price]
transform = "log1p"

[categorical.item]
column = "item_id"
table = "item"
hash_size = 1000

[categorical.history]
table = "item"
hash_size = 1000
list = true
pooling = "mean"
max_length = 3

[categorical.tags]
list = true
hash_size = 50
"""


def _parquet_input(path, rows=None):
    rows = rows or [
        dict(clicked=1, price=3.0, item_id=7, history=[7, 8, 9, 10], tags=["red", "blue"], user="alice",
             time="2024-01-01"),
        dict(clicked=0, price=None, item_id=8, history=[], tags=[], user="bob", time="2024-01-02T12:00:00"),
        dict(clicked=1, price=-2.0, item_id=None, history=None, tags=["red", None, "", "x"], user="alice",
             time="2024-02-01T00:00:00+01:00"),
    ]
    table = pa.table({
        "clicked": pa.array([r["clicked"] for r in rows], pa.int64()),
        "price": pa.array([r["price"] for r in rows], pa.float64()),
        "item_id": pa.array([r["item_id"] for r in rows], pa.int64()),
        "history": pa.array([r["history"] for r in rows], pa.list_(pa.int64())),
        "tags": pa.array([r["tags"] for r in rows], pa.list_(pa.string())),
        "user": pa.array([r["user"] for r in rows], pa.string()),
        "time": pa.array([r["time"] for r in rows], pa.string()),
    })
    pq.write_table(table, path, row_group_size=2)
    return rows


def test_parquet_lists_shared_table_unit_and_timestamp(tmp_path):
    src = tmp_path / "in.parquet"
    _parquet_input(src)
    out = tmp_path / "ds"
    meta = convert_table([src], out, schema=_schema(tmp_path, PARQUET_SCHEMA), chunk_rows=2)
    assert meta.features == ["item", "history", "tags"] and meta.list_features == ["history", "tags"]
    assert meta.feature_tables == {"item": "item", "history": "item", "tags": "tags"}
    assert meta.table_sizes == {"item": 1000, "tags": 50} and meta.pooling["history"] == "mean"
    assert meta.unit_column and meta.timestamp_column and meta.test_examples is None
    assert "privacy_events" not in meta.extra and read_meta(out) == meta
    # the public bound on ids per example the dense-table rule reads: tags has no max_length
    assert meta.max_ids_per_example() == {"item": 1, "history": 3, "tags": None}
    got = _rows(out / "data.parquet")
    h = lambda v: _hash_id(v, 1000)  # noqa: E731
    assert [r["item"] for r in got] == [h(7), h(8), 0]
    # max_length = 3 keeps the first three; an empty list and a null list are empty bags
    assert [r["history"] for r in got] == [[h(7), h(8), h(9)], [], []]
    assert got[0]["item"] == got[0]["history"][0]  # one table, one map: same value, same row
    # null and empty values inside a list are dropped
    assert [r["tags"] for r in got] == [[_hash_id("red", 50), _hash_id("blue", 50)], [],
                                        [_hash_id("red", 50), _hash_id("x", 50)]]
    assert [r["unit"] for r in got][0] == [r["unit"] for r in got][2] != got[1]["unit"]
    assert got[0]["unit"] == _string_hash("alice") - (1 << 64) * (_string_hash("alice") >> 63)
    assert [r["timestamp"] for r in got] == [1704067200, 1704196800, 1706742000]
    assert [r["dense"][0] for r in got] == pytest.approx([math.log1p(3.0), 0.0, 0.0])
    # the data set trains as it is: bags, shared table, units
    train, test = open_dataset(out, test_fraction=0.0)
    assert len(train) == 3 and len(test) == 0
    batch = train.take([0, 1, 2])
    assert batch.sparse["history"].lengths().tolist() == [3, 0, 0]
    assert train.units().tolist() == [r["unit"] for r in got]
    assert train.timestamps().tolist() == [r["timestamp"] for r in got]


# ---- CSV: plain and .gz, header and headerless, separator lists, many files ---------------------

CSV_SCHEMA = """
format = "csv"
label = "y"
unit = "uid"

[dense.age]
transform = ["clip", "standardize"]
clip = [0, 100]
mean = 40.0
std = 10.0
fill = 35.0

[dense.spend]
transform = "log1p"

[categorical.item]
table = "item"
hash_size = 97

[categorical.basket]
table = "item"
hash_size = 97
list = true
separator = "|"
"""

CSV_ROWS = [
    # y, age, spend, item, basket, uid
    ("1", "25", "10", "apple", "apple|pear", "17"),
    ("0", "", "", "42", "", "u-9"),
    ("1", "130", "-5", "pear", "42||kiwi|", "17"),
    ("0", "-3", "0.5", "", "kiwi", "007"),
]
HEADER = "y,age,spend,item,basket,uid"


def _csv_text(rows, header=True, delimiter=","):
    lines = ([HEADER.replace(",", delimiter)] if header else []) + [delimiter.join(r) for r in rows]
    return "\n".join(lines) + "\n"


def _expected_csv(rows):
    out = []
    for y, age, spend, item, basket, uid in rows:
        a = float(age) if age else 35.0
        dense = [(min(max(a, 0), 100) - 40) / 10, math.log1p(max(float(spend or 0), 0))]
        uid_v = int(uid) if uid in ("17",) else _string_hash(uid) - (1 << 64) * (_string_hash(uid) >> 63)
        out.append((float(y), dense, _hash_id(item, 97), [_hash_id(v, 97) for v in basket.split("|") if v], uid_v))
    return out


def _check_csv_output(directory, rows):
    got = _rows(directory / "data.parquet")
    assert len(got) == len(rows)
    for g, (y, dense, item, basket, uid) in zip(got, _expected_csv(rows)):
        assert g["label"] == y and g["item"] == item and g["basket"] == basket and g["unit"] == uid
        np.testing.assert_allclose(g["dense"], np.array(dense, dtype=np.float32), rtol=1e-6)


def test_csv_plain_gz_header_and_headerless_agree(tmp_path):
    schema = _schema(tmp_path, CSV_SCHEMA)
    plain = tmp_path / "a.csv"
    plain.write_text(_csv_text(CSV_ROWS))
    convert_table([plain], tmp_path / "plain", schema=schema)
    _check_csv_output(tmp_path / "plain", CSV_ROWS)
    gz = tmp_path / "a.tsv.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write(_csv_text(CSV_ROWS, header=False, delimiter="\t"))
    headerless = _schema(tmp_path, CSV_SCHEMA.replace('format = "csv"', 'format = "csv"\ndelimiter = "\\t"\nheader = false\n'
                                                      'columns = ["y", "age", "spend", "item", "basket", "uid"]'),
                         "headerless.toml")
    convert_table([gz], tmp_path / "gz", schema=headerless)
    assert pq.read_table(tmp_path / "gz" / "data.parquet").equals(pq.read_table(tmp_path / "plain" / "data.parquet"))


def test_many_files_and_globs_in_sorted_order_hash_the_same_everywhere(tmp_path):
    schema = _schema(tmp_path, CSV_SCHEMA)
    for i in range(4):
        (tmp_path / f"day_{i}.csv").write_text(_csv_text(CSV_ROWS[i:i + 1]))
    meta = convert_table([str(tmp_path / "day_[23].csv"), tmp_path / "day_0.csv", str(tmp_path / "day_1*")],
                         tmp_path / "ds", schema=schema)
    order = [2, 3, 0, 1]
    assert meta.num_examples == 4 and meta.extra["source"].count("day_") == 4
    _check_csv_output(tmp_path / "ds", [CSV_ROWS[i] for i in order])
    # another run, other files: the same value gets the same id ("17" -> 17, "apple" everywhere)
    (tmp_path / "again.csv").write_text(_csv_text(CSV_ROWS))
    convert_table([tmp_path / "again.csv"], tmp_path / "again", schema=schema)
    a, b = _rows(tmp_path / "ds" / "data.parquet"), _rows(tmp_path / "again" / "data.parquet")
    assert [a[order.index(i)] for i in range(4)] == b
    with pytest.raises(DataError, match=r"nothing_\*\.csv: the pattern matches no file"):
        convert_table([str(tmp_path / "nothing_*.csv")], tmp_path / "none", schema=schema)
    assert not (tmp_path / "none").exists()


def test_vocabulary_file_maps_line_numbers_and_unknowns_to_zero(tmp_path):
    (tmp_path / "items.txt").write_text("apple\npear\n42\n")
    schema = _schema(tmp_path, CSV_SCHEMA.replace("hash_size = 97", 'vocabulary = "items.txt"'))
    src = tmp_path / "a.csv"
    src.write_text(_csv_text(CSV_ROWS))
    meta = convert_table([src], tmp_path / "ds", schema=schema)
    assert meta.table_sizes == {"item": 4}
    got = _rows(tmp_path / "ds" / "data.parquet")
    assert [r["item"] for r in got] == [1, 3, 2, 0]
    assert [r["basket"] for r in got] == [[1, 2], [], [3, 0], [0]]


def test_dense_transforms_match_numpy(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(0, 50, size=200)
    x[::17] = np.nan  # missing -> fill
    src = tmp_path / "d.parquet"
    pq.write_table(pa.table({"y": pa.array(rng.integers(0, 2, 200)), "x": pa.array(x, from_pandas=True),
                             "c": pa.array(rng.integers(0, 9, 200))}), src)
    schema = _schema(tmp_path, """
format = "parquet"
label = "y"
[dense.raw]
column = "x"
[dense.logged]
column = "x"
transform = "log1p"
fill = 3.0
[dense.clipped]
column = "x"
transform = "clip"
clip = [-10.0, 20.0]
[dense.std]
column = "x"
transform = ["log1p", "standardize"]
mean = 1.5
std = 0.5
[categorical.c]
hash_size = 10
""")
    convert_table([src], tmp_path / "ds", schema=schema, chunk_rows=64)
    dense = np.array(pq.read_table(tmp_path / "ds" / "data.parquet").column("dense").to_pylist())
    filled0, filled3 = np.where(np.isnan(x), 0.0, x), np.where(np.isnan(x), 3.0, x)
    expect = np.stack([filled0, np.log1p(np.maximum(filled3, 0)), np.clip(filled0, -10, 20),
                       (np.log1p(np.maximum(filled0, 0)) - 1.5) / 0.5], axis=1).astype(np.float32)
    np.testing.assert_array_equal(dense.astype(np.float32), expect)


# ---- the test split ---------------------------------------------------------------------------

TIME_SCHEMA = """
format = "csv"
label = "y"
timestamp = "t"
[categorical.item]
hash_size = 31
"""


def test_test_after_sends_later_examples_to_the_test_file(tmp_path):
    src = tmp_path / "a.csv"
    src.write_text("y,t,item\n1,2024-01-01,a\n0,2024-01-31T23:59:59,b\n1,2024-02-01,c\n0,1706745601,d\n"
                   "1,2024-01-15T00:00:00+05:00,e\n")
    out = tmp_path / "ds"
    meta = convert_table([src], out, schema=_schema(tmp_path, TIME_SCHEMA), test_after="2024-02-01", chunk_rows=2)
    assert meta.num_examples == 3 and meta.test_examples == 2
    assert meta.test_split == "timestamp>=2024-02-01T00:00:00Z"
    assert [r["item"] for r in _rows(out / "data.parquet")] == [_hash_id(v, 31) for v in "abe"]
    assert [r["item"] for r in _rows(out / "test.parquet")] == [_hash_id(v, 31) for v in "cd"]
    assert [r["timestamp"] for r in _rows(out / "test.parquet")] == [1706745600, 1706745601]
    train, test = open_dataset(out, test_fraction=0.5, seed=3)  # test_fraction ignored: the file is the split
    assert (len(train), len(test)) == (3, 2) and test.path == out / "test.parquet"
    assert test.take([0, 1]).labels.tolist() == [1.0, 0.0]
    again_train, _ = open_dataset(out)  # from the cache
    assert again_train.timestamps().tolist() == train.timestamps().tolist()
    caches = list((out / ".widedp-cache").iterdir())
    assert len(caches) == 1
    with pytest.raises(DataError, match="--test-after needs a timestamp column"):
        convert_table([src], tmp_path / "no_ts", schema=_schema(tmp_path, CSV_SCHEMA, "s2.toml"), test_after="2024-01-01")
    with pytest.raises(DataError, match="no example has timestamp >= 2030-01-01"):
        convert_table([src], tmp_path / "late", schema=_schema(tmp_path, TIME_SCHEMA), test_after="2030-01-01")
    with pytest.raises(DataError, match="is not an ISO 8601"):
        convert_table([src], tmp_path / "bad_t", schema=_schema(tmp_path, TIME_SCHEMA), test_after="next week")
    assert not any((tmp_path / d).exists() for d in ("no_ts", "late", "bad_t"))


def test_test_files_become_test_parquet_and_the_identity_covers_them(tmp_path):
    from widedp.trainer.data.format.meta import dataset_identity

    schema = _schema(tmp_path, CSV_SCHEMA)
    (tmp_path / "train.csv").write_text(_csv_text(CSV_ROWS[:3]))
    (tmp_path / "eval.csv.gz").write_bytes(gzip.compress(_csv_text(CSV_ROWS[3:]).encode()))
    out = tmp_path / "ds"
    meta = convert_table([tmp_path / "train.csv"], out, schema=schema, test_inputs=[tmp_path / "eval.csv.gz"])
    assert meta.test_examples == 1 and meta.test_split == "file"
    assert pq.read_table(out / "test.parquet").schema.equals(pq.read_table(out / "data.parquet").schema)
    train, test = open_dataset(out)
    assert (len(train), len(test)) == (3, 1)
    assert test.units().tolist() == [_string_hash("007") - (1 << 64) * (_string_hash("007") >> 63)]
    ident = dataset_identity(out)
    assert ident["test_bytes"] == (out / "test.parquet").stat().st_size
    # a changed test file is another data set (identity) and is validated again (cache key)
    table = pq.read_table(out / "test.parquet")
    pq.write_table(table.set_column(table.schema.get_field_index("item"), "item", pa.array([97], pa.int64())),
                   out / "test.parquet")
    assert dataset_identity(out) != ident
    with pytest.raises(DataError, match=r"test.parquet: row 0: feature 'item': id 97 outside table 'item'"):
        open_dataset(out)


# ---- errors: file, row (line), column ------------------------------------------------------------

def _bad_csv(rows_text):
    return HEADER + "\n" + rows_text


CSV_ERRORS = [
    ("label 2", "1,25,10,a,b,1\n2,25,10,a,b,1\n", "line 3 (row 1): column 'y': label '2' is not 0 or 1"),
    ("empty label", "1,25,10,a,b,1\n,25,10,a,b,1\n", "line 3 (row 1): column 'y': label missing is not 0 or 1"),
    ("non-numeric dense", "1,25,10,a,b,1\n1,25,10,a,b,1\n0,abc,1,a,b,1\n",
     "line 4 (row 2): column 'age': dense value 'abc' is not a number"),
    ("nan dense", "1,nan,10,a,b,1\n", "line 2 (row 0): column 'age': dense value nan is not finite"),
    ("missing unit", "1,25,10,a,b,1\n0,25,10,a,b,\n", "line 3 (row 1): column 'uid': the unit is missing"),
    ("wrong field count", "1,25,10,a,b,1\n1,25,10\n", "line 3: expected 6 fields, got 3"),
]


@pytest.mark.parametrize("name,text,needle", CSV_ERRORS, ids=[e[0] for e in CSV_ERRORS])
def test_csv_errors_name_file_line_row_and_column(tmp_path, name, text, needle):
    src = tmp_path / "bad.csv"
    src.write_text(_bad_csv(text))
    out = tmp_path / "ds"
    with pytest.raises(DataError) as err:
        convert_table([src], out, schema=_schema(tmp_path, CSV_SCHEMA))
    assert str(err.value).startswith(f"{src}: ") and needle in str(err.value), str(err.value)
    assert not out.exists()


def test_timestamp_and_missing_column_errors(tmp_path):
    src = tmp_path / "a.csv"
    src.write_text("y,t,item\n1,2024-01-01,a\n0,yesterday,b\n")
    with pytest.raises(DataError, match=r"a.csv: line 3 \(row 1\): column 't': timestamp 'yesterday' is neither"):
        convert_table([src], tmp_path / "o1", schema=_schema(tmp_path, TIME_SCHEMA))
    src.write_text("y,item\n1,a\n")
    with pytest.raises(DataError, match=r"a.csv: line 1: missing column 't'"):
        convert_table([src], tmp_path / "o2", schema=_schema(tmp_path, TIME_SCHEMA))
    pq.write_table(pa.table({"y": [1], "item": ["a"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p.parquet: column 't': missing"):
        convert_table([tmp_path / "p.parquet"], tmp_path / "o3",
                      schema=_schema(tmp_path, TIME_SCHEMA.replace('"csv"', '"parquet"'), "p.toml"))
    assert not any((tmp_path / d).exists() for d in ("o1", "o2", "o3"))


PARQUET_ERRORS = [
    ("label 0.5", dict(clicked=pa.array([1.0, 0.5, 0.0])), "row 1: column 'clicked': label 0.5 is not 0 or 1"),
    ("wrong type", dict(price=pa.array([[1.0]] * 3)), "column 'price': wrong type list<"),
    ("scalar for a list", dict(history=pa.array([1, 2, 3])), "column 'history': wrong type int64"),
    ("bad timestamp", dict(time=pa.array(["2024-01-01", "2024-01-01", "2024-13-45"])),
     "row 2: column 'time': timestamp '2024-13-45' is neither"),
    ("missing timestamp", dict(time=pa.array(["2024-01-01", None, "2024-01-01"])),
     "row 1: column 'time': the timestamp is missing"),
]


@pytest.mark.parametrize("name,change,needle", PARQUET_ERRORS, ids=[e[0] for e in PARQUET_ERRORS])
def test_parquet_errors_name_file_row_and_column(tmp_path, name, change, needle):
    src = tmp_path / "in.parquet"
    _parquet_input(src)
    t = pq.read_table(src)
    for col, arr in change.items():
        t = t.set_column(t.schema.get_field_index(col), col, arr)
    pq.write_table(t, src)
    with pytest.raises(DataError) as err:
        convert_table([src], tmp_path / "ds", schema=_schema(tmp_path, PARQUET_SCHEMA))
    assert str(err.value).startswith(f"{src}: ") and needle in str(err.value), str(err.value)
    assert not (tmp_path / "ds").exists()


SCHEMA_ERRORS = [
    ("unknown top key", CSV_SCHEMA + "\nlabels = 'x'\n", "labels: unknown key"),
    ("unknown feature key", CSV_SCHEMA.replace("separator", "sep"), "categorical.basket.sep: unknown key"),
    ("missing label", CSV_SCHEMA.replace('label = "y"', ""), "label: missing"),
    ("bad format", CSV_SCHEMA.replace('"csv"', '"xlsx"'), 'format: must be "parquet" or "csv"'),
    ("no id rule", CSV_SCHEMA.replace("hash_size = 97\nlist", "list"), "categorical.basket.hash_size: give exactly one"),
    ("hash size 1", CSV_SCHEMA.replace("hash_size = 97\n\n", "hash_size = 1\n\n"),
     "categorical.item.hash_size: must be an integer >= 2"),
    ("standardize with a mean only", CSV_SCHEMA.replace("std = 10.0\n", ""),
     "dense.age.std: give both a PUBLIC mean and std, or neither (then they are estimated with DP)"),
    ("DP standardize of unbounded values", CSV_SCHEMA.replace("mean = 40.0\nstd = 10.0\n", "").replace(
        'transform = ["clip", "standardize"]', 'transform = ["clip", "log1p", "standardize"]'),
     "dense.age.transform: standardize without a PUBLIC mean and std estimates them with differential privacy, "
     "which needs the values bounded: put clip right before it"),
    ("bad statistics sigma", "statistics_noise_multiplier = 0\n" + CSV_SCHEMA,
     "statistics_noise_multiplier: must be > 0"),
    ("shared table sizes", CSV_SCHEMA.replace("hash_size = 97\nlist", "hash_size = 98\nlist"),
     "categorical.basket.table: features 'item' and 'basket' share table 'item' but give it different sizes (97 and 98)"),
    ("bad pooling", CSV_SCHEMA.replace('separator = "|"', 'separator = "|"\npooling = "max"'),
     "categorical.basket.pooling: must be one of"),
    ("max_length on a scalar", CSV_SCHEMA.replace("hash_size = 97\n\n", "hash_size = 97\nmax_length = 3\n\n"),
     "categorical.item.max_length: only for list = true"),
    ("reserved name", CSV_SCHEMA.replace("[categorical.item]", "[categorical.unit]"),
     "categorical.unit: a feature may not be named 'unit'"),
    ("not toml", "format = ", "not valid TOML"),
    ("headerless without columns", CSV_SCHEMA.replace('format = "csv"', 'format = "csv"\nheader = false'),
     "columns: missing"),
]


@pytest.mark.parametrize("name,text,needle", SCHEMA_ERRORS, ids=[e[0] for e in SCHEMA_ERRORS])
def test_schema_mistakes_name_the_schema_file_and_key(tmp_path, name, text, needle):
    src = tmp_path / "a.csv"
    src.write_text(_csv_text(CSV_ROWS))
    schema = _schema(tmp_path, text)
    with pytest.raises(DataError) as err:
        convert_table([src], tmp_path / "ds", schema=schema)
    assert str(err.value).startswith(f"{schema}: ") and needle in str(err.value), str(err.value)
    assert not (tmp_path / "ds").exists()


def test_existing_output_refused_and_a_bad_second_file_leaves_nothing(tmp_path):
    schema = _schema(tmp_path, CSV_SCHEMA)
    (tmp_path / "a.csv").write_text(_csv_text(CSV_ROWS))
    (tmp_path / "b.csv").write_text(_csv_text(CSV_ROWS[:2]) + "7,1,1,a,b,1\n")
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "dataset.json").write_text("{}")
    with pytest.raises(DataError, match="not empty; a data set directory is never overwritten"):
        convert_table([tmp_path / "a.csv"], existing, schema=schema)
    assert os.listdir(existing) == ["dataset.json"]
    out = tmp_path / "new" / "ds"
    with pytest.raises(DataError, match=r"b.csv: line 4 \(row 2\): column 'y': label '7'"):
        convert_table([tmp_path / "a.csv", tmp_path / "b.csv"], out, schema=schema, chunk_rows=1)
    assert not (tmp_path / "new").exists()  # created by the writer, removed with everything in it
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(DataError):
        convert_table([tmp_path / "a.csv"], empty, schema=schema, test_inputs=[tmp_path / "b.csv"])
    assert os.listdir(empty) == []  # no temporary data or test file left


# ---- bounded memory -------------------------------------------------------------------------------

MEMORY_PROBE = r"""
import sys, tracemalloc
import pyarrow as pa
from widedp.trainer.data.convert.table import convert_table
tracemalloc.start()
# a first small conversion loads what pyarrow imports lazily (pandas): modules are not data
convert_table([sys.argv[4]], sys.argv[2] + "_warm", schema=sys.argv[3])
tracemalloc.reset_peak()
baseline, _ = tracemalloc.get_traced_memory()  # (the modules loaded so far stay allocated)
convert_table([sys.argv[1]], sys.argv[2], schema=sys.argv[3], chunk_rows=2000, csv_block_bytes=1 << 16)
_, python_peak = tracemalloc.get_traced_memory()
print(python_peak - baseline, pa.default_memory_pool().max_memory())
"""


def test_memory_stays_bounded_on_an_input_much_larger_than_a_chunk(tmp_path):
    # ~27 MB of CSV (300k rows) converted with 64 KiB blocks: numpy/Python (tracemalloc) and Arrow
    # (its pool's peak) each stay far below the file size; without streaming both would exceed it
    n = 300_000
    rng = np.random.default_rng(0)
    cols = [rng.integers(0, 2, n).astype(str), rng.integers(0, 1000, n).astype(str),
            np.char.add("item", rng.integers(0, 10 ** 6, n).astype(str)),
            np.char.add(np.char.add(rng.integers(0, 99, n).astype(str), "|x"), "|yyyyyyyyyyyyyyyyyyyyyyyyyyyy" * 2),
            rng.integers(0, 10 ** 9, n).astype(str)]
    src = tmp_path / "big.csv"
    with open(src, "w") as fh:
        fh.write(HEADER.replace("age,", "").replace("spend", "age") + "\n")
        body = np.char.add(np.char.add(np.char.add(np.char.add(np.char.add(np.char.add(np.char.add(
            np.char.add(cols[0], ","), cols[1]), ","), cols[2]), ","), cols[3]), ","), cols[4])
        fh.write("\n".join(body.tolist()))
        fh.write("\n")
    size = src.stat().st_size
    assert size > 20e6
    schema = _schema(tmp_path, CSV_SCHEMA.replace("[dense.age]\ntransform = [\"clip\", \"standardize\"]\nclip = [0, 100]\n"
                                                  "mean = 40.0\nstd = 10.0\nfill = 35.0\n\n", "")
                     .replace("[dense.spend]", "[dense.age]"))
    small = tmp_path / "small.csv"
    with open(src) as fh:
        small.write_text("".join(fh.readline() for _ in range(10)))
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(src), str(tmp_path / "ds"), str(schema), str(small)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    python_peak, arrow_peak = map(int, out.stdout.split())
    assert read_meta(tmp_path / "ds").num_examples == n
    # measured: ~0.7 MB and ~4.2 MB (pyarrow 26) against 27 MB of input; reading it whole would need more than all
    assert python_peak < size / 8 and arrow_peak < size / 4, (python_peak, arrow_peak, size)


# ---- the CLI, Criteo over many / .gz files, training end to end ----------------------------------

def test_cli_convert_table_prints_one_json_and_reports_errors_in_one_line(tmp_path, capsys):
    schema = _schema(tmp_path, TIME_SCHEMA)
    (tmp_path / "a.csv").write_text("y,t,item\n1,2024-01-01,a\n0,2024-03-01,b\n")
    code = main(["convert", "table", str(tmp_path / "a.csv"), str(tmp_path / "ds"), "--schema", str(schema),
                 "--test-after", "2024-02-01"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert result["num_examples"] == 1 and result["test_examples"] == 1
    assert result["test_split"] == "timestamp>=2024-02-01T00:00:00Z"
    (tmp_path / "b.csv").write_text("y,t,item\n1,2024-01-01,a\nx,2024-03-01,b\n")
    code = main(["convert", "table", str(tmp_path / "b.csv"), str(tmp_path / "ds2"), "--schema", str(schema)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and "b.csv: line 3 (row 1): column 'y'" in err
    assert not (tmp_path / "ds2").exists()


def test_criteo_accepts_gz_and_many_files(tmp_path):
    line = "\t".join(["1"] + ["3"] * 13 + ["a1"] * 26)
    other = "\t".join(["0"] + [""] * 13 + ["ff"] * 26)
    (tmp_path / "day_0.tsv").write_text(line + "\n")
    with gzip.open(tmp_path / "day_1.tsv.gz", "wt") as fh:
        fh.write(other + "\n" + line + "\n")
    meta = convert_criteo(str(tmp_path / "day_*"), tmp_path / "ds", hash_size=64)
    assert meta.num_examples == 3
    t = pq.read_table(tmp_path / "ds" / "data.parquet")
    assert t.column("label").to_pylist() == [1.0, 0.0, 1.0]
    assert t.column("cat_0").to_pylist() == [1 + _splitmix64(0xA1) % 63, 1 + _splitmix64(0xFF) % 63,
                                             1 + _splitmix64(0xA1) % 63]
    (tmp_path / "day_2.tsv.gz").write_bytes(gzip.compress((line + "\n1\t2\n").encode()))
    with pytest.raises(DataError, match=r"day_2.tsv.gz: line 2 \(row 1\)"):
        convert_criteo([tmp_path / "day_0.tsv", tmp_path / "day_2.tsv.gz"], tmp_path / "ds2", hash_size=64)
    assert not (tmp_path / "ds2").exists()


def _train_data(tmp_path):
    rng = np.random.default_rng(1)
    n, n_test = 1200, 300
    item = rng.integers(0, 40, n + n_test)
    hist = [rng.integers(0, 40, rng.integers(0, 6)).tolist() for _ in range(n + n_test)]
    logit = (item % 2) * 2.0 - 1.0
    y = (rng.random(n + n_test) < 1 / (1 + np.exp(-logit))).astype(int)
    table = pa.table({"y": y, "x": rng.normal(size=n + n_test), "item": item,
                      "hist": pa.array(hist, pa.list_(pa.int64())), "user": rng.integers(0, 200, n + n_test)})
    pq.write_table(table.slice(0, n), tmp_path / "train.parquet")
    pq.write_table(table.slice(n), tmp_path / "test.parquet")
    schema = _schema(tmp_path, """
format = "parquet"
label = "y"
unit = "user"
[dense.x]
transform = ["clip", "standardize"]   # mean and std estimated with DP
clip = [-3, 3]
[categorical.item]
table = "item"
hash_size = 64
[categorical.hist]
table = "item"
hash_size = 64
list = true
pooling = "mean"
""")
    convert_table([tmp_path / "train.parquet"], tmp_path / "ds", schema=schema, test_inputs=[tmp_path / "test.parquet"])
    return tmp_path / "ds"


@pytest.mark.parametrize("mode", ["sparse", "nonprivate"])
def test_a_converted_list_valued_data_set_trains(tmp_path, capsys, mode):
    data = _train_data(tmp_path)
    run = tmp_path / "run"
    code = main(["train", "--config", str(REPO / "configs" / "quickstart.toml"), "--no-progress",
                 "--run-dir", str(run), *[x for s in (
                     f"data.path={data}", "data.synth=", f"train.mode={mode}", "train.steps=4", "train.batch_size=64",
                     "train.log_every=2", "train.checkpoint_every=4", "train.eval_every=4", "privacy.k=20",
                     "cluster.backend=local", "cluster.num_shards=1", "model.embedding_dim=4",
                     "model.bottom_mlp=[4]", "model.top_mlp=[4]") for x in ("--set", s)]])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_split"] == "file" and summary["private"] == (mode == "sparse")
    # the data set names a user per example; the run protects examples and says so
    assert summary["privacy_unit"] == "example"
    if mode == "sparse":  # the DP standardization statistics are charged before the first step
        assert any(c.startswith("Charged before training (in the ledger): DP standardization statistics")
                   for c in summary["privacy_caveats"])
        from widedp.accounting.events import GaussianDpEvent
        from widedp.accounting.ledger import PrivacyLedger

        assert PrivacyLedger.load(run / "ledger.json").history[0] == (GaussianDpEvent(20.0), 1)
    assert any("privacy unit per example" in c and "group of m" in c for c in summary["privacy_caveats"])
    metrics = summary["test_metrics"]
    assert math.isfinite(metrics["auc"]) and math.isfinite(metrics["logloss"])
