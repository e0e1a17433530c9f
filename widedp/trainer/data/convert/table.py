"""Your own tabular data (Parquet, CSV/TSV, plain or .gz) -> a widedp ctr data set, by a TOML schema.

    widedp convert table INPUT... OUT_DIR --schema SCHEMA.toml [--test INPUT... | --test-after T]

The schema (parsed with ``tomllib``; every key is checked, an unknown or missing key or a bad
value is a DataError naming the schema file and the key)::

    format = "csv"                  # "parquet" | "csv"
    delimiter = ","                 # csv: one character (default ","; "\\t" for TSV)
    header = true                   # csv: the first line names the columns (default true);
    # columns = ["clicked", ...]    # csv with header = false: the field names, in order
    label = "clicked"               # values 0 or 1
    unit = "user_id"                # optional: the privacy unit (int64 column ``unit``)
    timestamp = "time"              # optional: int seconds or ISO date/datetime (UTC)

    [dense.price]                   # dense features, in this order (dense[0], dense[1], ...)
    column = "price"                # default: the key
    transform = ["log1p", "standardize"]   # applied in order; "none" | "log1p" | "clip" |
    mean = 2.1                      #   "standardize" (a string or a list)
    std = 0.7                       # standardize: PUBLIC mean and std, or neither (DP, below)
    # clip = [0.0, 10.0]            # clip: the bounds
    fill = 0.0                      # a missing or empty value (default 0), before transforms

    [categorical.item]              # categorical features (the key is the feature's name)
    column = "item_id"              # default: the key
    table = "item"                  # default: the key; features may share a table
    hash_size = 100000              # ids by hashing into [1, hash_size) ...
    # vocabulary = "items.txt"      # ... or by a PUBLIC vocabulary file (line i -> id i + 1)

    [categorical.history]
    column = "history"
    table = "item"                  # shares table "item" with feature "item"
    hash_size = 100000              # so it must map ids the same way
    list = true                     # Parquet list<int|string>; csv: values split by separator
    separator = "|"                 # csv lists (default "|")
    pooling = "mean"                # "sum" (default) | "mean"
    max_length = 50                 # keep the first 50 values of a longer list

Ids (a data-independent map, so they cost no privacy; dataset.json has ``privacy_events`` only for
DP standardization statistics, below):

* ``hash_size = N``: an integer value v (a Parquet integer column, or text that is a canonical
  decimal integer such as ``"42"``/``"-7"``, so CSV and Parquet agree) -> ``1 +
  splitmix64(v mod 2**64) % (N - 1)`` (as ``convert criteo``); any other text ->
  ``1 + hash_strings(utf-8 bytes) % (N - 1)`` (trainer/data/_util.py: a stable, unkeyed 64-bit
  hash, the same in every run and file); a missing (null) or empty value -> id 0. The table has
  N rows.
* ``vocabulary = "PATH"`` (relative to the schema file): a public file, one value per line;
  value on line i (0-based) -> id i + 1, a value not in it (or missing) -> 0; the table has
  lines + 1 rows. Integer values are looked up by their decimal text. dataset.json's
  ``vocabulary_files`` records, per such feature, the file (absolute path), its number of values
  and their ``vocabulary_digest``: `widedp export` ships the file only while it still holds them.
* Lists: the bag of the ids of the list's values, in order, repeats kept; null and empty values
  inside a list are dropped; a null list or an empty CSV field is an empty bag (length 0);
  ``max_length`` keeps the first ``max_length`` values (a public bound on what one example
  puts into a bag). Features sharing a table must map ids the same way (same hash_size, or the
  same vocabulary file).

Dense values: a number (Parquet numeric column, or text parsed as a float); missing (null or
empty) -> ``fill``; then ``log1p`` = log(1 + max(x, 0)), ``clip`` = min(max(x, lo), hi),
``standardize`` = (x - mean) / std, in the order given; stored as float32. ``standardize``
without ``mean`` and ``std`` estimates them from the training examples with differential
privacy (trainer/data/convert/dp_statistics.py: one Gaussian mechanism of noise multiplier
``statistics_noise_multiplier``, a top-level key, default 20, over the values centred and scaled
by their clip range, so it needs ``clip`` right before ``standardize``); the release is recorded
in dataset.json's ``privacy_events`` (training charges it before its first step) and the values
in ``dense_statistics``; the test split is standardized with the same values. With a ``unit``
column the statistics are per user (each user's examples weighted 1/m, so each user adds their
mean values; the event bounds one user and one example alike, and its ``privacy_events`` entry
says ``"unit": "user"``): training at either level charges it as it is. A non-finite value
(nan, inf) or text that is not a number is an error.

``unit``: an integer is kept; text that is a canonical decimal integer is that integer, other
text its ``hash_strings`` value (as int64). ``timestamp``: an integer (seconds since 1970, UTC),
a Parquet timestamp/date, or ISO 8601 text (``2024-01-05``, ``2024-01-05T10:00:00``, optional
fraction and zone offset; without an offset UTC), stored as int64 seconds (floor). Missing
units or timestamps are errors.

Evaluation split: ``--test INPUT...`` converts those files with the same schema into
``test.parquet``; ``--test-after T`` (ISO date or datetime, UTC; needs a timestamp column) sends
every example with timestamp >= T to ``test.parquet``, the earlier ones to ``data.parquet``.
dataset.json records ``test_examples`` and ``test_split`` (``"file"`` or
``"timestamp>=<T as ISO>"``); training then uses data.parquet as the training split and
test.parquet as the test split. With neither, training keeps its seeded random split.

Errors name the file, the row (0-based data row of that file; for CSV also the 1-based line,
``line L (row R)``, which assumes no newline inside a quoted field) and the column. Nothing is
left behind on any error (trainer/data/format/writer.py), and an existing non-empty OUT_DIR is refused.

Memory is bounded whatever the input size: Parquet input is read ``chunk_rows`` rows at a time
(``iter_batches``; pyarrow also holds the compressed column chunks of one input row group),
CSV input in blocks of ``csv_block_bytes`` bytes of text (pyarrow's streaming reader,
decompressing .gz as it goes; one thread, no read-ahead). A chunk of r rows costs about
r × (input bytes per row + 8 × (dense + ids per row + 3)) bytes for its decoded columns, a few
times over for temporaries, and is written as one row group before the next is read: peak
memory is O(chunk), e.g. a few tens of MB at the defaults (65,536 rows; 4 MiB CSV blocks)
for rows of a few hundred bytes. tests/test_convert_table.py checks the bound on a file much
larger than it. Per-user DP statistics add a counting pass and 16 bytes per distinct user
(dp_statistics.UnitCounts).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from widedp.trainer.data._util import expand_inputs, hash_strings, splitmix64
from widedp.trainer.data.errors import DataError
from widedp.trainer.data.format.meta import POOLINGS, PRIVACY_EVENTS_KEY, RESERVED_COLUMNS, DatasetMeta
from widedp.trainer.data.format.writer import DatasetWriter

DEFAULT_CHUNK_ROWS = 65_536
DEFAULT_CSV_BLOCK_BYTES = 4 << 20
CSV_LIST_SEPARATOR = "|"
_CANONICAL_INT = r"^-?(0|[1-9][0-9]{0,17})$"  # fits int64; "007" and "+7" are text, not 7
_INTEGER_TEXT = r"^[+-]?[0-9]{1,18}$"  # timestamps given as seconds
_ZONE_SUFFIX = r"(Z|z|[+-][0-9]{2}:?[0-9]{2})$"
_TRANSFORMS = ("none", "log1p", "clip", "standardize")

_TOP_KEYS = ("format", "delimiter", "header", "columns", "label", "dense", "categorical", "unit", "timestamp",
             "statistics_noise_multiplier")
#: σ of the DP standardization statistics (trainer/data/convert/dp_statistics.py) unless the schema sets
#: statistics_noise_multiplier: Gaussian(σ = 20) alone costs ε ≈ 0.26 at δ = 1e-6 (less once
#: composed with training by PLD), and with n ≥ 10⁴ examples its error on a mean is ~0.3% of
#: the clip range per column.
DEFAULT_STATISTICS_NOISE_MULTIPLIER = 20.0
_DENSE_KEYS = ("column", "transform", "clip", "mean", "std", "fill")
_CAT_KEYS = ("column", "table", "hash_size", "vocabulary", "list", "separator", "pooling", "max_length")


# ---- the schema ---------------------------------------------------------------------------------

@dataclass
class DenseSpec:
    name: str
    column: str
    transforms: list[str]
    clip: Optional[tuple[float, float]] = None
    mean: float = 0.0
    std: float = 1.0
    fill: float = 0.0
    dp_statistics: bool = False  # standardize with mean/std estimated with DP (dp_statistics.py)


@dataclass
class CategoricalSpec:
    name: str
    column: str
    table: str
    is_list: bool
    pooling: str
    hash_size: Optional[int] = None
    vocabulary: Optional[Path] = None
    vocabulary_values: Optional[pa.Array] = None  # line i -> id i + 1
    separator: str = CSV_LIST_SEPARATOR
    max_length: Optional[int] = None

    @property
    def table_size(self) -> int:
        if self.hash_size is not None:
            return self.hash_size
        assert self.vocabulary_values is not None
        return len(self.vocabulary_values) + 1

    @property
    def id_rule(self) -> str:
        return f"hash_size={self.hash_size}" if self.hash_size is not None else f"vocabulary={self.vocabulary}"


@dataclass
class TableSchema:
    path: Path
    format: str
    label: str
    dense: list[DenseSpec]
    categorical: list[CategoricalSpec]
    unit: Optional[str] = None
    timestamp: Optional[str] = None
    delimiter: str = ","
    header: bool = True
    columns: Optional[list[str]] = None
    raw: dict = field(default_factory=dict)
    statistics_noise_multiplier: float = DEFAULT_STATISTICS_NOISE_MULTIPLIER

    @property
    def dp_dense(self) -> list["DenseSpec"]:
        """The dense features whose standardization statistics are estimated with DP."""
        return [d for d in self.dense if d.dp_statistics]

    def input_columns(self) -> list[str]:
        """The input columns the conversion reads (each once)."""
        names = [self.label, *(d.column for d in self.dense), *(c.column for c in self.categorical)]
        names += [c for c in (self.unit, self.timestamp) if c is not None]
        return list(dict.fromkeys(names))


def load_schema(path) -> TableSchema:
    """Parse and check a schema file (see the module docstring); DataError naming the file and key."""
    path = Path(os.fspath(path))
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path}: schema file missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read the schema: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise DataError(f"{path}: not valid TOML: {exc}") from None
    return parse_schema(raw, path)


def parse_schema(raw: dict, path: Path) -> TableSchema:
    def bad(key: str, msg: str) -> DataError:
        return DataError(f"{path}: {key}: {msg}")

    def unknown(keys, allowed, where: str) -> None:
        extra = [k for k in keys if k not in allowed]
        if extra:
            raise bad(f"{where}{extra[0]}", f"unknown key (known: {', '.join(allowed)})")

    def string(value, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise bad(key, f"must be a non-empty string, got {value!r}")
        return value

    def number(value, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(key, f"must be a finite number, got {value!r}")
        return float(value)

    def integer(value, key: str, low: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise bad(key, f"must be an integer >= {low}, got {value!r}")
        return value

    unknown(raw, _TOP_KEYS, "")
    for key in ("format", "label"):
        if key not in raw:
            raise bad(key, "missing (required)")
    fmt = raw["format"]
    if fmt not in ("parquet", "csv"):
        raise bad("format", f'must be "parquet" or "csv", got {fmt!r}')
    schema = TableSchema(path=path, format=fmt, label=string(raw["label"], "label"), dense=[], categorical=[],
                         raw=raw)
    if fmt == "csv":
        schema.delimiter = raw.get("delimiter", ",")
        if not (isinstance(schema.delimiter, str) and len(schema.delimiter) == 1 and schema.delimiter not in "\n\r\""):
            raise bad("delimiter", f"must be one character (not a quote or line end), got {schema.delimiter!r}")
        header = raw.get("header", True)
        if not isinstance(header, bool):
            raise bad("header", f"must be true or false, got {header!r}")
        schema.header = header
        if header and "columns" in raw:
            raise bad("columns", "only with header = false (the header names the columns)")
        if not header:
            cols = raw.get("columns")
            if cols is None:
                raise bad("columns", "missing: with header = false, columns = [...] names the fields in order")
            if not (isinstance(cols, list) and cols and all(isinstance(c, str) and c for c in cols)):
                raise bad("columns", f"must be a non-empty list of names, got {cols!r}")
            if len(set(cols)) != len(cols):
                raise bad("columns", "has duplicate names")
            schema.columns = list(cols)
    else:
        for key in ("delimiter", "header", "columns"):
            if key in raw:
                raise bad(key, 'only for format = "csv"')
    for key in ("unit", "timestamp"):
        if key in raw:
            setattr(schema, key, string(raw[key], key))
    if "statistics_noise_multiplier" in raw:
        sigma = number(raw["statistics_noise_multiplier"], "statistics_noise_multiplier")
        if sigma <= 0:
            raise bad("statistics_noise_multiplier", f"must be > 0, got {sigma!r}")
        schema.statistics_noise_multiplier = sigma

    dense = raw.get("dense", {})
    if not isinstance(dense, dict):
        raise bad("dense", "must be a table of [dense.NAME] entries")
    for name, spec in dense.items():
        where = f"dense.{name}"
        if not isinstance(spec, dict):
            raise bad(where, "must be a table")
        unknown(spec, _DENSE_KEYS, f"{where}.")
        transforms = spec.get("transform", "none")
        transforms = [transforms] if isinstance(transforms, str) else transforms
        if not (isinstance(transforms, list) and all(t in _TRANSFORMS for t in transforms)):
            raise bad(f"{where}.transform", f"must be one of {_TRANSFORMS} or a list of them, got {spec['transform']!r}")
        transforms = [t for t in transforms if t != "none"]
        d = DenseSpec(name=name, column=string(spec.get("column", name), f"{where}.column"), transforms=transforms,
                      fill=number(spec.get("fill", 0.0), f"{where}.fill"))
        if "clip" in transforms:
            lohi = spec.get("clip")
            if not (isinstance(lohi, list) and len(lohi) == 2):
                raise bad(f"{where}.clip", f"transform clip needs clip = [lo, hi], got {lohi!r}")
            lo, hi = number(lohi[0], f"{where}.clip"), number(lohi[1], f"{where}.clip")
            if lo > hi:
                raise bad(f"{where}.clip", f"lo > hi: {lohi!r}")
            d.clip = (lo, hi)
        elif "clip" in spec:
            raise bad(f"{where}.clip", 'given but transform does not include "clip"')
        if "standardize" in transforms:
            given = [k for k in ("mean", "std") if k in spec]
            if len(given) == 1:
                raise bad(f"{where}.{'std' if given == ['mean'] else 'mean'}",
                          "give both a PUBLIC mean and std, or neither (then they are estimated with DP)")
            if given:
                d.mean, d.std = number(spec["mean"], f"{where}.mean"), number(spec["std"], f"{where}.std")
                if d.std <= 0:
                    raise bad(f"{where}.std", f"must be > 0, got {spec['std']!r}")
            else:
                at = transforms.index("standardize")
                if transforms.count("standardize") != 1 or at == 0 or transforms[at - 1] != "clip":
                    raise bad(f"{where}.transform", "standardize without a PUBLIC mean and std estimates them with "
                              "differential privacy, which needs the values bounded: put clip right before it "
                              '(transform = [..., "clip", "standardize"], clip = [lo, hi])')
                d.dp_statistics = True
        else:
            for k in ("mean", "std"):
                if k in spec:
                    raise bad(f"{where}.{k}", 'given but transform does not include "standardize"')
        schema.dense.append(d)

    cats = raw.get("categorical", {})
    if not isinstance(cats, dict) or not cats:
        raise bad("categorical", "missing: at least one [categorical.NAME] feature is required")
    for name, spec in cats.items():
        where = f"categorical.{name}"
        if name in RESERVED_COLUMNS:
            raise bad(where, f"a feature may not be named {name!r} (reserved: {', '.join(RESERVED_COLUMNS)})")
        if not isinstance(spec, dict):
            raise bad(where, "must be a table")
        unknown(spec, _CAT_KEYS, f"{where}.")
        is_list = spec.get("list", False)
        if not isinstance(is_list, bool):
            raise bad(f"{where}.list", f"must be true or false, got {is_list!r}")
        pooling = spec.get("pooling", "sum")
        if pooling not in POOLINGS:
            raise bad(f"{where}.pooling", f"must be one of {POOLINGS}, got {pooling!r}")
        c = CategoricalSpec(name=name, column=string(spec.get("column", name), f"{where}.column"),
                            table=string(spec.get("table", name), f"{where}.table"), is_list=is_list, pooling=pooling)
        if ("hash_size" in spec) == ("vocabulary" in spec):
            raise bad(f"{where}.hash_size", "give exactly one of hash_size = N or vocabulary = \"PATH\"")
        if "hash_size" in spec:
            c.hash_size = integer(spec["hash_size"], f"{where}.hash_size", 2)
        else:
            vocab = Path(string(spec["vocabulary"], f"{where}.vocabulary"))
            c.vocabulary = vocab if vocab.is_absolute() else path.parent / vocab
            c.vocabulary_values = _read_vocabulary(c.vocabulary, f"{path}: {where}.vocabulary")
        for key in ("separator", "max_length"):
            if key in spec and not is_list:
                raise bad(f"{where}.{key}", "only for list = true")
        if "separator" in spec:
            if fmt != "csv":
                raise bad(f"{where}.separator", 'only for format = "csv" (Parquet lists are list columns)')
            c.separator = string(spec["separator"], f"{where}.separator")
            if c.separator == schema.delimiter:
                raise bad(f"{where}.separator", "must differ from the delimiter")
        if "max_length" in spec:
            c.max_length = integer(spec["max_length"], f"{where}.max_length", 1)
        schema.categorical.append(c)

    by_table: dict[str, CategoricalSpec] = {}
    for c in schema.categorical:
        first = by_table.setdefault(c.table, c)
        if first.table_size != c.table_size:
            raise bad(f"categorical.{c.name}.table", f"features {first.name!r} and {c.name!r} share table {c.table!r} "
                      f"but give it different sizes ({first.table_size} and {c.table_size})")
        if first.id_rule != c.id_rule:
            raise bad(f"categorical.{c.name}.table", f"features {first.name!r} and {c.name!r} share table {c.table!r} "
                      f"but map values to ids differently ({first.id_rule} and {c.id_rule})")
    if schema.columns is not None:
        missing = [c for c in schema.input_columns() if c not in schema.columns]
        if missing:
            raise bad("columns", f"does not name column {missing[0]!r}, which the schema reads")
    return schema


def _read_vocabulary(path: Path, where: str) -> pa.Array:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DataError(f"{where}: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: {path} is not UTF-8: {exc}") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    if not lines:
        raise DataError(f"{where}: {path} is empty")
    seen: dict[str, int] = {}
    for i, line in enumerate(lines):
        if line == "":
            raise DataError(f"{path}: line {i + 1}: empty value in the vocabulary")
        if line in seen:
            raise DataError(f"{path}: line {i + 1}: {line!r} repeats line {seen[line] + 1}")
        seen[line] = i
    return pa.array(lines, pa.string())


# ---- reading inputs, chunk by chunk --------------------------------------------------------------

@dataclass
class _Chunk:
    """Columns of a run of rows of one input file (``base``: the first row's 0-based index)."""

    path: Path
    base: int
    columns: dict[str, pa.Array]
    line_offset: Optional[int]  # CSV: line of data row r is r + line_offset; None for Parquet

    @property
    def num_rows(self) -> int:
        return len(next(iter(self.columns.values())))

    def where(self, i: int, column: str) -> str:
        row = self.base + i
        at = f"line {row + self.line_offset} (row {row})" if self.line_offset is not None else f"row {row}"
        return f"{self.path}: {at}: column {column!r}"


def _read_csv(path: Path, schema: TableSchema, block_bytes: int) -> Iterator[_Chunk]:
    needed = schema.input_columns()
    names = schema.columns
    if schema.header:
        names = _csv_header(path, schema.delimiter)
        missing = [c for c in needed if c not in names]
        if missing:
            raise DataError(f"{path}: line 1: missing column {missing[0]!r} (the header has {names})")
    invalid: list = []

    def on_invalid_row(row) -> str:
        invalid.append(row)
        return "error"

    read = pa_csv.ReadOptions(use_threads=False, block_size=block_bytes,
                              column_names=None if schema.header else names)
    parse = pa_csv.ParseOptions(delimiter=schema.delimiter, ignore_empty_lines=False, newlines_in_values=False,
                                invalid_row_handler=on_invalid_row)
    convert = pa_csv.ConvertOptions(column_types={c: pa.string() for c in needed}, include_columns=needed,
                                    strings_can_be_null=False, quoted_strings_can_be_null=False)
    line_offset = 2 if schema.header else 1
    base = 0
    try:
        stream = pa.input_stream(str(path), compression="detect")
        with stream, pa_csv.open_csv(stream, read_options=read, parse_options=parse, convert_options=convert) as reader:
            for batch in reader:
                if batch.num_rows:
                    yield _Chunk(path, base, {c: batch.column(c) for c in needed}, line_offset)
                    base += batch.num_rows
    except (pa.ArrowException, OSError, EOFError) as exc:
        if invalid:
            r = invalid[0]
            line = r.number if r.number is not None else "?"
            raise DataError(f"{path}: line {line}: expected {r.expected_columns} fields, got {r.actual_columns}") from None
        raise DataError(f"{path}: cannot read CSV after row {base - 1 if base else 0}: {exc}") from None


def _csv_header(path: Path, delimiter: str) -> list[str]:
    import csv
    import io

    from widedp.trainer.data._util import open_binary

    try:
        with open_binary(path) as fh:
            first = fh.readline()
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    if not first.strip():
        raise DataError(f"{path}: line 1: empty; expected the header line (or set header = false)")
    try:
        return next(csv.reader(io.StringIO(first.decode("utf-8").rstrip("\r\n")), delimiter=delimiter))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: line 1: the header is not UTF-8: {exc}") from None


def _read_parquet(path: Path, schema: TableSchema, chunk_rows: int) -> Iterator[_Chunk]:
    needed = schema.input_columns()
    try:
        pf = pq.ParquetFile(str(path))
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file: {exc}") from None
    names = pf.schema_arrow.names
    missing = [c for c in needed if c not in names]
    if missing:
        raise DataError(f"{path}: column {missing[0]!r}: missing (the file has {names})")
    types = {c: pf.schema_arrow.field(c).type for c in needed}
    _check_parquet_types(path, schema, types)
    base = 0
    try:
        for batch in pf.iter_batches(batch_size=chunk_rows, columns=needed, use_threads=False):
            if batch.num_rows:
                yield _Chunk(path, base, {c: batch.column(c) for c in needed}, None)
                base += batch.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: cannot read from row {base}: {exc}") from None


def _is_text(t) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_int(t) -> bool:
    return pa.types.is_integer(t) or (pa.types.is_dictionary(t) and pa.types.is_integer(t.value_type))


def _check_parquet_types(path: Path, schema: TableSchema, types: dict) -> None:
    def wrong(column: str, want: str) -> DataError:
        return DataError(f"{path}: column {column!r}: wrong type {types[column]} (expected {want})")

    numeric = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean, pa.types.is_decimal)
    if not (any(f(types[schema.label]) for f in numeric) or _is_text(types[schema.label])):
        raise wrong(schema.label, "0/1 numbers or text for the label")
    for d in schema.dense:
        t = types[d.column]
        if not (any(f(t) for f in numeric[:2]) or pa.types.is_decimal(t) or _is_text(t)):
            raise wrong(d.column, "numbers (or numeric text) for a dense feature")
    for c in schema.categorical:
        t = types[c.column]
        is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
        if c.is_list != is_list:
            raise wrong(c.column, "a list column for a list = true feature" if c.is_list else
                        "integers or text (not a list) for a list = false feature")
        item = t.value_type if is_list else t
        if not (_is_int(item) or _is_text(item)):
            raise wrong(c.column, f"{'a list of ' if is_list else ''}integers or text for a categorical feature")
    if schema.unit is not None and not (_is_int(types[schema.unit]) or _is_text(types[schema.unit])):
        raise wrong(schema.unit, "integers or text for the unit")
    if schema.timestamp is not None:
        t = types[schema.timestamp]
        if not (_is_int(t) or _is_text(t) or pa.types.is_timestamp(t) or pa.types.is_date(t)):
            raise wrong(schema.timestamp, "integer seconds, a timestamp, a date or ISO text for the timestamp")


def _read(path: Path, schema: TableSchema, chunk_rows: int, block_bytes: int) -> Iterator[_Chunk]:
    if not path.is_file():
        raise DataError(f"{path}: cannot open: {'No such file or directory' if not path.exists() else 'not a file'}")
    if schema.format == "csv":
        return _read_csv(path, schema, block_bytes)
    return _read_parquet(path, schema, chunk_rows)


# ---- decoding one chunk (vectorized) -------------------------------------------------------------

def _plain(arr: pa.Array) -> pa.Array:
    """Dictionary-decoded, string (not large_string) view of an array."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if pa.types.is_large_string(arr.type):
        arr = arr.cast(pa.string())
    return arr


def _first_failure(arr: pa.Array, convert: Callable[[pa.Array], Any]) -> int:
    """Index of the first element of ``arr`` that ``convert`` (a vectorized cast that raises on a
    bad element) fails on: bisection over prefixes, O(n log n), on the error path only."""
    lo, hi = 0, len(arr)  # convert(arr[:lo]) succeeds, convert(arr[:hi]) fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            convert(arr.slice(0, mid))
            lo = mid
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
            hi = mid
    return hi - 1


def _numbers(chunk: _Chunk, column: str, what: str) -> np.ndarray:
    """float64 values of a column; NaN where missing (null, or empty text)."""
    arr = _plain(chunk.columns[column])
    if _is_text(arr.type):
        arr = pc.if_else(pc.equal(arr, ""), pa.scalar(None, pa.string()), arr)

        def cast(a):
            return pc.cast(a, pa.float64())
        try:
            values = cast(arr)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            i = _first_failure(arr, cast)
            raise DataError(f"{chunk.where(i, column)}: {what} {arr[i].as_py()!r} is not a number") from None
    elif pa.types.is_boolean(arr.type) or pa.types.is_decimal(arr.type) or pa.types.is_integer(arr.type) \
            or pa.types.is_floating(arr.type):
        values = pc.cast(arr, pa.float64())
    else:
        raise DataError(f"{chunk.where(0, column)}: wrong type {arr.type} (expected numbers)")
    out = np.array(values.to_numpy(zero_copy_only=False), dtype=np.float64)  # a writable copy
    present = np.asarray(values.is_valid().to_numpy(zero_copy_only=False))
    bad = present & ~np.isfinite(out)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DataError(f"{chunk.where(i, column)}: {what} {out[i]} is not finite")
    out[~present] = np.nan
    return out


def _labels(chunk: _Chunk, column: str) -> np.ndarray:
    raw = _plain(chunk.columns[column])
    x = _numbers(chunk, column, "label")
    bad = ~((x == 0) | (x == 1))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        value = raw[i].as_py()
        shown = "missing" if value is None or value == "" else repr(value)
        raise DataError(f"{chunk.where(i, column)}: label {shown} is not 0 or 1")
    return x.astype(np.float32)


def _dense(chunk: _Chunk, spec: DenseSpec, before_standardize: bool = False) -> np.ndarray:
    """The feature's values in this chunk after its transforms (or, with `before_standardize`,
    after those before `standardize`: what the DP statistics are computed on)."""
    x = _numbers(chunk, spec.column, "dense value")
    x[np.isnan(x)] = spec.fill
    for t in spec.transforms:
        if before_standardize and t == "standardize":
            return x
        if t == "log1p":
            x = np.log1p(np.maximum(x, 0.0))
        elif t == "clip":
            assert spec.clip is not None
            x = np.clip(x, spec.clip[0], spec.clip[1])
        elif t == "standardize":
            x = (x - spec.mean) / spec.std
    x = x.astype(np.float32)
    bad = ~np.isfinite(x)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DataError(f"{chunk.where(i, spec.column)}: dense value becomes {x[i]} after {spec.transforms}")
    return x


def _text_hashes(arr: pa.Array) -> np.ndarray:
    """uint64 ``hash_strings`` of each (non-null) string of a string array."""
    arr = arr.cast(pa.large_string())
    offsets_buf, data_buf = arr.buffers()[1], arr.buffers()[2]
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)[arr.offset: arr.offset + len(arr) + 1]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, dtype=np.uint8)
    return hash_strings(data, offsets)


def _int_or_text_keys(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 hash, missing bool) of each value: integers (and canonical integer text) by
    splitmix64, other text by hash_strings; null or empty text is missing."""
    arr = _plain(arr)
    n = len(arr)
    if _is_int(arr.type):
        missing = np.asarray(arr.is_null().to_numpy(zero_copy_only=False))
        ints = pc.fill_null(pc.cast(arr, pa.int64()), 0).to_numpy(zero_copy_only=False)
        return splitmix64(np.asarray(ints, dtype=np.int64).view(np.uint64)), missing
    filled = pc.fill_null(arr, "")
    missing = np.asarray(pc.equal(filled, "").to_numpy(zero_copy_only=False))
    is_int = np.asarray(pc.match_substring_regex(filled, _CANONICAL_INT).to_numpy(zero_copy_only=False))
    keys = np.zeros(n, dtype=np.uint64)
    if is_int.any():
        ints = pc.cast(filled.filter(pa.array(is_int)), pa.int64()).to_numpy(zero_copy_only=False)
        keys[is_int] = splitmix64(np.asarray(ints, dtype=np.int64).view(np.uint64))
    text = ~is_int & ~missing
    if text.any():
        keys[text] = _text_hashes(filled.filter(pa.array(text)))
    return keys, missing


def _ids(values: pa.Array, spec: CategoricalSpec) -> np.ndarray:
    """int64 ids of a flat array of values (see the module docstring)."""
    if spec.hash_size is not None:
        keys, missing = _int_or_text_keys(values)
        ids = (keys % np.uint64(spec.hash_size - 1)).astype(np.int64) + 1
        ids[missing] = 0
        return ids
    values = _plain(values)
    text = pc.cast(values, pa.string()) if _is_int(values.type) else values
    found = pc.index_in(text, value_set=spec.vocabulary_values)
    return np.asarray(pc.fill_null(pc.add(found, 1), 0).to_numpy(zero_copy_only=False), dtype=np.int64)


def _bags(chunk: _Chunk, spec: CategoricalSpec) -> tuple[np.ndarray, np.ndarray]:
    """(lengths int64 [n], ids int64) of a list feature: missing values dropped, max_length kept."""
    arr = chunk.columns[spec.column]
    if chunk.line_offset is not None:  # CSV: split the field's text
        lists = pc.split_pattern(pc.fill_null(_plain(arr), ""), spec.separator)
    else:
        lists = arr
        if pa.types.is_large_list(lists.type):
            lists = lists.cast(pa.list_(lists.type.value_type))
    lengths = np.asarray(pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False), dtype=np.int64)
    values = _plain(lists.flatten())  # respects slicing; a null list contributes nothing
    keep = np.asarray(values.is_valid().to_numpy(zero_copy_only=False))
    if _is_text(values.type):
        keep &= ~np.asarray(pc.equal(pc.fill_null(values, ""), "").to_numpy(zero_copy_only=False))
    if not keep.all():  # drop missing values from their bags
        row = np.repeat(np.arange(len(lengths)), lengths)
        lengths = np.bincount(row[keep], minlength=len(lengths)).astype(np.int64)
        values = values.filter(pa.array(keep))
    if spec.max_length is not None and (lengths > spec.max_length).any():
        pos = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        values = values.filter(pa.array(pos < spec.max_length))
        lengths = np.minimum(lengths, spec.max_length)
    return lengths, _ids(values, spec)


def _units(chunk: _Chunk, column: str) -> np.ndarray:
    arr = _plain(chunk.columns[column])
    if _is_int(arr.type):
        missing = np.asarray(arr.is_null().to_numpy(zero_copy_only=False))
        units = np.asarray(pc.fill_null(pc.cast(arr, pa.int64()), 0).to_numpy(zero_copy_only=False), dtype=np.int64)
    else:
        filled = pc.fill_null(arr, "")
        missing = np.asarray(pc.equal(filled, "").to_numpy(zero_copy_only=False))
        is_int = np.asarray(pc.match_substring_regex(filled, _CANONICAL_INT).to_numpy(zero_copy_only=False))
        units = np.zeros(len(arr), dtype=np.int64)
        if is_int.any():
            units[is_int] = pc.cast(filled.filter(pa.array(is_int)), pa.int64()).to_numpy(zero_copy_only=False)
        text = ~is_int & ~missing
        if text.any():
            units[text] = _text_hashes(filled.filter(pa.array(text))).view(np.int64)
    if missing.any():
        raise DataError(f"{chunk.where(int(np.flatnonzero(missing)[0]), column)}: the unit is missing")
    return units


def _seconds_of_iso(arr: pa.Array) -> np.ndarray:
    """int64 seconds (UTC, floor) of ISO 8601 strings; raises pa.ArrowInvalid on a bad one."""
    zoned = np.asarray(pc.match_substring_regex(arr, _ZONE_SUFFIX).to_numpy(zero_copy_only=False))
    micros = np.zeros(len(arr), dtype=np.int64)
    for mask, typ in ((zoned, pa.timestamp("us", tz="UTC")), (~zoned, pa.timestamp("us"))):
        if mask.any():
            micros[mask] = pc.cast(arr.filter(pa.array(mask)), typ).cast(pa.int64()).to_numpy(zero_copy_only=False)
    return np.floor_divide(micros, 1_000_000)


def _timestamps(chunk: _Chunk, column: str) -> np.ndarray:
    arr = _plain(chunk.columns[column])
    if arr.null_count:
        i = int(np.flatnonzero(np.asarray(arr.is_null().to_numpy(zero_copy_only=False)))[0])
        raise DataError(f"{chunk.where(i, column)}: the timestamp is missing")
    if _is_int(arr.type):
        return np.asarray(pc.cast(arr, pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)
    if pa.types.is_date(arr.type):
        arr = pc.cast(arr, pa.timestamp("s"))
    if pa.types.is_timestamp(arr.type):
        micros = pc.cast(arr, pa.timestamp("us", tz=arr.type.tz), safe=False).cast(pa.int64())
        return np.floor_divide(np.asarray(micros.to_numpy(zero_copy_only=False), dtype=np.int64), 1_000_000)
    is_int = np.asarray(pc.match_substring_regex(arr, _INTEGER_TEXT).to_numpy(zero_copy_only=False))
    out = np.zeros(len(arr), dtype=np.int64)
    if is_int.any():
        out[is_int] = pc.cast(arr.filter(pa.array(is_int)), pa.int64()).to_numpy(zero_copy_only=False)
    iso = np.flatnonzero(~is_int)
    if iso.size:
        text = arr.take(pa.array(iso))
        try:
            out[iso] = _seconds_of_iso(text)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            i = int(iso[_first_failure(text, _seconds_of_iso)])
            raise DataError(f"{chunk.where(i, column)}: timestamp {arr[i].as_py()!r} is neither integer seconds nor "
                            "an ISO 8601 date/datetime") from None
    return out


def _decode(chunk: _Chunk, schema: TableSchema) -> tuple[pa.Table, Optional[np.ndarray]]:
    """The output row group of one chunk, and its timestamps (when the schema has them)."""
    n = chunk.num_rows
    cols: dict[str, pa.Array] = {"label": pa.array(_labels(chunk, schema.label))}
    if schema.dense:
        dense = np.stack([_dense(chunk, d) for d in schema.dense], axis=1)
        cols["dense"] = pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), len(schema.dense))
    for c in schema.categorical:
        if c.is_list:
            lengths, ids = _bags(chunk, c)
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            cols[c.name] = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(ids, pa.int64())).cast(
                pa.list_(pa.int64()))
        else:
            cols[c.name] = pa.array(_ids(chunk.columns[c.column], c), pa.int64())
    if schema.unit is not None:
        cols["unit"] = pa.array(_units(chunk, schema.unit), pa.int64())
    timestamps = None
    if schema.timestamp is not None:
        timestamps = _timestamps(chunk, schema.timestamp)
        cols["timestamp"] = pa.array(timestamps, pa.int64())
    return pa.table(cols), timestamps


# ---- the conversion -------------------------------------------------------------------------------

def parse_time(text: str, what: str = "--test-after") -> int:
    """Seconds (UTC) of an ISO date or datetime; a time without a zone offset is UTC."""
    try:
        t = _dt.datetime.fromisoformat(text)
    except ValueError:
        raise DataError(f"{what}: {text!r} is not an ISO 8601 date or datetime (e.g. 2024-01-31 or "
                        "2024-01-31T12:00:00)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return math.floor(t.timestamp())


def _iso(seconds: int) -> str:
    return _dt.datetime.fromtimestamp(seconds, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _estimate_dp_statistics(spec: TableSchema, paths: list, cutoff: Optional[int], chunk_rows: int,
                            block_bytes: int, noise_seed: Optional[int]) -> tuple[TableSchema, dict]:
    """A first pass over the training examples (those before ``cutoff`` when it is set): the DP
    mean and std of every dense feature that standardizes without public statistics
    (trainer/data/convert/dp_statistics.py). Returns the schema with those values filled in and the
    dataset.json ``privacy_events`` entry of the release."""
    from widedp.accounting.events import GaussianDpEvent
    from widedp.selection.keyed_random import KEY_BITS, NoiseKey

    from widedp.trainer.data.convert import dp_statistics as dps
    from widedp.trainer.data.format.meta import privacy_event_entry

    dp_dense = spec.dp_dense
    ranges = []
    for d in dp_dense:
        assert d.clip is not None  # parse_schema: clip right before standardize
        ranges.append(dps.ClipRange(*d.clip))

    def training_chunks() -> Iterator[tuple[_Chunk, Optional[np.ndarray]]]:
        """Each chunk with the mask of its training rows (None: all of them)."""
        for path in paths:
            for chunk in _read(path, spec, chunk_rows, block_bytes):
                if cutoff is None:
                    yield chunk, None
                else:
                    assert spec.timestamp is not None  # convert_table: --test-after needs a timestamp column
                    yield chunk, _timestamps(chunk, spec.timestamp) < cutoff

    per_user = spec.unit is not None
    counts = dps.UnitCounts()
    if per_user:  # a first pass counts each user's training examples (their weight is 1/m_u)
        assert spec.unit is not None
        for chunk, keep in training_chunks():
            units = _units(chunk, spec.unit)
            counts.add(units if keep is None else units[keep])
    sums, n = np.zeros(2 * len(dp_dense)), 0
    for chunk, keep in training_chunks():
        values = np.stack([_dense(chunk, d, before_standardize=True) for d in dp_dense], axis=1)
        chunk_units: Optional[np.ndarray] = _units(chunk, spec.unit) if spec.unit is not None else None
        if keep is not None:
            values = values[keep]
            chunk_units = None if chunk_units is None else chunk_units[keep]
        weights = None if chunk_units is None else counts.weights(chunk_units)
        sums += dps.moment_sums(dps.normalized(values, ranges), weights)
        n += len(values)
    if n == 0:
        return spec, {}  # no training example: the conversion refuses the data below
    rng = (NoiseKey.fresh(secure=True) if noise_seed is None else NoiseKey(int(noise_seed) % (1 << KEY_BITS))).generator()
    sigma = spec.statistics_noise_multiplier
    divisor = counts.num_units if per_user else n
    mean, std = dps.mean_and_std(dps.noisy_moment_sums(sums, sigma, rng), divisor, ranges)
    estimated = {d.name: (float(m), float(s)) for d, m, s in zip(dp_dense, mean, std)}
    dense = [dataclasses.replace(d, mean=estimated[d.name][0], std=estimated[d.name][1]) if d.name in estimated else d
             for d in spec.dense]
    # Per user the number of users is public (like n); the number of training examples is not: it
    # changes by m_u when a user is removed, so it is not written into the description (which the
    # export's privacy report and every run's caveats quote).
    over = (f"the {divisor} users' mean values (each example weighted 1/(its user's examples); "
            "ℓ2 sensitivity per user and per example") if per_user else f"the {n} training examples (ℓ2 sensitivity"
    description = (f"DP standardization statistics (mean, std) of dense feature(s) {', '.join(estimated)} over {over} "
                   f"√(2·{len(dp_dense)})): Gaussian mechanism, noise multiplier {sigma:g}, on the moment sums of "
                   "the values centred and scaled by their public clip ranges"
                   + ("; noise from a FIXED seed (tests only: its ε holds only while the seed is secret)"
                      if noise_seed is not None else ""))
    return dataclasses.replace(spec, dense=dense), privacy_event_entry(description, GaussianDpEvent(sigma),
                                                                       unit="user" if per_user else "example")


def convert_table(inputs, out_dir, *, schema, test_inputs: Optional[Sequence] = None,
                  test_after: Optional[str] = None, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                  csv_block_bytes: int = DEFAULT_CSV_BLOCK_BYTES,
                  statistics_noise_seed: Optional[int] = None) -> DatasetMeta:
    """Convert ``inputs`` (paths or globs) to a ctr data set in ``out_dir`` by ``schema`` (a path
    to the TOML file, or a ``TableSchema``); see the module docstring. Returns its meta.

    ``statistics_noise_seed``: TESTS ONLY, a fixed seed of the DP standardization statistics'
    noise (their ε then holds only while it is secret); default: fresh OS entropy."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if csv_block_bytes < 1024:
        raise ValueError(f"csv_block_bytes must be >= 1024, got {csv_block_bytes}")
    spec = schema if isinstance(schema, TableSchema) else load_schema(schema)
    if test_inputs and test_after is not None:
        raise DataError("give --test INPUT... or --test-after TIMESTAMP, not both")
    cutoff = None
    if test_after is not None:
        cutoff = parse_time(test_after)
        if spec.timestamp is None:
            raise DataError(f"--test-after needs a timestamp column: {spec.path} names none (timestamp = \"COLUMN\")")
    paths = expand_inputs(inputs)
    test_paths = expand_inputs(test_inputs, "test") if test_inputs else []
    overlap = {p.resolve() for p in paths} & {p.resolve() for p in test_paths}
    if overlap:
        raise DataError(f"{sorted(overlap)[0]}: both an input and a --test input")
    for path in paths + test_paths:  # before anything is written
        if not path.is_file():
            raise DataError(f"{path}: cannot open: {'No such file or directory' if not path.exists() else 'not a file'}")

    event_entries = []
    if spec.dp_dense:  # before the output directory exists: a failure here leaves nothing
        spec, entry = _estimate_dp_statistics(spec, paths, cutoff, chunk_rows, csv_block_bytes, statistics_noise_seed)
        event_entries = [entry] if entry else []
    with DatasetWriter(out_dir) as writer:
        for path in paths:
            for chunk in _read(path, spec, chunk_rows, csv_block_bytes):
                table, timestamps = _decode(chunk, spec)
                if cutoff is None:
                    writer.write(table)
                else:
                    assert timestamps is not None
                    later = pa.array(timestamps >= cutoff)
                    writer.write(table.filter(pc.invert(later)))
                    writer.write_test(table.filter(later))
        for path in test_paths:
            for chunk in _read(path, spec, chunk_rows, csv_block_bytes):
                writer.write_test(_decode(chunk, spec)[0])
        names = ", ".join(map(str, paths))
        if writer.rows == 0:
            if cutoff is not None and writer.test_rows:
                raise DataError(f"{names}: every example has timestamp >= {test_after}: the training data would "
                                "be empty")
            raise DataError(f"{names}: no examples")
        if test_paths and writer.test_rows == 0:
            raise DataError(f"{', '.join(map(str, test_paths))}: no examples (--test)")
        if cutoff is not None and writer.test_rows == 0:
            raise DataError(f"{names}: no example has timestamp >= {test_after}: the test data would be empty")
        meta = _meta(spec, writer.rows, writer.test_rows, paths, test_paths,
                     None if cutoff is None else f"timestamp>={_iso(cutoff)}", event_entries)
        writer.commit(meta)
    return meta


def _meta(spec: TableSchema, rows: int, test_rows: int, paths: list, test_paths: list,
          cutoff_rule: Optional[str], event_entries: list) -> DatasetMeta:
    features = [c.name for c in spec.categorical]
    extra: dict[str, Any] = {
        "source": f"table {', '.join(map(str, paths))}",
        "schema_file": str(spec.path),
        "schema": _public_schema(spec),
        "dense_features": [d.name for d in spec.dense],
        "list_features": [c.name for c in spec.categorical if c.is_list],
        "unit_column": spec.unit is not None,
        "timestamp_column": spec.timestamp is not None,
    }
    vocabularies = {c.name: vocabulary_record(c) for c in spec.categorical if c.vocabulary is not None}
    if vocabularies:  # which vocabulary each feature was converted with (`widedp export` ships it)
        extra["vocabulary_files"] = vocabularies
    if spec.dp_dense:  # the released (DP) statistics, applied to every split; charged by training
        unit = "user" if spec.unit is not None else "example"
        extra["dense_statistics"] = {d.name: {"mean": d.mean, "std": d.std, "estimated": "dp", "unit": unit}
                                     for d in spec.dp_dense}
        extra[PRIVACY_EVENTS_KEY] = event_entries
    if test_rows:
        extra["test_examples"] = test_rows
        extra["test_split"] = cutoff_rule or "file"
        if test_paths:
            extra["test_source"] = ", ".join(map(str, test_paths))
    return DatasetMeta(kind="ctr", num_examples=rows, features=features,
                       feature_tables={c.name: c.table for c in spec.categorical},
                       table_sizes={c.table: c.table_size for c in spec.categorical},
                       pooling={c.name: c.pooling for c in spec.categorical}, num_dense=len(spec.dense),
                       bayes_auc=None, extra=extra)


def vocabulary_digest(values: Sequence[str]) -> str:
    """sha256 (hex) of a vocabulary's values as parsed (UTF-8 of the values joined by "\\n")."""
    import hashlib

    return hashlib.sha256("\n".join(values).encode("utf-8")).hexdigest()


def vocabulary_record(c: CategoricalSpec) -> dict:
    """dataset.json ``vocabulary_files[feature]``: the file a vocabulary feature was converted
    with (absolute path), its number of values and their ``vocabulary_digest``, so a later
    reader (`widedp export`) can tell whether the file still holds the same vocabulary."""
    assert c.vocabulary is not None and c.vocabulary_values is not None
    values = c.vocabulary_values.to_pylist()
    return {"path": str(Path(c.vocabulary).resolve()), "values": len(values), "sha256": vocabulary_digest(values)}


def _public_schema(spec: TableSchema) -> dict:
    """The schema as converted (JSON-able): what a reader of dataset.json needs to apply the same
    mapping to new data (vocabulary files by path)."""
    raw = dict(spec.raw)
    for c in spec.categorical:
        if c.vocabulary is not None:
            raw.setdefault("categorical", {})
            raw["categorical"] = {**raw["categorical"],
                                  c.name: {**raw["categorical"][c.name], "vocabulary": str(c.vocabulary)}}
    return raw
