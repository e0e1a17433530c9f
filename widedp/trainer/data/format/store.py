"""Validation of a data set's Parquet file and its decoded, random-access column store.

``load_all_columns`` reads ``data.parquet`` (and ``test.parquet`` when the data set has one)
once, row group by row group (bounded memory), checks every value vectorized (numpy over each
row group; no per-row Python), and decodes each file into flat numpy arrays that support
O(batch) random access:

* ``fixed`` int64 [N, F_fixed]: the single-id features (ctr: e.g. ``cat_*``; cbow: ``target``,
  ``neg_*``), one row per example, so gathering a batch reads one contiguous row each;
* ``jagged[name] = (offsets int64 [N+1], values int64)``: multi-id features (cbow context,
  ctr ``list_features``; a ctr bag may be empty);
* ``labels`` float32 [N], ``dense`` float32 [N, D];
* ``units`` / ``timestamps`` int64 [N] when the data set has those columns (else None).

With ``cache=True`` (default) the decoded arrays are written as raw files under
``DIR/.widedp-cache/v<version>-<key>/`` and memory-mapped (``numpy.memmap``, read-only), so
processes on one machine share the page cache and nothing needs to fit in RAM; the key
hashes dataset.json and the Parquet file's identity (size, mtime, ctime, inode), and a cache
exists only after a full successful validation, so a later open skips re-validation. One cache
holds both files' arrays (manifest.json lists each file's arrays) and its key covers both
files' identities. When the directory is not writable the arrays are decoded into memory
instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from widedp.trainer.data.errors import DataError
from widedp.trainer.data.format.meta import DATA_FILE, TEST_FILE, DatasetMeta, expected_columns, type_matches

CACHE_DIR = ".widedp-cache"
CACHE_VERSION = 2  # 2: one cache for data.parquet and test.parquet; units, timestamps
TEST_PART = "test"


@dataclass
class Columns:
    num_rows: int
    labels: np.ndarray
    dense: np.ndarray
    fixed: np.ndarray
    fixed_features: list[str]
    jagged: dict  # name -> (offsets [N+1] int64, values int64)
    units: Optional[np.ndarray] = None  # int64 [N]: the privacy unit of each example
    timestamps: Optional[np.ndarray] = None  # int64 [N]: seconds, UTC


def fixed_and_jagged(meta: DatasetMeta) -> tuple[list[str], list[str]]:
    if meta.kind == "ctr":
        lists = set(meta.list_features)
        return [f for f in meta.features if f not in lists], [f for f in meta.features if f in lists]
    return [f for f in meta.features if f != "context"], ["context"]


def data_parts(meta: DatasetMeta) -> list[tuple[str, str, int]]:
    """(part name, file name, rows) of each Parquet file of the data set."""
    parts = [("", DATA_FILE, meta.num_examples)]
    if meta.test_examples is not None:
        parts.append((TEST_PART, TEST_FILE, meta.test_examples))
    return parts


def load_all_columns(directory, meta: DatasetMeta, *, cache: bool = True) -> list[Columns]:
    """The decoded columns of each file of ``data_parts(meta)``, in that order."""
    directory = Path(directory)
    parts = data_parts(meta)
    stats = []
    for _, name, _ in parts:
        path = directory / name
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise DataError(f"{path}: missing") from None
        if st.st_size == 0:
            raise DataError(f"{path}: empty file (no examples)")
        stats.append(st)
    if cache:
        key = _cache_key(meta, stats)
        root = directory / CACHE_DIR
        final = root / f"v{CACHE_VERSION}-{key}"
        if (final / "manifest.json").exists():
            try:
                return _open_cache(final, meta)
            except (OSError, ValueError, KeyError):
                shutil.rmtree(final, ignore_errors=True)  # damaged cache: rebuild below
        tmp = root / f".tmp-{uuid.uuid4().hex}"
        try:
            tmp.mkdir(parents=True)
        except OSError:
            tmp = None
        if tmp is not None:
            sink = _FileSink(tmp)
            try:
                _decode_parts(directory, meta, sink)
                try:
                    os.rename(tmp, final)
                except OSError:  # another process won the race (or final is damaged)
                    if not (final / "manifest.json").exists():
                        raise
                    shutil.rmtree(tmp, ignore_errors=True)
                _remove_stale(root, final)
                return _open_cache(final, meta)
            except DataError:
                sink.close()
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            except OSError:  # disk full, permissions...: decode in memory instead
                sink.close()
                shutil.rmtree(tmp, ignore_errors=True)
            except BaseException:
                sink.close()
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    mem_sink = _MemSink()
    _decode_parts(directory, meta, mem_sink)
    jagged_names = fixed_and_jagged(meta)[1]
    return [_columns_from(mem_sink.arrays(part, jagged_names), meta) for part, _, _ in parts]


# ---- validation ----------------------------------------------------------------------------

def _decode_parts(directory: Path, meta: DatasetMeta, sink) -> None:
    for part, name, rows in data_parts(meta):
        _validate_and_decode(directory / name, meta, sink, part, rows)
    sink.finish()


def _validate_and_decode(path: Path, meta: DatasetMeta, sink, part: str, expected_rows: int) -> None:
    try:
        pf = pq.ParquetFile(str(path), memory_map=True)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file: {exc}") from None
    _check_schema(path, pf.schema_arrow, meta)
    n = pf.metadata.num_rows
    if n == 0:
        raise DataError(f"{path}: zero examples")
    if n != expected_rows:
        key = "num_examples" if part == "" else "test_examples"
        raise DataError(f"{path}: has {n} rows but dataset.json says {key}={expected_rows}")
    fixed_names, jagged_names = fixed_and_jagged(meta)
    sink.begin(part, n, len(fixed_names), meta.num_dense, jagged_names, _extras(meta),
               labels=meta.kind == "ctr")
    base = 0
    for rg in range(pf.num_row_groups):
        try:
            table = pf.read_row_group(rg)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{path}: row group {rg} (from row {base}): cannot read: {exc}") from None
        if table.num_rows == 0:
            continue
        if meta.kind == "ctr":
            _ctr_group(path, meta, table, base, sink)
        else:
            _cbow_group(path, meta, table, base, sink)
        base += table.num_rows


def _check_schema(path: Path, schema: pa.Schema, meta: DatasetMeta) -> None:
    expected = expected_columns(meta)
    names = list(schema.names)
    missing = [c for c in expected if c not in names]
    if missing:
        raise DataError(f"{path}: wrong schema: missing column(s) {', '.join(missing)} "
                        f"(expected {list(expected)})")
    extra = [c for c in names if c not in expected]
    if extra:
        raise DataError(f"{path}: wrong schema: unexpected column(s) {', '.join(extra)}")
    if len(set(names)) != len(names):
        raise DataError(f"{path}: wrong schema: duplicate column names")
    for name, typ in expected.items():
        actual = schema.field(name).type
        if not type_matches(actual, typ):
            raise DataError(f"{path}: wrong schema: column {name!r} has type {actual}, expected {typ}")


def _array(table: pa.Table, name: str) -> pa.Array:
    col = table.column(name)
    return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)


def _check_nulls(path: Path, arr: pa.Array, name: str, base: int) -> None:
    if arr.null_count:
        r = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{path}: row {base + r}: column {name!r} is null")


def _fixed_size_list(path: Path, table: pa.Table, name: str, width: int, base: int) -> np.ndarray:
    """Column `name` (fixed_size_list[width]) as an array [rows, width]; DataError naming the
    row and the element of the first null."""
    arr = _array(table, name)
    _check_nulls(path, arr, name, base)
    flat = arr.flatten()
    if flat.null_count:
        i = _first(flat.is_null().to_numpy(zero_copy_only=False))
        raise DataError(f"{path}: row {base + i // width}: {name}[{i % width}] is null")
    return flat.to_numpy().reshape(table.num_rows, width)


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _ctr_group(path: Path, meta: DatasetMeta, table: pa.Table, base: int, sink) -> None:
    n = table.num_rows
    label_arr = _array(table, "label")
    _check_nulls(path, label_arr, "label", base)
    labels = label_arr.to_numpy()
    bad = ~np.isfinite(labels)
    if bad.any():
        r = _first(bad)
        raise DataError(f"{path}: row {base + r}: label is {float(labels[r])} (not finite)")
    bad = (labels != 0) & (labels != 1)
    if bad.any():
        r = _first(bad)
        raise DataError(f"{path}: row {base + r}: label {float(labels[r])!r} is not 0 or 1")

    d = meta.num_dense
    if d == 0:
        dense = np.zeros((n, 0), dtype=np.float32)
    else:
        dense = _fixed_size_list(path, table, "dense", d, base)
        bad = ~np.isfinite(dense)
        if bad.any():
            i = _first(bad.reshape(-1))
            raise DataError(f"{path}: row {base + i // d}: dense[{i % d}] is {float(dense.reshape(-1)[i])} "
                            "(not finite)")

    fixed_names, jagged_names = fixed_and_jagged(meta)
    fixed = np.empty((n, len(fixed_names)), dtype=np.int64)
    for j, f in enumerate(fixed_names):
        arr = _array(table, f)
        _check_nulls(path, arr, f, base)
        fixed[:, j] = arr.to_numpy()
    _check_ids(path, meta, fixed, fixed_names, base)
    jagged = {f: _bags(path, meta, table, f, base, allow_empty=True) for f in jagged_names}
    extras = {}
    for name in _extras(meta):
        arr = _array(table, name)
        _check_nulls(path, arr, name, base)
        extras[name] = arr.to_numpy()
    sink.add(labels=labels, dense=dense, fixed=fixed, jagged=jagged, extras=extras)


def _extras(meta: DatasetMeta) -> list[str]:
    """The per-example int64 columns besides ids: ``unit``, ``timestamp`` (when present)."""
    return ([ "unit"] if meta.unit_column else []) + (["timestamp"] if meta.timestamp_column else [])


def _bags(path: Path, meta: DatasetMeta, table: pa.Table, name: str, base: int, *,
          allow_empty: bool) -> tuple[np.ndarray, np.ndarray]:
    """(lengths int64 [n], values int64) of a list<int64> feature column, checked."""
    col = _array(table, name)
    _check_nulls(path, col, name, base)
    lengths = col.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
    values_arr = col.flatten()
    ends = np.cumsum(lengths)
    if values_arr.null_count:
        i = _first(values_arr.is_null().to_numpy(zero_copy_only=False))
        r = int(np.searchsorted(ends, i, side="right"))
        raise DataError(f"{path}: row {base + r}: {name} contains a null id")
    values = values_arr.to_numpy()
    if not allow_empty:
        bad = lengths == 0
        if bad.any():
            raise DataError(f"{path}: row {base + _first(bad)}: empty {name}")
    size = meta.table_sizes[meta.feature_tables[name]]
    bad = (values < 0) | (values >= size)
    if bad.any():
        i = _first(bad)
        r = int(np.searchsorted(ends, i, side="right"))
        _raise_id(path, meta, name, base + r, int(values[i]))
    return lengths, values


def _check_ids(path: Path, meta: DatasetMeta, fixed: np.ndarray, names: list[str], base: int) -> None:
    sizes = np.array([meta.table_sizes[meta.feature_tables[f]] for f in names], dtype=np.int64)
    bad = (fixed < 0) | (fixed >= sizes)
    if bad.any():
        i = _first(bad.reshape(-1))
        r, j = divmod(i, len(names))
        _raise_id(path, meta, names[j], base + r, int(fixed[r, j]))


def _raise_id(path: Path, meta: DatasetMeta, feature: str, row: int, value: int) -> None:
    table = meta.feature_tables[feature]
    size = meta.table_sizes[table]
    if value < 0:
        raise DataError(f"{path}: row {row}: feature {feature!r}: negative id {value}")
    raise DataError(f"{path}: row {row}: feature {feature!r}: id {value} outside table "
                    f"{table!r} of size {size}")


def _cbow_group(path: Path, meta: DatasetMeta, table: pa.Table, base: int, sink) -> None:
    n = table.num_rows
    # an empty context is an error; a long one (checked below) too
    lengths, values = _bags(path, meta, table, "context", base, allow_empty=False)
    window = meta.extra.get("window")
    if isinstance(window, int) and window > 0:
        bad = lengths > 2 * window
        if bad.any():
            r = _first(bad)
            raise DataError(f"{path}: row {base + r}: context has {lengths[r]} ids, more than "
                            f"2*window={2 * window}")

    names = fixed_and_jagged(meta)[0]
    k = meta.num_negatives
    fixed = np.empty((n, 1 + k), dtype=np.int64)
    tgt = _array(table, "target")
    _check_nulls(path, tgt, "target", base)
    fixed[:, 0] = tgt.to_numpy()
    fixed[:, 1:] = _fixed_size_list(path, table, "negatives", k, base)
    _check_ids(path, meta, fixed, names, base)
    sink.add(fixed=fixed, jagged={"context": (lengths, values)})


# ---- sinks: where decoded arrays go ----------------------------------------------------------
# Both take the files of a data set one after the other: ``begin(part, ...)`` starts a file
# ("" for data.parquet, "test" for test.parquet); each part has its own dict of named arrays.

class _MemSink:
    def __init__(self):
        self.parts: dict[str, dict[str, list]] = {}
        self.rows: dict[str, int] = {}

    def begin(self, part, n, num_fixed, num_dense, jagged_names, extras, *, labels):
        self.part = part
        self.rows[part] = n
        names = ["fixed", *(["labels", "dense"] if labels else []), *extras]
        names += [f"{j}.{kind}" for j in range(len(jagged_names)) for kind in ("lengths", "values")]
        self.parts[part] = {name: [] for name in names}
        self.jagged_names = list(jagged_names)

    def add(self, *, fixed, labels=None, dense=None, jagged=None, extras=None):
        arrays = self.parts[self.part]
        arrays["fixed"].append(fixed)
        if labels is not None:
            arrays["labels"].append(labels.astype(np.float32, copy=False))
            arrays["dense"].append(dense.astype(np.float32, copy=False))
        for name, (lengths, values) in (jagged or {}).items():
            j = self.jagged_names.index(name)
            arrays[f"{j}.lengths"].append(lengths)
            arrays[f"{j}.values"].append(values)
        for name, values in (extras or {}).items():
            arrays[name].append(np.asarray(values, dtype=np.int64))

    def finish(self):
        pass

    def arrays(self, part: str, jagged_names: list[str]) -> dict:
        chunks = self.parts[part]
        out = {name: np.concatenate(c) for name, c in chunks.items() if "." not in name}
        for j, name in enumerate(jagged_names):
            offsets = np.zeros(self.rows[part] + 1, dtype=np.int64)
            if chunks[f"{j}.lengths"]:
                np.cumsum(np.concatenate(chunks[f"{j}.lengths"]), out=offsets[1:])
            values = chunks[f"{j}.values"]
            out[f"{name}.offsets"] = offsets
            out[f"{name}.values"] = (np.concatenate(values) if values else np.zeros(0)).astype(np.int64, copy=False)
        return out


class _FileSink:
    """Appends each decoded array to a raw file (named by its position: feature names may hold
    any character); ``finish`` writes manifest.json last."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.files: dict[str, dict[str, dict]] = {}
        self.handles: dict = {}
        self.rows: dict[str, int] = {}
        self.jag_total: dict = {}

    def begin(self, part, n, num_fixed, num_dense, jagged_names, extras, *, labels):
        self.part = part
        self.rows[part] = n
        self.files[part] = {}
        self._open("fixed", np.int64, (num_fixed,))
        if labels:
            self._open("labels", np.float32, ())
            self._open("dense", np.float32, (num_dense,))
        for name in extras:
            self._open(name, np.int64, ())
        for name in jagged_names:
            self._open(f"{name}.offsets", np.int64, ())
            self._open(f"{name}.values", np.int64, ())
            self._write(f"{name}.offsets", np.zeros(1, dtype=np.int64))
            self.jag_total[(part, name)] = 0

    def _open(self, name, dtype, trailing):
        file = f"a{len(self.handles)}.bin"
        self.files[self.part][name] = {"dtype": np.dtype(dtype).str, "trailing": list(trailing), "rows": 0,
                                       "file": file}
        self.handles[(self.part, name)] = open(self.dir / file, "wb")

    def _write(self, name, arr):
        info = self.files[self.part][name]
        arr = np.ascontiguousarray(arr, dtype=np.dtype(info["dtype"]))
        self.handles[(self.part, name)].write(arr.tobytes())
        info["rows"] += arr.shape[0]

    def add(self, *, fixed, labels=None, dense=None, jagged=None, extras=None):
        self._write("fixed", fixed)
        if labels is not None:
            self._write("labels", labels)
            self._write("dense", dense)
        for name, (lengths, values) in (jagged or {}).items():
            key = (self.part, name)
            offsets = self.jag_total[key] + np.cumsum(lengths, dtype=np.int64)
            self._write(f"{name}.offsets", offsets)
            self._write(f"{name}.values", values)
            self.jag_total[key] = int(offsets[-1]) if len(offsets) else self.jag_total[key]
        for name, values in (extras or {}).items():
            self._write(name, values)

    def close(self):
        for fh in self.handles.values():
            fh.close()

    def finish(self):
        self.close()
        manifest = {"version": CACHE_VERSION, "rows": self.rows, "arrays": self.files}
        with open(self.dir / "manifest.json", "w", encoding="utf-8") as fh:
            json.dump(manifest, fh)


def _open_cache(directory: Path, meta: DatasetMeta) -> list[Columns]:
    with open(directory / "manifest.json", encoding="utf-8") as fh:
        manifest = json.load(fh)
    if manifest.get("version") != CACHE_VERSION:
        raise ValueError("cache version")
    parts = data_parts(meta)
    if manifest["rows"] != {part: rows for part, _, rows in parts}:
        raise ValueError("cache row count")
    out = []
    for part, _, _ in parts:
        arrays = {}
        for name, info in manifest["arrays"][part].items():
            shape = (info["rows"], *info["trailing"])
            dtype = np.dtype(info["dtype"])
            fname = directory / info["file"]
            if os.path.getsize(fname) != int(np.prod(shape)) * dtype.itemsize:
                raise ValueError(f"cache file {fname} has the wrong size")
            if int(np.prod(shape)) == 0:
                arrays[name] = np.zeros(shape, dtype=dtype)
            else:
                arrays[name] = np.asarray(np.memmap(fname, dtype=dtype, mode="r", shape=shape))
        out.append(_columns_from(arrays, meta))
    return out


def advise_random_access(columns: Columns) -> int:
    """Tell the kernel that the memory-mapped cache behind `columns` is read at random rows
    (madvise MADV_RANDOM): a page fault then reads its page alone instead of the read-around
    window (128 KiB by default) — a Poisson-sampled step touches a few pages per sampled example,
    and read-around multiplies its storage reads some 30× once the cache no longer fits in the
    page cache. Returns the number of mappings advised (0 in memory, or where madvise is missing)."""
    import mmap

    advice = getattr(mmap, "MADV_RANDOM", None)
    if advice is None:
        return 0
    arrays = [columns.labels, columns.dense, columns.fixed, columns.units, columns.timestamps,
              *[a for pair in columns.jagged.values() for a in pair]]
    seen, advised = set(), 0
    for arr in arrays:
        base = arr
        while base is not None and not isinstance(base, mmap.mmap):
            base = getattr(base, "_mmap", None) or getattr(base, "base", None)
        if base is not None and id(base) not in seen:
            seen.add(id(base))
            base.madvise(advice)
            advised += 1
    return advised


def _columns_from(arrays: dict, meta: DatasetMeta) -> Columns:
    fixed_names, jagged_names = fixed_and_jagged(meta)
    fixed = arrays["fixed"]
    n = fixed.shape[0]
    labels = arrays.get("labels")
    if labels is None:
        labels = np.zeros(n, dtype=np.float32)
    dense = arrays.get("dense")
    if dense is None:
        dense = np.zeros((n, meta.num_dense), dtype=np.float32)
    jagged = {name: (arrays[f"{name}.offsets"], arrays[f"{name}.values"]) for name in jagged_names}
    return Columns(num_rows=n, labels=labels, dense=dense, fixed=fixed, fixed_features=fixed_names,
                   jagged=jagged, units=arrays.get("unit"), timestamps=arrays.get("timestamp"))


def _cache_key(meta: DatasetMeta, stats: list) -> str:
    files = [{"size": st.st_size, "mtime": st.st_mtime_ns, "ctime": st.st_ctime_ns, "ino": st.st_ino,
              "dev": st.st_dev} for st in stats]
    ident = {"meta": meta.to_dict(), "files": files, "v": CACHE_VERSION}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _remove_stale(root: Path, keep: Path) -> None:
    """Best effort: drop caches of earlier versions of this data set."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return
    now = time.time()
    for entry in entries:
        try:
            if entry == keep or not entry.is_dir():
                continue
            # other versions; temporaries a crashed process left behind more than a day ago
            if entry.name.startswith("v") or (entry.name.startswith(".tmp-")
                                              and now - entry.stat().st_mtime > 86400):
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass


def cache_dirs(directory) -> list[Path]:
    root = Path(directory) / CACHE_DIR
    return sorted(p for p in root.iterdir()) if root.exists() else []


def validate(directory, meta: Optional[DatasetMeta] = None) -> None:
    """Validate a data set without keeping (or caching) the decoded arrays."""
    from widedp.trainer.data.format.meta import read_meta

    meta = meta or read_meta(directory)

    class _Null:
        def begin(self, *a, **k):
            pass

        def add(self, **k):
            pass

        def finish(self):
            pass

    for _, name, _ in data_parts(meta):
        if not (Path(directory) / name).exists():
            raise DataError(f"{Path(directory) / name}: missing")
    _decode_parts(Path(directory), meta, _Null())
