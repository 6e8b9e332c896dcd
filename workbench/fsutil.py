"""Atomic file writes and hashing: nothing half-written ever sits under a final name."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


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
