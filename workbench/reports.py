"""Reproducible reports: papermill runs into `reports/<run-id>/`, self-contained HTML (plotly.js
inlined once, no CDN: reports are opened offline and mailed around), a run manifest, key figures
recorded from inside notebooks, a stage cache for pipelines, the index and run comparison.

Layout of one run directory::

    reports/<run-id>/<stem>.ipynb   executed notebook (failing cell included)
    reports/<run-id>/<stem>.html    self-contained HTML
    reports/<run-id>/figures.json   {stem: {name: value}} written by `record()` in the kernel
    reports/<run-id>/run-manifest.json
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import html
import json
import os
import platform
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workbench.fsutil import atomic_write_json, atomic_write_text, sha256_file

RUN_DIR_ENV = "WORKBENCH_RUN_DIR"  # set by the runner for the kernel; `record()` writes there
NOTEBOOK_ENV = "WORKBENCH_NOTEBOOK"
MANIFEST = "run-manifest.json"
FIGURES = "figures.json"
STAGE_CACHE = ".stages.json"
MANIFEST_VERSION = 1
# Shown as index columns when any run has them; every other recorded figure is listed too.
KEY_FIGURES = ("tau", "speedup", "best_config", "step0_acc")
PACKAGES = (
    "workbench", "torch", "transformers", "papermill", "nbconvert", "nbclient", "ipykernel",
    "plotly", "numpy", "safetensors", "accelerate", "sglang",
)  # fmt: skip

# Interactive fallback of `record()` (JupyterLab, no runner): figures stay in this dict.
RECORDED: dict[str, Any] = {}


# ---------------------------------------------------------------------------------------------
# Inside notebooks


def _jsonable(value: Any) -> Any:
    """numpy/torch scalars and arrays, paths, tuples -> plain JSON values."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # numpy / torch
        return _jsonable(value.tolist())
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return str(value)


def record(name: str, value: Any) -> Any:
    """Record a key figure (tau, speedup, best_config, ...) machine-readably; returns `value`.

    Under the runner it merges into `<run dir>/figures.json` under the notebook's stem; run
    interactively (no runner) it only keeps the value in `RECORDED`, so notebooks run as-is."""
    value = _jsonable(value)
    RECORDED[name] = value
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        path = Path(run_dir) / FIGURES
        data = _read_json(path, {})
        data.setdefault(os.environ.get(NOTEBOOK_ENV, "notebook"), {})[name] = value
        atomic_write_json(path, data, sort_keys=False)
    return value


# ---------------------------------------------------------------------------------------------
# Small utilities


def _read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def new_run_id() -> str:
    """`20261129-181502-a3f9`: sortable by time, unique enough for concurrent runs."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def parse_value(text: str) -> Any:
    """A CLI parameter value, like papermill's -p: int, float, bool/null/list (YAML), else str."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (bool, list, dict)) or value is None else text


def load_parameters(
    files: list[str | Path] | None = None, pairs: list[tuple[str, str]] | None = None
) -> dict[str, Any]:
    """Merge YAML parameter files then `-p NAME VALUE` pairs (later wins)."""
    import yaml

    params: dict[str, Any] = {}
    for f in files or []:
        data = yaml.safe_load(Path(f).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(
                f"{f}: a parameters file must hold a mapping, got {type(data).__name__}"
            )
        params.update(data)
    for name, value in pairs or []:
        params[name] = parse_value(value)
    return params


def _looks_like_path(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) < 4096 and "\n" not in value


def artifact_hash(path: str | Path) -> dict[str, Any] | None:
    """Fingerprint an input artifact: a file's sha256; a directory's manifest.json sha256 when it
    has one (captures and exports do), else a hash of its listing (names + sizes)."""
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


def input_artifacts(parameters: dict[str, Any], exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """Hashes of parameters whose value names an existing file or directory."""
    out = {}
    for name, value in parameters.items():
        if name in exclude or not _looks_like_path(value):
            continue
        with contextlib.suppress(OSError):
            if (h := artifact_hash(value)) is not None:
                out[name] = h
    return out


# ---------------------------------------------------------------------------------------------
# Environment facts for the manifest


def _git(*args: str, cwd: Path) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def git_facts(cwd: str | Path | None = None) -> dict[str, Any]:
    cwd = Path(cwd or Path(__file__).resolve().parents[1])
    sha = _git("rev-parse", "HEAD", cwd=cwd)
    status = _git("status", "--porcelain", "--untracked-files=no", cwd=cwd)
    return {
        "sha": sha.strip() if sha else None,
        "dirty": bool(status.strip()) if status is not None else None,
    }


@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


@functools.lru_cache(maxsize=1)
def host_facts() -> dict[str, Any]:
    mem = None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": mem,
    }


@functools.lru_cache(maxsize=1)
def accelerator_facts() -> dict[str, Any]:
    """GPU names, CUDA/driver/NCCL versions when present; importing torch only if installed."""
    out: dict[str, Any] = {"cuda_available": False, "devices": []}
    from importlib.util import find_spec

    if find_spec("torch") is None:
        return out
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["cuda_available"] = True
            out["devices"] = [
                torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
            ]
            with contextlib.suppress(Exception):
                v = torch.cuda.nccl.version()
                out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # a broken CUDA install must not stop a report
        out["error"] = repr(e)
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            r = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            )  # fmt: skip
            if r.returncode == 0 and r.stdout.strip():
                out["driver"] = r.stdout.strip().splitlines()[0]
    return out


# ---------------------------------------------------------------------------------------------
# Running one notebook


class UnknownParameters(ValueError):
    """Parameter names the notebook's `parameters` cell does not define (refused before running)."""


class NotebookFailed(RuntimeError):
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


def notebook_parameters(notebook: str | Path) -> dict[str, Any]:
    """The names (and defaults, as source text) defined in the notebook's tagged parameters cell."""
    import papermill as pm

    return {name: p.get("default") for name, p in pm.inspect_notebook(str(notebook)).items()}


def validate_parameters(notebook: str | Path, parameters: dict[str, Any]) -> dict[str, Any]:
    """Refuse names the notebook does not declare, listing the ones it does; returns them."""
    declared = notebook_parameters(notebook)
    unknown = sorted(set(parameters) - set(declared))
    if unknown:
        listing = (
            ", ".join(f"{k}={v}" for k, v in declared.items()) or "(no tagged parameters cell)"
        )
        raise UnknownParameters(
            f"{Path(notebook).name}: unknown parameter(s) {', '.join(unknown)}; "
            f"the notebook's parameters are: {listing}"
        )
    return declared


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


def _notebook_hash(notebook: str | Path) -> str:
    """Hash of cell types + sources only: saving in JupyterLab (metadata, outputs) keeps it."""
    import nbformat

    nb = nbformat.read(str(notebook), as_version=4)
    h = hashlib.sha256()
    for c in nb.cells:
        h.update(f"{c.cell_type}\0{c.source}\0".encode())
    return h.hexdigest()


# CDN scripts in renderer output: <script src="https://..."> and <script type="module">import "https://..."
_EXTERNAL_SCRIPT = re.compile(
    r"<script[^>]*\ssrc=[\"']?(?:https?:)?//[^>]*>\s*</script>"
    r"|<script[^>]*>\s*import\s+[\"'](?:https?:)?//[^\"']*[\"'];?\s*</script>",
    re.I,
)


def _text(value: str | list[str]) -> str:
    return "".join(value) if isinstance(value, list) else value


def _is_plotlyjs_bundle(output: dict) -> bool:
    """A `notebook` renderer output that injects plotly.js itself (we inline it once instead)."""
    text = _text(output.get("data", {}).get("text/html", ""))
    return "plotly.js v" in text and ("define('plotly'" in text or len(text) > 1_000_000)


def export_html(ipynb: str | Path, html_path: str | Path, banner: str = "") -> Path:
    """Self-contained HTML: lab template without require.js/MathJax/mermaid/widget CDN scripts,
    plotly outputs turned into divs, and plotly.js inlined once in <head> when any plot exists."""
    import nbformat
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    from workbench.plots import PLOTLY_MIMETYPE, figure_html, plotlyjs_script

    nb = nbformat.read(str(ipynb), as_version=4)
    n_plots = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.get("outputs", []):
            if _is_plotlyjs_bundle(out):
                continue
            data = out.get("data", {})
            if PLOTLY_MIMETYPE in data:
                data["text/html"] = figure_html(dict(data[PLOTLY_MIMETYPE]))
                for k in [k for k in data if k not in ("text/html", "text/plain")]:
                    del data[k]
                n_plots += 1
            elif "plotly" in (h := _text(data.get("text/html", ""))):
                # html from a `notebook*` renderer: keep the figure, drop its CDN scripts
                data["text/html"] = _EXTERNAL_SCRIPT.sub("", h)
                n_plots += h.count('class="plotly-graph-div"')
            kept.append(out)
        cell.outputs = kept
    template = """{%- extends 'lab/index.html.j2' -%}
{% block html_head_js_requirejs %}{% endblock %}
{% block html_head_js_mathjax %}{% endblock %}
{% block html_head_js_mermaidjs %}{% endblock %}
{% block jupyter_widgets %}{% endblock %}
{% block html_head_css %}{{ resources.wb_head | default('') }}{% endblock %}
"""
    exporter = HTMLExporter(extra_loaders=[DictLoader({"wb_offline.html.j2": template})])
    exporter.template_file = "wb_offline.html.j2"
    resources = {"wb_head": plotlyjs_script() if n_plots else ""}
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    if banner:
        body = body.replace("<main>", f"<main>\n{banner}", 1)
    html_path = Path(html_path)
    atomic_write_text(html_path, body)
    return html_path


def _failure_message(stem: str, exc: Exception, executed: Path) -> tuple[str, int | None]:
    """'notebook X.ipynb failed in cell N (In [k]) `first line`: Ename: evalue' (one line)."""
    ename, evalue = getattr(exc, "ename", type(exc).__name__), getattr(exc, "evalue", str(exc))
    source, index = getattr(exc, "source", "") or "", getattr(exc, "cell_index", None)
    exec_count = getattr(exc, "exec_count", None)
    if index is not None:  # papermill's index counts the injected-parameters cell; map it back
        with contextlib.suppress(Exception):
            import nbformat

            cells = nbformat.read(str(executed), as_version=4).cells
            cells = [
                c for c in cells if "papermill-error-cell-tag" not in c.metadata.get("tags", [])
            ]
            index = sum(
                1 for c in cells[:index] if "injected-parameters" not in c.metadata.get("tags", [])
            )
    first = next((ln.strip() for ln in source.splitlines() if ln.strip()), "")
    where = f"cell {index} (In [{exec_count}]) `{first}`" if index is not None else "setup"
    evalue = (evalue or "").strip().splitlines()
    return f"notebook {stem}.ipynb failed in {where}: {ename}: {' '.join(evalue)[:500]}", index


def _banner(run_id: str, stem: str, status: str) -> str:
    color = {"ok": "#1a7f37", "failed": "#cf222e"}.get(status, "#666")
    return (
        '<div style="font:13px sans-serif;padding:6px 12px;border-bottom:1px solid #ddd">'
        f'<a href="../index.html">&larr; all runs</a> &middot; run <b>{html.escape(run_id)}</b>'
        f' &middot; {html.escape(stem)} &middot; <span style="color:{color}">{status}</span></div>'
    )


def _update_manifest(run_dir: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """Insert/replace this notebook's entry and refresh run-level status and figures."""
    path = run_dir / MANIFEST
    m = _read_json(path, None) or {
        "manifest_version": MANIFEST_VERSION,
        "run_id": run_dir.name,
        "created": _now(),
        "git": git_facts(),
        "packages": package_versions(),
        "host": host_facts(),
        "accelerator": accelerator_facts(),
        "notebooks": [],
    }
    nbs = [e for e in m["notebooks"] if e["notebook"] != entry["notebook"]] + [entry]
    m["notebooks"] = nbs
    m["updated"] = _now()
    states = [e["status"] for e in nbs]
    m["status"] = "failed" if "failed" in states else "running" if "running" in states else "ok"
    m["figures"] = {k: v for e in nbs for k, v in (e.get("figures") or {}).items()}
    m["duration_s"] = round(sum(e.get("duration_s") or 0 for e in nbs), 3)
    atomic_write_json(path, m, sort_keys=False)
    return m


def _literal(source: Any) -> Any:
    """A parameters-cell default (source text) as a value when it is a plain literal."""
    import ast

    try:
        return ast.literal_eval(source)
    except (ValueError, SyntaxError, TypeError):
        return source


def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


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
    next to it and merge an entry into `run-manifest.json`. Raises `UnknownParameters` before
    anything runs; raises `NotebookFailed` (after writing ipynb + HTML + manifest) on error.
    `name` (default: the notebook's stem) names the outputs, so one run can hold a notebook twice."""
    import papermill as pm

    notebook = Path(notebook)
    parameters = dict(parameters or {})
    declared = validate_parameters(notebook, parameters)
    seeds = {k: _literal(v) for k, v in declared.items() if k.lower().startswith("seed")}
    seeds.update({k: v for k, v in parameters.items() if k.lower().startswith("seed")})
    run_id = run_id or new_run_id()
    run_dir = Path(reports_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    stem = name or notebook.stem
    ipynb, html_path = run_dir / f"{stem}.ipynb", run_dir / f"{stem}.html"
    entry: dict[str, Any] = {
        "notebook": stem,
        "source": str(notebook),
        "source_sha256": _notebook_hash(notebook),
        "parameters": _jsonable(parameters),
        "notebook_defaults": declared,
        "seeds": _jsonable(seeds),
        "inputs": input_artifacts(parameters, exclude_inputs),
        "started": _now(),
        "status": "running",
        "ipynb": ipynb.name,
        "html": html_path.name,
        **(manifest_extra or {}),
    }
    _update_manifest(run_dir, entry)
    t0 = time.perf_counter()
    error: Exception | None = None
    env = {
        RUN_DIR_ENV: str(run_dir.resolve()),
        NOTEBOOK_ENV: stem,
        "PLOTLY_RENDERER": "plotly_mimetype",
    }
    try:
        with _kernel_env(**env):
            pm.execute_notebook(
                str(notebook), str(ipynb), parameters=parameters, kernel_name=kernel_name,
                progress_bar=progress_bar, log_output=log_output, report_mode=False,
            )  # fmt: skip
    except Exception as e:  # papermill wrote the executed notebook with the error cell
        error = e
    duration = time.perf_counter() - t0
    status = "failed" if error else "ok"
    html_out: Path | None = None
    if ipynb.exists():
        try:
            html_out = export_html(ipynb, html_path, banner=_banner(run_id, stem, status))
        except Exception as e:  # an export bug must not hide the notebook's own error
            error = error or e
            status = "failed"
    figures = _read_json(run_dir / FIGURES, {}).get(stem, {})
    entry.update(status=status, duration_s=round(duration, 3), finished=_now(), figures=figures)
    message, cell_index = (None, None)
    if error is not None:
        message, cell_index = _failure_message(stem, error, ipynb)
        entry["error"] = message
    _update_manifest(run_dir, entry)
    if update_index:
        write_index(reports_dir)
    if error is not None:
        raise NotebookFailed(
            message, notebook=stem, run_dir=run_dir, ipynb=ipynb, html=html_out,
            cell_index=cell_index, ename=getattr(error, "ename", type(error).__name__),
            evalue=getattr(error, "evalue", str(error)),
        ) from error  # fmt: skip
    return RunResult(run_id, run_dir, stem, ipynb, html_path, run_dir / MANIFEST, status,
                     round(duration, 3), parameters, figures)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Pipelines: several notebooks in one run, outputs passed on, unchanged stages skipped

_REF = re.compile(r"\$\{([A-Za-z0-9_\-]+)\.([A-Za-z0-9_\-]+)\}")


@dataclass
class Stage:
    """One pipeline step. Parameter values may reference earlier stages as `${stage.name}`:
    the stage's recorded figure `name` if it recorded one, else its parameter `name` (a whole-
    string reference keeps the value's type). `outputs` names parameters this stage writes
    (paths): they are not hashed as inputs, and a skip requires them to still exist."""

    notebook: str | Path
    parameters: dict[str, Any] = field(default_factory=dict)
    name: str | None = None
    outputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.name = self.name or Path(self.notebook).stem
        self.outputs = tuple(self.outputs)


def resolve_references(
    parameters: dict[str, Any], done: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Substitute `${stage.name}` references from finished stages (recorded figures first)."""

    def lookup(stage: str, name: str) -> Any:
        if stage not in done:
            raise KeyError(f"reference ${{{stage}.{name}}}: no earlier stage named {stage!r}")
        figs, params = done[stage]["figures"], done[stage]["parameters"]
        if name in figs:
            return figs[name]
        if name in params:
            return params[name]
        have = sorted(set(figs) | set(params))
        raise KeyError(
            f"reference ${{{stage}.{name}}}: stage {stage!r} has no {name!r} (has {have})"
        )

    def sub(value: Any) -> Any:
        if isinstance(value, str):
            if m := _REF.fullmatch(value):
                return lookup(*m.groups())
            return _REF.sub(lambda m: str(lookup(*m.groups())), value)
        if isinstance(value, list):
            return [sub(v) for v in value]
        if isinstance(value, dict):
            return {k: sub(v) for k, v in value.items()}
        return value

    return {k: sub(v) for k, v in parameters.items()}


def stage_key(stage: Stage, parameters: dict[str, Any]) -> str:
    """What decides a skip: notebook content + resolved parameters + input artifact hashes."""
    doc = {
        "notebook": _notebook_hash(stage.notebook),
        "parameters": _jsonable(parameters),
        "inputs": {k: v["sha256"] for k, v in input_artifacts(parameters, stage.outputs).items()},
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def run_pipeline(
    stages: list[Stage],
    reports_dir: str | Path = "reports",
    run_id: str | None = None,
    force: bool = False,
    kernel_name: str | None = None,
    log: Callable[[str], None] = lambda s: print(s, flush=True),
    **run_kwargs: Any,
) -> list[RunResult]:
    """Run stages in order into one run directory; a stage whose key matches its last successful
    run (cache in `reports/.stages.json`) is skipped, and says so, unless `force`."""
    reports_dir = Path(reports_dir)
    run_id = run_id or new_run_id()
    run_dir = reports_dir / run_id
    cache_path = reports_dir / STAGE_CACHE
    done: dict[str, dict[str, Any]] = {}
    results: list[RunResult] = []
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"stage names must be unique: {names}")
    for i, stage in enumerate(stages, 1):
        assert stage.name is not None
        params = resolve_references(stage.parameters, done)
        validate_parameters(stage.notebook, params)
        key = stage_key(stage, params)
        cache = _read_json(cache_path, {})
        hit = cache.get(stage.name, {}).get(key)
        if hit and not (reports_dir / hit["run_id"]).is_dir():
            hit = None  # its report is gone: rerun rather than link to nothing
        outputs_exist = all(
            Path(params[o]).exists() for o in stage.outputs if _looks_like_path(params.get(o))
        )
        prefix = f"[{i}/{len(stages)}] {stage.name}"
        if hit and outputs_exist and not force:
            log(
                f"{prefix}: skipped, inputs unchanged since run {hit['run_id']} (use force to rerun)"
            )
            stem = stage.name
            prev = Path("..") / hit["run_id"]
            entry = {
                "notebook": stem, "source": str(stage.notebook), "stage": stage.name,
                "status": "skipped", "reused_from": hit["run_id"], "parameters": _jsonable(params),
                "figures": hit.get("figures", {}), "duration_s": 0.0, "stage_key": key,
                "ipynb": str(prev / f"{stem}.ipynb"), "html": str(prev / f"{stem}.html"),
            }  # fmt: skip
            run_dir.mkdir(parents=True, exist_ok=True)
            _update_manifest(run_dir, entry)
            res = RunResult(run_id, run_dir, stem, reports_dir / hit["run_id"] / f"{stem}.ipynb",
                            reports_dir / hit["run_id"] / f"{stem}.html", run_dir / MANIFEST,
                            "skipped", 0.0, params, entry["figures"])  # fmt: skip
        else:
            why = "forced" if hit and force else "running"
            log(f"{prefix}: {why} {stage.notebook}")
            try:
                res = run_notebook(
                    stage.notebook, params, reports_dir, run_id, kernel_name,
                    exclude_inputs=stage.outputs, name=stage.name,
                    manifest_extra={"stage": stage.name, "stage_key": key}, **run_kwargs,
                )  # fmt: skip
            except NotebookFailed as e:
                log(f"{prefix}: FAILED: {e}")
                raise
            cache = _read_json(cache_path, {})
            cache.setdefault(stage.name, {})[key] = {
                "run_id": run_id, "finished": _now(), "figures": res.figures,
                "duration_s": res.duration_s,
            }  # fmt: skip
            atomic_write_json(cache_path, cache, sort_keys=False)
            log(f"{prefix}: ok in {res.duration_s:.1f}s -> {res.html}")
        done[stage.name] = {"figures": res.figures, "parameters": params}
        results.append(res)
    write_index(reports_dir)
    return results


# ---------------------------------------------------------------------------------------------
# Index and comparison


def list_runs(reports_dir: str | Path = "reports") -> list[dict[str, Any]]:
    """Manifests of every run directory, newest first."""
    runs = []
    for p in Path(reports_dir).glob(f"*/{MANIFEST}"):
        m = _read_json(p, None)
        if isinstance(m, dict):
            m.setdefault("run_id", p.parent.name)
            runs.append(m)
    return sorted(runs, key=lambda m: m["run_id"], reverse=True)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)
    return "" if v is None else str(v)


_CSS = """body{font:14px system-ui,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}.ok{color:#1a7f37}.failed{color:#cf222e}.skipped,.running{color:#9a6700}
.diff{background:#fff3b0}code{font-size:12px}small{color:#666}"""


def write_index(reports_dir: str | Path = "reports") -> Path:
    """`reports/index.html`: one row per run with notebooks (links), status and key figures."""
    reports_dir = Path(reports_dir)
    runs = list_runs(reports_dir)
    keys = [k for k in KEY_FIGURES if any(k in (m.get("figures") or {}) for m in runs)]
    e = html.escape
    rows = []
    for m in runs:
        rid = m["run_id"]
        links = []
        for nb in m.get("notebooks", []):
            href = f"{rid}/{nb.get('html', nb['notebook'] + '.html')}"
            extra = (
                f" <small>(from {e(nb['reused_from'])})</small>" if nb.get("reused_from") else ""
            )
            err = f' title="{e(nb["error"])}"' if nb.get("error") else ""
            links.append(
                f'<a href="{e(href)}"{err}>{e(nb["notebook"])}</a> '
                f'<span class="{e(nb["status"])}">{e(nb["status"])}</span>{extra}'
            )
        figs = m.get("figures") or {}
        others = ", ".join(f"{e(k)}={e(_fmt(v))}" for k, v in figs.items() if k not in keys)
        git = m.get("git") or {}
        sha = (git.get("sha") or "")[:8] + ("+dirty" if git.get("dirty") else "")
        rows.append(
            f"<tr><td><code>{e(rid)}</code><br><small>{e(m.get('created', ''))}</small></td>"
            f'<td class="{e(m.get("status", ""))}">{e(m.get("status", ""))}</td>'
            f"<td>{'<br>'.join(links)}</td>"
            + "".join(f"<td>{e(_fmt(figs.get(k)))}</td>" for k in keys)
            + f"<td><small>{others}</small></td><td><code>{e(sha)}</code></td>"
            f"<td>{_fmt(m.get('duration_s'))}</td></tr>"
        )
    compares = sorted(reports_dir.glob("compare-*.html"))
    comp = "".join(f'<li><a href="{e(p.name)}">{e(p.stem)}</a></li>' for p in compares)
    head = "".join(f"<th>{e(k)}</th>" for k in keys)
    page = f"""<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Workbench reports</title>
<style>{_CSS}</style></head><body><h1>Workbench reports</h1>
<p>{len(runs)} run(s). Compare two runs: <code>workbench compare RUN_A RUN_B</code>.</p>
<table><tr><th>run</th><th>status</th><th>notebooks</th>{head}<th>other figures</th><th>git</th><th>seconds</th></tr>
{"".join(rows)}</table>{"<h2>Comparisons</h2><ul>" + comp + "</ul>" if comp else ""}</body></html>
"""
    path = reports_dir / "index.html"
    reports_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, page)
    return path


def _flatten(m: dict[str, Any]) -> dict[str, Any]:
    """The comparable facts of a run: per-notebook parameters/status/duration, figures, env."""
    out: dict[str, Any] = {"status": m.get("status"), "created": m.get("created")}
    figs = m.get("figures") or {}
    out.update({f"key figure {k}": figs[k] for k in KEY_FIGURES if k in figs})
    for k, v in (m.get("git") or {}).items():
        out[f"git.{k}"] = v
    for nb in m.get("notebooks", []):
        s = nb["notebook"]
        out[f"{s}: status"] = nb.get("status")
        out[f"{s}: seconds"] = nb.get("duration_s")
        for k, v in (nb.get("parameters") or {}).items():
            out[f"{s}: param {k}"] = v
        for k, v in (nb.get("figures") or {}).items():
            out[f"{s}: figure {k}"] = v
    for k, v in (m.get("packages") or {}).items():
        out[f"package {k}"] = v
    for k in ("hostname", "cpu_count", "memory_bytes"):
        out[f"host {k}"] = (m.get("host") or {}).get(k)
    out["accelerator devices"] = (m.get("accelerator") or {}).get("devices")
    return out


def compare_runs(run_a: str, run_b: str, reports_dir: str | Path = "reports") -> Path:
    """`reports/compare-A-vs-B.html`: parameters and key figures in two columns, diffs marked."""
    reports_dir = Path(reports_dir)
    ms = []
    for rid in (run_a, run_b):
        p = reports_dir / rid / MANIFEST
        if not p.is_file():
            known = ", ".join(m["run_id"] for m in list_runs(reports_dir)[:10])
            raise FileNotFoundError(f"no run {rid!r} in {reports_dir} (recent runs: {known})")
        ms.append(json.loads(p.read_text()))
    fa, fb = _flatten(ms[0]), _flatten(ms[1])
    e = html.escape
    rows, n_diff = [], 0
    for k in list(dict.fromkeys([*fa, *fb])):
        a, b = fa.get(k), fb.get(k)
        diff = a != b and k != "created"
        n_diff += diff
        rows.append(
            f"<tr{' class=diff' if diff else ''}><th>{e(k)}</th>"
            f"<td>{e(_fmt(a))}</td><td>{e(_fmt(b))}</td></tr>"
        )
    page = f"""<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">
<title>{e(run_a)} vs {e(run_b)}</title><style>{_CSS}</style></head><body>
<p><a href="index.html">&larr; all runs</a></p><h1>{e(run_a)} vs {e(run_b)}</h1>
<p>{n_diff} differing value(s), highlighted.</p>
<table><tr><th></th><th><a href="{e(run_a)}/">{e(run_a)}</a></th><th><a href="{e(run_b)}/">{e(run_b)}</a></th></tr>
{"".join(rows)}</table></body></html>
"""
    path = reports_dir / f"compare-{run_a}-vs-{run_b}.html"
    path.write_text(page, encoding="utf-8")
    write_index(reports_dir)
    return path


# ---------------------------------------------------------------------------------------------
# Headless browser check

_PROBE = """<script>window.__wb={errors:[],console:[]};window.addEventListener('error',function(e){
__wb.errors.push(String(e.message||e.type)+' @'+(e.filename||'')+':'+(e.lineno||''))},true);
window.addEventListener('unhandledrejection',function(e){__wb.errors.push('unhandled rejection: '+e.reason)});
(function(){var ce=console.error;console.error=function(){__wb.console.push(Array.prototype.join.call(arguments,' '));
return ce.apply(console,arguments)}})();
document.addEventListener('DOMContentLoaded',function(){setTimeout(function(){var d=document.createElement('pre');
d.id='__wb_probe';d.textContent=JSON.stringify(__wb);document.body.appendChild(d)},1500)});</script>"""


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if p := shutil.which(name):
            return p
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None


def _chromium_argv(exe: str, profile: str) -> list[str]:
    return [
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}",
    ]  # fmt: skip


def check_html_in_browser(
    path: str | Path, screenshot: str | Path | None = None, timeout: float = 90.0,
    window: tuple[int, int] = (1280, 2400), min_plots: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """Open an HTML report in headless Chromium (a temp copy with a probe script that records
    uncaught errors and console.error calls into the DOM, read back with --dump-dom): count
    plotly plots and those rendered (`.js-plotly-plot` holding a `.main-svg`), collect errors,
    optionally save a screenshot. `ok` needs >= min_plots plots, all rendered, and no errors.
    Returns {ok, plots, rendered_plots, main_svgs, js_errors, console_errors, log_uncaught,
    screenshot, returncode}."""
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("chromium not found (Debian: apt-get install -y chromium)")
    src = Path(path).resolve()
    text = src.read_text(encoding="utf-8")
    probed = re.sub(r"<head>", "<head>" + _PROBE, text, count=1)
    with tempfile.TemporaryDirectory(prefix="wb-chromium-") as tmp:
        page = Path(tmp) / src.name  # same name; links elsewhere do not matter for the check
        page.write_text(probed, encoding="utf-8")
        budget = "--virtual-time-budget=10000"
        argv = _chromium_argv(exe, str(Path(tmp) / "profile"))
        r = subprocess.run(
            [*argv, "--enable-logging=stderr", "--v=0", budget, "--dump-dom", page.as_uri()],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        dom = r.stdout
        shot = None
        if screenshot is not None:
            shot = Path(screenshot).resolve()
            shot.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [*argv, budget, f"--window-size={window[0]},{window[1]}",
                 f"--screenshot={shot}", src.as_uri()],
                capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
    m = re.search(r'<pre id="__wb_probe">(.*?)</pre>', dom, re.S)
    probe = json.loads(html.unescape(m.group(1))) if m else {"errors": [], "console": []}
    js_errors = probe["errors"] + ([] if m else ["probe did not report (page never loaded?)"])
    uncaught = [ln for ln in r.stderr.splitlines() if "CONSOLE" in ln and "Uncaught" in ln]
    # Plot divs come from figure_html (class plotly-graph-div); plotly adds js-plotly-plot and a
    # <svg class="main-svg"> inside once it has drawn the figure.
    parts = re.split(r'<div[^>]*class="([^"]*\bplotly-graph-div\b[^"]*)"', dom)
    classes, bodies = parts[1::2], parts[2::2]
    rendered = sum(
        1
        for c, b in zip(classes, bodies, strict=True)
        if "js-plotly-plot" in c and 'class="main-svg"' in b
    )
    out = {
        "plots": len(classes),
        "rendered_plots": rendered,
        "main_svgs": dom.count('class="main-svg"'),
        "js_errors": js_errors,
        "console_errors": probe["console"],
        "log_uncaught": uncaught,
        "screenshot": str(shot) if shot and shot.exists() else None,
        "returncode": r.returncode,
    }
    out["ok"] = bool(
        r.returncode == 0 and out["plots"] >= min_plots and rendered == out["plots"]
        and not js_errors and not uncaught and not probe["console"]
        and (screenshot is None or out["screenshot"])
    )  # fmt: skip
    return out


def result_dict(r: RunResult) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(r).items()}


__all__ = [
    "KEY_FIGURES", "NotebookFailed", "RunResult", "Stage", "UnknownParameters", "check_html_in_browser",
    "compare_runs", "export_html", "list_runs", "load_parameters", "new_run_id", "notebook_parameters",
    "parse_value", "record", "run_notebook", "run_pipeline", "validate_parameters", "write_index",
]  # fmt: skip
