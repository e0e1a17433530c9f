"""benchmarks/public_logs.py: the history feature (strictly earlier rows only), the Parquet logs
(a period whose lists are all empty still has a list<string> column, written whole or not at
all), the R lazy-load chunk formats, and clear errors. No download: the packages are not fetched."""

from __future__ import annotations

import bz2
import lzma
import struct
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import public_logs  # noqa: E402

pd = pytest.importorskip("pandas")


def test_history_holds_only_strictly_earlier_items_most_recent_first():
    frame = pd.DataFrame({"u": [1, 1, 1, 1, 2, 2], "t": [3, 1, 2, 2, 5, 5], "item": ["d", "a", "b", "c", "x", "y"]})
    out = public_logs._history(frame, "u", "t", "item")
    got = {(u, it): h for u, it, h in zip(out["u"], out["item"], out["history"])}
    assert got[(1, "a")] == []
    assert got[(1, "b")] == ["a"] and got[(1, "c")] == ["a"]  # tied on t: not each other's history
    assert got[(1, "d")] == ["c", "b", "a"]  # most recent first
    assert got[(2, "x")] == [] and got[(2, "y")] == []  # another unit's rows never leak in


def test_history_is_capped(monkeypatch):
    monkeypatch.setattr(public_logs, "HISTORY", 2)
    frame = pd.DataFrame({"u": [0] * 4, "t": [0, 1, 2, 3], "item": list("abcd")})
    out = public_logs._history(frame, "u", "t", "item")
    assert list(out["history"])[-1] == ["c", "b"]


def test_write_logs_types_an_all_empty_list_column_as_strings_and_replaces_the_directory(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    frame = pd.DataFrame({"period": [1, 1, 2], "label": [0, 1, 1], "history": [[], [], ["a"]]})
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "stale.txt").write_text("old")
    public_logs.write_logs(frame, "period", logs, "schema = 1\n")
    assert not (logs / "stale.txt").exists() and (logs / "schema.toml").read_text() == "schema = 1\n"
    first = pq.read_table(logs / "period=1" / "part-0.parquet")
    pa = pytest.importorskip("pyarrow")
    history = first.schema.field("history").type
    assert pa.types.is_list(history) and pa.types.is_string(history.value_type)
    assert "period" not in first.schema.names
    assert not list(tmp_path.glob("*.writing"))


@pytest.mark.parametrize("wrap", [
    lambda b: struct.pack(">i", len(b)) + zlib.compress(b),
    lambda b: struct.pack(">i", len(b)) + b"Z" + lzma.compress(b),
    lambda b: struct.pack(">i", len(b)) + b"2" + bz2.compress(b),
    lambda b: struct.pack(">i", len(b)) + b"0" + b,
])
def test_lazy_load_chunks_of_every_compression_decode(wrap):
    payload = b"RDX3\n" + bytes(range(200))
    assert public_logs._decompress_chunk(wrap(payload), "x.rdb") == payload


def test_bad_chunks_name_the_file():
    with pytest.raises(public_logs.PublicDataError, match="x.rdb: truncated"):
        public_logs._decompress_chunk(b"\0\0", "x.rdb")
    with pytest.raises(public_logs.PublicDataError, match="x.rdb: cannot decompress"):
        public_logs._decompress_chunk(b"\0\0\0\x05garbage", "x.rdb")


def test_a_directory_without_the_lazy_load_files_is_named(tmp_path):
    pytest.importorskip("rdata")  # the bench extra
    with pytest.raises(public_logs.PublicDataError, match="Rdata.rdx: no such file"):
        public_logs.read_lazy_load(tmp_path, "InstEval")


def test_an_unknown_set_is_refused_by_name(tmp_path):
    with pytest.raises(public_logs.PublicDataError, match="unknown set 'nope'"):
        public_logs.build("nope", tmp_path, tmp_path / "debs")
