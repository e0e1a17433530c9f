"""Interaction logs with real users and real time, from public data that ships in Debian packages
— not from our generators — written as Parquet logs with a schema and converted by
`widedp convert table`, the path a team's own logs take.

Two sets (the raw data is the packages' own; every choice below is stated, none looked at a
model's results):
- `insteval`: lme4's `InstEval` (r-cran-lme4): 73,421 lecture ratings 1–5 by 2,972 students of
  1,128 lecturers at ETH Zürich. Unit: the student. Label: rating ≥ 4. Time: the semester the
  lecture was held (`lectage`, 1 = the survey's semester, … 6 = five semesters back); the test
  split is the survey's semester (lectage = 1), training the five before. Features: the
  lecturer (item), the department, whether the lecture was a service course, the student's
  semester number, and the history: the lecturers the student rated in earlier semesters
  (most recent first, ≤ 20).
- `movielens`: dslabs' `movielens` (r-cran-dslabs): 100,004 ratings 0.5–5 by 671 users of 9,066
  movies, 1995–2016. Unit: the user. Label: rating ≥ 4. Time: the rating's timestamp; the test
  split is every rating from 2015-01-01 on (new users and new movies included). Features: the
  movie (item), its genres (a list), its decade, and the history: the user's last 20 movies
  rated before this one (most recent first).

The packages are fetched with `apt-get download` into the cache (--cache, default
runs/bench/public_logs/debs) and unpacked with `dpkg-deb -x`; R's lazy-load data base
(data/Rdata.rdx + Rdata.rdb) is read with the `rdata` package (`pip install -e '.[bench]'`).
No R is needed. Written per set under --work-dir: logs/period=*/part-0.parquet, logs/schema.toml,
data/ (the converted set) and stats.json (users, examples, positives, per split: public
descriptions of the raw data, not of any model).

    python benchmarks/public_logs.py [--sets insteval,movielens] [--work-dir DIR] [--cache DIR]

Then e.g. `python benchmarks/user_level.py --data DIR/insteval/data`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import bz2
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO  # noqa: E402

PACKAGES = {"insteval": ("r-cran-lme4", "lme4", "InstEval"), "movielens": ("r-cran-dslabs", "dslabs", "movielens")}
HISTORY = 20


class PublicDataError(RuntimeError):
    pass


# ---- R's lazy-load data base -------------------------------------------------------------------

def _decompress_chunk(blob: bytes, where: str) -> bytes:
    """One object of an .rdb: a 4-byte big-endian length, then zlib data (R's compress = TRUE),
    or a type byte 'Z' (xz), '2' (bzip2) or '0' (none) and the data (compress = 2, 3)."""
    if len(blob) < 5:
        raise PublicDataError(f"{where}: truncated object ({len(blob)} bytes)")
    kind = blob[4:5]
    try:
        if kind == b"Z":
            return lzma.decompress(blob[5:])
        if kind == b"2":
            return bz2.decompress(blob[5:])
        if kind == b"0":
            return blob[5:]
        return zlib.decompress(blob[4:])
    except (zlib.error, lzma.LZMAError, OSError) as e:
        raise PublicDataError(f"{where}: cannot decompress an object: {e}") from None


def read_lazy_load(data_dir: Path, name: str):
    """The R object `name` of the lazy-load data base data_dir/Rdata.{rdx,rdb}, converted by
    `rdata` (a data.frame becomes a pandas DataFrame, factors categoricals)."""
    try:
        import rdata
    except ImportError:
        raise PublicDataError("reading R data needs the `rdata` package: pip install -e '.[bench]'") from None
    rdx, rdb = data_dir / "Rdata.rdx", data_dir / "Rdata.rdb"
    for path in (rdx, rdb):
        if not path.is_file():
            raise PublicDataError(f"{path}: no such file (not an R package's lazy-load data directory)")
    import warnings

    warnings.filterwarnings("ignore", message="Unknown file type", module="rdata")  # a bare object: "assumed RDS"
    raw = rdx.read_bytes()
    index_bytes = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else _decompress_chunk(raw, str(rdx))
    index = rdata.conversion.convert(rdata.parser.parse_data(index_bytes))
    variables = index["variables"]
    if name not in variables:
        raise PublicDataError(f"{rdx}: no object {name!r} (has {', '.join(sorted(map(str, variables)))})")
    offset, length = (int(v) for v in variables[name])
    with open(rdb, "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    return rdata.conversion.convert(rdata.parser.parse_data(_decompress_chunk(blob, f"{rdb}[{name}]")))


def debian_package_data(package: str, r_name: str, cache: Path) -> Path:
    """The data/ directory of R package `r_name` from Debian package `package`, downloaded once
    into `cache` by `apt-get download` and unpacked with `dpkg-deb -x`."""
    cache.mkdir(parents=True, exist_ok=True)
    unpacked = cache / package
    data = unpacked / "usr" / "lib" / "R" / "site-library" / r_name / "data"
    if data.is_dir():
        return data
    debs = sorted(cache.glob(f"{package}_*.deb"))
    if not debs:
        for tool in ("apt-get", "dpkg-deb"):
            if shutil.which(tool) is None:
                raise PublicDataError(f"{tool} not found: the public logs come from Debian's {package}")
        done = subprocess.run(["apt-get", "download", package], cwd=cache, capture_output=True, text=True)
        debs = sorted(cache.glob(f"{package}_*.deb"))
        if done.returncode != 0 or not debs:
            raise PublicDataError(f"apt-get download {package} failed (rc {done.returncode}): "
                                  f"{(done.stderr or done.stdout).strip()[-400:]}")
    tmp = cache / f".{package}.unpacking"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(tmp)], check=True)
    tmp.rename(unpacked)  # whole or not at all
    if not data.is_dir():
        raise PublicDataError(f"{debs[-1]}: has no {data.relative_to(unpacked)}")
    return data


# ---- the logs ----------------------------------------------------------------------------------

def _history(frame, unit: str, key: str, item: str):
    """Per row, the items of the unit's rows with a strictly smaller `key` (most recent first,
    ≤ HISTORY): rows tied on `key` (the same semester or second) are not each other's history."""
    frame = frame.sort_values([unit, key], kind="stable").reset_index(drop=True)
    history: list = [None] * len(frame)
    units, keys, items = frame[unit].to_numpy(), frame[key].to_numpy(), frame[item].to_numpy()
    start = 0
    while start < len(frame):
        past: list = []
        row = start
        while row < len(frame) and units[row] == units[start]:
            tie = row
            while tie < len(frame) and units[tie] == units[start] and keys[tie] == keys[row]:
                history[tie] = past[:HISTORY]
                tie += 1
            past = list(items[row:tie][::-1]) + past
            row = tie
        start = row
    frame["history"] = history
    return frame


def insteval_frame(raw):
    import numpy as np
    import pandas as pd

    lectage = raw["lectage"].astype(int).to_numpy()
    frame = pd.DataFrame({
        "user_id": raw["s"].astype(str).map(lambda s: f"s{s}"),
        "lecturer": raw["d"].astype(str).map(lambda s: f"d{s}"),
        "dept": raw["dept"].astype(str),
        "service": raw["service"].astype(str),
        "studage": raw["studage"].astype(str),
        "semester": 7 - lectage,  # 1 = five semesters back … 6 = the survey's semester
        "label": (raw["y"].astype(int).to_numpy() >= 4).astype(np.int64),
    })
    start = pd.Timestamp("2000-03-01")
    frame["ts"] = [start + pd.DateOffset(months=6 * (s - 1)) for s in frame["semester"]]
    frame = _history(frame, "user_id", "semester", "lecturer")
    test_after = str((start + pd.DateOffset(months=6 * 5) - pd.Timedelta(days=1)).date())
    return frame, "semester", test_after


INSTEVAL_SCHEMA = """# lme4's InstEval (r-cran-lme4) as logs: benchmarks/public_logs.py. Unit: the student.
format = "parquet"
label = "label"
unit = "user_id"
timestamp = "ts"

[categorical.lecturer]
table = "lecturer"
hash_size = 4096

[categorical.history]        # the lecturers the student rated in earlier semesters
table = "lecturer"
hash_size = 4096
list = true
pooling = "mean"
max_length = 20

[categorical.dept]
hash_size = 64

[categorical.service]
hash_size = 8

[categorical.studage]
hash_size = 16
"""


def movielens_frame(raw):
    import numpy as np
    import pandas as pd

    ts = pd.to_datetime(raw["timestamp"].astype("int64"), unit="s")
    year = raw["year"].astype("Int64")
    frame = pd.DataFrame({
        "user_id": raw["userId"].astype(int).map(lambda u: f"u{u}"),
        "movie": raw["movieId"].astype(int).map(lambda m: f"m{m}"),
        "genres": [[] if g in ("(no genres listed)", "nan") else g.split("|") for g in raw["genres"].astype(str)],
        "decade": [("unknown" if pd.isna(y) else f"{int(y) // 10 * 10}s") for y in year],
        "ts": ts,
        "label": (raw["rating"].to_numpy() >= 4.0).astype(np.int64),
    })
    frame["order"] = raw["timestamp"].astype("int64").to_numpy()
    frame = _history(frame, "user_id", "order", "movie")
    frame["period"] = frame["ts"].dt.year
    return frame.drop(columns=["order"]), "period", "2014-12-31"


MOVIELENS_SCHEMA = """# dslabs' movielens (r-cran-dslabs) as logs: benchmarks/public_logs.py. Unit: the user.
format = "parquet"
label = "label"
unit = "user_id"
timestamp = "ts"

[categorical.movie]
table = "movie"
hash_size = 16384

[categorical.history]        # the user's last 20 movies rated before this one
table = "movie"
hash_size = 16384
list = true
pooling = "mean"
max_length = 20

[categorical.genres]
hash_size = 64
list = true
pooling = "mean"
max_length = 10

[categorical.decade]
hash_size = 32
"""

BUILDERS = {"insteval": (insteval_frame, INSTEVAL_SCHEMA), "movielens": (movielens_frame, MOVIELENS_SCHEMA)}


def write_logs(frame, period_column: str, logs: Path, schema_text: str) -> None:
    """Parquet logs partitioned by period (period=P/part-0.parquet) and schema.toml, written into a
    temporary directory that replaces `logs` whole."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = logs.with_name(logs.name + ".writing")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for period, part in frame.groupby(period_column, sort=True):
        target = tmp / f"period={period}"
        target.mkdir()
        table = pa.Table.from_pandas(part.drop(columns=[period_column]), preserve_index=False)
        for i, field in enumerate(table.schema):  # a period whose lists are all empty: list<null>
            if pa.types.is_list(field.type) and pa.types.is_null(field.type.value_type):
                table = table.set_column(i, field.name, table.column(i).cast(pa.list_(pa.string())))
        pq.write_table(table, target / "part-0.parquet")
    (tmp / "schema.toml").write_text(schema_text)
    shutil.rmtree(logs, ignore_errors=True)
    tmp.rename(logs)


def describe(frame, test_after: str) -> dict:
    import pandas as pd

    test = frame["ts"] > pd.Timestamp(test_after) + pd.Timedelta(days=1) - pd.Timedelta(seconds=1)
    out = {}
    for name, part in (("train", frame[~test]), ("test", frame[test])):
        per_user = part.groupby("user_id", observed=True).size()
        out[name] = {"examples": int(len(part)), "users": int(per_user.size), "positive_rate": float(part["label"].mean()),
                     "examples_per_user_median": float(per_user.median()), "examples_per_user_max": int(per_user.max())}
    train_users = set(frame.loc[~test, "user_id"])
    out["test"]["users_new"] = int(len(set(frame.loc[test, "user_id"]) - train_users))
    return out


def source_of(data: Path):
    """The description `build` wrote beside a converted set (its stats.json: set, source, users,
    examples per split), or None for a set that did not come from here."""
    stats = Path(data).parent / "stats.json"
    return json.loads(stats.read_text()) if stats.is_file() else None


def build(name: str, work: Path, cache: Path) -> Path:
    """The converted data set of public logs `name` under work/name/data (made once)."""
    import contextlib
    import io

    from widedp.trainer.data.convert.table import convert_table

    if name not in BUILDERS:
        raise PublicDataError(f"--sets: unknown set {name!r} (known: {', '.join(BUILDERS)})")
    root = work / name
    data = root / "data"
    if (data / "dataset.json").exists():
        return data
    package, r_name, obj = PACKAGES[name]
    raw = read_lazy_load(debian_package_data(package, r_name, cache), obj)
    make_frame, schema_text = BUILDERS[name]
    frame, period_column, test_after = make_frame(raw)
    write_logs(frame, period_column, root / "logs", schema_text)
    stats = {"set": name, "source": f"Debian {package}, R object {r_name}::{obj}", "test_after": test_after,
             **describe(frame, test_after)}
    (root / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    with contextlib.redirect_stdout(io.StringIO()):
        convert_table([str(root / "logs" / "period=*" / "*.parquet")], data, schema=root / "logs" / "schema.toml",
                      test_after=test_after)
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", default="insteval,movielens")
    parser.add_argument("--work-dir", default=str(REPO / "runs" / "bench" / "public_logs"))
    parser.add_argument("--cache", default=None, help="where the .deb files are kept (default WORK/debs)")
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    cache = Path(args.cache) if args.cache else work / "debs"
    try:
        for name in [s for s in args.sets.split(",") if s]:
            data = build(name, work, cache)
            stats = json.loads((work / name / "stats.json").read_text())
            print(f"{name}: {data}  train {stats['train']['examples']} examples of {stats['train']['users']} users "
                  f"(rate {stats['train']['positive_rate']:.3f}), test {stats['test']['examples']} of "
                  f"{stats['test']['users']} users ({stats['test']['users_new']} new)")
    except PublicDataError as e:
        print(f"public_logs: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
