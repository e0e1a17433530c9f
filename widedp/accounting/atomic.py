"""Atomic file writes: a temp file in the target's directory, fsync, then rename. A reader
(or a crash) sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile


def atomic_write_bytes(path: str | os.PathLike, data: bytes | memoryview) -> None:
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
