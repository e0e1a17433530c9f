"""Criteo TSV -> widedp ctr data set (streaming, vectorized per chunk of lines).

Input: one example per line, ``label \\t I1..I13 \\t C1..C26`` (40 tab-separated fields, no
header), ``\\n`` or ``\\r\\n`` line ends; any field but the label may be empty.

* label: exactly ``0`` or ``1``;
* dense ``I_j``: optionally signed decimal integer (at most 18 digits); empty -> 0, else
  ``log(1 + max(x, 0))`` as float32;
* categorical ``C_j``: hex string (at most 16 hex digits, either case); empty -> id 0, else
  ``1 + splitmix64(int(hex, 16)) % (hash_size_j - 1)`` — a stable hash (no salted ``hash()``),
  so ids are in [1, hash_size_j) and table ``t_{j-1}`` has ``hash_size_j`` rows. The sizes are
  one ``hash_size`` for all 26 tables or ``hash_sizes`` (26 values, one per feature in column
  order). Both are data-independent choices (the schema is public and hashing does not look at
  the data), so nothing here is charged to the privacy budget: ``privacy_events`` is absent.

Input files: one or several paths or globs (each glob's matches sorted; a pattern matching
nothing is an error), plain or gzip-compressed (``.gz``), converted in order into one data set.
Any malformed line raises DataError naming the file, the 1-based line number and the 0-based
data row within that file; no output is left behind. Memory is bounded by ``chunk_rows`` (one row
group, ~264 bytes per row) plus a parse block of 16K lines, whatever the file size.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from widedp.trainer.data._util import expand_inputs, open_binary, parse_digits, splitmix64
from widedp.trainer.data.errors import DataError
from widedp.trainer.data.format.meta import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE, DatasetMeta, ctr_meta
from widedp.trainer.data.format.writer import DatasetWriter, ctr_table

NUM_FIELDS = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_SPARSE  # 40
_PARSE_ROWS = 16_384  # lines parsed at once (bounds the parser's temporaries)


DEFAULT_HASH_SIZE = 2 ** 20


def _hash_sizes(hash_size, hash_sizes) -> list[int]:
    if hash_size is not None and hash_sizes is not None:
        raise ValueError("give hash_size (one size for all tables) or hash_sizes (one per feature), not both")
    if hash_sizes is None:
        size = DEFAULT_HASH_SIZE if hash_size is None else hash_size
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 2:
            raise ValueError(f"hash_size must be an integer >= 2, got {size!r}")
        return [int(size)] * CRITEO_NUM_SPARSE
    sizes = list(hash_sizes)
    if len(sizes) != CRITEO_NUM_SPARSE:
        raise ValueError(f"hash_sizes needs {CRITEO_NUM_SPARSE} values (one per categorical feature "
                         f"C1..C{CRITEO_NUM_SPARSE}), got {len(sizes)}")
    for j, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 2:
            raise ValueError(f"hash_sizes[{j}] (C{j + 1}) must be an integer >= 2, got {size!r}")
    return [int(x) for x in sizes]


def convert_criteo(input_tsv, out_dir, *, hash_size: Optional[int] = None,
                   hash_sizes: Optional[Sequence[int]] = None,
                   chunk_rows: int = 100_000) -> DatasetMeta:
    """Convert Criteo TSV file(s) to a ctr data set in ``out_dir``; returns its meta.

    ``input_tsv``: a path or glob, or a list of them (plain or ``.gz``; see the module
    docstring). ``hash_size``: rows of every table (default 2**20); ``hash_sizes``: 26
    per-feature sizes instead (mutually exclusive with ``hash_size``); each >= 2.
    """
    sizes = _hash_sizes(hash_size, hash_sizes)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if isinstance(input_tsv, (str, bytes)) or hasattr(input_tsv, "__fspath__"):
        input_tsv = [os.fspath(input_tsv)]
    paths = expand_inputs(input_tsv, "Criteo TSV")
    for path in paths:  # before anything is written: every input must exist
        if not path.is_file():
            raise DataError(f"{path}: cannot open: {'No such file or directory' if not path.exists() else 'not a file'}")
    with DatasetWriter(out_dir) as writer:
        total = 0
        for path in paths:
            total += _convert_file(path, writer, sizes, chunk_rows)
        if total == 0:
            raise DataError(f"{paths[0] if len(paths) == 1 else ', '.join(map(str, paths))}: empty file "
                            "(no examples)")
        uniform = {"hash_size": sizes[0]} if len(set(sizes)) == 1 else {}
        meta = ctr_meta(total, sizes, bayes_auc=None, extra={
            "source": f"criteo {', '.join(map(str, paths))}",
            **uniform,
            "hash_sizes": sizes,
            "categorical_hash": "empty -> 0; else 1 + splitmix64(int(hex, 16)) % (hash_sizes[j] - 1)",
            "dense_transform": "empty -> 0; else log(1 + max(x, 0)) as float32",
        })
        writer.commit(meta)
    return meta


def _convert_file(path: Path, writer: DatasetWriter, sizes: list[int], chunk_rows: int) -> int:
    """Append one TSV file's examples (row groups of chunk_rows lines); returns its row count."""
    try:
        fh = open_binary(path)
    except OSError as exc:
        raise DataError(f"{path}: cannot open: {exc.strerror or exc}") from None
    row = 0
    with fh:
        eof = False
        while not eof:
            # one row group of chunk_rows lines, parsed in blocks of at most _PARSE_ROWS lines
            parts = []
            in_group = 0
            while in_group < chunk_rows:
                try:
                    lines = list(itertools.islice(fh, min(_PARSE_ROWS, chunk_rows - in_group)))
                except (OSError, EOFError) as exc:  # a damaged or truncated .gz
                    raise DataError(f"{path}: cannot read after line {row}: {exc}") from None
                if not lines:
                    eof = True
                    break
                parts.append(_parse_chunk(path, lines, row, sizes))
                row += len(lines)
                in_group += len(lines)
            if parts:
                writer.write(ctr_table(*(np.concatenate(x) for x in zip(*parts))))
    return row


def _where(path: Path, row: int) -> str:
    return f"{path}: line {row + 1} (row {row})"


def _parse_chunk(path: Path, lines: list[bytes], row0: int, hash_sizes: list[int]):
    buf = b"".join(lines)
    if not buf.endswith(b"\n"):
        buf += b"\n"
    a = np.frombuffer(buf, dtype=np.uint8)
    nl = np.flatnonzero(a == 10)
    n = len(nl)
    tabs = np.flatnonzero(a == 9)
    tab_line = np.searchsorted(nl, tabs)
    counts = np.bincount(tab_line, minlength=n)
    wrong = np.flatnonzero(counts != NUM_FIELDS - 1)
    if len(wrong):
        # the lines before the first malformed one may hold an earlier error: check them first
        c = int(wrong[0])
        if c > 0:
            _parse_chunk(path, lines[:c], row0, hash_sizes)
        raise DataError(f"{_where(path, row0 + c)}: expected {NUM_FIELDS} tab-separated fields, "
                        f"got {counts[c] + 1}")
    delims = np.sort(np.concatenate([tabs, nl]))
    ends = delims.reshape(n, NUM_FIELDS).copy()
    starts = np.empty_like(ends)
    starts.reshape(-1)[0] = 0
    starts.reshape(-1)[1:] = delims[:-1] + 1
    # "\r\n" line ends: the last field stops before the "\r"
    last = ends[:, -1]
    cr = (last > starts[:, -1]) & (a[np.maximum(last - 1, 0)] == 13)
    ends[cr, -1] -= 1
    lengths = ends - starts

    def text(i: int, j: int) -> str:
        return buf[starts[i, j]:ends[i, j]].decode("utf-8", "replace")

    errors = []  # (row within chunk, message)

    # label
    lab_byte = a[starts[:, 0]]
    lab_ok = (lengths[:, 0] == 1) & ((lab_byte == ord("0")) | (lab_byte == ord("1")))
    if not lab_ok.all():
        i = int(np.flatnonzero(~lab_ok)[0])
        errors.append((i, f"label {text(i, 0)!r} is not 0 or 1"))
    labels = (lab_byte == ord("1")).astype(np.float32)

    # dense: optional sign, then decimal digits
    ds, dl = starts[:, 1:1 + CRITEO_NUM_DENSE], lengths[:, 1:1 + CRITEO_NUM_DENSE]
    first = a[np.minimum(ds, len(a) - 1)]
    signed = (dl > 0) & ((first == ord("-")) | (first == ord("+")))
    negative = signed & (first == ord("-"))
    body_s, body_l = ds + signed, dl - signed
    vals, bad = parse_digits(a, body_s.reshape(-1), body_l.reshape(-1), 10, 18)
    bad = bad.reshape(dl.shape) | (signed & (body_l == 0))
    if bad.any():
        i, j = np.argwhere(bad)[0]
        errors.append((int(i), f"field {j + 2} (I{j + 1}) {text(i, j + 1)!r} is not an integer"))
    x = vals.reshape(dl.shape).astype(np.float64)
    x[negative] = 0.0  # max(x, 0)
    dense = np.log1p(x).astype(np.float32)

    # categorical: hex
    cs, cl = starts[:, 1 + CRITEO_NUM_DENSE:], lengths[:, 1 + CRITEO_NUM_DENSE:]
    hv, bad = parse_digits(a, cs.reshape(-1), cl.reshape(-1), 16, 16)
    bad = bad.reshape(cl.shape)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        j0 = j + 1 + CRITEO_NUM_DENSE
        errors.append((int(i), f"field {j0 + 1} (C{j + 1}) {text(i, j0)!r} is not a hex string "
                               "(at most 16 hex digits)"))
    if errors:
        i, msg = min(errors)
        raise DataError(f"{_where(path, row0 + i)}: {msg}")
    modulus = np.asarray(hash_sizes, dtype=np.uint64) - np.uint64(1)  # one per column
    ids = (splitmix64(hv).reshape(cl.shape) % modulus[None, :]).astype(np.int64) + 1
    ids[cl == 0] = 0
    return labels, dense, ids
