"""The HTTP sweep backend: launch a server per config (the local engine in a thread, or
SGLang as a process group), warm it up, load it through the client, tear it down.

Every config gets a fresh server (SGLang cannot change speculation settings live), the
same prompts (chat template applied here, sent as token ids), `batch_size` as the client's
concurrency, and streaming so TPOT is measured. `tok_s` is decode-only, like the local
backend's: concurrency / mean TPOT; the client's end-to-end `output_tok_s` is kept too.
The per-cycle trace (draft / verify / extend ms; the local server's, or SGLang's through the
workbench_trace plugin) feeds the cost model; the warm-up's cycles are left out.
Communication settings (`env`, `flags` from `workbench.experiments.nccl`) apply to SGLang
launches.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from workbench import metrics
from workbench.engine.trace import read_trace
from workbench.errors import WorkbenchError
from workbench.experiments.sweep import RunFailed, config_key


@dataclass
class ServedBackend:
    """`run_config` for `run_sweep`: `ServedBackend("local", target, draft, out_dir)(config)`."""

    backend: str  # local | sglang
    target: str
    draft: str
    out_dir: Path
    prompts: str = "mtbench"
    n_prompts: int = 4
    max_new_tokens: int = 48
    dtype: str = "float32"
    tp_size: int = 1
    device: str = "auto"
    warmup_tokens: int = 8
    deadline_s: float = 900.0

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        from workbench.serving import client as lc
        from workbench.serving.local import LocalConfig

        spec = bool(config.get("spec", True)) and "num_steps" in config
        key = config_key(config)
        out = Path(self.out_dir)
        trace = out / "traces" / key  # local: a file; sglang: the plugin's folder
        if trace.is_file():
            trace.unlink()
        model_path = self.target
        if self.backend == "sglang":
            from workbench.target import resolve_target_dir

            model_path = str(resolve_target_dir(self.target)[1])  # SGLang loads HF dirs
        cfg = LocalConfig(
            model_path=model_path, draft=self.draft if spec else "",
            num_steps=config.get("num_steps") if spec else None,
            eagle_topk=config.get("eagle_topk") if spec else None,
            num_draft_tokens=config.get("num_draft_tokens") if spec else None,
            dtype=self.dtype, trace_path=str(trace) if self.backend == "local" and spec else None,
        )  # fmt: skip
        tok = lc.load_tokenizer(self.target)
        reqs = lc.build_requests(self.prompts, self.n_prompts, tok)
        with self._server(cfg, config, out / "logs", trace if spec else None) as url:
            lc.run_load(lc.LoadConfig(url, max_new_tokens=self.warmup_tokens), reqs[:1])
            skip = len(self._records(trace)) if spec else 0  # the warm-up's cycles
            load = lc.LoadConfig(url, max_new_tokens=self.max_new_tokens,
                                 concurrency=int(config.get("batch_size", 1)))  # fmt: skip
            run = lc.run_load(load, reqs, out / "loads" / f"{key}.json")
        if run.status != "complete":
            raise RunFailed(f"load {run.status}: {run.reason}", lc.format_summary(run))
        recs = self._records(trace)[skip:] if spec else []
        return self._result(run, config, recs, trace)

    def _records(self, trace: Path) -> list:
        if self.backend == "local":
            return read_trace(trace) if trace.is_file() else []
        from workbench.serving import plugin

        return plugin.read_trace_dir(trace) if plugin.trace_files(trace) else []

    def _server(self, cfg, config: dict[str, Any], log_dir: Path, trace: Path | None):
        import contextlib

        from workbench.serving.session import open_server, sglang_spec

        env, flags = config.get("env") or {}, list(config.get("flags") or [])
        if self.backend == "local":
            if env or flags:
                raise WorkbenchError(
                    "communication settings (env, flags) apply to SGLang launches; the local "
                    "backend runs in one process"
                )

            @contextlib.contextmanager
            def local():
                with open_server("local", cfg, deadline_s=self.deadline_s) as s:
                    yield s.url

            return local()
        if self.backend != "sglang":
            raise WorkbenchError(f"backend must be local or sglang, got {self.backend!r}")
        from workbench.experiments.nccl import check
        from workbench.serving import sglang

        check({"env": env, "flags": flags})

        @contextlib.contextmanager
        def launched():
            ss = sglang_spec(cfg, self.tp_size, self.device)
            ss = replace(ss, env={**ss.env, **env}, extra_args=[*ss.extra_args, *flags],
                         trace_dir=str(trace) if trace is not None else None)  # fmt: skip
            log = log_dir / f"sglang-{config_key(config)}.log"
            server = sglang.launch(ss, log, deadline_s=self.deadline_s)
            try:
                yield server.url
            finally:
                server.stop()

        return launched()

    def _result(self, run, config: dict[str, Any], recs: list, trace: Path) -> dict[str, Any]:
        s = run.summary
        b = int(config.get("batch_size", 1))
        ok = [r for r in run.requests if r.ok]
        tpots = [r.tpot_s for r in ok if r.tpot_s]
        if not tpots:
            raise RunFailed("no request produced two tokens: TPOT (and tok/s) is undefined")
        tpot = statistics.fmean(tpots)
        tau = s.get("pooled_tau", 1.0) if s.get("speculative") else 1.0
        out: dict[str, Any] = {
            "tok_s": b / tpot,
            "output_tok_s": s["output_tok_s"],
            "tpot_ms": tpot * 1e3,
            "tau": tau,
            "cycle_ms": tpot * tau * 1e3,
            "ttft_s_p50": s.get("ttft_s_p50"),
            "completion_tokens": s["output_tokens"],
            "server_metrics_delta": s.get("server_metrics_delta"),
            "load": str(run.path) if run.path else None,
        }
        if s.get("speculative"):
            out["tau_sglang"] = s["pooled_tau_sglang"]
            # per-request histograms summed with padding (their lengths differ: a request
            # that never accepted 2 drafts stops at h[1])
            hists = [r.meta.get("spec_correct_drafts_histogram") or [] for r in ok]
            width = max(map(len, hists), default=0)
            total = [sum(h[i] for h in hists if i < len(h)) for i in range(width)]
            n = int(config["num_steps"])
            acc = metrics.acceptance_from_histogram(total) if total else []
            out["acceptance"] = (acc + [0.0] * n)[:n]  # positions never reached: 0
        if recs:
            out.update(
                draft_ms=statistics.fmean(r.draft_ms for r in recs),
                verify_ms=statistics.fmean(r.verify_ms for r in recs),
                extend_ms=statistics.fmean(r.extend_ms for r in recs),
                traced_ms=statistics.fmean(r.total_ms for r in recs),
                trace=str(trace),
                trace_cycles=len(recs),
            )
        return out
