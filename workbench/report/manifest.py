"""The run manifest (`reports/<run-id>/run-manifest.json`): what ran, with which parameters,
inputs, code and software, and what it recorded. Read by the index and the comparison."""

from __future__ import annotations

import datetime as _dt
import secrets
import time
from pathlib import Path
from typing import Any

from workbench.fsutil import atomic_write_json
from workbench.provenance import accelerator_facts, git_facts, host_facts, package_versions
from workbench.report.errors import ReportError, read_json_file

MANIFEST = "run-manifest.json"
MANIFEST_VERSION = 1


def new_run_id() -> str:
    """`20261129-181502-a3f9`: sortable by time, unique enough for concurrent runs."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def read_manifest(path: Path) -> dict[str, Any] | None:
    """A run manifest, None when absent; corrupt is a `ReportError` naming the file."""
    m = read_json_file(path, "run manifest", None)
    if m is not None and not (isinstance(m, dict) and isinstance(m.get("notebooks"), list)):
        raise ReportError(
            f"run manifest {path} is not a manifest (no 'notebooks' list); fix or remove it"
        )
    return m


def update_manifest(run_dir: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """Insert/replace this notebook's entry and refresh run-level status and figures."""
    path = run_dir / MANIFEST
    m = read_manifest(path) or {
        "manifest_version": MANIFEST_VERSION,
        "run_id": run_dir.name,
        "created": now(),
        "git": git_facts(),
        "packages": package_versions(),
        "host": host_facts(),
        "accelerator": accelerator_facts(),
        "notebooks": [],
    }
    nbs = [e for e in m["notebooks"] if e["notebook"] != entry["notebook"]] + [entry]
    m["notebooks"] = nbs
    m["updated"] = now()
    states = [e["status"] for e in nbs]
    m["status"] = "failed" if "failed" in states else "running" if "running" in states else "ok"
    m["figures"] = {k: v for e in nbs for k, v in (e.get("figures") or {}).items()}
    m["duration_s"] = round(sum(e.get("duration_s") or 0 for e in nbs), 3)
    atomic_write_json(path, m, sort_keys=False)
    return m


def list_runs(reports_dir: str | Path = "reports") -> list[dict[str, Any]]:
    """Manifests of every run directory, newest first."""
    runs = []
    for p in Path(reports_dir).glob(f"*/{MANIFEST}"):
        if (m := read_manifest(p)) is None:
            continue  # removed since the glob
        m.setdefault("run_id", p.parent.name)
        runs.append(m)
    return sorted(runs, key=lambda m: m["run_id"], reverse=True)
