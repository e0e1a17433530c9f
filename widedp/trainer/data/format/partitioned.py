"""Partitioned data sets: one data set written as many parts, each read only by the trainer
that owns it (docs/DESIGN.md §2.2, "partitioned data").

Privacy assumption: none of its own, and none broken. Which part an example lands in is a
public function of the example alone (a hash of its row position in the source at example
level, of its unit label at user level: `part_of`), never of the sampling coins; each trainer
samples each of its parts at the one rate q with a stream of its own (trainer/data/sampler.py
`PartitionSampler`), so each example (unit) is in a step's sample independently with
probability q — the union over the parts is exactly the Poisson sample the accountant assumes
(DESIGN §1: Poisson sampling is separable per example). At user level a unit's examples all sit
in one part (the hash is of the unit label), so per-unit sums and the cap on a unit's examples
are computed where its examples are. The part sizes (examples, and units at user level) are
in the manifest; they are public as n (and U) are.

On-disk layout (a directory)::

    DIR/partitions.json   the manifest (`PartitionManifest`): format, partition_by, num_parts,
                          num_examples, num_units, per part its directory, examples and units,
                          the test split's directory and size, the source and its split rule
    DIR/part-00000/ ...   each part an ordinary data set (dataset.json + data.parquet, every
                          row a training example; trainer/data/format/meta.py)
    DIR/test/             the held-out split, an ordinary data set (absent when the source had
                          no test examples)

A partitioned data set is written into a temporary sibling directory and renamed into place at
the end (`write_partitioned`): a failure leaves nothing half-written, and an existing non-empty
directory is never overwritten. Its identity (`partitioned_identity`: what a run's checkpoint
and the data set's budget name) is the manifest's bytes and every part's `dataset_identity`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Optional

import numpy as np

from widedp.trainer.data._util import missing_directories, remove_empty_directories, splitmix64
from widedp.trainer.data.errors import DataError
from widedp.trainer.data.format.store import advise_random_access
from widedp.trainer.data.format.meta import (DATA_FILE, FOOTER_BYTES, META_FILE, TEST_FILE, DatasetMeta,
                                             dataset_identity, identity_of, meta_json, read_json_file, read_meta)
from widedp.trainer.data.format.remote import RemoteDir, local_path, remote_dir

MANIFEST_FILE = "partitions.json"
#: the data set's budget (trainer/run/budget.py): copied from the source, so the spending on record
#: before the partitioning stays on record (README "Copies of a data set": a copy's budget is its own
#: from the moment of the copy, holding the lines before it)
#: (the head first: a line a run appends to the source between the two copies then lies past the copied
#: head, which the budget accepts, instead of a head past the lines, which it refuses as truncated)
BUDGET_FILES = ("privacy_budget.head.json", "privacy_budget.jsonl")
MANIFEST_FORMAT = "widedp-partitioned"
MANIFEST_VERSION = 1
TEST_DIR = "test"
PARTITION_BY = ("example", "unit")
_ROWS_PER_BATCH = 1 << 16


def part_dir(index: int) -> str:
    """The directory name of part `index`."""
    return f"part-{int(index):05d}"


def is_partitioned(directory) -> bool:
    """Whether `directory` (a local path, or a URI: trainer/data/format/remote.py) holds a
    partitioned data set (its manifest)."""
    remote = remote_dir(directory)
    if remote is not None:
        return remote.exists(MANIFEST_FILE)
    return (local_path(directory) / MANIFEST_FILE).is_file()


def part_of(keys: np.ndarray, num_parts: int) -> np.ndarray:
    """The part (0..num_parts-1) of each int64 key: an example's row position in the source,
    or its unit label at user level. A public function of the key alone."""
    if int(num_parts) < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts!r}")
    keys = np.asarray(keys, dtype=np.int64).view(np.uint64)
    return (splitmix64(keys) % np.uint64(num_parts)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class PartInfo:
    """One part: its directory (relative to the data set's), examples and units (None at example level)."""

    directory: str
    num_examples: int
    num_units: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class PartitionManifest:
    """What partitions.json says (see the module docstring)."""

    partition_by: str
    parts: tuple[PartInfo, ...]
    num_examples: int
    num_units: Optional[int] = None
    test_directory: Optional[str] = None
    test_examples: int = 0
    source: str = ""
    split: str = "file"

    @property
    def num_parts(self) -> int:
        return len(self.parts)

    def to_dict(self) -> dict:
        return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "partition_by": self.partition_by,
                "num_parts": self.num_parts, "num_examples": self.num_examples, "num_units": self.num_units,
                "parts": [dataclasses.asdict(p) for p in self.parts], "test_directory": self.test_directory,
                "test_examples": self.test_examples, "source": self.source, "split": self.split}

    @classmethod
    def from_dict(cls, data, source: str = MANIFEST_FILE) -> "PartitionManifest":
        def bad(msg: str) -> DataError:
            return DataError(f"{source}: {msg}")

        if not isinstance(data, dict):
            raise bad("not a JSON object")
        if data.get("format") != MANIFEST_FORMAT or data.get("version") != MANIFEST_VERSION:
            raise bad(f"not a widedp partition manifest (format {data.get('format')!r}, version "
                      f"{data.get('version')!r}; expected {MANIFEST_FORMAT!r}, {MANIFEST_VERSION})")
        by = data.get("partition_by")
        if by not in PARTITION_BY:
            raise bad(f"partition_by must be one of {PARTITION_BY}, got {by!r}")
        raw_parts = data.get("parts")
        if not isinstance(raw_parts, list) or not raw_parts:
            raise bad("parts must be a non-empty list")
        parts = []
        for i, p in enumerate(raw_parts):
            if not isinstance(p, dict) or not isinstance(p.get("directory"), str) or not _count(p.get("num_examples")):
                raise bad(f"parts[{i}] must have a directory (string) and num_examples (integer >= 0)")
            units = p.get("num_units")
            if (by == "unit" and not _count(units)) or (by != "unit" and units is not None):
                raise bad(f"parts[{i}]: num_units must be an integer >= 0 when partition_by = \"unit\", and absent "
                          "(null) otherwise")
            if Path(p["directory"]).is_absolute() or ".." in Path(p["directory"]).parts:
                raise bad(f"parts[{i}].directory must be a path inside the data set, got {p['directory']!r}")
            parts.append(PartInfo(p["directory"], int(p["num_examples"]), None if units is None else int(units)))
        directories = [Path(p.directory).as_posix().rstrip("/") for p in parts]
        if len(set(directories)) != len(directories):
            raise bad("two parts name the same directory (its examples would be sampled twice each step)")
        n = data.get("num_examples")
        if not _count(n) or n != sum(p.num_examples for p in parts):
            raise bad(f"num_examples {n!r} must be the sum of the parts' ({sum(p.num_examples for p in parts)})")
        if data.get("num_parts") != len(parts):
            raise bad(f"num_parts {data.get('num_parts')!r} does not match the {len(parts)} parts listed")
        units_total = data.get("num_units")
        if by != "unit" and units_total is not None:
            raise bad(f"num_units must be absent (null) when partition_by = {by!r}, got {units_total!r}")
        if by == "unit" and units_total != sum(p.num_units or 0 for p in parts):
            raise bad(f"num_units {units_total!r} must be the sum of the parts' ({sum(p.num_units or 0 for p in parts)})")
        test_dir, test_n = data.get("test_directory"), data.get("test_examples", 0)
        if test_dir is not None and not isinstance(test_dir, str) or not _count(test_n) or (test_dir is None) != (test_n == 0):
            raise bad("test_directory (string) and test_examples (integer >= 1) go together, or neither")
        if test_dir is not None and (Path(test_dir).is_absolute() or ".." in Path(test_dir).parts
                                     or Path(test_dir).as_posix().rstrip("/") in directories):
            raise bad(f"test_directory must be a directory inside the data set and not a part, got {test_dir!r}")
        return cls(by, tuple(parts), int(n), None if units_total is None else int(units_total), test_dir, int(test_n),
                   str(data.get("source", "")), str(data.get("split", "file")))


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_manifest(directory) -> PartitionManifest:
    """The manifest of the partitioned data set in `directory` (a local path or a URI);
    DataError naming the file."""
    missing = "not a partitioned widedp data set"
    remote = remote_dir(directory)
    if remote is not None:
        return PartitionManifest.from_dict(remote.read_json(MANIFEST_FILE, missing), remote.where(MANIFEST_FILE))
    path = local_path(directory) / MANIFEST_FILE
    return PartitionManifest.from_dict(read_json_file(path, missing), str(path))


def read_part_meta(directory, manifest: PartitionManifest, index: int = 0) -> DatasetMeta:
    """The metadata (dataset.json) of part `index`, read where the data set is (nothing staged)."""
    remote = remote_dir(directory)
    rel = f"{manifest.parts[index].directory}/{META_FILE}"
    if remote is not None:
        return DatasetMeta.from_dict(remote.read_json(rel, "not a widedp data set directory?"), remote.where(rel))
    return read_meta(local_path(directory) / manifest.parts[index].directory)


def partitioned_identity(directory) -> dict:
    """What identifies a partitioned data set's contents: the manifest's sha256 and every
    part's (and the test split's) `dataset_identity`, digested; DataError naming what is missing.
    At a URI the same digest is computed from the remote objects (their dataset.json, sizes and
    Parquet footers), so a data set and its upload have one identity."""
    remote = remote_dir(directory)
    manifest = read_manifest(directory)
    dirs = [p.directory for p in manifest.parts] + ([manifest.test_directory] if manifest.test_directory else [])
    if remote is not None:
        digest = hashlib.sha256(remote.read_bytes(MANIFEST_FILE))
        for d in dirs:
            digest.update(json.dumps(remote_dataset_identity(remote, d), sort_keys=True).encode())
    else:
        local = local_path(directory)
        digest = hashlib.sha256((local / MANIFEST_FILE).read_bytes())
        for d in dirs:
            digest.update(json.dumps(dataset_identity(local / d), sort_keys=True).encode())
    return {"partitioned": True, "num_parts": manifest.num_parts, "num_examples": manifest.num_examples,
            "partitions_sha256": digest.hexdigest()}


def remote_dataset_identity(remote: RemoteDir, rel: str) -> dict:
    """`dataset_identity` of the data set directory `rel` at a URI (the same fields and values)."""
    meta_bytes = remote.read_bytes(f"{rel}/{META_FILE}")
    size, tail = remote.size_and_footer(f"{rel}/{DATA_FILE}", FOOTER_BYTES)
    test = None
    if remote.exists(f"{rel}/{TEST_FILE}"):
        test_size, test_tail = remote.size_and_footer(f"{rel}/{TEST_FILE}", FOOTER_BYTES)
        test = {"test_bytes": test_size, "test_footer_sha256": hashlib.sha256(test_tail).hexdigest()}
    return identity_of(meta_bytes, size, tail, test, remote.where(f"{rel}/{META_FILE}"))


def any_dataset_identity(directory) -> dict:
    """`partitioned_identity` of a partitioned data set, else `dataset_identity`."""
    if is_partitioned(directory):
        return partitioned_identity(directory)
    require_local(directory)
    return dataset_identity(local_path(directory))


def require_local(directory) -> None:
    """DataError unless `directory` is local: only a partitioned data set is read from a URI."""
    remote = remote_dir(directory)
    if remote is not None:
        raise DataError(f"{remote.where(MANIFEST_FILE)}: missing; a data set at a URI must be a partitioned one "
                        "(`widedp convert partition` it, then `widedp convert upload` the result), each trainer "
                        "staging only its own parts")


# ---- writing ----------------------------------------------------------------------------------------

def write_partitioned(source, out_dir, num_parts: int, *, partition_by: str = "example",
                      test_fraction: float = 0.1, seed: int = 0) -> PartitionManifest:
    """Write the data set in `source` (an ordinary widedp data set directory) as a partitioned
    one in `out_dir`, streaming its rows (a batch of rows at a time, never the whole file).

    Args:
        source: the data set to partition (its dataset.json and data.parquet; its test.parquet
            becomes the test split when it has one).
        out_dir: a new directory (or an empty one); refused when it holds anything.
        num_parts: K >= 1 parts.
        partition_by: "example" (an example's part hashes its row position in data.parquet) or
            "unit" (hashes its unit label, so a user's examples stay in one part; needs the
            data set's unit column).
        test_fraction, seed: for a source without a test file, the held-out rows are the ones
            `open_dataset(source, test_fraction, seed)` would hold out (the same seeded
            permutation of the rows), written to the test split.

    Returns:
        The manifest written. Raises DataError naming the file or parameter on bad input;
        nothing is left behind on failure.
    """
    import pyarrow.parquet as pq

    source, out_dir = Path(os.fspath(source)), Path(os.fspath(out_dir))
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise DataError(f"--parts must be an integer >= 1, got {num_parts!r}")
    if partition_by not in PARTITION_BY:
        raise DataError(f"--by must be one of {', '.join(PARTITION_BY)}, got {partition_by!r}")
    if not (0.0 <= test_fraction < 1.0):
        raise DataError(f"--test-fraction must be in [0, 1), got {test_fraction}")
    meta = read_meta(source)
    if partition_by == "unit" and not meta.unit_column:
        raise DataError(f"{source / META_FILE}: --by unit needs a data set with a unit column (unit_column: true)")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DataError(f"{out_dir}: exists and is not an empty directory; a data set is never overwritten")
    data_path = source / DATA_FILE
    try:
        data_file = pq.ParquetFile(str(data_path))
    except (OSError, ValueError) as exc:
        raise DataError(f"{data_path}: cannot read as Parquet: {exc}") from None
    n = data_file.metadata.num_rows
    if n != meta.num_examples:
        raise DataError(f"{data_path}: {n} rows, but {source / META_FILE} says num_examples = {meta.num_examples}")
    held_out = None
    if meta.test_examples is None and test_fraction > 0:  # open_dataset's rule, so both agree on the split
        held_out = np.zeros(n, dtype=bool)
        held_out[np.random.default_rng(seed).permutation(n)[: int(np.floor(n * test_fraction))]] = True
    if held_out is not None and not held_out.any():
        raise DataError(f"--test-fraction {test_fraction} of {n} rows holds out no example: give a larger fraction "
                        "(or 0 with a source that has a test file)")
    created = missing_directories(out_dir.absolute().parent)  # removed again on failure
    tmp = out_dir.parent / f".{out_dir.name}.{uuid.uuid4().hex}.tmp"
    writers: dict = {}
    done = False
    try:
        tmp.mkdir(parents=True)
        counts = np.zeros(num_parts, dtype=np.int64)
        units: list[set] = [set() for _ in range(num_parts)]
        test_rows = 0
        start = 0
        import pyarrow as pa

        batches = data_file.iter_batches(batch_size=_ROWS_PER_BATCH)
        while True:
            try:
                record_batch = next(batches, None)
            except (OSError, pa.ArrowException) as exc:
                raise DataError(f"{data_path}: cannot read rows {start}..: {exc}") from None
            if record_batch is None:
                break
            table = pa.Table.from_batches([record_batch])
            rows = np.arange(start, start + table.num_rows, dtype=np.int64)
            start += table.num_rows
            if held_out is not None:
                test_mask = held_out[rows]
                if test_mask.any():
                    _write(writers, tmp / TEST_DIR, table.filter(pa.array(test_mask)), data_file.schema_arrow)
                    test_rows += int(test_mask.sum())
                table, rows = table.filter(pa.array(~test_mask)), rows[~test_mask]
            if partition_by == "unit":
                labels = table.column("unit").to_numpy().astype(np.int64)
                parts = part_of(labels, num_parts)
            else:
                labels, parts = None, part_of(rows, num_parts)
            for j in np.unique(parts):
                mask = parts == j
                _write(writers, tmp / part_dir(int(j)), table.filter(pa.array(mask)), data_file.schema_arrow)
                counts[j] += int(mask.sum())
                if labels is not None:
                    units[int(j)].update(np.unique(labels[mask]).tolist())
        if start != n:
            raise DataError(f"{data_path}: read {start} rows, expected {n}")
        for writer in writers.values():
            writer.close()
        writers.clear()
        part_meta = dataclasses.replace(meta, extra={k: v for k, v in meta.extra.items()
                                                     if k not in ("test_examples", "test_split")})
        parts_info = []
        for j in range(num_parts):
            d = tmp / part_dir(j)
            if counts[j] == 0:
                raise DataError(f"{data_path}: part {j} of {num_parts} would hold no example ({n} rows, "
                                f"partitioned by {partition_by}): use fewer parts")
            (d / META_FILE).write_text(meta_json(dataclasses.replace(part_meta, num_examples=int(counts[j]))),
                                       encoding="utf-8")
            parts_info.append(PartInfo(part_dir(j), int(counts[j]), len(units[j]) if partition_by == "unit" else None))
        test_dir, split = None, "file"
        if meta.test_examples is not None:
            (tmp / TEST_DIR).mkdir()
            shutil.copyfile(source / TEST_FILE, tmp / TEST_DIR / DATA_FILE)
            test_rows, split = int(meta.test_examples), str(meta.test_split or "file")
        elif held_out is not None:
            split = f"random(test_fraction={test_fraction}, seed={seed})"
        if test_rows:
            test_dir = TEST_DIR
            (tmp / TEST_DIR / META_FILE).write_text(
                meta_json(dataclasses.replace(part_meta, num_examples=int(test_rows))), encoding="utf-8")
        manifest = PartitionManifest(partition_by, tuple(parts_info), int(counts.sum()),
                                     sum(p.num_units or 0 for p in parts_info) if partition_by == "unit" else None,
                                     test_dir, int(test_rows), str(source), split)
        for name in BUDGET_FILES:  # the data's spending so far comes along, as with a copy of the directory
            if (source / name).exists():
                shutil.copyfile(source / name, tmp / name)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n", encoding="utf-8")
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.rename(tmp, out_dir)
        done = True
        return manifest
    finally:
        for writer in writers.values():
            try:
                writer.close()
            except Exception:  # noqa: BLE001 — already failing
                pass
        shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            remove_empty_directories(created)


def _write(writers: dict, directory: Path, table, schema) -> None:
    import pyarrow.parquet as pq

    writer = writers.get(directory)
    if writer is None:
        directory.mkdir(parents=True, exist_ok=True)
        writer = writers[directory] = pq.ParquetWriter(str(directory / DATA_FILE), schema)
    if table.num_rows:
        writer.write_table(table.cast(schema))


# ---- reading ----------------------------------------------------------------------------------------

def open_part(directory, index: int):
    """Part `index` of a partitioned data set as a split (every row a training example), its
    memory-mapped columns advised for random access (`advise_random_access`)."""
    from widedp.trainer.data.format.dataset import open_dataset

    directory = local_path(directory)
    manifest = read_manifest(directory)
    if not 0 <= index < manifest.num_parts:
        raise ValueError(f"{directory}: no part {index} (it has {manifest.num_parts})")
    train, _ = open_dataset(directory / manifest.parts[index].directory, test_fraction=0.0)
    advise_random_access(train._cols)  # a trainer reads its part at the sampled rows only
    if len(train) != manifest.parts[index].num_examples:
        raise DataError(f"{directory / manifest.parts[index].directory}: {len(train)} examples, the manifest says "
                        f"{manifest.parts[index].num_examples}")
    return train


def open_partitioned_test(directory, stage_dir=None, expected_manifest_sha256: Optional[str] = None):
    """The held-out split of a partitioned data set (None when it has none); at a URI staged
    into `stage_dir` first (trainer/data/format/remote.py), refused when its manifest is not
    `expected_manifest_sha256` (when given)."""
    from widedp.trainer.data.format.dataset import open_dataset

    manifest = read_manifest(directory)
    if manifest.test_directory is None:
        return None
    remote = remote_dir(directory)

    def opened(local: Path, rel: str):
        test, _ = open_dataset(local / rel, test_fraction=0.0)
        test.name = "test"
        return test

    if remote is None:
        return opened(local_path(directory), manifest.test_directory)
    return remote.stage([manifest.test_directory], stage_dir, expected_manifest_sha256=expected_manifest_sha256,
                        opener=opened)[1][0]


def manifest_sha256(directory) -> str:
    """The sha256 of the manifest's bytes (local or at a URI): what names one partitioning."""
    remote = remote_dir(directory)
    data = (remote.read_bytes(MANIFEST_FILE, "missing (not a partitioned widedp data set)") if remote is not None
            else (local_path(directory) / MANIFEST_FILE).read_bytes())
    return hashlib.sha256(data).hexdigest()


class PartsView:
    """Several parts read as one split: index i runs over part 0's examples, then part 1's, ...
    (`take` of sorted indices keeps their order). The engine's trainer-side data interface
    (`meta`, `len`, `take`, `iter_batches`, `units`)."""

    def __init__(self, splits: list):
        if not splits:
            raise ValueError("PartsView needs at least one part")
        self.splits = list(splits)
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in self.splits])]).astype(np.int64)
        self.meta = dataclasses.replace(self.splits[0].meta, num_examples=int(self.offsets[-1]))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def take(self, indices):
        from widedp.trainer.data.format.dataset import concat_batches

        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
            raise IndexError(f"index {bad} out of range for split of size {len(self)}")
        owner = np.searchsorted(self.offsets, idx, side="right") - 1
        if idx.size > 1 and np.any(np.diff(owner) < 0):
            raise ValueError("PartsView.take needs indices grouped by part in order (e.g. sorted)")
        batches = []
        for j, split in enumerate(self.splits):
            mine = idx[owner == j]
            if mine.size:
                batches.append(split.take(mine - self.offsets[j]))
        if not batches:
            return self.splits[0].take(np.zeros(0, dtype=np.int64))
        out = batches[0] if len(batches) == 1 else concat_batches(batches)
        return dataclasses.replace(out, indices=idx.copy())

    def iter_batches(self, batch_size: int):
        for start in range(0, len(self), batch_size):
            yield self.take(np.arange(start, min(start + batch_size, len(self)), dtype=np.int64))

    def units(self) -> Optional[np.ndarray]:
        units = [s.units() for s in self.splits]
        return None if any(u is None for u in units) else np.concatenate(units).astype(np.int64)

    def part_sizes(self) -> list[int]:
        return [len(s) for s in self.splits]
