"""The workbench's SGLang trace plugin, seen from the workbench: its environment and its files.

The plugin itself lives in `support/sglang_plugin` (package `workbench_sglang_plugin`, entry
point `workbench_trace` in group `sglang.srt.plugins`), installed into the server environment
by `make sglang-env`; it imports nothing from the workbench (that environment has another
torch). It writes `trace-rank{R}.jsonl` per scheduler rank in the design's trace schema, so
`workbench.engine.trace.read_trace` reads it like the local engine's trace.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Collection
from pathlib import Path

from workbench.engine.trace import CycleRecord, read_trace
from workbench.errors import WorkbenchError

PLUGIN_NAME = "workbench_trace"
ENV_DIR = "WORKBENCH_TRACE_DIR"
ENV_RUN_ID = "WORKBENCH_TRACE_RUN_ID"
ENV_HIDDEN = "WORKBENCH_TRACE_HIDDEN"


def trace_env(
    trace_dir: str | os.PathLike, hidden: bool = False, allowed: str | None = None
) -> dict[str, str]:
    """Server environment that enables the plugin: SGLang's `SGLANG_PLUGINS` allow-list (the
    plugin added to `allowed`, the list already there) plus the trace folder, a run id shared
    by every rank, and whether to record per-aux-layer norms."""
    names = [n.strip() for n in (allowed or "").split(",") if n.strip()]
    if PLUGIN_NAME not in names:
        names.append(PLUGIN_NAME)
    return {
        "SGLANG_PLUGINS": ",".join(names),
        ENV_DIR: str(Path(trace_dir).resolve()),
        ENV_RUN_ID: uuid.uuid4().hex[:12],
        ENV_HIDDEN: "1" if hidden else "0",
    }


def trace_files(trace_dir: str | os.PathLike) -> list[Path]:
    return sorted(Path(trace_dir).glob("trace-rank*.jsonl"))


def read_trace_dir(
    trace_dir: str | os.PathLike,
    rank: int | None = 0,
    request_ids: Collection[str] | None = None,
) -> list[CycleRecord]:
    """The plugin's records for one rank (None: every rank, rank by rank), in cycle order.

    `request_ids`: only the cycles that served one of these requests (a load's own, read from a
    server that also served others: an attached server's trace holds its whole life). A batched
    cycle shared with other requests is kept whole, since its time is the whole batch's."""
    files = trace_files(trace_dir)
    if rank is not None:
        files = [f for f in files if f.name == f"trace-rank{rank}.jsonl"]
    if not files:
        raise WorkbenchError(
            f"no trace in {trace_dir} (trace-rank{'*' if rank is None else rank}.jsonl): was the "
            f"server launched with ServeSpec.trace_dir, and is the plugin installed in the "
            f"server environment (`make sglang-env`)? A server that has served no EAGLE decode "
            f"cycle writes no file either"
        )
    recs = [r for f in files for r in read_trace(f)]
    if request_ids is None:
        return recs
    want = set(request_ids)
    mine = [r for r in recs if want.intersection(r.request_ids)]
    if not mine:
        raise WorkbenchError(
            f"the trace in {trace_dir} has {len(recs)} cycles but none of the {len(want)} "
            f"requests asked for (e.g. {sorted(want)[:2]}): is it the trace folder of the server "
            f"that answered them (`workbench serve --trace-dir`)?"
        )
    return mine
