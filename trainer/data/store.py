"""Validation of a data set's Parquet file and its decoded, random-access column store.

``load_columns`` reads ``data.parquet`` once, row group by row group (bounded memory),
checks every value vectorized (numpy over each row group; no per-row Python), and decodes
it into flat numpy arrays that support O(batch) random access:

* ``fixed`` int64 [N, F_fixed]: the single-id features (ctr: ``cat_*``; cbow: ``target``,
  ``neg_*``), one row per example, so gathering a batch reads one contiguous row each;
* ``jagged[name] = (offsets int64 [N+1], values int64)``: multi-id features (cbow context);
* ``labels`` float32 [N], ``dense`` float32 [N, D].

With ``cache=True`` (default) the decoded arrays are written as raw files under
``DIR/.widedp-cache/v<version>-<key>/`` and memory-mapped (``numpy.memmap``, read-only), so
processes on one machine share the page cache and nothing needs to fit in RAM; the key
hashes dataset.json and the Parquet file's identity (size, mtime, ctime, inode), and a cache
exists only after a full successful validation, so a later open skips re-validation. When
the directory is not writable the arrays are decoded into memory instead.
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

from .errors import DataError
from .meta import DATA_FILE, DatasetMeta, expected_columns, type_matches

CACHE_DIR = ".widedp-cache"
CACHE_VERSION = 1


@dataclass
class Columns:
    num_rows: int
    labels: np.ndarray
    dense: np.ndarray
    fixed: np.ndarray
    fixed_features: list[str]
    jagged: dict  # name -> (offsets [N+1] int64, values int64)


def fixed_and_jagged(meta: DatasetMeta) -> tuple[list[str], list[str]]:
    if meta.kind == "ctr":
        return list(meta.features), []
    return [f for f in meta.features if f != "context"], ["context"]


def load_columns(directory, meta: DatasetMeta, *, cache: bool = True) -> Columns:
    directory = Path(directory)
    path = directory / DATA_FILE
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DataError(f"{path}: missing") from None
    if st.st_size == 0:
        raise DataError(f"{path}: empty file (no examples)")
    if cache:
        key = _cache_key(meta, st)
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
                _validate_and_decode(path, meta, sink)
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
    _validate_and_decode(path, meta, mem_sink)
    return _columns_from(mem_sink.arrays(), meta)


# ---- validation ----------------------------------------------------------------------------

def _validate_and_decode(path: Path, meta: DatasetMeta, sink) -> None:
    try:
        pf = pq.ParquetFile(str(path), memory_map=True)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file: {exc}") from None
    _check_schema(path, pf.schema_arrow, meta)
    n = pf.metadata.num_rows
    if n == 0:
        raise DataError(f"{path}: zero examples")
    if n != meta.num_examples:
        raise DataError(f"{path}: has {n} rows but dataset.json says num_examples={meta.num_examples}")
    fixed_names, jagged_names = fixed_and_jagged(meta)
    sink.begin(n, len(fixed_names), meta.num_dense, jagged_names)
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
    sink.finish()


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
    dense_arr = _array(table, "dense")
    _check_nulls(path, dense_arr, "dense", base)
    flat = dense_arr.flatten()
    if flat.null_count:
        i = _first(flat.is_null().to_numpy(zero_copy_only=False))
        raise DataError(f"{path}: row {base + i // d}: dense[{i % d}] is null")
    dense = flat.to_numpy().reshape(n, d)
    bad = ~np.isfinite(dense)
    if bad.any():
        i = _first(bad.reshape(-1))
        raise DataError(f"{path}: row {base + i // d}: dense[{i % d}] is {float(dense.reshape(-1)[i])} "
                        "(not finite)")

    fixed = np.empty((n, len(meta.features)), dtype=np.int64)
    for j, f in enumerate(meta.features):
        arr = _array(table, f)
        _check_nulls(path, arr, f, base)
        fixed[:, j] = arr.to_numpy()
    _check_ids(path, meta, fixed, meta.features, base)
    sink.add(labels=labels, dense=dense, fixed=fixed)


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
    ctx = _array(table, "context")
    _check_nulls(path, ctx, "context", base)
    lengths = ctx.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
    values_arr = ctx.flatten()
    ends = np.cumsum(lengths)
    if values_arr.null_count:
        i = _first(values_arr.is_null().to_numpy(zero_copy_only=False))
        r = int(np.searchsorted(ends, i, side="right"))
        raise DataError(f"{path}: row {base + r}: context contains a null id")
    values = values_arr.to_numpy()
    bad = lengths == 0
    if bad.any():
        raise DataError(f"{path}: row {base + _first(bad)}: empty context")
    window = meta.extra.get("window")
    if isinstance(window, int) and window > 0:
        bad = lengths > 2 * window
        if bad.any():
            r = _first(bad)
            raise DataError(f"{path}: row {base + r}: context has {lengths[r]} ids, more than "
                            f"2*window={2 * window}")
    size = meta.table_sizes[meta.feature_tables["context"]]
    bad = (values < 0) | (values >= size)
    if bad.any():
        i = _first(bad)
        r = int(np.searchsorted(ends, i, side="right"))
        _raise_id(path, meta, "context", base + r, int(values[i]))

    names = fixed_and_jagged(meta)[0]
    k = meta.num_negatives
    fixed = np.empty((n, 1 + k), dtype=np.int64)
    tgt = _array(table, "target")
    _check_nulls(path, tgt, "target", base)
    fixed[:, 0] = tgt.to_numpy()
    neg = _array(table, "negatives")
    _check_nulls(path, neg, "negatives", base)
    neg_flat = neg.flatten()
    if neg_flat.null_count:
        i = _first(neg_flat.is_null().to_numpy(zero_copy_only=False))
        raise DataError(f"{path}: row {base + i // k}: negatives[{i % k}] is null")
    fixed[:, 1:] = neg_flat.to_numpy().reshape(n, k)
    _check_ids(path, meta, fixed, names, base)
    sink.add(fixed=fixed, jagged={"context": (lengths, values)})


# ---- sinks: where decoded arrays go ----------------------------------------------------------

class _MemSink:
    def begin(self, n, num_fixed, num_dense, jagged_names):
        self.n, self.num_fixed, self.num_dense = n, num_fixed, num_dense
        self.parts = {"labels": [], "dense": [], "fixed": []}
        self.jag = {name: ([], []) for name in jagged_names}

    def add(self, *, fixed, labels=None, dense=None, jagged=None):
        self.parts["fixed"].append(fixed)
        if labels is not None:
            self.parts["labels"].append(labels.astype(np.float32, copy=False))
            self.parts["dense"].append(dense.astype(np.float32, copy=False))
        for name, (lengths, values) in (jagged or {}).items():
            self.jag[name][0].append(lengths)
            self.jag[name][1].append(values)

    def finish(self):
        pass

    def arrays(self) -> dict:
        out = {"fixed": np.concatenate(self.parts["fixed"])}
        if self.parts["labels"]:
            out["labels"] = np.concatenate(self.parts["labels"])
            out["dense"] = np.concatenate(self.parts["dense"])
        for name, (lengths, values) in self.jag.items():
            offsets = np.zeros(self.n + 1, dtype=np.int64)
            np.cumsum(np.concatenate(lengths), out=offsets[1:])
            out[f"{name}.offsets"] = offsets
            out[f"{name}.values"] = np.concatenate(values).astype(np.int64, copy=False)
        return out


class _FileSink:
    """Appends each decoded array to a raw file; ``finish`` writes manifest.json last."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.files: dict[str, dict] = {}
        self.handles: dict = {}

    def begin(self, n, num_fixed, num_dense, jagged_names):
        self.n = n
        self._open("fixed", np.int64, (num_fixed,))
        if num_dense or not jagged_names:
            self._open("labels", np.float32, ())
            self._open("dense", np.float32, (num_dense,))
        self.jag_total = {}
        for name in jagged_names:
            self._open(f"{name}.offsets", np.int64, ())
            self._open(f"{name}.values", np.int64, ())
            self._write(f"{name}.offsets", np.zeros(1, dtype=np.int64))
            self.jag_total[name] = 0

    def _open(self, name, dtype, trailing):
        self.files[name] = {"dtype": np.dtype(dtype).str, "trailing": list(trailing), "rows": 0}
        self.handles[name] = open(self.dir / f"{name}.bin", "wb")

    def _write(self, name, arr):
        info = self.files[name]
        arr = np.ascontiguousarray(arr, dtype=np.dtype(info["dtype"]))
        self.handles[name].write(arr.tobytes())
        info["rows"] += arr.shape[0]

    def add(self, *, fixed, labels=None, dense=None, jagged=None):
        self._write("fixed", fixed)
        if labels is not None:
            self._write("labels", labels)
            self._write("dense", dense)
        for name, (lengths, values) in (jagged or {}).items():
            offsets = self.jag_total[name] + np.cumsum(lengths, dtype=np.int64)
            self._write(f"{name}.offsets", offsets)
            self._write(f"{name}.values", values)
            self.jag_total[name] = int(offsets[-1]) if len(offsets) else self.jag_total[name]

    def close(self):
        for fh in self.handles.values():
            fh.close()

    def finish(self):
        self.close()
        manifest = {"version": CACHE_VERSION, "num_rows": self.n, "arrays": self.files}
        with open(self.dir / "manifest.json", "w", encoding="utf-8") as fh:
            json.dump(manifest, fh)


def _open_cache(directory: Path, meta: DatasetMeta) -> Columns:
    with open(directory / "manifest.json", encoding="utf-8") as fh:
        manifest = json.load(fh)
    if manifest.get("version") != CACHE_VERSION:
        raise ValueError("cache version")
    arrays = {}
    for name, info in manifest["arrays"].items():
        shape = (info["rows"], *info["trailing"])
        dtype = np.dtype(info["dtype"])
        fname = directory / f"{name}.bin"
        if os.path.getsize(fname) != int(np.prod(shape)) * dtype.itemsize:
            raise ValueError(f"cache file {fname} has the wrong size")
        if int(np.prod(shape)) == 0:
            arrays[name] = np.zeros(shape, dtype=dtype)
        else:
            arrays[name] = np.asarray(np.memmap(fname, dtype=dtype, mode="r", shape=shape))
    if manifest["num_rows"] != meta.num_examples:
        raise ValueError("cache row count")
    return _columns_from(arrays, meta)


def _columns_from(arrays: dict, meta: DatasetMeta) -> Columns:
    fixed_names, jagged_names = fixed_and_jagged(meta)
    n = arrays["fixed"].shape[0]
    labels = arrays.get("labels")
    if labels is None:
        labels = np.zeros(n, dtype=np.float32)
    dense = arrays.get("dense")
    if dense is None:
        dense = np.zeros((n, meta.num_dense), dtype=np.float32)
    jagged = {name: (arrays[f"{name}.offsets"], arrays[f"{name}.values"]) for name in jagged_names}
    return Columns(num_rows=n, labels=labels, dense=dense, fixed=arrays["fixed"],
                   fixed_features=fixed_names, jagged=jagged)


def _cache_key(meta: DatasetMeta, st: os.stat_result) -> str:
    ident = {"meta": meta.to_dict(), "size": st.st_size, "mtime": st.st_mtime_ns,
             "ctime": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev, "v": CACHE_VERSION}
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
    from .meta import read_meta

    meta = meta or read_meta(directory)

    class _Null:
        def begin(self, *a):
            pass

        def add(self, **k):
            pass

        def finish(self):
            pass

    path = Path(directory) / DATA_FILE
    if not path.exists():
        raise DataError(f"{path}: missing")
    _validate_and_decode(path, meta, _Null())
