"""Run one notebook with Papermill into `reports/<run-id>/`: the executed notebook (failing
cell included), its offline HTML, and its entry in the run manifest.

Layout of one run directory::

    reports/<run-id>/<stem>.ipynb   executed notebook (failing cell included)
    reports/<run-id>/<stem>.html    self-contained HTML
    reports/<run-id>/figures.json   {stem: {name: value}} written by `record()` in the kernel
    reports/<run-id>/run-manifest.json
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError
from workbench.provenance import artifact_hash
from workbench.report.errors import ReportError
from workbench.report.figures import NOTEBOOK_ENV, RUN_DIR_ENV, jsonable, read_figures
from workbench.report.html import banner, export_html, write_index
from workbench.report.manifest import MANIFEST, new_run_id, now, update_manifest
from workbench.report.params import literal, validate_parameters


class NotebookFailed(WorkbenchError):
    """A notebook raised; its executed .ipynb and HTML exist (`ipynb`, `html`)."""

    def __init__(self, message: str, *, notebook: str, run_dir: Path, ipynb: Path, html: Path | None,
                 cell_index: int | None = None, ename: str | None = None, evalue: str | None = None):  # fmt: skip
        super().__init__(message)
        self.notebook, self.run_dir, self.ipynb, self.html = notebook, run_dir, ipynb, html
        self.cell_index, self.ename, self.evalue = cell_index, ename, evalue


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    notebook: str  # stem
    ipynb: Path
    html: Path
    manifest: Path
    status: str  # ok | failed | skipped
    duration_s: float
    parameters: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)


def looks_like_path(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) < 4096 and "\n" not in value


def input_artifacts(parameters: dict[str, Any], exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """Hashes of parameters whose value names an existing file or directory. An existing input
    that cannot be read is a `ReportError` naming the parameter and the file."""
    out = {}
    for name, value in parameters.items():
        # os.path.exists: False for strings no filesystem could hold (prompts, 300-char names)
        if name in exclude or not looks_like_path(value) or not os.path.exists(value):
            continue
        try:
            h = artifact_hash(value)
        except OSError as e:
            raise ReportError(
                f"input {name}={value}: cannot read {e.filename or value}: {e.strerror}"
            ) from e
        if h is not None:
            out[name] = h
    return out


def notebook_hash(notebook: str | Path) -> str:
    """Hash of cell types + sources only: saving in JupyterLab (metadata, outputs) keeps it."""
    import nbformat

    nb = nbformat.read(str(notebook), as_version=4)
    h = hashlib.sha256()
    for c in nb.cells:
        h.update(f"{c.cell_type}\0{c.source}\0".encode())
    return h.hexdigest()


@contextlib.contextmanager
def _kernel_env(**env: str) -> Iterator[None]:
    """Environment for the kernel papermill spawns (it inherits os.environ)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _user_cell_index(executed: Path, papermill_index: int) -> int:
    """Papermill's cell index counts the injected-parameters and error cells; map it back to the
    index in the source notebook."""
    import nbformat

    cells = nbformat.read(str(executed), as_version=4).cells
    cells = [c for c in cells if "papermill-error-cell-tag" not in c.metadata.get("tags", [])]
    return sum(
        1
        for c in cells[:papermill_index]
        if "injected-parameters" not in c.metadata.get("tags", [])
    )


def _failure_message(stem: str, exc: Exception, executed: Path) -> tuple[str, int | None]:
    """'notebook X.ipynb failed in cell N (In [k]) `first line`: Ename: evalue' (one line)."""
    ename, evalue = getattr(exc, "ename", type(exc).__name__), getattr(exc, "evalue", str(exc))
    source, index = getattr(exc, "source", "") or "", getattr(exc, "cell_index", None)
    exec_count = getattr(exc, "exec_count", None)
    if index is not None and executed.is_file():
        index = _user_cell_index(executed, index)
    first = next((ln.strip() for ln in source.splitlines() if ln.strip()), "")
    where = f"cell {index} (In [{exec_count}]) `{first}`" if index is not None else "setup"
    evalue = (evalue or "").strip().splitlines()
    return f"notebook {stem}.ipynb failed in {where}: {ename}: {' '.join(evalue)[:500]}", index


def run_notebook(
    notebook: str | Path,
    parameters: dict[str, Any] | None = None,
    reports_dir: str | Path = "reports",
    run_id: str | None = None,
    kernel_name: str | None = None,
    *,
    progress_bar: bool = False,
    log_output: bool = False,
    update_index: bool = True,
    exclude_inputs: tuple[str, ...] = (),
    name: str | None = None,
    manifest_extra: dict[str, Any] | None = None,
) -> RunResult:
    """Execute `notebook` with papermill into `reports/<run-id>/<stem>.ipynb`, export the HTML
    next to it and merge an entry into `run-manifest.json`. Raises `UnknownParameters` or
    `ParameterError` before anything runs; raises `NotebookFailed` (after writing ipynb + HTML +
    manifest) on error. `name` (default: the notebook's stem) names the outputs, so one run can
    hold a notebook twice."""
    import papermill as pm

    notebook = Path(notebook)
    parameters = dict(parameters or {})
    declared = validate_parameters(notebook, parameters)
    seeds = {k: literal(v) for k, v in declared.items() if k.lower().startswith("seed")}
    seeds.update({k: v for k, v in parameters.items() if k.lower().startswith("seed")})
    inputs = input_artifacts(parameters, exclude_inputs)
    run_id = run_id or new_run_id()
    run_dir = Path(reports_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    stem = name or notebook.stem
    ipynb, html_path = run_dir / f"{stem}.ipynb", run_dir / f"{stem}.html"
    entry: dict[str, Any] = {
        "notebook": stem,
        "source": str(notebook),
        "source_sha256": notebook_hash(notebook),
        "parameters": jsonable(parameters),
        "notebook_defaults": declared,
        "seeds": jsonable(seeds),
        "inputs": inputs,
        "started": now(),
        "status": "running",
        "ipynb": ipynb.name,
        "html": html_path.name,
        **(manifest_extra or {}),
    }
    update_manifest(run_dir, entry)
    t0 = time.perf_counter()
    error: Exception | None = None
    env = {
        RUN_DIR_ENV: str(run_dir.resolve()),
        NOTEBOOK_ENV: stem,
        "PLOTLY_RENDERER": "plotly_mimetype",
        # transformers' and the hub's bars stay out of the report; ours go to the terminal
        # with a one-line summary in the notebook (workbench.progress)
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    try:
        with _kernel_env(**env):
            pm.execute_notebook(
                str(notebook), str(ipynb), parameters=parameters, kernel_name=kernel_name,
                progress_bar=progress_bar, log_output=log_output, report_mode=False,
            )  # fmt: skip
    except Exception as e:  # raised below as NotebookFailed, after the HTML and the manifest
        error = e
    duration = time.perf_counter() - t0
    status = "failed" if error else "ok"
    html_out: Path | None = None
    export_error: Exception | None = None
    if ipynb.exists():
        try:
            html_out = export_html(ipynb, html_path, banner=banner(run_id, stem, status))
        except Exception as e:  # recorded and raised below, after the notebook's own error
            export_error, status = e, "failed"
    figures = read_figures(run_dir).get(stem, {})
    entry.update(status=status, duration_s=round(duration, 3), finished=now(), figures=figures)
    message, cell_index = None, None
    if error is not None:
        message, cell_index = _failure_message(stem, error, ipynb)
    if export_error is not None:
        also = f"{message}; " if message else ""
        message = (
            f"{also}HTML export of {ipynb} failed: {type(export_error).__name__}: {export_error}"
        )
    if message:
        entry["error"] = message
    update_manifest(run_dir, entry)
    if update_index:
        write_index(reports_dir)
    if error is None and export_error is not None:
        raise export_error  # a bug in the export, with its traceback (the manifest says failed)
    if error is not None:
        raise NotebookFailed(
            message, notebook=stem, run_dir=run_dir, ipynb=ipynb, html=html_out,
            cell_index=cell_index, ename=getattr(error, "ename", type(error).__name__),
            evalue=getattr(error, "evalue", str(error)),
        ) from error  # fmt: skip
    return RunResult(run_id, run_dir, stem, ipynb, html_path, run_dir / MANIFEST, status,
                     round(duration, 3), parameters, figures)  # fmt: skip
