"""SGLang general plugin: one JSON line per EAGLE v2 decode cycle per rank (the workbench trace).

Entry point `workbench_trace` in group `sglang.srt.plugins`. SGLang's `load_plugins()` calls
`register()` early in every server process (main, scheduler, detokenizer); hooks go in the
scheduler processes only. It does nothing unless `WORKBENCH_TRACE_DIR` names a folder, so an installed but unused plugin costs nothing:
no hook is registered and SGLang runs its own functions. Allow it explicitly with
`SGLANG_PLUGINS=workbench_trace` (SGLang loads every installed plugin when that is unset).

Environment:
  WORKBENCH_TRACE_DIR     folder for `trace-rank{R}.jsonl` (one file per scheduler rank)
  WORKBENCH_TRACE_RUN_ID  run id written in every line (the launcher sets one per server)
  WORKBENCH_TRACE_HIDDEN  "1": also per-aux-layer norms of the draft's 3H input (costs a
                          small reduction per cycle; read after the cycle, never synced in it)

Imports nothing from the workbench (the server environment has its own torch); the schema is
the workbench's `CycleRecord` (workbench/engine/trace.py), read by `read_trace`.
"""

from __future__ import annotations

import os

ENV_DIR = "WORKBENCH_TRACE_DIR"
ENV_RUN_ID = "WORKBENCH_TRACE_RUN_ID"
ENV_HIDDEN = "WORKBENCH_TRACE_HIDDEN"
PLUGIN_NAME = "workbench_trace"


def register() -> None:
    """Register the trace hooks with SGLang's HookRegistry when WORKBENCH_TRACE_DIR is set."""
    trace_dir = os.environ.get(ENV_DIR)
    if not trace_dir or not _may_run_the_worker():
        return
    from workbench_sglang_plugin import hooks

    hooks.install(trace_dir, os.environ.get(ENV_RUN_ID), os.environ.get(ENV_HIDDEN) == "1")


def _may_run_the_worker() -> bool:
    """False in the processes SGLang 0.5.23 loads plugins in that never run the EAGLE worker
    (the launching process, the detokenizer): registering there would only import the worker
    modules (tens of seconds of CPU at start-up). Schedulers are multiprocessing children."""
    import multiprocessing

    if multiprocessing.parent_process() is None:
        return False
    try:
        import setproctitle

        return "detokenizer" not in setproctitle.getproctitle()
    except ImportError:
        return True
