"""Dataset description (``dataset.json``) and the Parquet schema it implies.

On-disk format of a data set (a directory)::

    DIR/dataset.json   kind, num_examples, features, feature_tables, table_sizes, pooling,
                       num_dense, bayes_auc, source, plus generator/converter parameters
                       (every top-level key that is not a DatasetMeta field lands in
                       ``DatasetMeta.extra``)
    DIR/data.parquet   one row per example (the training data when test.parquet exists)
    DIR/test.parquet   optional (kind "ctr"): the held-out evaluation examples, same columns;
                       present iff dataset.json has ``test_examples``

Optional dataset.json keys of kind ``"ctr"`` (absent in data sets written before them, which
stay valid; each lands in ``DatasetMeta.extra`` and has a property of the same name):

* ``list_features``: names of features stored as ``list<int64>`` bags (any length, 0 included;
  repeats allowed), e.g. a history of item ids; the others hold one int64 id per example;
* ``unit_column`` (bool): an int64 column ``unit``, the privacy unit of each example (e.g. a
  hashed user id); ``timestamp_column`` (bool): an int64 column ``timestamp`` (seconds, UTC);
* ``test_examples`` (int >= 1): rows in ``test.parquet``; ``test_split``: the rule that made it,
  ``"file"`` (separate input files) or ``"timestamp>=<ISO time>"`` (examples at or after that
  time). Without ``test_examples``, training splits data.parquet by a seeded permutation
  (``open_dataset``'s ``test_fraction``).

``privacy_events`` (optional; absent or ``[]`` when nothing private was released while building
the data set — synthetic data, Criteo, a text conversion with a public vocabulary file): a list
of ``{"description": str, "event": accounting.events.event_to_dict(event)}`` for every DP
mechanism the converter ran on the private data (e.g. the text converter's private vocabulary
selection). Their outputs are baked into the data set, so whoever trains on it must charge
these events to the training's privacy ledger before the first step.
``DatasetMeta.privacy_events`` returns them as ``[(description, DpEvent)]``. An entry may also
carry ``"unit": "user"``: its event bounds what one whole user (the ``unit`` column) does to
the release, and one example's too (e.g. the per-user DP standardization statistics of
trainer/data/convert/dp_statistics.py); without it the event bounds one example only.
``DatasetMeta.privacy_event_units`` lists each entry's unit (``"example"`` or ``"user"``).

Parquet columns:

* ``kind == "ctr"``: ``label`` float32 (0/1), ``dense`` fixed_size_list<float32>[num_dense]
  (one list column, not 13 scalar columns; absent when num_dense == 0), then one column per
  feature, named as the feature: int64 (one id per example, a row of the feature's table) or,
  for ``list_features``, list<int64> (a bag of rows of its table, pooled as ``pooling`` says);
  then ``unit`` int64 and ``timestamp`` int64 when dataset.json says so. Feature names are any
  non-empty names other than ``label``, ``dense``, ``unit`` and ``timestamp``; several features
  may share a table. The Criteo layout (``convert criteo``, ``synth ctr``) is ``cat_0`` ..
  ``cat_25``, table ``t_i`` each, 13 dense values.
* ``kind == "cbow"``: ``context`` list<int64> (1 .. 2*window ids, table ``input``, mean
  pooling), ``target`` int64 (table ``output``, sum pooling), ``negatives``
  fixed_size_list<int64>[K] (table ``output``). The sparse features are, in order,
  ``context``, ``target``, ``neg_0`` .. ``neg_{K-1}``; ``neg_i`` is the single-id bag
  ``negatives[i]``.

Every column is non-null. Both files are written to a temporary name in DIR and renamed
into place (data first, then dataset.json).

``dataset_identity(DIR)`` names the data a run trained on (a checkpoint records it, and a
resume refuses other data): sha256 of dataset.json's bytes, num_examples, data.parquet's size
and the sha256 of its last MiB (the Parquet footer: schema, row-group sizes, per-column
statistics). It tells a different or re-converted data set from the one a run started on
without reading the whole file; it is not a signature against a deliberate edit that keeps the
footer intact. With a test.parquet it also has ``test_bytes`` and ``test_footer_sha256`` (absent
otherwise, so the identity of a data set without one is what it always was).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from widedp.trainer.data.errors import DataError

META_FILE = "dataset.json"
DATA_FILE = "data.parquet"
TEST_FILE = "test.parquet"
FORMAT_VERSION = 1

KINDS = ("ctr", "cbow")
POOLINGS = ("sum", "mean")
CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26

#: names a ctr feature may not take: the other columns of data.parquet
RESERVED_COLUMNS = ("label", "dense", "unit", "timestamp")
_FIELDS = ("kind", "num_examples", "features", "feature_tables", "table_sizes", "pooling",
           "num_dense", "bayes_auc")
PRIVACY_EVENTS_KEY = "privacy_events"


@dataclass
class DatasetMeta:
    """What ``dataset.json`` says about a data set (see the module docstring)."""

    kind: str
    num_examples: int
    features: list[str]
    feature_tables: dict[str, str]
    table_sizes: dict[str, int]
    pooling: dict[str, str]
    num_dense: int
    bayes_auc: Optional[float] = None
    extra: dict = field(default_factory=dict)

    # ---- derived views (not part of the file) ----
    @property
    def tables(self) -> list[str]:
        """Table names in order of first use by ``features``."""
        seen: dict[str, None] = {}
        for f in self.features:
            seen.setdefault(self.feature_tables[f], None)
        return list(seen)

    @property
    def privacy_events(self) -> list:
        """[(description, DpEvent)] of the DP mechanisms run on private data to build the data
        set (``privacy_events`` in dataset.json; ``[]`` when absent)."""
        return parse_privacy_events(self.extra.get(PRIVACY_EVENTS_KEY, []), META_FILE)

    @property
    def privacy_event_units(self) -> list[str]:
        """The unit each ``privacy_events`` entry's event bounds, in order: ``"user"`` (one
        whole user, hence one example too) or ``"example"`` (one example only; the default)."""
        entries = self.extra.get(PRIVACY_EVENTS_KEY, [])
        parse_privacy_events(entries, META_FILE)
        return [entry.get("unit", "example") for entry in entries]

    @property
    def list_features(self) -> list[str]:
        """ctr: the features stored as list<int64> bags (``[]`` when absent)."""
        return list(self.extra.get("list_features", []))

    def max_ids_per_example(self) -> dict[str, Optional[int]]:
        """Per feature, the most ids (rows of its table, repeats counted) one example holds — a
        public bound from the format and the conversion: 1 for a single-id feature; cbow's
        ``context`` 2·window; a list feature its schema's ``max_length``. None where nothing
        bounds it (a list without ``max_length``, or a data set written without the key)."""
        if self.kind == "cbow":
            window = self.extra.get("window")
            context = None if window is None else 2 * int(window)
            return {f: context if f == "context" else 1 for f in self.features}
        lists = set(self.list_features)
        declared = (self.extra.get("schema") or {}).get("categorical", {})
        out: dict[str, Optional[int]] = {}
        for f in self.features:
            bound = (declared.get(f) or {}).get("max_length") if f in lists else 1
            out[f] = None if bound is None else int(bound)
        return out

    @property
    def unit_column(self) -> bool:
        """Whether the Parquet files hold an int64 ``unit`` column (the privacy unit)."""
        return bool(self.extra.get("unit_column", False))

    @property
    def timestamp_column(self) -> bool:
        """Whether the Parquet files hold an int64 ``timestamp`` column (seconds, UTC)."""
        return bool(self.extra.get("timestamp_column", False))

    @property
    def test_examples(self) -> Optional[int]:
        """Rows of test.parquet, or None when the data set has no test file."""
        n = self.extra.get("test_examples")
        return None if n is None else int(n)

    @property
    def test_split(self) -> Optional[str]:
        """How test.parquet was made (``"file"`` or ``"timestamp>=..."``); None without one."""
        return self.extra.get("test_split") if self.test_examples is not None else None

    @property
    def num_negatives(self) -> int:
        """cbow: number of negatives per example (0 for ctr)."""
        return sum(1 for f in self.features if f.startswith("neg_")) if self.kind == "cbow" else 0

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"format_version": FORMAT_VERSION}
        for name in _FIELDS:
            out[name] = getattr(self, name)
        for key, value in self.extra.items():
            if key in out:
                raise ValueError(f"extra key {key!r} collides with a dataset.json field")
            out[key] = value
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = META_FILE) -> "DatasetMeta":
        """Parse and check a dataset.json object; DataError naming ``source`` and the key."""

        def bad(msg: str) -> DataError:
            return DataError(f"{source}: {msg}")

        if not isinstance(data, dict):
            raise bad("top level is not a JSON object")
        missing = [k for k in _FIELDS if k not in data]
        if missing:
            raise bad(f"missing key(s) {', '.join(missing)}")
        kind = data["kind"]
        if kind not in KINDS:
            raise bad(f"kind must be one of {KINDS}, got {kind!r}")
        n = data["num_examples"]
        if not _is_int(n) or n < 0:
            raise bad(f"num_examples must be a non-negative integer, got {n!r}")
        features = data["features"]
        if not (isinstance(features, list) and features and all(isinstance(f, str) for f in features)):
            raise bad("features must be a non-empty list of names")
        if len(set(features)) != len(features):
            raise bad("features has duplicate names")
        ft, ts, pool = data["feature_tables"], data["table_sizes"], data["pooling"]
        for name, value in (("feature_tables", ft), ("table_sizes", ts), ("pooling", pool)):
            if not isinstance(value, dict):
                raise bad(f"{name} must be an object")
        for f in features:
            if f not in ft or not isinstance(ft[f], str):
                raise bad(f"feature_tables has no table for feature {f!r}")
            if ft[f] not in ts:
                raise bad(f"table_sizes has no size for table {ft[f]!r} (feature {f!r})")
            if pool.get(f) not in POOLINGS:
                raise bad(f"pooling of feature {f!r} must be one of {POOLINGS}, got {pool.get(f)!r}")
        for t, size in ts.items():
            if not _is_int(size) or size < 1:
                raise bad(f"table_sizes[{t!r}] must be a positive integer, got {size!r}")
        nd = data["num_dense"]
        if not _is_int(nd) or nd < 0:
            raise bad(f"num_dense must be a non-negative integer, got {nd!r}")
        auc = data["bayes_auc"]
        if auc is not None and (isinstance(auc, bool) or not isinstance(auc, (int, float))):
            raise bad(f"bayes_auc must be a number or null, got {auc!r}")
        meta = cls(kind=kind, num_examples=int(n), features=list(features),
                   feature_tables={f: ft[f] for f in features},
                   table_sizes={t: int(ts[t]) for t in ts}, pooling={f: pool[f] for f in features},
                   num_dense=int(nd), bayes_auc=None if auc is None else float(auc),
                   extra={k: v for k, v in data.items() if k not in _FIELDS and k != "format_version"})
        _check_kind_layout(meta, bad)
        if PRIVACY_EVENTS_KEY in meta.extra:
            parse_privacy_events(meta.extra[PRIVACY_EVENTS_KEY], source)
        return meta


EVENT_UNITS = ("example", "user")


def privacy_event_entry(description: str, event, unit: str = "example") -> dict:
    """One ``privacy_events`` entry of dataset.json; ``unit="user"`` when the event bounds one
    whole user (and so one example as well)."""
    from widedp.accounting.events import event_to_dict

    if unit not in EVENT_UNITS:
        raise ValueError(f"unit must be one of {EVENT_UNITS}, got {unit!r}")
    entry = {"description": str(description), "event": event_to_dict(event)}
    if unit != "example":
        entry["unit"] = unit
    return entry


def parse_privacy_events(entries: Any, source: str = META_FILE) -> list:
    """[(description, DpEvent)] from dataset.json's ``privacy_events`` value; DataError naming
    ``source`` and the entry when it is malformed."""
    if not isinstance(entries, list):
        raise DataError(f"{source}: {PRIVACY_EVENTS_KEY} must be a list, got {type(entries).__name__}")
    if not entries:
        return []
    from widedp.accounting.events import DpEvent, event_from_dict  # imports dp_accounting: only when needed

    out = []
    for i, entry in enumerate(entries):
        where = f"{source}: {PRIVACY_EVENTS_KEY}[{i}]"
        if not (isinstance(entry, dict) and {"description", "event"} <= set(entry) <= {"description", "event", "unit"}):
            raise DataError(f"{where} must be an object with the keys 'description' and 'event' (and optionally "
                            f"'unit'), got {entry!r}")
        if entry.get("unit", "example") not in EVENT_UNITS:
            raise DataError(f"{where}.unit must be one of {', '.join(EVENT_UNITS)}, got {entry['unit']!r}")
        if not isinstance(entry["description"], str):
            raise DataError(f"{where}.description must be a string, got {entry['description']!r}")
        try:
            event = event_from_dict(entry["event"])
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise DataError(f"{where}.event is not a valid privacy event: {exc}") from None
        if not isinstance(event, DpEvent):
            raise DataError(f"{where}.event is not a privacy event: {entry['event']!r}")
        out.append((entry["description"], event))
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_CTR_ONLY_KEYS = ("list_features", "unit_column", "timestamp_column")


def _check_kind_layout(meta: DatasetMeta, bad) -> None:
    extra = meta.extra
    if "test_examples" in extra:
        n = extra["test_examples"]
        if not _is_int(n) or n < 1:
            raise bad(f"test_examples must be a positive integer, got {n!r}")
        if not isinstance(extra.get("test_split", "file"), str):
            raise bad(f"test_split must be a string, got {extra['test_split']!r}")
    if meta.kind == "ctr":
        for i, f in enumerate(meta.features):
            if not f or f in RESERVED_COLUMNS:
                raise bad(f"feature {i} is named {f!r}; ctr feature names must be non-empty and not one of "
                          f"{RESERVED_COLUMNS}")
        lists = extra.get("list_features", [])
        if not (isinstance(lists, list) and all(isinstance(f, str) for f in lists)):
            raise bad(f"list_features must be a list of feature names, got {lists!r}")
        unknown = [f for f in lists if f not in meta.features]
        if unknown or len(set(lists)) != len(lists):
            raise bad(f"list_features {lists} must name distinct features of {meta.features}")
        for key in ("unit_column", "timestamp_column"):
            if not isinstance(extra.get(key, False), bool):
                raise bad(f"{key} must be true or false, got {extra[key]!r}")
    else:
        present = [k for k in (*_CTR_ONLY_KEYS, "test_examples") if k in extra]
        if present:
            raise bad(f"{', '.join(present)}: only kind 'ctr' data sets have them")
        k = len(meta.features) - 2
        expected = ["context", "target"] + [f"neg_{i}" for i in range(k)]
        if meta.features != expected:
            raise bad(f"cbow features must be {expected[:3] + ['...']}, got {meta.features}")
        if meta.num_dense != 0:
            raise bad(f"cbow has no dense features, num_dense is {meta.num_dense}")


def ctr_meta(num_examples: int, table_sizes: list[int], *, bayes_auc: Optional[float],
             extra: dict, num_dense: int = CRITEO_NUM_DENSE) -> DatasetMeta:
    features = [f"cat_{i}" for i in range(len(table_sizes))]
    return DatasetMeta(
        kind="ctr", num_examples=num_examples, features=features,
        feature_tables={f: f"t_{i}" for i, f in enumerate(features)},
        table_sizes={f"t_{i}": int(s) for i, s in enumerate(table_sizes)},
        pooling={f: "sum" for f in features}, num_dense=num_dense, bayes_auc=bayes_auc,
        extra=extra)


def cbow_meta(num_examples: int, vocab_size: int, negatives: int, *, extra: dict) -> DatasetMeta:
    features = ["context", "target"] + [f"neg_{i}" for i in range(negatives)]
    tables = {f: ("input" if f == "context" else "output") for f in features}
    return DatasetMeta(
        kind="cbow", num_examples=num_examples, features=features, feature_tables=tables,
        table_sizes={"input": int(vocab_size), "output": int(vocab_size)},
        pooling={f: ("mean" if f == "context" else "sum") for f in features}, num_dense=0,
        bayes_auc=None, extra=extra)


def read_json_file(path: Path, missing: str) -> Any:
    """The JSON value in `path`; DataError naming the file when it is missing (`missing` says
    what that means), unreadable or not JSON."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: missing ({missing})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: malformed JSON: {exc}") from None


def read_meta(directory) -> DatasetMeta:
    path = Path(directory) / META_FILE
    return DatasetMeta.from_dict(read_json_file(path, "not a widedp data set directory?"), str(path))


FOOTER_BYTES = 1 << 20


def dataset_identity(directory) -> dict:
    """What identifies a data set's contents (see the module docstring); DataError naming the
    file when one is missing."""
    directory = Path(directory)
    meta_path, data_path, test_path = directory / META_FILE, directory / DATA_FILE, directory / TEST_FILE
    try:
        meta_bytes = meta_path.read_bytes()
        size, tail = _size_and_footer(data_path)
        test = None
        if test_path.exists():
            test_size, test_tail = _size_and_footer(test_path)
            test = {"test_bytes": test_size, "test_footer_sha256": hashlib.sha256(test_tail).hexdigest()}
    except FileNotFoundError as exc:
        raise DataError(f"{exc.filename}: missing (not a widedp data set directory?)") from None
    except OSError as exc:
        raise DataError(f"{getattr(exc, 'filename', None) or directory}: cannot read: {exc.strerror or exc}") from None
    return identity_of(meta_bytes, size, tail, test, str(meta_path))


def identity_of(meta_bytes: bytes, size: int, tail: bytes, test: Optional[dict], meta_where: str) -> dict:
    """`dataset_identity`'s fields from what was read of the directory (wherever it is)."""
    try:
        num_examples = json.loads(meta_bytes).get("num_examples")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise DataError(f"{meta_where}: malformed JSON: {exc}") from None
    return {"dataset_json_sha256": hashlib.sha256(meta_bytes).hexdigest(), "num_examples": num_examples,
            "data_bytes": size, "data_footer_sha256": hashlib.sha256(tail).hexdigest(), **(test or {})}


def _size_and_footer(path: Path) -> tuple[int, bytes]:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        fh.seek(max(0, size - FOOTER_BYTES))
        return size, fh.read()


def write_text_atomic(path, text: str) -> None:
    """Write a file via a temporary name in the same directory and os.replace."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise


def meta_json(meta: DatasetMeta) -> str:
    return json.dumps(meta.to_dict(), indent=2, allow_nan=False) + "\n"


def _unlink_quiet(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---- expected Parquet schema ---------------------------------------------------------------

def expected_columns(meta: DatasetMeta) -> dict:
    """Column name -> expected pyarrow type, in file order."""
    import pyarrow as pa

    if meta.kind == "ctr":
        cols = {"label": pa.float32()}
        if meta.num_dense:  # (a fixed_size_list of size 0 crashes pyarrow: no column then)
            cols["dense"] = pa.list_(pa.float32(), meta.num_dense)
        lists = set(meta.list_features)
        for f in meta.features:
            cols[f] = pa.list_(pa.int64()) if f in lists else pa.int64()
        if meta.unit_column:
            cols["unit"] = pa.int64()
        if meta.timestamp_column:
            cols["timestamp"] = pa.int64()
        return cols
    return {"context": pa.list_(pa.int64()), "target": pa.int64(),
            "negatives": pa.list_(pa.int64(), meta.num_negatives)}


def type_matches(actual, expected) -> bool:
    """Type equality that ignores the name of a list's item field."""
    import pyarrow as pa

    if pa.types.is_fixed_size_list(expected):
        return (pa.types.is_fixed_size_list(actual) and actual.list_size == expected.list_size
                and actual.value_type == expected.value_type)
    if pa.types.is_list(expected):
        return pa.types.is_list(actual) and actual.value_type == expected.value_type
    return actual == expected
