"""Where a result came from: git state, package versions, host and accelerator facts, artifact
hashes. Written into run manifests, capture manifests and exports so a figure can be traced
back to the code, software and inputs that made it. Bottom of the import graph: stdlib + fsutil.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import socket
import subprocess
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from workbench.fsutil import sha256_file

PACKAGES = (
    "workbench", "torch", "transformers", "papermill", "nbconvert", "nbclient", "ipykernel",
    "plotly", "numpy", "safetensors", "accelerate", "sglang",
)  # fmt: skip


def _git(*args: str, cwd: Path) -> str | None:
    """git's stdout, or None where there is no git or no repository (an installed package)."""
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def git_facts(cwd: str | Path | None = None) -> dict[str, Any]:
    """{sha, dirty} of the checkout holding the workbench (None where not a git checkout)."""
    cwd = Path(cwd or Path(__file__).resolve().parents[1])
    sha = _git("rev-parse", "HEAD", cwd=cwd)
    status = _git("status", "--porcelain", "--untracked-files=no", cwd=cwd)
    return {
        "sha": sha.strip() if sha else None,
        "dirty": bool(status.strip()) if status is not None else None,
    }


@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, str | None]:
    """Python and the versions of the packages a result depends on (None: not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


@functools.lru_cache(maxsize=1)
def host_facts() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    }


@functools.lru_cache(maxsize=1)
def accelerator_facts() -> dict[str, Any]:
    """GPU names, torch's CUDA version, NCCL and driver versions when present.

    torch is imported only when installed. A broken CUDA install is recorded under `error`
    (the manifest says what went wrong) rather than stopping the report."""
    out: dict[str, Any] = {"cuda_available": False, "devices": []}
    if find_spec("torch") is not None:
        import torch

        out["torch_cuda"] = torch.version.cuda
        try:
            if torch.cuda.is_available():
                out["cuda_available"] = True
                out["devices"] = [
                    torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
                ]
                if torch.distributed.is_available() and torch.distributed.is_nccl_available():
                    v = torch.cuda.nccl.version()
                    out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except (RuntimeError, OSError, AssertionError) as e:  # a driver/runtime mismatch
            out["error"] = f"{type(e).__name__}: {e}"
    if smi := shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as e:
            out["driver_error"] = f"{type(e).__name__}: {e}"
        else:
            if r.returncode == 0 and r.stdout.strip():
                out["driver"] = r.stdout.strip().splitlines()[0]
            else:
                out["driver_error"] = (r.stderr or r.stdout).strip()[:300]
    return out


def artifact_hash(path: str | Path) -> dict[str, Any] | None:
    """Fingerprint an artifact: a file's sha256; a directory's manifest.json sha256 when it has
    one (captures and exports do), else a hash of its listing (names + sizes). None if absent.
    An existing but unreadable artifact raises OSError (callers name the parameter)."""
    p = Path(path)
    if p.is_file():
        return {"path": str(p), "kind": "file", "sha256": sha256_file(p)}
    if p.is_dir():
        m = p / "manifest.json"
        if m.is_file():
            return {"path": str(p), "kind": "dir-manifest", "sha256": sha256_file(m)}
        h = hashlib.sha256()
        for f in sorted(q for q in p.rglob("*") if q.is_file()):
            h.update(f"{f.relative_to(p)}\0{f.stat().st_size}\n".encode())
        return {"path": str(p), "kind": "dir-listing", "sha256": h.hexdigest()}
    return None


def code_hash(package_dir: str | Path | None = None) -> str:
    """sha256 over the workbench package's files (relative path + bytes, `__pycache__` left out):
    which code made a cached result, whether or not the package sits in a git checkout."""
    root = Path(package_dir) if package_dir else Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(q for q in root.rglob("*") if q.is_file() and "__pycache__" not in q.parts):
        h.update(f"{f.relative_to(root).as_posix()}\0{f.stat().st_size}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()
