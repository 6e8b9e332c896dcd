"""A server for a notebook or a sweep: attached by URL, or launched for the block and torn down.

The local backend runs in a thread of this process (bound to 127.0.0.1, a free port): no
start-up cost beyond loading the models, and nothing can outlive the kernel. SGLang runs as
its own process group through `workbench.serving.sglang` (see there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from workbench.serving.local import LocalConfig, LocalServer, load_engine
from workbench.serving.process import ServerError, attach

BACKENDS = ("local", "sglang")


@dataclass
class Session:
    url: str
    backend: str
    launched: bool
    argv: list[str] = field(default_factory=list)  # the command that serves the same thing
    start_s: float = 0.0


def sglang_spec(cfg: LocalConfig, tp_size: int = 1, device: str = "auto"):
    """The SGLang serve spec of the same settings (`device` auto: cuda when present, else cpu)."""
    from workbench.serving.sglang import ServeSpec

    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return ServeSpec(
        target=cfg.model_path,
        draft=cfg.draft if cfg.speculative else None,
        speculative_algorithm=cfg.speculative_algorithm if cfg.speculative else None,
        speculative_num_steps=cfg.num_steps,
        speculative_eagle_topk=cfg.eagle_topk,
        speculative_num_draft_tokens=cfg.num_draft_tokens,
        tp_size=tp_size,
        dtype=cfg.dtype,
        device=device,
    )


def traced(cfg, trace_dir: str | os.PathLike | None, hidden: bool = False):
    """`cfg` (a LocalConfig or an SGLang ServeSpec) writing its per-cycle trace into `trace_dir`
    as `trace-rank{R}.jsonl` (the local engine as rank 0): one layout, one reader
    (`serving.plugin.read_trace_dir`). No `trace_dir`: `cfg` unchanged."""
    if not trace_dir:
        return cfg
    if isinstance(cfg, LocalConfig):
        path = str(Path(trace_dir) / "trace-rank0.jsonl")
        return dataclasses.replace(cfg, trace_path=path, trace_hidden=hidden)
    return dataclasses.replace(cfg, trace_dir=str(trace_dir), trace_hidden=hidden)


@contextlib.contextmanager
def open_server(
    backend: str,
    cfg: LocalConfig,
    url: str = "",
    tp_size: int = 1,
    *,
    device: str = "auto",
    log_dir: str | os.PathLike = "reports/serve",
    deadline_s: float = 900.0,
    trace_dir: str | os.PathLike | None = None,
    trace_hidden: bool = False,
    targets: dict | None = None,
) -> Iterator[Session]:
    """Attach to `url` when given, else launch `cfg` on `backend` for the block, then stop it.

    `trace_dir`: a launched server writes the per-cycle trace there as `trace-rank{R}.jsonl`
    (SGLang through the workbench_trace plugin, the local engine as rank 0), so
    `serving.plugin.read_trace_dir` reads either; `trace_hidden` adds per-aux-layer norms.
    `targets`: local servers opened with the same dict share a loaded target (`load_engine`)."""
    if backend not in BACKENDS:
        raise ServerError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if url:
        attach(url)
        yield Session(url.rstrip("/"), backend, launched=False)
        return
    t0 = time.perf_counter()
    if backend == "sglang":
        from workbench.serving import sglang

        mode = "eagle3" if cfg.speculative else "plain"
        log = Path(log_dir) / f"sglang-{mode}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        spec = traced(sglang_spec(cfg, tp_size, device), trace_dir, trace_hidden)
        server = sglang.launch(spec, log, deadline_s=deadline_s)
        try:
            yield Session(server.url, backend, True, list(server.argv), time.perf_counter() - t0)
        finally:
            server.stop()
        return
    if tp_size != 1:
        raise ServerError("the local backend runs in one process: tp_size must be 1")
    cfg = traced(cfg, trace_dir, trace_hidden)
    server = LocalServer(load_engine(cfg, targets)).start()
    try:
        yield Session(server.url, backend, True, cfg.argv(port=server.port),
                      time.perf_counter() - t0)  # fmt: skip
    finally:
        server.stop()


@dataclass
class Served:
    """One server of a comparison: launched from `cfg`, or attached at `url`."""

    cfg: LocalConfig
    url: str = ""
    trace_dir: str | os.PathLike | None = None  # a launched server's per-cycle trace


def load_servers(
    backend: str,
    servers: dict[str, Served],
    load: dict,
    reqs: list,
    out_dir: str | os.PathLike,
    *,
    tp_size: int = 1,
    trace_hidden: bool = False,
    say=print,
) -> tuple[dict, str]:
    """The same requests through each server: ({name: LoadRun}, "paired" | "one after another").

    Paired (`client.run_paired`: single requests alternating between servers that are up at
    once) when the load is one request at a time with no arrival rate and every server can be
    up at once: the local backend, or servers attached by URL. Otherwise (concurrency, a rate,
    or launched SGLang servers, which would compete for memory) one server after another.
    `load` holds `client.LoadConfig`'s fields but the URL. Results: `out_dir/load-<name>.json`.
    """
    from workbench.serving import client as lc

    out = Path(out_dir)
    cfgs = {n: lc.LoadConfig("", **load) for n in servers}  # validates the load once per server
    single = all(c.concurrency == 1 and c.request_rate == float("inf") for c in cfgs.values())
    together = backend == "local" or all(s.url for s in servers.values())
    paired = len(servers) > 1 and single and together

    targets: dict = {}  # paired local servers share one loaded target (one decodes at a time)

    def opened(stack: contextlib.ExitStack, name: str, s: Served) -> str:
        srv = stack.enter_context(
            open_server(
                backend,
                s.cfg,
                s.url,
                tp_size,
                trace_dir=s.trace_dir,
                trace_hidden=trace_hidden,
                targets=targets if paired else None,
            )
        )
        how = (
            f"launched in {srv.start_s:.1f} s: {shlex.join(srv.argv)}"
            if srv.launched
            else "attached"
        )
        say(f"{name}: {srv.url} ({how})")
        return srv.url

    if paired:
        with contextlib.ExitStack() as stack:
            for n, s in servers.items():
                cfgs[n].url = opened(stack, n, s)
            outs = {n: out / f"load-{n}.json" for n in servers}
            return lc.run_paired(cfgs, reqs, outs), "paired"
    runs = {}
    for n, s in servers.items():
        with contextlib.ExitStack() as stack:
            cfgs[n].url = opened(stack, n, s)
            runs[n] = lc.run_load(cfgs[n], reqs, out / f"load-{n}.json")
    return runs, "one after another"
