"""Asynchronous load client for SGLang's `/generate` API (a real SGLang server or the local one).

Bounded concurrency and request rate (Poisson arrivals, as in `sglang.bench_serving`); streaming,
so time to first token (TTFT) and the gaps between streamed chunks (ITL) are measured per
request. With speculation a chunk carries every token a verify committed, so an ITL gap is the
time of one decode cycle, not of one token; TPOT ((latency - TTFT) / (tokens - 1)) is per token.

Per request: latency, tokens, the server's `meta_info` (spec fields included) and whether
SGLang's identities hold (`metrics.sglang_identity_problems`; a failure is flagged in the summary).
Summary: output tokens/s, pooled accept length in both conventions (`tau`: decode tokens per
verify, prefill token excluded; `tau_sglang`: completion tokens / verify count, what SGLang's
`spec_accept_length` reports), the mean of per-request τ (a different number, labelled so),
per-position acceptance from the pooled histogram, TTFT/ITL/TPOT/latency percentiles, and the
server's own `/metrics` counters over the run. One results file per run, written atomically;
when the server dies mid-load the completed requests are kept and the file says `partial`.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from workbench import metrics
from workbench.errors import WorkbenchError
from workbench.fsutil import atomic_write_json
from workbench.serving import prom


class LoadError(WorkbenchError):
    """The load could not run (no server at the URL, no prompts, bad settings)."""


@dataclass
class LoadRequest:
    id: str
    input_ids: list[int] | None = None
    text: str | None = None
    category: str = ""


@dataclass
class LoadConfig:
    url: str
    max_new_tokens: int = 128
    temperature: float = 0.0
    concurrency: int = 1
    request_rate: float = float("inf")  # requests/s (Poisson arrivals); inf sends at once
    stream: bool = True
    ignore_eos: bool = False
    timeout_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise LoadError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate <= 0:
            raise LoadError(f"request_rate must be > 0 (inf for no limit), got {self.request_rate}")
        if self.max_new_tokens < 1:
            raise LoadError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class RequestResult:
    id: str
    ok: bool = False
    error: str | None = None
    sent: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    start_s: float = 0.0  # since the run started
    latency_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed chunks
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    identity_problems: list[str] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass
class LoadRun:
    status: str  # complete | partial
    reason: str
    config: dict[str, Any]
    summary: dict[str, Any]
    requests: list[RequestResult]
    server_info: dict[str, Any] | None = None
    path: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "reason": self.reason,
            "config": self.config,
            "summary": self.summary,
            "server_info": self.server_info,
            "requests": [asdict(r) | {"tpot_s": r.tpot_s} for r in self.requests],
        }


# ---------------------------------------------------------------- prompts


def build_requests(prompt_set: str, n: int | None, tokenizer=None) -> list[LoadRequest]:
    """First user turns of a prompt set ('mtbench', 'humaneval', a .jsonl, ...).

    With a tokenizer the chat template is applied here and `input_ids` are sent, so both
    backends see the very same tokens; without one the raw first turn is sent as `text`."""
    from workbench.data import load_prompt_set, prompt_ids, select

    out = []
    for p in select(load_prompt_set(prompt_set), n or None, first_turn_only=True):
        msgs = [m for m in p.messages(1) if m["role"] != "assistant"]
        if tokenizer is not None:
            out.append(
                LoadRequest(p.id, input_ids=prompt_ids(tokenizer, msgs), category=p.category)
            )
        else:
            out.append(LoadRequest(p.id, text=p.turns[0], category=p.category))
    if not out:
        raise LoadError(f"prompt set {prompt_set!r} gave no prompts")
    return out


def load_tokenizer(target: str):
    """The tokenizer of a target spec (HF dir, .gguf, 'smollm2-135m'), without the weights."""
    from transformers import AutoTokenizer

    from workbench.target import resolve_target_dir

    return AutoTokenizer.from_pretrained(str(resolve_target_dir(target)[1]))


# ---------------------------------------------------------------- server endpoints


def get_metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """`GET /metrics` (Prometheus text) → metric name → value summed over labels."""
    r = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout)
    if r.status_code != 200:
        raise LoadError(
            f"{url}/metrics answered {r.status_code}: start SGLang with --enable-metrics"
        )
    return prom.parse(r.text)


def get_server_info(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """`GET /server_info`: the server's args and `internal_states[i].avg_spec_accept_length`."""
    base = url.rstrip("/")
    r = httpx.get(base + "/server_info", timeout=timeout)
    if r.status_code == 404:  # older SGLang releases
        r = httpx.get(base + "/get_server_info", timeout=timeout)
    r.raise_for_status()
    return r.json()


def flush_cache(url: str, timeout: float = 30.0) -> None:
    """SGLang's `/flush_cache` (runs only when the server is idle; resets its averages)."""
    httpx.post(url.rstrip("/") + "/flush_cache", timeout=timeout).raise_for_status()


def avg_spec_accept_length(info: dict[str, Any]) -> float | None:
    """SGLang's cumulative accept length since the last /flush_cache (None without spec)."""
    states = info.get("internal_states") or [{}]
    v = states[0].get("avg_spec_accept_length")
    return None if v is None else float(v)


def healthy(url: str, timeout: float = 5.0) -> bool:
    try:
        return httpx.get(url.rstrip("/") + "/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


# ---------------------------------------------------------------- the load


def _body(req: LoadRequest, cfg: LoadConfig) -> dict[str, Any]:
    body: dict[str, Any] = {
        "sampling_params": {
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "ignore_eos": cfg.ignore_eos,
        },
        "stream": cfg.stream,
    }
    if req.input_ids is not None:
        body["input_ids"] = req.input_ids
    else:
        body["text"] = req.text
    return body


async def _one(client: httpx.AsyncClient, req: LoadRequest, cfg: LoadConfig,
               res: RequestResult, t_run: float) -> None:  # fmt: skip
    """Send one request and fill `res`; transport failures land in `res.error` (re-raised)."""
    t0 = time.perf_counter()
    res.sent, res.start_s = True, t0 - t_run
    final: dict[str, Any] | None = None
    if cfg.stream:
        last_t, last_n, done = None, 0, False
        async with client.stream("POST", "/generate", json=_body(req, cfg)) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                obj, now = json.loads(payload), time.perf_counter()
                n = int(obj.get("meta_info", {}).get("completion_tokens", 0))
                if n > last_n:
                    if last_t is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last_t)
                    last_t, last_n = now, n
                final = obj
        if not done:
            raise httpx.RemoteProtocolError("stream ended without [DONE] (server died?)")
    else:
        r = await client.post("/generate", json=_body(req, cfg))
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {r.text}"
            return
        final = r.json()
    assert final is not None
    res.latency_s = time.perf_counter() - t0
    meta = final.get("meta_info", {})
    res.meta = meta
    res.output_ids = list(final.get("output_ids") or [])
    res.text = final.get("text", "")
    res.prompt_tokens = int(meta.get("prompt_tokens", 0))
    res.completion_tokens = int(meta.get("completion_tokens", len(res.output_ids)))
    res.identity_problems = metrics.sglang_identity_problems(meta)
    res.ok = True


async def _run(cfg: LoadConfig, reqs: Sequence[LoadRequest], results: list[RequestResult],
               state: dict[str, Any]) -> None:  # fmt: skip
    rng = random.Random(cfg.seed)
    sem = asyncio.Semaphore(cfg.concurrency)
    dead = asyncio.Event()
    limits = httpx.Limits(
        max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency
    )
    t_run = state["t_run"] = time.perf_counter()

    async def task(i: int) -> None:
        try:
            await _one(client, reqs[i], cfg, results[i], t_run)
        except (httpx.TransportError, json.JSONDecodeError) as e:
            results[i].error = f"{type(e).__name__}: {e}"
            results[i].latency_s = time.perf_counter() - t_run - results[i].start_s
            if not await asyncio.to_thread(healthy, cfg.url, 3.0):
                dead.set()
        finally:
            sem.release()

    timeout = httpx.Timeout(cfg.timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=cfg.url.rstrip("/"), timeout=timeout,
                                 limits=limits) as client:  # fmt: skip
        tasks = []
        for i in range(len(reqs)):
            if i and cfg.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            await sem.acquire()
            if dead.is_set():
                sem.release()
                break
            tasks.append(asyncio.create_task(task(i)))
        await asyncio.gather(*tasks)
    state["duration_s"] = time.perf_counter() - t_run
    state["server_died"] = dead.is_set()


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(xs, dtype=float), q))


def _cycles_from_histogram(hist: Sequence[int]) -> list[int]:
    """Per-cycle emitted counts (bonus included) a histogram stands for: h[i] cycles of i + 1."""
    return [i + 1 for i, h in enumerate(hist) for _ in range(int(h))]


def summarize(
    results: Sequence[RequestResult], duration_s: float, num_steps: int | None = None
) -> dict[str, Any]:
    """Throughput, accept lengths (both conventions, labelled), latency percentiles, flags.

    `num_steps` (the server's) pads the pooled histogram to num_steps + 1 entries."""
    ok = [r for r in results if r.ok]
    comp = [r.completion_tokens for r in ok]
    s: dict[str, Any] = {
        "n_requests": len(results),
        "n_ok": len(ok),
        "n_failed": sum(1 for r in results if r.sent and not r.ok),
        "n_not_sent": sum(1 for r in results if not r.sent),
        "duration_s": duration_s,
        "output_tokens": sum(comp),
        "output_tok_s": sum(comp) / duration_s if duration_s > 0 else 0.0,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
    }
    for name, xs in (
        ("ttft_s", [r.ttft_s for r in ok if r.ttft_s is not None]),
        ("itl_s", [g for r in ok for g in r.itl_s]),
        ("tpot_s", [r.tpot_s for r in ok if r.tpot_s is not None]),
        ("latency_s", [r.latency_s for r in ok]),
    ):
        for q in (50, 90, 99):
            s[f"{name}_p{q}"] = _pct(xs, q)
    spec = [r for r in ok if r.meta.get("spec_verify_ct") is not None]
    s["speculative"] = bool(spec)
    if spec:
        vct = [int(r.meta["spec_verify_ct"]) for r in spec]
        cycles = [_cycles_from_histogram(r.meta.get("spec_correct_drafts_histogram") or [])
                  for r in spec]  # fmt: skip
        hists = [list(r.meta.get("spec_correct_drafts_histogram") or []) for r in spec]
        width = max([len(h) for h in hists] + [(num_steps or 0) + 1])  # SGLang trims zeros
        hist = [sum(h[i] if i < len(h) else 0 for h in hists) for i in range(width)]
        s.update(
            {
                "spec_verify_ct": sum(vct),
                # SGLang's convention: completion tokens (prefill's counted) / verify count
                "pooled_tau_sglang": metrics.pooled_tau_sglang(
                    [r.completion_tokens for r in spec], vct
                ),  # fmt: skip
                # the engine's convention: decode tokens (prefill's excluded) / verify count
                "pooled_tau": metrics.pooled_tau(cycles),
                "mean_request_tau (mean of per-request tau, not pooled)": metrics.mean_request_tau(
                    cycles
                ),  # fmt: skip
                "mean_request_spec_accept_length (mean of per-request, not pooled)": (
                    sum(r.meta["spec_accept_length"] for r in spec) / len(spec)
                ),  # fmt: skip
                "spec_correct_drafts_histogram": hist,
                "acceptance_from_histogram": metrics.acceptance_from_histogram(hist)
                if hist
                else [],  # fmt: skip
            }
        )
    bad = {r.id: r.identity_problems for r in ok if r.identity_problems}
    s["identity_failures"] = bad
    s["identities_ok"] = not bad
    return s


def _run_sync(coro) -> None:
    """asyncio.run, also from inside a running loop (Jupyter): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    errors: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(coro)
        except BaseException as e:  # handed to the caller below
            errors.append(e)

    t = threading.Thread(target=target, name="load-client")
    t.start()
    t.join()
    if errors:
        raise errors[0]


def run_load(
    cfg: LoadConfig,
    reqs: Sequence[LoadRequest],
    out: str | Path | None = None,
    flush: bool = True,
) -> LoadRun:
    """Run the load against `cfg.url`; write `out` (atomically, also when cut short)."""
    if not reqs:
        raise LoadError("no requests to send")
    info, before = _begin(cfg, flush)
    results = [RequestResult(r.id) for r in reqs]
    state: dict[str, Any] = {"duration_s": 0.0, "server_died": False}
    try:
        _run_sync(_run(cfg, reqs, results, state))
        state["ended"] = True
    finally:
        run = _finish(cfg, results, state, info, before, out)
    return run


def run_paired(
    cfgs: dict[str, LoadConfig],
    reqs: Sequence[LoadRequest],
    outs: dict[str, str | Path | None] | None = None,
) -> dict[str, LoadRun]:
    """The same requests through every server in `cfgs`, one request at a time, alternating.

    Request i goes to each server in turn, the order rotated by i, so a shared machine's drift
    (other tenants, clock, cache state) hits every server alike: compared one server after
    the other, one draft's served speedup over plain ranged 0.97-1.31x between runs here.
    Each server's throughput counts its own requests' time only; `start_s` is on the common
    clock of the whole paired run. Needs concurrency 1 and no arrival rate (`run_load` serves
    other load shapes, one server after another). A server that dies ends the run for all;
    every results file is still written (status `partial`).
    """
    if not reqs:
        raise LoadError("no requests to send")
    if not cfgs:
        raise LoadError("no servers to load")
    for name, c in cfgs.items():
        if c.concurrency != 1 or c.request_rate != float("inf"):
            raise LoadError(
                f"paired load alternates single requests: server {name!r} has concurrency "
                f"{c.concurrency} and request_rate {c.request_rate}; use concurrency 1 and no "
                "rate, or run_load for each server in turn"
            )
    outs = outs or {}
    names = list(cfgs)
    begun = {n: _begin(cfgs[n], True) for n in names}
    results = {n: [RequestResult(r.id) for r in reqs] for n in names}
    states = {n: {"duration_s": 0.0, "server_died": False} for n in names}
    t0 = time.perf_counter()
    try:
        for i, req in enumerate(reqs):
            if any(st["server_died"] for st in states.values()):
                break
            for n in names[i % len(names) :] + names[: i % len(names)]:
                one: dict[str, Any] = {}
                _run_sync(_run(cfgs[n], [req], results[n][i : i + 1], one))
                results[n][i].start_s += one["t_run"] - t0
                states[n]["duration_s"] += one["duration_s"]
                states[n]["server_died"] = one["server_died"]
                if one["server_died"]:
                    break
        dead = [n for n in names if states[n]["server_died"]]
        for n in names:
            states[n]["ended"] = True
            if dead and n not in dead:
                states[n]["stopped"] = f"stopped early: server {dead[0]!r} died mid-load"
    finally:
        runs = {n: _finish(cfgs[n], results[n], states[n], *begun[n], outs.get(n)) for n in names}
    return runs


def _begin(cfg: LoadConfig, flush: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Check the server is up, flush its cache; its info and metrics before the load."""
    if not healthy(cfg.url, 10.0):
        raise LoadError(f"no healthy server at {cfg.url} (GET /health); start one or fix --url")
    if flush:
        flush_cache(cfg.url)
    return get_server_info(cfg.url), get_metrics(cfg.url)


def _finish(cfg: LoadConfig, results: list[RequestResult], state: dict[str, Any],
            info: dict[str, Any], before: dict[str, float], out: str | Path | None) -> LoadRun:  # fmt: skip
    """Summary, status and the server's counters over the run; written to `out` atomically."""
    status = "partial"
    if state["server_died"]:
        reason = "server died mid-load: completed requests kept, the rest failed or unsent"
    elif not state.get("ended"):
        reason = "interrupted"  # the load did not run to its end (Ctrl-C, an error)
    elif state.get("stopped"):
        reason = state["stopped"]
    elif any(not r.ok for r in results):
        reason = "some requests failed: see their error"
    else:
        status, reason = "complete", ""
    summary = summarize(results, state["duration_s"], info.get("speculative_num_steps"))
    if not state["server_died"] and healthy(cfg.url, 3.0):
        after = get_metrics(cfg.url)
        summary["server_metrics_delta"] = {k: after[k] - before.get(k, 0.0) for k in after
                                           if k.endswith("_total")}  # fmt: skip
        summary["server_metrics_after"] = after
        info = get_server_info(cfg.url)
    conf = asdict(cfg)
    if conf["request_rate"] == float("inf"):
        conf["request_rate"] = None  # JSON has no infinity: None = no limit
    run = LoadRun(status, reason, conf, summary, results, info)
    if out is not None:
        run.path = Path(out)
        run.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run.path, run.to_dict(), sort_keys=False)
    return run


def format_summary(run: LoadRun) -> str:
    """A few lines for the terminal."""
    s = run.summary
    lines = [f"{run.status}{': ' + run.reason if run.reason else ''}",
             f"{s['n_ok']}/{s['n_requests']} requests ok in {s['duration_s']:.1f} s: "
             f"{s['output_tok_s']:.1f} output tok/s"]  # fmt: skip
    if s.get("ttft_s_p50") is not None:
        lines.append(f"TTFT p50/p90/p99 {s['ttft_s_p50']:.3f}/{s['ttft_s_p90']:.3f}/"
                     f"{s['ttft_s_p99']:.3f} s")  # fmt: skip
    if s.get("itl_s_p50") is not None:
        lines.append(f"ITL (per chunk) p50/p90/p99 {s['itl_s_p50'] * 1e3:.1f}/"
                     f"{s['itl_s_p90'] * 1e3:.1f}/{s['itl_s_p99'] * 1e3:.1f} ms")  # fmt: skip
    if s.get("speculative"):
        lines.append(f"accept length pooled: tau_sglang {s['pooled_tau_sglang']:.3f}, "
                     f"tau {s['pooled_tau']:.3f}")  # fmt: skip
    if not s["identities_ok"]:
        lines.append(f"SGLang identities FAILED on {len(s['identity_failures'])} requests")
    if run.path:
        lines.append(f"results: {run.path}")
    return "\n".join(lines)
