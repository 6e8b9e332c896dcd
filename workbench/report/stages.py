"""Pipelines: several notebooks in one run directory, outputs passed on as `${stage.name}`
references, and a stage skipped (saying so) when its notebook, parameters and input artifacts
match its last successful run (the cache in `reports/.stages.json`).

The workbench's own code is not in the skip key: an edit anywhere in the package would redo an
hour of capture and training. It is recorded instead (`provenance.code_hash`), and a skip whose
result came from other code says so, in the log and in the manifest (`code_changed`)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.fsutil import atomic_write_json
from workbench.provenance import code_hash
from workbench.report.errors import ReportError, read_json_file
from workbench.report.figures import jsonable
from workbench.report.html import write_index
from workbench.report.manifest import MANIFEST, new_run_id, now, update_manifest
from workbench.report.params import validate_parameters
from workbench.report.runner import (
    NotebookFailed,
    RunResult,
    input_artifacts,
    looks_like_path,
    notebook_hash,
    run_notebook,
)

STAGE_CACHE = ".stages.json"
_REF = re.compile(r"\$\{([A-Za-z0-9_\-]+)\.([A-Za-z0-9_\-]+)\}")


@dataclass
class Stage:
    """One pipeline step. Parameter values may reference earlier stages as `${stage.name}`:
    the stage's recorded figure `name` if it recorded one, else its parameter `name` (a whole-
    string reference keeps the value's type). `outputs` names parameters this stage writes
    (paths): they are not hashed as inputs, and a skip requires them to still exist.
    `key_extra` holds what the result depends on beyond the parameters (the training preset a
    profile name stands for): hashed into the skip key, so editing it reruns the stage."""

    notebook: str | Path
    parameters: dict[str, Any] = field(default_factory=dict)
    name: str | None = None
    outputs: tuple[str, ...] = ()
    key_extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.name = self.name or Path(self.notebook).stem
        self.outputs = tuple(self.outputs)


def resolve_references(
    parameters: dict[str, Any], done: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Substitute `${stage.name}` references from finished stages (recorded figures first)."""

    def lookup(stage: str, name: str) -> Any:
        if stage not in done:
            raise ReportError(f"reference ${{{stage}.{name}}}: no earlier stage named {stage!r}")
        figs, params = done[stage]["figures"], done[stage]["parameters"]
        if name in figs:
            return figs[name]
        if name in params:
            return params[name]
        have = sorted(set(figs) | set(params))
        raise ReportError(
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
        "notebook": notebook_hash(stage.notebook),
        "parameters": jsonable(parameters),
        "inputs": {k: v["sha256"] for k, v in input_artifacts(parameters, stage.outputs).items()},
    }
    if stage.key_extra:  # only when set: the keys of stages without it stay as they were
        doc["extra"] = jsonable(stage.key_extra)
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _skip(stage: Stage, params: dict[str, Any], key: str, hit: dict[str, Any],
          reports_dir: Path, run_dir: Path, code_changed: bool) -> RunResult:  # fmt: skip
    """Link the stage's last successful run into this run's manifest instead of rerunning."""
    stem = stage.name
    assert stem is not None
    prev = Path("..") / hit["run_id"]
    entry = {
        "notebook": stem, "source": str(stage.notebook), "stage": stem,
        "status": "skipped", "reused_from": hit["run_id"], "parameters": jsonable(params),
        "figures": hit.get("figures", {}), "duration_s": 0.0, "stage_key": key,
        "ipynb": str(prev / f"{stem}.ipynb"), "html": str(prev / f"{stem}.html"),
        "code_changed": code_changed,
    }  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    update_manifest(run_dir, entry)
    old = reports_dir / hit["run_id"]
    return RunResult(run_dir.name, run_dir, stem, old / f"{stem}.ipynb", old / f"{stem}.html",
                     run_dir / MANIFEST, "skipped", 0.0, params, entry["figures"])  # fmt: skip


STARTED = "_started"  # cache entry: stage name -> key of the run last started (maybe killed)


def _output_paths(stage: Stage, params: dict[str, Any]) -> list[str]:
    return [str(params[o]) for o in stage.outputs if looks_like_path(params.get(o))]


def _last_finished(
    stage: Stage, params: dict[str, Any], cache: dict[str, Any], unrecorded: bool = False
) -> str | None:
    """Key of the last finished run that wrote this stage's output paths (what is on disk).
    `unrecorded`: count runs from before the cache recorded outputs as writing them too."""
    paths = _output_paths(stage, params)
    # ordered by `seq` (timestamps have whole seconds: two fast runs would tie), then time
    finished = [(e.get("seq", 0), e["finished"], k) for k, e in cache.get(stage.name, {}).items()
                if "finished" in e and e.get("outputs", paths if unrecorded else None) == paths]  # fmt: skip
    return max(finished)[2] if finished else None


def _set_aside(stage: Stage, params: dict[str, Any], key: str, cache: dict[str, Any],
               run_id: str, log: Callable[[str], None], prefix: str) -> None:  # fmt: skip
    """Move aside outputs that the last finished run into these paths made from other inputs.

    Why: a stage reruns into the same paths when its inputs change (a profile's new prompt
    pick, say), and a capture or training folder refuses to resume from other arguments, so
    the run would stop there. The old result is renamed `<name>.before-<run id>`, never
    deleted. Outputs of a started run of these same inputs (killed midway) stay, to resume.
    Runs into other paths (another WORKBENCH_HOME) do not count; entries from before outputs
    were recorded do.
    """
    paths = _output_paths(stage, params)
    if cache.get(STARTED, {}).get(stage.name) == {"key": key, "outputs": paths}:
        return
    if _last_finished(stage, params, cache, unrecorded=True) in (key, None):
        return
    for path in map(Path, paths):
        if path.exists():
            aside = path.with_name(f"{path.name}.before-{run_id}")
            path.rename(aside)
            log(f"{prefix}: {path} was made from other inputs: moved aside to {aside}")


def run_stages(
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
    code = code_hash()
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ReportError(f"stage names must be unique: {names}")
    for i, stage in enumerate(stages, 1):
        assert stage.name is not None
        params = resolve_references(stage.parameters, done)
        validate_parameters(stage.notebook, params)
        key = stage_key(stage, params)
        cache = read_json_file(cache_path, "stage cache", {})
        hit = cache.get(stage.name, {}).get(key)
        if hit and not (reports_dir / hit["run_id"]).is_dir():
            hit = None  # its report is gone: rerun rather than link to nothing
        last = _last_finished(stage, params, cache)
        if hit and _output_paths(stage, params) and last not in (key, None):
            hit = None  # a run from other inputs has written these outputs since
        outputs_exist = all(
            Path(params[o]).exists() for o in stage.outputs if looks_like_path(params.get(o))
        )
        prefix = f"[{i}/{len(stages)}] {stage.name}"
        if hit and outputs_exist and not force:
            log(
                f"{prefix}: skipped, inputs unchanged since run {hit['run_id']} (use force to rerun)"
            )
            code_changed = hit.get("code") != code
            if code_changed:
                made_by = hit["code"][:12] if "code" in hit else "not recorded"
                log(
                    f"{prefix}: note: that result was made by other workbench code ({made_by}, "
                    f"now {code[:12]}); force reruns the stage with this code"
                )
            res = _skip(stage, params, key, hit, reports_dir, run_dir, code_changed)
        else:
            log(f"{prefix}: {'forced' if hit and force else 'running'} {stage.notebook}")
            cache = read_json_file(cache_path, "stage cache", {})
            _set_aside(stage, params, key, cache, run_id, log, prefix)
            started = {"key": key, "outputs": _output_paths(stage, params)}
            cache.setdefault(STARTED, {})[stage.name] = started
            atomic_write_json(cache_path, cache, sort_keys=False)
            try:
                res = run_notebook(
                    stage.notebook, params, reports_dir, run_id, kernel_name,
                    exclude_inputs=stage.outputs, name=stage.name,
                    manifest_extra={"stage": stage.name, "stage_key": key}, **run_kwargs,
                )  # fmt: skip
            except NotebookFailed as e:
                log(f"{prefix}: FAILED: {e}")
                raise
            cache = read_json_file(cache_path, "stage cache", {})
            entries = cache.setdefault(stage.name, {})
            seq = 1 + max((e.get("seq", 0) for e in entries.values()), default=0)
            entries[key] = {
                "run_id": run_id, "finished": now(), "seq": seq, "figures": res.figures,
                "duration_s": res.duration_s, "code": code,
                "outputs": _output_paths(stage, params),
            }  # fmt: skip
            atomic_write_json(cache_path, cache, sort_keys=False)
            log(f"{prefix}: ok in {res.duration_s:.1f}s -> {res.html}")
        done[stage.name] = {"figures": res.figures, "parameters": params}
        results.append(res)
    write_index(reports_dir)
    return results
