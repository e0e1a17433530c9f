"""A partitioned data set in object storage (or any filesystem pyarrow reaches), named by a URI:
``data.path = "s3://bucket/prefix"`` — with ``?endpoint_override=HOST:PORT&scheme=http`` (and
``region=``) for an S3-compatible server; credentials come from the environment (the AWS chain:
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, a profile or an instance role), never the URI,
because the URI is written into the run's records.

The layout at the URI is the one `widedp convert partition` writes on a local disk
(trainer/data/format/partitioned.py): ``partitions.json``, ``part-NNNNN/``, ``test/`` and the data
set's budget. Nothing is decoded remotely: a reader **stages** the directories it needs — a
trainer its own parts, the coordinator the test split — into a local directory
(`stage`, ``data.stage_dir``; default ``$WIDEDP_STAGE_DIR`` or ``~/.cache/widedp/staged``) and
opens the local copy as it opens any part (decoded once into the memory-mapped column store,
read at the sampled rows each step). The I/O a step costs is therefore the local part's, and
the object store is read once per part and node: a whole part on first use, and again only when
the object listing (every file's size and modification time) changed. A staged copy is written
into a temporary sibling and renamed, so an interrupted download is never opened.

``file:///abs/path`` names a local directory and is opened as one.

Privacy assumption: none here — this module moves bytes. What a reader may read is decided by
its caller (a trainer stages only its own parts: trainer/data/partitioned_training.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from widedp.trainer.data.errors import DataError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: query parameters that would carry a secret into the run's records
_SECRET_PARAMS = ("access_key", "secret_key", "session_token")
CACHE_DIR = ".widedp-cache"
STAGED_MARK = ".staged.json"
#: in a staging directory: the URI it is a copy of (a staged copy is never a data set of its own)
STAGED_FROM = ".widedp-staged-from.json"
_CHUNK = 8 << 20
#: staging: an object is read in ranges of this many bytes, DOWNLOAD_THREADS at a time
RANGE_BYTES = 32 << 20
DOWNLOAD_THREADS = 8


def is_uri(path) -> bool:
    """Whether `path` names a remote location (a URI other than file://)."""
    match = _SCHEME.match(str(path)) if isinstance(path, str) else None
    return match is not None and match.group(1).lower() != "file"


def local_path(path) -> Path:
    """`path` as a local Path: a file:// URI's path, else the path itself."""
    text = os.fspath(path)
    if isinstance(text, str) and text.lower().startswith("file://"):
        parsed = urllib.parse.urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise DataError(f"{text}: a file:// URI names a path on this machine (file:///abs/path), "
                            f"not on host {parsed.netloc!r}")
        return Path(urllib.parse.unquote(parsed.path))
    return Path(text)


def default_stage_root() -> Path:
    return Path(os.environ.get("WIDEDP_STAGE_DIR") or Path.home() / ".cache" / "widedp" / "staged")


class RemoteDir:
    """A directory at a URI, read through pyarrow's filesystems.

    Args:
        uri: ``scheme://bucket/prefix[?options]`` (pyarrow's `FileSystem.from_uri` options).
    """

    def __init__(self, uri: str):
        parsed = urllib.parse.urlsplit(str(uri))
        if parsed.username or parsed.password:
            raise DataError(f"{_without_userinfo(parsed)}: credentials in a data set's URI would be written into "
                            "every run's records; set them in the environment (AWS_ACCESS_KEY_ID / "
                            "AWS_SECRET_ACCESS_KEY, a profile or an instance role)")
        options = urllib.parse.parse_qsl(parsed.query, keep_blank_values=True)
        secret = sorted({k for k, _ in options if k.lower() in _SECRET_PARAMS})
        if secret:
            raise DataError(f"{_without_userinfo(parsed)._replace(query='').geturl()}: the URI carries "
                            f"{', '.join(secret)}; credentials would be written into every run's records: set them "
                            "in the environment instead")
        self.scheme = parsed.scheme.lower()
        #: the URI's options (endpoint_override, scheme, region, ...), sorted: part of where the data are
        self.query = urllib.parse.urlencode(sorted(options), safe=":/")
        self.uri = urllib.parse.urlunsplit((self.scheme, parsed.netloc, parsed.path, self.query, ""))
        self.base_uri = urllib.parse.urlunsplit((self.scheme, parsed.netloc, parsed.path.rstrip("/"), "", ""))
        self._fs = None
        self._root = ""

    def __repr__(self) -> str:
        return f"RemoteDir({self.uri})"

    def __str__(self) -> str:
        return self.uri

    def where(self, rel: str) -> str:
        """The URI of `rel` inside this directory, its options kept (they name the store: an
        endpoint, a region; never a secret)."""
        path = f"{self.base_uri}/{rel}" if rel else self.base_uri
        return f"{path}?{self.query}" if self.query else path

    def bucket_and_prefix(self) -> tuple[str, str]:
        """(bucket, key prefix) as an S3 client names them (percent-escapes decoded, as pyarrow does)."""
        parsed = urllib.parse.urlsplit(self.base_uri)
        return urllib.parse.unquote(parsed.netloc), urllib.parse.unquote(parsed.path).strip("/")

    def option(self, name: str) -> Optional[str]:
        values = [v for k, v in urllib.parse.parse_qsl(self.query) if k.lower() == name]
        return values[-1] if values else None

    def filesystem(self):
        """(pyarrow FileSystem, this directory's path in it); DataError naming the URI."""
        if self._fs is None:
            import pyarrow.fs as pafs

            try:
                self._fs, self._root = pafs.FileSystem.from_uri(self.uri)
            except (ValueError, OSError, TypeError) as exc:
                raise DataError(f"{self.uri}: not a location pyarrow's filesystems can open ({exc})") from None
            self._root = self._root.rstrip("/")
        return self._fs, self._root

    def _path(self, rel: str) -> str:
        _, root = self.filesystem()
        return f"{root}/{rel}" if rel else root

    def exists(self, rel: str) -> bool:
        import pyarrow.fs as pafs

        fs, _ = self.filesystem()
        try:
            return fs.get_file_info(self._path(rel)).type == pafs.FileType.File
        except OSError as exc:
            raise DataError(f"{self.where(rel)}: cannot reach it ({exc})") from None

    def read_bytes(self, rel: str, missing: str = "missing") -> bytes:
        """The whole file `rel`; DataError naming its URI when it is missing or unreadable."""
        fs, _ = self.filesystem()
        try:
            with fs.open_input_stream(self._path(rel)) as stream:
                return stream.read()
        except FileNotFoundError:
            raise DataError(f"{self.where(rel)}: {missing}") from None
        except OSError as exc:
            if "not found" in str(exc).lower() or "nosuchkey" in str(exc).lower():
                raise DataError(f"{self.where(rel)}: {missing}") from None
            raise DataError(f"{self.where(rel)}: cannot read ({exc})") from None

    def read_json(self, rel: str, missing: str) -> object:
        data = self.read_bytes(rel, f"missing ({missing})")
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError(f"{self.where(rel)}: malformed JSON: {exc}") from None

    def size_and_footer(self, rel: str, footer_bytes: int) -> tuple[int, bytes]:
        fs, _ = self.filesystem()
        try:
            with fs.open_input_file(self._path(rel)) as fh:
                size = fh.size()
                return size, fh.read_at(min(size, footer_bytes), max(0, size - footer_bytes))
        except FileNotFoundError:
            raise DataError(f"{self.where(rel)}: missing") from None
        except OSError as exc:
            raise DataError(f"{self.where(rel)}: cannot read ({exc})") from None

    def listing(self, rel_dir: str) -> list[list]:
        """[relative path, size, mtime in ns] of every file under `rel_dir` (sorted; the decoded
        cache left by a local conversion excluded); DataError when there is none."""
        import pyarrow.fs as pafs

        fs, _ = self.filesystem()
        base = self._path(rel_dir)
        try:
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        except OSError as exc:
            raise DataError(f"{self.where(rel_dir)}: cannot list it ({exc})") from None
        out = []
        for info in infos:
            if info.type != pafs.FileType.File:
                continue
            rel = info.path[len(base):].lstrip("/")
            if rel.split("/")[0] in (CACHE_DIR, STAGED_MARK) or ".." in rel.split("/"):
                continue
            out.append([rel, int(info.size), int(info.mtime_ns or 0)])
        if not out:
            raise DataError(f"{self.where(rel_dir)}: no files there (upload the whole partitioned data set: "
                            "`widedp convert upload`)")
        return sorted(out)

    def stage(self, rel_dirs: list[str], stage_root=None, *, expected_manifest_sha256: Optional[str] = None,
              opener: Optional[Callable[[Path, str], Any]] = None) -> tuple[Path, list]:
        """Stage this data set's manifest and the directories `rel_dirs` into a local directory,
        each a copy of its files at the URI (downloaded when missing or when its listing changed);
        returns (that directory, `opener(directory, rel)` of each rel). Each directory is staged
        and opened under a lock of its own, so another process on the node never re-stages a
        directory while it is being opened (decoded); what is open is memory-mapped and outlives
        a later re-staging. The local directory is named by the URI (its options included) and
        the manifest's digest, so another data set at the same URI never shares one.
        `expected_manifest_sha256`: the manifest the run recorded; another one is refused.
        DataError naming the URI or the local directory."""
        from widedp.trainer.data.format.partitioned import MANIFEST_FILE

        manifest = self.read_bytes(MANIFEST_FILE, "missing (not a partitioned widedp data set)")
        digest = hashlib.sha256(manifest).hexdigest()
        if expected_manifest_sha256 is not None and digest != expected_manifest_sha256:
            raise DataError(f"{self.where(MANIFEST_FILE)}: not the manifest this run started with (sha256 "
                            f"{digest[:12]}…, the run's {expected_manifest_sha256[:12]}…): the data set at this URI "
                            "was replaced; a run trains on one data set")
        root = Path(stage_root) if stage_root else default_stage_root()
        local = root / hashlib.sha256(f"{self.uri}\n{digest}".encode()).hexdigest()[:24]
        try:
            local.mkdir(parents=True, exist_ok=True)
            with _locked(local / ".lock"):
                _replace_file(local / MANIFEST_FILE, manifest)
                _replace_file(local / STAGED_FROM, (json.dumps({"uri": self.uri, "partitions_sha256": digest})
                                                    + "\n").encode())
        except OSError as exc:
            raise DataError(f"{local}: cannot create the staging directory for {self.where('')} "
                            f"({exc.strerror or exc}); set data.stage_dir to a writable local directory") from None
        opened = []
        for rel in rel_dirs:
            with _locked(local / f".lock-{rel}"):
                self._stage_dir(rel, local)
                if opener is not None:
                    opened.append(opener(local, rel))
        return local, opened

    def _stage_dir(self, rel: str, local: Path) -> None:
        want = self.listing(rel)
        target = local / rel
        mark = target / STAGED_MARK
        for left in local.glob(f".{rel}.*.tmp"):  # a stager of this directory that died (we hold its lock)
            shutil.rmtree(left, ignore_errors=True)
        try:
            if json.loads(mark.read_text(encoding="utf-8")) == want:
                return  # staged, and the remote files are the ones staged
        except (OSError, ValueError):
            pass
        fs, _ = self.filesystem()
        tmp = local / f".{rel}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            for name, size, _ in want:
                dest = tmp / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                copied = _download(fs, f"{self._path(rel)}/{name}", dest, size)
                if copied != size:
                    raise DataError(f"{self.where(rel + '/' + name)}: read {copied} bytes, the listing says {size} "
                                    "(the object changed while it was staged: try again)")
            (tmp / STAGED_MARK).write_text(json.dumps(want), encoding="utf-8")
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        except OSError as exc:
            raise DataError(f"{self.where(rel)}: cannot stage it into {target} ({exc})") from None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def _download(fs, path: str, dest: Path, size: int) -> int:
    """Copy the object `path` (`size` bytes by its listing) to the local file `dest`: ranges of
    `RANGE_BYTES` read concurrently (`DOWNLOAD_THREADS` ranged reads: one stream of an object
    store is far slower than its bandwidth), each written at its offset. Returns the bytes read."""
    from concurrent.futures import ThreadPoolExecutor

    with fs.open_input_file(path) as src:
        if src.size() != size:
            return int(src.size())
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            def copy(offset: int) -> int:
                data = src.read_at(min(RANGE_BYTES, size - offset), offset)  # read_at: thread-safe
                os.pwrite(fd, data, offset)
                return len(data)

            offsets = range(0, size, RANGE_BYTES)
            if len(offsets) <= 1:
                return sum(copy(o) for o in offsets)
            with ThreadPoolExecutor(min(DOWNLOAD_THREADS, len(offsets))) as pool:
                return sum(pool.map(copy, offsets))
        finally:
            os.close(fd)


def _without_userinfo(parsed: urllib.parse.SplitResult) -> urllib.parse.SplitResult:
    host = parsed.hostname or ""
    return parsed._replace(netloc=host + (f":{parsed.port}" if parsed.port else ""))


def dataset_of(location: str) -> str:
    """The data set a recorded file location (`RemoteDir.where`, or a local path) is in: the
    location without its last path component, its options kept."""
    parsed = urllib.parse.urlsplit(location)
    if not parsed.scheme or len(parsed.scheme) == 1:  # a local path
        return location.rsplit("/", 1)[0]
    return urllib.parse.urlunsplit(parsed._replace(path=parsed.path.rsplit("/", 1)[0]))


def _replace_file(path: Path, data: bytes) -> None:
    try:
        if path.read_bytes() == data:
            return
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One stager of a staging directory at a time (processes on one node share it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def refuse_staged_copy(directory) -> None:
    """DataError when the local `directory` is a staging directory (`RemoteDir.stage`): a copy
    of a data set at a URI, which holds no budget of its own; train on the URI."""
    mark = local_path(directory) / STAGED_FROM
    if mark.is_file():
        try:
            source = json.loads(mark.read_text(encoding="utf-8")).get("uri", "?")
        except (OSError, ValueError, AttributeError):
            source = "?"
        raise DataError(f"{directory}: a staged copy of {source} (its parts, downloaded to this node), not a data set "
                        f"of its own: its spending is recorded at the URI; set data.path = {source}")


def remote_dir(path) -> Optional[RemoteDir]:
    """A `RemoteDir` when `path` is a remote URI, else None."""
    return RemoteDir(path) if is_uri(path) else None


def upload(source, uri: str) -> list[str]:
    """Copy the local partitioned data set `source` to `uri` (every file but the decoded caches
    and the lock), the manifest last, so a reader never sees a manifest whose parts are not all
    there; the budget copied under the source's budget lock (no line lands between its two
    files). Refused: a target prefix holding any object, a scheme whose budget widedp cannot
    write (s3:// only: conditional writes), a staged copy as the source. Checked after: the
    upload's identity (`partitioned_identity`) is the source's. On failure what was written is
    removed. Returns the relative paths copied."""
    from widedp.trainer.data.format.partitioned import MANIFEST_FILE, partitioned_identity, read_manifest

    source = local_path(source)
    refuse_staged_copy(source)
    read_manifest(source)  # a partitioned data set, or DataError naming its manifest
    want = partitioned_identity(source)  # every part there and readable
    target = RemoteDir(uri)
    if target.scheme not in ("s3", "s3a"):
        raise DataError(f"{target.where('')}: widedp keeps a data set's budget beside it, which needs conditional "
                        "writes; it writes them on s3:// (and S3-compatible servers) only")
    fs, root = target.filesystem()
    import pyarrow.fs as pafs

    try:
        there = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    except OSError as exc:
        raise DataError(f"{target.where('')}: cannot list it ({exc})") from None
    if any(info.type == pafs.FileType.File for info in there):
        raise DataError(f"{target.where('')}: objects are there already; a data set is uploaded to an empty prefix "
                        "only (never over another data set or its budget)")
    files = sorted(p for p in source.rglob("*") if p.is_file() and CACHE_DIR not in p.relative_to(source).parts
                   and p.name != "privacy_budget.lock")
    budget = [p for p in files if p.name.startswith("privacy_budget.")]  # head first (sorted), then the lines
    ordered = [p for p in files if p.name != MANIFEST_FILE and p not in budget] + budget + [source / MANIFEST_FILE]
    copied: list[str] = []
    try:
        with _locked(source / "privacy_budget.lock"):
            for path in ordered:
                rel = path.relative_to(source).as_posix()
                try:
                    fs.create_dir(f"{root}/{rel}".rsplit("/", 1)[0], recursive=True)
                    with open(path, "rb") as src, fs.open_output_stream(f"{root}/{rel}") as out:
                        while True:
                            chunk = src.read(_CHUNK)
                            if not chunk:
                                break
                            out.write(chunk)
                except OSError as exc:
                    raise DataError(f"{target.where(rel)}: cannot write it ({exc})") from None
                copied.append(rel)
        got = partitioned_identity(target.uri)
        if got != want:
            raise DataError(f"{target.where('')}: the upload's identity {got['partitions_sha256'][:12]}… is not the "
                            f"source's {want['partitions_sha256'][:12]}… (the source changed while it was copied?)")
    except BaseException:
        for rel in reversed(copied):  # the manifest first: nothing half-uploaded looks like a data set
            with contextlib.suppress(OSError):
                fs.delete_file(f"{root}/{rel}")
        raise
    return copied
