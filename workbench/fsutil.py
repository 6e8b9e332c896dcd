"""Atomic file writes and hashing: nothing half-written ever sits under a final name."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workbench.errors import DiskFullError, InUseError

LOCK_FILE = ".workbench.lock"


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"disk full while writing {path}: free space and rerun") from e
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, sort_keys: bool = True) -> None:
    """Indented JSON; values JSON cannot hold (paths, dates) are written as strings."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys, default=str) + "\n")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def claim_dir(args_file: str | os.PathLike, args: dict) -> str | None:
    """Record the arguments a resumable job started a directory with.

    Returns None when the directory is new (the arguments are written) or was started with
    the same arguments; otherwise the differences, one `  key: was X, now Y` line each, for
    the caller's refusal message.
    """
    args_file = Path(args_file)
    if not args_file.exists():
        atomic_write_json(args_file, args)
        return None
    old = json.loads(args_file.read_text())
    new = json.loads(json.dumps(args, default=str))
    if old == new:
        return None
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return "\n".join(f"  {k}: was {old.get(k)!r}, now {new.get(k)!r}" for k in diff)


@contextlib.contextmanager
def locked_dir(directory: str | os.PathLike, what: str = "run folder") -> Iterator[Path]:
    """Hold an exclusive `fcntl` lock on `directory/.workbench.lock` for the block.

    A second writer (another process, or this one twice) gets `InUseError` naming the pid
    that holds it. The kernel drops the lock when the holder dies, so a kill -9 never leaves
    a stale lock behind; the file itself stays (harmless)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise InUseError(
                f"{what} {d} is in use by pid {holder}; wait for it to finish or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield d
    finally:
        os.close(fd)  # closing releases the lock


def workbench_home() -> Path:
    """Cache root: `$WORKBENCH_HOME`, else the user's cache dir."""
    env = os.environ.get("WORKBENCH_HOME")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("workbench"))
