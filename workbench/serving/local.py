"""The embedded engine behind the subset of SGLang's HTTP API the workbench uses.

`GET /health`, `POST /generate` (SGLang's request and response shape, `meta_info` with the
`spec_*` fields), `GET /metrics` (Prometheus text, SGLang's metric names), `GET /server_info`
(`internal_states[0].avg_spec_accept_length`), `POST /flush_cache`: clients talk to it as to SGLang.

Batch 1: one engine serves requests one at a time under a lock (a queued request's TTFT and
latency include its wait). Plain decoding is the same engine with `draft=None`: a fair baseline.

Figures follow SGLang's semantics (formulas in `workbench/metrics.py`): `spec_verify_ct` counts
target verify forwards (the prefill is not one), `completion_tokens` counts the prefill's token,
`spec_accept_length` = completion_tokens / spec_verify_ct (`tau_sglang`),
`spec_num_proposed_drafts` = num_steps per verify (the deepest a cycle can accept),
`spec_accept_rate` = correct / proposed, `spec_correct_drafts_histogram[i]` = cycles that
accepted exactly i draft tokens. The `/metrics` gauges `spec_accept_length`/`spec_accept_rate`
hold the last request's values (SGLang's are last-value gauges too); `avg_spec_accept_length`
in `/server_info` is pooled since start or the last `/flush_cache`.

Run it: `python -m workbench.serving.local --model-path smollm2-135m --speculative-algorithm
EAGLE3 --speculative-draft-model-path DRAFT --port 0` (`sglang.launch_server`'s flag names),
`workbench serve --backend local`, or `LocalServer(engine).start()` in a thread.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from workbench import metrics
from workbench.errors import InUseError, WorkbenchError
from workbench.serving import prom

LOOPBACK = "127.0.0.1"
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
ALGORITHMS = ("EAGLE3",)
# sampling params the engine honours, and the ones accepted only at their no-op value
SAMPLING_KEYS = {"max_new_tokens", "temperature", "ignore_eos", "stop_token_ids", "sampling_seed",
                 "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}  # fmt: skip
NOOP_SAMPLING = {"top_p": (1.0,), "top_k": (-1, 0, 1 << 30), "min_p": (0.0,), "n": (1,),
                 "frequency_penalty": (0.0,), "presence_penalty": (0.0,),
                 "repetition_penalty": (1.0,), "min_new_tokens": (0,)}  # fmt: skip


class LocalServerError(WorkbenchError):
    """Bad settings for the local server (speculation, draft, target)."""


class BadRequest(WorkbenchError):
    """A /generate request the local backend cannot serve; answered with HTTP 400."""


# ---------------------------------------------------------------- configuration


@dataclass
class LocalConfig:
    """What to serve. `draft` empty (or algorithm None) serves plain decoding."""

    model_path: str = "smollm2-135m"
    draft: str = ""
    speculative_algorithm: str | None = "EAGLE3"
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    dtype: str = "float32"
    seed: int = 0
    trace_path: str | None = None
    trace_hidden: bool = False  # the trace also records per-aux-layer norms (live wiring check)
    model_name: str | None = None

    @property
    def speculative(self) -> bool:
        return bool(self.draft) and self.speculative_algorithm is not None

    def argv(self, host: str = LOOPBACK, port: int = 0) -> list[str]:
        """The `python -m workbench.serving.local` command line serving this config."""
        a = [sys.executable, "-m", "workbench.serving.local", "--model-path", self.model_path,
             "--dtype", self.dtype, "--random-seed", str(self.seed), "--host", host,
             "--port", str(port)]  # fmt: skip
        if self.speculative:
            a += ["--speculative-algorithm", str(self.speculative_algorithm),
                  "--speculative-draft-model-path", self.draft]  # fmt: skip
            for flag, v in (("--speculative-num-steps", self.num_steps),
                            ("--speculative-eagle-topk", self.eagle_topk),
                            ("--speculative-num-draft-tokens", self.num_draft_tokens)):  # fmt: skip
                if v is not None:
                    a += [flag, str(v)]
        if self.trace_path:
            a += ["--trace-path", str(self.trace_path)]
            if self.trace_hidden:
                a.append("--trace-hidden")
        if self.model_name:
            a += ["--served-model-name", self.model_name]
        return a


def resolve_spec(cfg: LocalConfig):
    """Validate the speculation settings before anything loads; SpecParams or None."""
    from workbench.engine import SpecError, resolve_params

    alg = cfg.speculative_algorithm
    if alg is not None and alg not in ALGORITHMS:
        raise LocalServerError(
            f"speculative_algorithm {alg!r} is not served by the local backend; use one of "
            f"{ALGORITHMS} or none (plain decoding)"
        )
    if not cfg.speculative:
        given = [v for v in (cfg.num_steps, cfg.eagle_topk, cfg.num_draft_tokens) if v is not None]
        if given and alg is not None:
            raise LocalServerError(
                "speculation settings given without a draft: pass --speculative-draft-model-path "
                "(a draft export or training run) or drop the speculative flags"
            )
        return None
    try:
        return resolve_params(cfg.num_steps, cfg.eagle_topk, cfg.num_draft_tokens)
    except SpecError as e:
        raise LocalServerError(f"bad speculation settings: {e}") from e


def load_draft_model(path: str, target, dtype: str = "float32"):
    """(draft, canonical layer ids or None) through the one loader, checked against `target`.

    A draft trained on another target (fingerprint recorded at training/export) is refused."""
    import torch

    from workbench.draft.load import load_draft

    # no target_model: the engine's check_draft fills the embeddings after the shape checks
    loaded = load_draft(path, dtype=getattr(torch, dtype))
    draft, prov, ids = loaded.draft, loaded.provenance, loaded.layer_ids
    prov = prov or {}
    fp = prov.get("target_fingerprint") or (prov.get("target") or {}).get("fingerprint")
    if fp and target.fingerprint and fp != target.fingerprint:
        raise LocalServerError(
            f"draft {path} was trained on a target with fingerprint {fp}, but {target.name} has "
            f"{target.fingerprint}: serve it with the target it was trained on"
        )
    return draft.to(getattr(torch, dtype)).eval(), ids


def load_engine(cfg: LocalConfig, targets: dict | None = None) -> LocalEngine:
    """Load target (+ draft) and check they fit; every user-fixable failure is a WorkbenchError.
    Engines given one `targets` dict share a target of the same path and dtype (paired servers)."""
    from workbench.engine import SpecError, TraceWriter
    from workbench.llama import Llama
    from workbench.target import TargetError, load_target

    params = resolve_spec(cfg)  # fail fast, before seconds of loading
    targets = {} if targets is None else targets
    if (key := (str(cfg.model_path), cfg.dtype)) not in targets:
        try:
            tgt = load_target(cfg.model_path)
        except TargetError as e:
            raise LocalServerError(f"cannot load target {cfg.model_path!r}: {e}") from e
        targets[key] = (tgt, Llama(tgt.model, cfg.dtype))
    tgt, llm = targets[key]
    draft = ids = None
    if params is not None:
        try:
            draft, ids = load_draft_model(cfg.draft, tgt, cfg.dtype)
        except (FileNotFoundError, ValueError) as e:
            if isinstance(e, LocalServerError):
                raise
            raise LocalServerError(f"cannot load draft {cfg.draft!r}: {e}") from e
    trace = None
    if cfg.trace_path and params is not None:
        trace = TraceWriter(cfg.trace_path, hidden_norms=cfg.trace_hidden)
    try:
        return LocalEngine(llm, tgt.tokenizer, draft, params, model_path=str(cfg.model_path),
                           draft_path=cfg.draft or None, trace=trace, seed=cfg.seed,
                           model_name=cfg.model_name, layer_ids=ids)  # fmt: skip
    except SpecError as e:
        raise LocalServerError(
            f"draft {cfg.draft} does not fit target {cfg.model_path}: {e}"
        ) from e


# ---------------------------------------------------------------- engine


class LocalEngine:
    """One `SpecDecoder` (or plain decoding) answering SGLang-shaped requests, one at a time."""

    def __init__(
        self,
        llm,
        tokenizer,
        draft=None,
        params=None,
        *,
        model_path: str = "",
        draft_path: str | None = None,
        trace=None,
        seed: int = 0,
        model_name: str | None = None,
        layer_ids=None,
    ) -> None:
        from workbench.data import eos_ids
        from workbench.engine import SpecDecoder

        self.tokenizer, self.params = tokenizer, params if draft is not None else None
        self.model_path, self.draft_path = model_path, draft_path
        self.model_name = model_name or model_path
        self.decoder = SpecDecoder(
            llm, draft, self.params, seed=seed, trace=trace, layer_ids=layer_ids
        )
        self.eos = eos_ids(tokenizer) if tokenizer is not None else []
        self.stats = prom.ServerStats()
        self._lock = threading.Lock()  # the engine (batch 1)
        self._stats_lock = threading.Lock()
        self.started = time.time()

    @property
    def speculative(self) -> bool:
        return self.params is not None

    # -- requests -------------------------------------------------------------------

    def parse(self, req: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        """Prompt ids and sampling settings of one request; BadRequest says what is wrong."""
        if not isinstance(req, dict):
            raise BadRequest("the request body must be a JSON object")
        text, ids = req.get("text"), req.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("give exactly one of 'text' or 'input_ids'")
        if isinstance(text, list) or (ids and isinstance(ids[0], list)):
            raise BadRequest("batched requests are not served by the local backend (batch 1); "
                             "send one request per prompt")  # fmt: skip
        if text is not None:
            if self.tokenizer is None:
                raise BadRequest("this server has no tokenizer; send 'input_ids'")
            ids = self.tokenizer.encode(str(text))
        if not ids or not all(isinstance(t, int) for t in ids):
            raise BadRequest("'input_ids' must be a non-empty list of token ids")
        sp = dict(req.get("sampling_params") or {})
        unknown = sorted(set(sp) - SAMPLING_KEYS - set(NOOP_SAMPLING))
        if unknown:
            raise BadRequest(f"sampling_params {unknown} are not supported by the local backend; "
                             f"supported: {sorted(SAMPLING_KEYS | set(NOOP_SAMPLING))}")  # fmt: skip
        for k, ok in NOOP_SAMPLING.items():
            if k in sp and sp[k] not in ok:
                raise BadRequest(f"sampling_params.{k}={sp[k]!r} is not supported by the local "
                                 f"backend (only {ok[0]!r})")  # fmt: skip
        mnt = sp.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if not isinstance(mnt, int) or mnt < 1:
            raise BadRequest(f"sampling_params.max_new_tokens must be an int >= 1, got {mnt!r}")
        temp = float(sp.get("temperature", 1.0))  # SGLang's default is 1.0
        if temp < 0:
            raise BadRequest(f"sampling_params.temperature must be >= 0, got {temp}")
        eos = [] if sp.get("ignore_eos") else list(self.eos)
        eos += [int(t) for t in sp.get("stop_token_ids") or []]
        return [int(t) for t in ids], {
            "max_new_tokens": mnt,
            "temperature": 0.0 if temp < 1e-6 else temp,  # SGLang: below 1e-6 is greedy
            "eos": eos,
            "seed": sp.get("sampling_seed"),
            "skip_special_tokens": sp.get("skip_special_tokens", True),
        }

    def generate(
        self,
        req: dict[str, Any],
        on_chunk: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Serve one request; `on_chunk` gets SGLang-style stream chunks (cumulative text/ids)."""
        t_arrive = time.perf_counter()
        ids, sp = self.parse(req)
        rid = str(req.get("rid") or uuid.uuid4().hex)
        out: list[int] = []
        times: list[float] = []
        with self._stats_lock:
            self.stats.queued += 1
        try:
            with self._lock:
                with self._stats_lock:
                    self.stats.queued -= 1
                    self.stats.running += 1
                dec = self.decoder
                dec.temperature = sp["temperature"]
                if sp["seed"] is not None:
                    dec.gen.manual_seed(int(sp["seed"]))

                def emit(new: list[int]) -> None:
                    out.extend(new)
                    times.append(time.perf_counter())
                    if on_chunk is not None:
                        on_chunk(self._response(rid, ids, out, sp, None, t_arrive))

                g = dec.generate(ids, sp["max_new_tokens"], sp["eos"], rid, on_tokens=emit)
        except BaseException:
            with self._stats_lock:
                self.stats.aborted += 1
                self.stats.running = max(0, self.stats.running - 1)
            raise
        resp = self._response(rid, ids, g.tokens, sp, g.stats, t_arrive)
        self._account(resp["meta_info"], times, t_arrive)
        return resp

    def _response(self, rid, ids, out, sp, st, t_arrive) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "finish_reason": None,
            "e2e_latency": time.perf_counter() - t_arrive,
        }
        if st is not None:
            last = out[-1] if out else None
            meta["finish_reason"] = (
                {"type": "stop", "matched": last}
                if last in sp["eos"]
                else {"type": "length", "length": sp["max_new_tokens"]}
            )
            if self.speculative:
                meta.update(metrics.sglang_spec_meta(len(out), st.accepted, self.params.num_steps))
        text = self.tokenizer.decode(out, skip_special_tokens=sp["skip_special_tokens"]) if (
            self.tokenizer is not None) else ""  # fmt: skip
        return {"text": text, "output_ids": list(out), "meta_info": meta}

    def _account(self, meta: dict[str, Any], times: list[float], t_arrive: float) -> None:
        s = self.stats
        with self._stats_lock:
            s.running = max(0, s.running - 1)
            s.requests += 1
            s.prompt_tokens += meta["prompt_tokens"]
            s.generation_tokens += meta["completion_tokens"]
            if times:
                s.ttft.observe(times[0] - t_arrive)
                for a, b in zip(times[:-1], times[1:], strict=True):
                    s.itl.observe(b - a)
            s.e2e.observe(meta["e2e_latency"])
            if len(times) > 1 and times[-1] > times[0]:
                s.last_gen_throughput = (meta["completion_tokens"] - 1) / (times[-1] - times[0])
            vct = meta.get("spec_verify_ct")
            if vct is not None:
                s.verify_calls += vct
                s.flushed_completion += meta["completion_tokens"]
                s.flushed_verify += vct
                s.last_accept_length = meta["spec_accept_length"]
                s.last_accept_rate = meta["spec_accept_rate"]

    # -- other endpoints --------------------------------------------------------------

    def flush_cache(self) -> None:
        """Reset the pooled accept length (the engine keeps no cache between requests)."""
        with self._stats_lock:
            self.stats.flushed_completion = self.stats.flushed_verify = 0

    def server_info(self) -> dict[str, Any]:
        s, p = self.stats, self.params
        with self._stats_lock:
            avg = metrics.tau_sglang(s.flushed_completion, s.flushed_verify)
            state = {"avg_spec_accept_length": avg if p else None,
                     "last_gen_throughput": s.last_gen_throughput}  # fmt: skip
        return {
            "version": "workbench-local",
            "backend": "local",
            "model_path": self.model_path,
            "served_model_name": self.model_name,
            "tp_size": 1,
            "max_running_requests": 1,
            "speculative_algorithm": "EAGLE3" if p else None,
            "speculative_draft_model_path": self.draft_path if p else None,
            "speculative_num_steps": p.num_steps if p else None,
            "speculative_eagle_topk": p.eagle_topk if p else None,
            "speculative_num_draft_tokens": p.num_draft_tokens if p else None,
            "dtype": str(self.decoder.llm.dtype).replace("torch.", ""),
            "internal_states": [state],
        }

    def metrics_text(self) -> str:
        """Prometheus exposition with SGLang's metric names."""
        p = self.params
        with self._stats_lock:
            return prom.render(self.stats, self.model_name, p.num_steps if p else 0,
                               p.num_draft_tokens if p else 0)  # fmt: skip


# ---------------------------------------------------------------- HTTP


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer
    _headers_sent = False

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except (ConnectionResetError, BrokenPipeError):  # a client dropped its keep-alive
            self.close_connection = True

    def end_headers(self) -> None:
        self._headers_sent = True
        super().end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        if not self.server.quiet:
            super().log_message(format, *args)

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, code: int, obj: Any) -> None:
        self._send(code, json.dumps(obj).encode())

    def _error(self, code: int, msg: str) -> None:
        kind = "BadRequest" if code == 400 else "NotFound" if code == 404 else "InternalError"
        self._json(code, {"object": "error", "message": msg, "type": kind, "code": code})

    def do_GET(self) -> None:  # noqa: N802
        eng, path = self.server.engine, self.path.split("?")[0]
        if path in ("/health", "/health_generate"):
            self._send(200, b"")
        elif path in ("/server_info", "/get_server_info"):
            self._json(200, eng.server_info())
        elif path == "/get_model_info":
            self._json(200, {"model_path": eng.model_path, "is_generation": True})
        elif path == "/metrics":
            self._send(200, eng.metrics_text().encode(), "text/plain; version=0.0.4")
        else:
            self._error(404, f"no route GET {path}")

    def do_POST(self) -> None:  # noqa: N802
        eng, path = self.server.engine, self.path.split("?")[0]
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if path == "/flush_cache":
            eng.flush_cache()
            self._send(200, b"Cache flushed.\n", "text/plain")
            return
        if path != "/generate":
            self._error(404, f"no route POST {path}")
            return
        try:
            req = json.loads(raw or b"{}")
            if isinstance(req, dict) and req.get("stream"):
                eng.parse(req)  # a bad request gets a 400, not a broken stream
                self._stream(req)
            else:
                self._json(200, eng.generate(req))
        except (BadRequest, json.JSONDecodeError) as e:
            self._error(400, str(e))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away: the request was aborted
        except Exception as e:  # an engine failure: say so to the client, keep the traceback
            traceback.print_exc()
            if not self._headers_sent:
                self._error(500, f"{type(e).__name__}: {e}")
            self.close_connection = True

    def _stream(self, req: dict[str, Any]) -> None:
        """Server-sent events, chunked: `data: {...}` per committed batch, then `data: [DONE]`."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(obj: Any) -> None:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode())
            data += b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        final = self.server.engine.generate(req, on_chunk=chunk)  # a closed socket aborts it
        chunk(final)
        chunk(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr, engine: LocalEngine, quiet: bool) -> None:
        self.engine, self.quiet = engine, quiet
        super().__init__(addr, _Handler)


class LocalServer:
    """The engine on `host:port` (port 0: a free one). `start()` serves in a daemon thread."""

    def __init__(
        self, engine: LocalEngine, host: str = LOOPBACK, port: int = 0, quiet: bool = True
    ) -> None:
        try:
            self.httpd = _HTTPServer((host, port), engine, quiet)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise InUseError(
                    f"port {port} on {host} is in use (another server?); stop it, pick another "
                    "--port, or pass --port 0 for a free one"
                ) from e
            raise LocalServerError(f"cannot listen on {host}:{port}: {e}") from e
        self.engine = engine
        self.host, self.port = host, int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> LocalServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name=f"local-server-{self.port}")  # fmt: skip
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        try:
            self.httpd.serve_forever()
        finally:
            self.httpd.server_close()

    def stop(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> tuple[LocalConfig, str, int]:
    ap = argparse.ArgumentParser(prog="python -m workbench.serving.local", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model-path", default="smollm2-135m", help="HF dir, .gguf or smollm2-135m")
    ap.add_argument("--speculative-algorithm", default=None, help="EAGLE3, or omit for plain")
    ap.add_argument("--speculative-draft-model-path", default="", help="draft export or run dir")
    ap.add_argument("--speculative-num-steps", type=int, default=None)
    ap.add_argument("--speculative-eagle-topk", type=int, default=None)
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--random-seed", type=int, default=0)
    ap.add_argument("--host", default=LOOPBACK)
    ap.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    ap.add_argument("--trace-path", default=None, help="write the per-cycle trace (JSON lines)")
    ap.add_argument(
        "--trace-hidden",
        action="store_true",
        help="the trace also records per-aux-layer norms (live wiring check)",
    )
    ap.add_argument("--served-model-name", default=None)
    a = ap.parse_args(argv)
    alg = a.speculative_algorithm
    if alg is None and a.speculative_draft_model_path:
        alg = "EAGLE3"  # a draft without an algorithm: the only one served here
    cfg = LocalConfig(
        model_path=a.model_path, draft=a.speculative_draft_model_path,
        speculative_algorithm=None if (alg or "").lower() in ("", "none") else alg,
        num_steps=a.speculative_num_steps, eagle_topk=a.speculative_eagle_topk,
        num_draft_tokens=a.speculative_num_draft_tokens, dtype=a.dtype, seed=a.random_seed,
        trace_path=a.trace_path, trace_hidden=a.trace_hidden, model_name=a.served_model_name,
    )  # fmt: skip
    return cfg, a.host, a.port


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, host, port = parse_args(argv)
        resolve_spec(cfg)
        server = LocalServer(load_engine(cfg), host, port, quiet=False)
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mode = f"EAGLE3 {server.engine.params}" if server.engine.speculative else "no speculation"
    print(f"workbench local server ({mode}) on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
