"""Training run folders and checkpoints: claiming a folder (refuse a rerun over an existing
run; --force moves it aside), atomic step folders, a `latest` pointer, RNG state, resume checks.

Layout: `RUN/checkpoints/step-NNNNNNNN/{state.pt, draft_config.json}` and `RUN/checkpoints/
latest` (the folder name). `state.pt` holds tensors and plain data only (weights, optimizer,
scheduler, data position, RNG, metrics so far) and is read with `weights_only=True`: a file
that needs any other Python object to unpickle is refused, so no checkpoint can run code.
A step folder is built under `.tmp-step-*` and renamed into place; a failed write leaves no
temp folder, and a resumed run sweeps any a killed one left behind.
"""

from __future__ import annotations

import datetime as _dt
import errno
import io
import json
import os
import pickle
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.draft.errors import TrainError
from workbench.errors import DiskFullError
from workbench.fsutil import LOCK_FILE, atomic_write_bytes, atomic_write_json, atomic_write_text

STATE_FILE = "state.pt"
CHECKPOINTS = "checkpoints"
TMP_PREFIX = ".tmp-step-"
# The config keys a resumed run must share with its checkpoint (they shape data and schedule).
RESUME_KEYS = ("ttt_len", "batch_size", "seed", "max_len", "val_fraction", "val_max_samples",
               "lr", "epochs", "max_steps", "warmup", "min_lr_ratio", "loss_decay",
               "ttt_sample", "loss_on", "bucket_batches", "pack_rows")  # fmt: skip
# what a checkpoint that predates a key ran with (not today's default: that may have changed)
RESUME_PAST = {"bucket_batches": 16, "pack_rows": 0}


# ---------------------------------------------------------------- RNG


def rng_state() -> dict:
    """Every RNG the loop draws from, as tensors and plain values (loadable without pickle)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    st = {
        "torch": torch.get_rng_state(),
        "numpy": [
            str(name),
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(gauss),
        ],  # fmt: skip
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    name, keys, pos, has_gauss, gauss = st["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), int(pos), int(has_gauss), float(gauss)))
    py = st["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


# ---------------------------------------------------------------- the run folder


def _is_empty(out: Path) -> bool:
    return not out.exists() or all(p.name == LOCK_FILE for p in out.iterdir())


def claim_run_dir(out: Path, *, resume: bool, force: bool) -> Path | None:
    """Refuse to start afresh over an existing run (or a folder of other files); with --force,
    move it aside to `out.old-<time>` and return where it went (None: nothing moved).

    Call with the folder's lock held (the lock file moves aside with the old run: lock the new
    folder again)."""
    if _is_empty(out) or (resume and (out / "train_config.json").is_file()):
        return None
    is_run = (out / "train_config.json").is_file()
    what = "a training run" if is_run else "files that are not a training run"
    if resume and not is_run:
        raise TrainError(f"{out} holds {what} (no train_config.json): choose another --out")
    if not force:
        raise TrainError(
            f"{out} already holds {what}: pass --resume to continue a run, or --force to "
            "move the folder aside and start afresh"
        )
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    aside, n = out.with_name(f"{out.name}.old-{stamp}"), 1
    while aside.exists():
        n += 1
        aside = out.with_name(f"{out.name}.old-{stamp}-{n}")
    os.replace(out, aside)
    out.mkdir()
    print(f"moved the previous contents of {out} aside to {aside}", file=sys.stderr)
    return aside


def append_jsonl(log: Path, rec: dict) -> None:
    """Append one record; a full disk is named as such."""
    try:
        with open(log, "a") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(
                f"disk full while writing {log}: free space and rerun with --resume"
            ) from e
        raise


# ---------------------------------------------------------------- write


def save_checkpoint(out: Path, step: int, state: dict, keep: int) -> Path:
    """Write checkpoints/step-N/ via a temp dir + rename, then repoint `latest` atomically.

    Keeps the newest `keep` (>= 1) step folders. A full disk raises `DiskFullError` and
    leaves no temp folder behind."""
    if keep < 1:
        raise TrainError(f"keep_ckpts must be >= 1 (the latest checkpoint is kept), got {keep}")
    root = Path(out) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f"{TMP_PREFIX}{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        buf = io.BytesIO()
        torch.save(state, buf)  # in memory first: torch's own writer reports ENOSPC obscurely
        atomic_write_bytes(tmp / STATE_FILE, buf.getvalue())
        atomic_write_json(tmp / "draft_config.json", state["draft_config"])
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(root / "latest", final.name + "\n")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(
                f"disk full while writing checkpoint {final}: free space and rerun with --resume"
            ) from e
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    for p in done[: max(0, len(done) - keep)]:
        shutil.rmtree(p)
    return final


def clean_tmp(out: str | os.PathLike) -> list[Path]:
    """Remove half-written step folders a killed or failed run left (returns what went)."""
    root = Path(out) / CHECKPOINTS
    gone = sorted(root.glob(TMP_PREFIX + "*")) if root.is_dir() else []
    for p in gone:
        shutil.rmtree(p)
    return gone


# ---------------------------------------------------------------- read


def latest_checkpoint(out: str | os.PathLike) -> Path | None:
    p = Path(out) / CHECKPOINTS / "latest"
    if not p.is_file():
        return None
    d = p.parent / p.read_text().strip()
    return d if (d / STATE_FILE).is_file() else None


def resolve_checkpoint(path: str | os.PathLike) -> Path | None:
    """A checkpoint folder itself, or a run folder's latest one (None: neither)."""
    p = Path(path)
    return p if (p / STATE_FILE).is_file() else latest_checkpoint(p)


def _legacy_numpy_globals() -> list:
    """Checkpoints written before the no-pickle format hold numpy's RNG state as an ndarray;
    these globals rebuild a plain array and nothing else."""
    core = getattr(np, "_core", None) or np.core
    out = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    out += [getattr(np.dtypes, n) for n in ("UInt32DType", "Int64DType") if hasattr(np, "dtypes")]
    return out


def read_state(ckpt: str | os.PathLike, mmap: bool = False) -> dict[str, Any]:
    """`state.pt` of a checkpoint folder, without pickle: anything but tensors and plain data
    is refused with a `TrainError` before a single object of it is built."""
    path = Path(ckpt) / STATE_FILE
    try:
        with torch.serialization.safe_globals(_legacy_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise TrainError(
            f"{path}: refusing to load: it needs Python objects beyond tensors and plain data "
            f"(loading it could run code). Only load checkpoints you wrote. ({str(e)[:200]})"
        ) from None


def check_resume(
    state: dict, cfg: dict, capture_hash: str, target_fingerprint: str, defaults: dict
) -> None:
    """Refuse to resume a checkpoint whose capture, target or data/schedule config differ.

    `defaults` give the value of keys an older checkpoint did not record."""
    problems = []
    if state["capture_hash"] != capture_hash:
        problems.append(f"capture hash: checkpoint {state['capture_hash']}, now {capture_hash}")
    if state["target_fingerprint"] != target_fingerprint:
        problems.append(
            f"target fingerprint: checkpoint {state['target_fingerprint']}, now {target_fingerprint}"
        )
    old = state["config"]
    for k in RESUME_KEYS:
        was = old.get(k, defaults.get(k))
        if isinstance(was, list):
            was = tuple(was)
        now = cfg.get(k)
        if was != now:
            problems.append(f"{k}: checkpoint {was!r}, now {now!r}")
    if problems:
        raise TrainError(
            "cannot resume: the run differs from the checkpoint:\n  "
            + "\n  ".join(problems)
            + "\nStart afresh with --force (the old run is moved aside) or another --out; "
            "under `workbench pipeline` (an edited preset), move the profile's draft folder aside"
        )
