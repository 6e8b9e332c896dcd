"""Resumable sweeps: a grid of configs, one run each, one JSON line of results per config.

A config is a flat dict (`num_steps`, `eagle_topk`, `num_draft_tokens`, `batch_size`, `env`,
`flags`, ...); `spec: False` marks the no-speculation baseline, always added by `step_grid`.
Each config is keyed by a stable hash of its canonical JSON, so a rerun of the same sweep
skips every key already in `results.jsonl` (status `ok` or `failed`; `retry_failed=True`
runs the failed ones again). The runner is generic: a backend is a `run_config(config) ->
dict` callable (`local.LocalBackend` in process, `served.ServedBackend` over HTTP, a
torchrun all-reduce command from `nccl.allreduce_backend`). A failure (exception, crash, timeout) is recorded with its error and log
tail and the sweep goes on; Ctrl-C (KeyboardInterrupt) stops it, and what finished stays.

Rows are written whole: the file is rewritten to a temp name, fsynced and renamed
(`fsutil.atomic_write_text`), so a kill at any moment leaves either the old or the new
file, never half a line.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from workbench.engine.spec import SpecError, resolve_params
from workbench.errors import WorkbenchError
from workbench.fsutil import atomic_write_text, claim_dir, locked_dir
from workbench.serving import process

RESULTS = "results.jsonl"
WORKLOAD = "sweep-args.json"
LOG_TAIL_CHARS = 4000

RunConfig = Callable[[dict[str, Any]], dict[str, Any]]


class SweepError(WorkbenchError):
    """A sweep that cannot start (bad grid, results of another sweep in the folder)."""


class RunFailed(RuntimeError):
    """One config failed in a way the backend could describe (exit code, timeout); the
    runner records `str(self)` and `log_tail`."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


# ---------------------------------------------------------------- configs


def config_key(config: dict[str, Any]) -> str:
    """Stable 12-hex key: sha256 of the config's canonical JSON (sorted keys)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def label(config: dict[str, Any]) -> str:
    """Short human name: `s/k/n` (or `plain`), `@b` for the batch, then env/flags if any."""
    if config.get("spec", True) and "num_steps" in config:
        out = f"{config['num_steps']}/{config['eagle_topk']}/{config['num_draft_tokens']}"
    elif "num_steps" in config or config.get("spec") is False:
        out = "plain"
    else:
        out = ""
    if "batch_size" in config:
        out += f"@{config['batch_size']}"
    if config.get("repeat"):
        out += f" (again, {config['repeat']})"
    env = config.get("env") or {}
    extra = [f"{k}={v}" for k, v in sorted(env.items())] + list(config.get("flags") or [])
    return " ".join([out] * bool(out) + extra) or "default"


def validate(config: dict[str, Any]) -> dict[str, Any]:
    """SGLang's rules (engine.spec.resolve_params: all-or-none, topk 1 forces ndt = steps + 1,
    the hard limit) applied to a speculative config; returns it normalized, raises SpecError."""
    if config.get("spec", True) is False or "num_steps" not in config:
        return dict(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the topk-1 adjustment is the normalization itself
        p = resolve_params(
            config.get("num_steps"), config.get("eagle_topk"), config.get("num_draft_tokens")
        )
    return {
        **config,
        "num_steps": p.num_steps,
        "eagle_topk": p.eagle_topk,
        "num_draft_tokens": p.num_draft_tokens,
    }


def step_grid(
    num_steps: Sequence[int],
    eagle_topk: Sequence[int] = (1,),
    num_draft_tokens: Sequence[int | None] = (None,),
    batch_size: Sequence[int] = (1,),
    baseline: bool = True,
) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], str]]]:
    """(valid configs, [(rejected config, SGLang rule it breaks)]) over the product.

    `num_draft_tokens=None` means the chain's steps + 1 (or, for topk > 1, SGLang's largest
    legal tree is not guessed: give the values). topk 1 normalizes ndt to steps + 1, so
    duplicates collapse. The no-speculation baseline comes first for every batch size."""
    out: list[dict[str, Any]] = []
    rejected: list[tuple[dict[str, Any], str]] = []
    seen: set[str] = set()
    if baseline:
        for b in batch_size:
            out.append({"spec": False, "batch_size": int(b)})
            seen.add(config_key(out[-1]))
    for b, s, k, n in itertools.product(batch_size, num_steps, eagle_topk, num_draft_tokens):
        raw = {"spec": True, "num_steps": int(s), "eagle_topk": int(k), "batch_size": int(b),
               "num_draft_tokens": int(n) if n is not None else int(s) + 1}  # fmt: skip
        try:
            cfg = validate(raw)
        except SpecError as e:
            rejected.append((raw, str(e)))
            continue
        key = config_key(cfg)
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out, rejected


# ---------------------------------------------------------------- results file


def read_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a results file ([] when absent). A line that is not JSON is an error: the
    file is only ever replaced whole, so a bad line means someone else wrote it."""
    p = Path(path)
    if not p.exists():
        return []
    rows = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise SweepError(f"{p}:{i} is not a JSON line ({e}); fix or remove that line") from e
    return rows


def append_row(path: str | os.PathLike, row: dict[str, Any]) -> None:
    """Append one row atomically (the whole file is replaced by temp + fsync + rename)."""
    p = Path(path)
    old = p.read_text() if p.exists() else ""
    if old and not old.endswith("\n"):
        old += "\n"
    atomic_write_text(p, old + json.dumps(row, sort_keys=True, default=str) + "\n")


def latest_rows(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The last row per config key (a retried config's newest result wins)."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        out[r["key"]] = r
    return out


# ---------------------------------------------------------------- the runner


def _tail(text: str, n: int = LOG_TAIL_CHARS) -> str:
    return text[-n:]


def run_sweep(
    configs: Sequence[dict[str, Any]],
    run_config: RunConfig,
    out_dir: str | os.PathLike,
    *,
    retry_failed: bool = False,
    progress: bool = True,
    desc: str = "sweep",
    workload: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run every config not yet in `out_dir/results.jsonl`; return the latest row per config
    of this grid, in grid order.

    Row: `key, label, config, status (ok|failed), result (ok) | error + log_tail (failed),
    seconds, finished_at`. Invalid configs (SGLang's rules) are recorded as failed without a
    run. The folder is locked while the sweep runs (a second sweep there gets InUseError).
    `workload` (prompts, lengths, target, draft: what every config shares) is claimed in
    `sweep-args.json`: resuming a folder with another workload is refused, since its rows
    would not be comparable."""
    out = Path(out_dir)
    path = out / RESULTS
    keys = [config_key(c) for c in configs]
    if len(set(keys)) != len(keys):
        raise SweepError("the grid holds the same config twice; drop the duplicates")
    with locked_dir(out, "sweep folder"):
        if workload is not None:
            diff = claim_dir(out / WORKLOAD, workload)
            if diff:
                raise SweepError(
                    f"{out} holds a sweep of another workload:\n{diff}\n"
                    "use another folder, or the same arguments to resume"
                )
        done = latest_rows(read_results(path))
        todo = [
            (c, k)
            for c, k in zip(configs, keys, strict=True)
            if k not in done or (retry_failed and done[k]["status"] != "ok")
        ]
        bar = None
        if progress and todo:
            from workbench.progress import progress as make_bar

            bar = make_bar(total=len(todo), desc=desc, unit="config")
        try:
            for cfg, key in todo:
                if bar is not None:
                    bar.set_postfix_str(label(cfg))
                row = _run_one(cfg, key, run_config)
                append_row(path, row)
                done[key] = row
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
    return [done[k] for k in keys if k in done]


def _run_one(cfg: dict[str, Any], key: str, run_config: RunConfig) -> dict[str, Any]:
    row: dict[str, Any] = {"key": key, "label": label(cfg), "config": cfg}
    t0 = time.perf_counter()
    try:
        norm = validate(cfg)
        if norm != cfg:
            raise SpecError(
                f"config {label(cfg)} is not in SGLang's normal form; run {label(norm)} instead"
            )
    except SpecError as e:
        return {**row, "status": "failed", "phase": "validate", "error": str(e), "log_tail": "",
                "seconds": 0.0, "finished_at": time.time()}  # fmt: skip
    try:
        result = run_config(cfg)
    except RunFailed as e:
        row.update(status="failed", phase="run", error=str(e), log_tail=_tail(e.log_tail))
    except Exception as e:  # recorded with its traceback; the sweep goes on
        row.update(status="failed", phase="run", error=f"{type(e).__name__}: {e}",
                   log_tail=_tail(traceback.format_exc()))  # fmt: skip
    else:
        row.update(status="ok", result=result)
    row.update(seconds=time.perf_counter() - t0, finished_at=time.time())
    return row


# ---------------------------------------------------------------- subprocess backends


def run_command(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
    log_path: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
) -> str:
    """Run `argv` in its own process group, stdout+stderr to `log_path`; return the output.

    A non-zero exit, a death by signal or a run past `timeout_s` raises RunFailed with the
    log tail; on timeout (or Ctrl-C) the whole process group is killed, so torchrun's
    workers and a server's schedulers go with it."""
    log = Path(log_path) if log_path else None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}
    with open(log or os.devnull, "w+b") as f:
        proc = subprocess.Popen(list(argv), stdout=f, stderr=subprocess.STDOUT, env=full_env,
                                cwd=cwd, start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise RunFailed(
                f"timed out after {timeout_s:.0f} s: {' '.join(argv[:4])} ...; process group "
                "killed",
                _read_tail(log),
            ) from None
        except BaseException:
            kill_group(proc)
            raise
    text = log.read_text(errors="replace") if log is not None else ""
    if rc != 0:
        why = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
        raise RunFailed(f"{' '.join(argv[:4])} ... failed: {why}", _tail(text))
    return text


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the process group `proc` leads at once (serving.process's teardown) and reap it."""
    process.kill_group(proc.pid, grace_s=0)
    proc.wait()


def _read_tail(path: Path | None) -> str:
    if path is None or not path.exists():
        return ""
    return _tail(path.read_text(errors="replace"))
