"""Writing a data set directory: streamed row groups, nothing half-written on error.

A data set directory is written once: a writer refuses an output directory that exists and is
not empty. Runs trained on a data set record its identity (trainer/data/format/meta.py,
`dataset_identity`) and the directory keeps their privacy spending (privacy_budget.jsonl,
trainer/run/budget.py); replacing the data under them would make both describe other data.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from widedp.trainer.data.errors import DataError
from widedp.trainer.data._util import missing_directories, remove_empty_directories
from widedp.trainer.data.format.meta import DATA_FILE, META_FILE, TEST_FILE, DatasetMeta, _unlink_quiet, meta_json


def ctr_table(labels: np.ndarray, dense: np.ndarray, cats: np.ndarray) -> pa.Table:
    """labels [n], dense [n, D] float32, cats [n, F] int64 -> a ctr row group."""
    n, d = dense.shape
    cols = {
        "label": pa.array(np.ascontiguousarray(labels, dtype=np.float32)),
        "dense": pa.FixedSizeListArray.from_arrays(
            pa.array(np.ascontiguousarray(dense, dtype=np.float32).reshape(-1)), d),
    }
    cats = np.asarray(cats, dtype=np.int64)
    for i in range(cats.shape[1]):
        cols[f"cat_{i}"] = pa.array(np.ascontiguousarray(cats[:, i]))
    return pa.table(cols)


def cbow_table(ctx_lengths: np.ndarray, ctx_values: np.ndarray, targets: np.ndarray,
               negatives: np.ndarray) -> pa.Table:
    """Context bags (lengths [n], values [sum lengths]), targets [n], negatives [n, K]."""
    offsets = np.zeros(len(ctx_lengths) + 1, dtype=np.int32)
    np.cumsum(ctx_lengths, out=offsets[1:])
    k = negatives.shape[1]
    return pa.table({
        "context": pa.ListArray.from_arrays(pa.array(offsets),
                                            pa.array(np.asarray(ctx_values, dtype=np.int64))),
        "target": pa.array(np.asarray(targets, dtype=np.int64)),
        "negatives": pa.FixedSizeListArray.from_arrays(
            pa.array(np.ascontiguousarray(negatives, dtype=np.int64).reshape(-1)), k),
    })


class DatasetWriter:
    """Context manager: ``with DatasetWriter(out_dir) as w: w.write(table); w.commit(meta)``.

    Row groups go to a temporary Parquet file in ``out_dir``; ``commit`` closes it, renames
    it to ``data.parquet`` and then writes ``dataset.json`` atomically (plus any side files
    added with ``add_file``). ``write_test(table)`` sends row groups to a second temporary file
    that becomes ``test.parquet`` (renamed before data.parquet; same schema: the first table
    written to either fixes it), for data sets with a separate evaluation file. On an exception, or without ``commit``, every temporary file
    is removed, and ``out_dir`` too if this writer created it and it is empty. An ``out_dir``
    that exists and is not empty is refused (DataError): a data set is never overwritten.
    """

    def __init__(self, out_dir):
        self.out_dir = Path(out_dir)
        self._created: list[Path] = []
        self._tmp_data: Optional[Path] = None
        self._tmp_test: Optional[Path] = None
        self._writer: Optional[pq.ParquetWriter] = None
        self._test_writer: Optional[pq.ParquetWriter] = None
        self._schema: Optional[pa.Schema] = None
        self._side: dict[str, str] = {}
        self.rows = 0
        self.test_rows = 0
        self._committed = False

    def __enter__(self) -> "DatasetWriter":
        p = self.out_dir.absolute()
        if p.is_dir() and any(p.iterdir()):
            raise DataError(f"{self.out_dir}: not empty; a data set directory is never overwritten (runs trained "
                            "on it record its identity and privacy spending): write to a new directory")
        if p.exists() and not p.is_dir():
            raise DataError(f"{self.out_dir}: exists and is not a directory")
        self._created = missing_directories(p)  # deepest first
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._tmp_data = self.out_dir / f".{DATA_FILE}.{uuid.uuid4().hex}.tmp"
        self._tmp_test = self.out_dir / f".{TEST_FILE}.{uuid.uuid4().hex}.tmp"
        return self

    def write(self, table: pa.Table) -> None:
        """One row group of data.parquet."""
        if table.num_rows:
            if self._writer is None:
                self._writer = pq.ParquetWriter(str(self._tmp_data), self._schema_of(table))
            self._writer.write_table(table.cast(self._schema), row_group_size=table.num_rows)
            self.rows += table.num_rows

    def write_test(self, table: pa.Table) -> None:
        """One row group of test.parquet (the data set's separate evaluation examples)."""
        if table.num_rows:
            if self._test_writer is None:
                self._test_writer = pq.ParquetWriter(str(self._tmp_test), self._schema_of(table))
            self._test_writer.write_table(table.cast(self._schema), row_group_size=table.num_rows)
            self.test_rows += table.num_rows

    def _schema_of(self, table: pa.Table) -> pa.Schema:
        """The one schema of both files: the first row group's, whichever file it went to."""
        if self._schema is None:
            self._schema = table.schema
        return self._schema

    def add_file(self, name: str, text: str) -> None:
        self._side[name] = text

    def commit(self, meta: DatasetMeta) -> None:
        if self._writer is None:
            raise RuntimeError("DatasetWriter.commit with no rows written")
        self._writer.close()
        self._writer = None
        if self._test_writer is not None:
            self._test_writer.close()
            self._test_writer = None
        assert meta.num_examples == self.rows, (meta.num_examples, self.rows)
        assert (meta.test_examples or 0) == self.test_rows, (meta.test_examples, self.test_rows)
        text = meta_json(meta)
        side_tmp = []
        try:
            for name, content in list(self._side.items()) + [(META_FILE, text)]:
                fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.out_dir)
                side_tmp.append((tmp, self.out_dir / name))
                os.fchmod(fd, 0o644)
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    fh.write(content)
            assert self._tmp_data is not None and self._tmp_test is not None  # set by __enter__
            if self.test_rows:
                os.replace(self._tmp_test, self.out_dir / TEST_FILE)
            os.replace(self._tmp_data, self.out_dir / DATA_FILE)
            for tmp, final in side_tmp:  # dataset.json last
                os.replace(tmp, final)
        finally:
            for tmp, _ in side_tmp:
                _unlink_quiet(tmp)
        self._committed = True

    def __exit__(self, exc_type, exc, tb) -> None:
        for writer in (self._writer, self._test_writer):
            if writer is not None:
                try:
                    writer.close()
                except Exception:
                    pass
        self._writer = self._test_writer = None
        if not self._committed:
            for tmp in (self._tmp_data, self._tmp_test):
                if tmp is not None:
                    _unlink_quiet(tmp)
            remove_empty_directories(self._created)
