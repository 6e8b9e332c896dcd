"""SGLang as the serving backend: a typed spec → the exact launch command, checked, launched.

`ServeSpec` says what to serve (target, EAGLE-3 draft, steps/topk/draft tokens, tensor
parallelism, dtype, memory fraction, extra flags, environment such as NCCL variables).
`command(spec)` gives the exact `python -m sglang.launch_server ...` argv and environment;
`validate(spec)` checks it with SGLang's own rules (sglang.md) and, when the server
environment is installed, with SGLang's own parser (`ServerArgs.add_cli_args`, run in
`.venv-sglang` by a subprocess since that environment pins another torch), so a TP=8 command
written here is one SGLang accepts. `launch` starts it through `process` (own process group,
log file, /health deadline, no orphans); `attach` connects to a running server by URL.

On a CPU (`device="cpu"`) the command runs the real SGLang with the test support in
`support/sglang_cpu` (a pure-torch `sgl_kernel` and a launcher that keeps `intel_amx`
attention without AMX; see its README): `SGLANG_USE_CPU_ENGINE=1`, the support folder first
on PYTHONPATH, `intel_amx` attention for EAGLE (torch_native for plain serving), no CUDA
graphs, a small KV pool, no warm-up, metrics on, loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError
from workbench.serving import process
from workbench.serving.process import LOOPBACK, Server, ServerError

SGLANG_VERSION = "0.5.23"
ALGORITHMS = ("EAGLE3", "EAGLE")
REPO_ROOT = Path(__file__).resolve().parents[2]
CPU_SUPPORT = REPO_ROOT / "support" / "sglang_cpu"
CPU_LAUNCHER = "sglang_cpu_launch"  # module in CPU_SUPPORT
CPU_FLAGS = ["--disable-cuda-graph", "--max-total-tokens", "4096", "--skip-server-warmup"]

RULE_ALL_OR_NONE = (
    "set all three of --speculative-num-steps, --speculative-eagle-topk, "
    "--speculative-num-draft-tokens, or none of them (SGLang then picks them per architecture)"
)
RULE_TOPK1 = (
    "--speculative-eagle-topk 1 forces --speculative-num-draft-tokens = num_steps + 1 "
    "(SGLang silently adjusts any other value)"
)
RULE_HARD_LIMIT = "num_draft_tokens - 1 <= topk + (num_steps - 1) * topk^2"
RULE_CUDA_GRAPH_MAX_BS = (
    "--cuda-graph-max-bs is gone in SGLang 0.5.23 (an ambiguous prefix: argparse exits); "
    "use --cuda-graph-max-bs-decode"
)


class ServeSpecError(WorkbenchError):
    """A serve spec SGLang would reject (or silently change); the message names the rule."""


@dataclass
class ServeSpec:
    """What to serve with SGLang. `draft=None` serves plain decoding.

    The three speculation numbers are all set or all None (SGLang chooses). `env` is added to
    the server's environment (e.g. NCCL_ALGO, NCCL_PROTO, NCCL_MIN_NCHANNELS, NCCL_DEBUG).
    `extra_args` are passed verbatim after the generated flags.
    """

    target: str
    draft: str | None = None
    speculative_algorithm: str | None = "EAGLE3"
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    tp_size: int = 1
    dtype: str = "auto"
    mem_fraction_static: float | None = None
    device: str = "cuda"
    host: str = LOOPBACK
    port: int | None = None  # None: a free port at launch (or 30000 in a printed command)
    attention_backend: str | None = None  # None: SGLang's choice (CPU: see module doc)
    enable_metrics: bool = True
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    trace_dir: str | None = None  # set: the workbench_trace plugin writes the per-cycle trace here
    trace_hidden: bool = False  # the trace also records per-aux-layer norms (live wiring check)

    @property
    def speculative(self) -> bool:
        return self.draft is not None and self.speculative_algorithm is not None

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    def url(self) -> str:
        return f"http://{self.host}:{self.port if self.port is not None else 30000}"


# ---------------------------------------------------------------- the command


def sglang_args(spec: ServeSpec) -> list[str]:
    """The arguments after `python -m sglang.launch_server` (what SGLang's parser sees)."""
    a = ["--model-path", str(spec.target), "--tp-size", str(spec.tp_size), "--dtype", spec.dtype]
    if spec.speculative:
        a += ["--speculative-algorithm", str(spec.speculative_algorithm),
              "--speculative-draft-model-path", str(spec.draft)]  # fmt: skip
        for flag, v in (("--speculative-num-steps", spec.speculative_num_steps),
                        ("--speculative-eagle-topk", spec.speculative_eagle_topk),
                        ("--speculative-num-draft-tokens", spec.speculative_num_draft_tokens)):  # fmt: skip
            if v is not None:
                a += [flag, str(v)]
    if spec.mem_fraction_static is not None:
        a += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    backend = spec.attention_backend
    if spec.cpu:
        a += ["--device", "cpu"]
        backend = backend or ("intel_amx" if spec.speculative else "torch_native")
        a += [f for f in CPU_FLAGS if f not in spec.extra_args]
    if backend:
        a += ["--attention-backend", backend]
    if spec.enable_metrics:
        a.append("--enable-metrics")
    a += ["--host", spec.host, "--port", str(spec.port if spec.port is not None else 30000)]
    return a + list(spec.extra_args)


def server_env(spec: ServeSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: `base` (default ours) + the spec's + what CPU mode needs."""
    env = dict(os.environ if base is None else base)
    env.update({k: str(v) for k, v in spec.env.items()})
    if spec.trace_dir is not None:
        from workbench.serving import plugin

        env.update(plugin.trace_env(spec.trace_dir, spec.trace_hidden, env.get("SGLANG_PLUGINS")))
    if spec.cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # without it the scheduler imports vllm and dies
        old = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = str(CPU_SUPPORT) + (os.pathsep + old if old else "")
        if spec.tp_size > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in spec.env:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = _split_cores(spec.tp_size)
        if spec.tp_size > 1 and "SGLANG_NCCL_SO_PATH" not in spec.env:
            # torch 2.14.1's CUDA build brings libnccl, so SGLang would build a PyNccl
            # communicator on the cpu device and die; without it the ranks all-reduce with
            # torch.distributed (gloo), which SGLang uses on CPUs without AMX anyway.
            env["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl-disabled-on-cpu.so.2"
    return env


def _split_cores(n: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for n CPU ranks on this machine: cores split evenly."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n:
        raise ServeSpecError(
            f"tp_size {n} on CPU needs at least {n} cores; this process may use {len(cores)}"
        )
    per = len(cores) // n
    groups = [cores[i * per : (i + 1) * per] for i in range(n)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def command(spec: ServeSpec, python: str | os.PathLike | None = None) -> list[str]:
    """The exact argv: `PY -m sglang.launch_server ARGS` (on CPU the support launcher, which
    runs sglang.launch_server with the same ARGS)."""
    py = str(python or server_python() or "python")
    module = CPU_LAUNCHER if spec.cpu else "sglang.launch_server"
    return [py, "-m", module, *sglang_args(spec)]


def shell_line(spec: ServeSpec, python: str | None = None) -> str:
    """The command as one copy-pasteable line, environment variables from the spec first."""
    import shlex

    env = [f"{k}={shlex.quote(str(v))}" for k, v in sorted(spec.env.items())]
    return " ".join(env + [shlex.quote(a) for a in command(spec, python)])


def server_python() -> Path | None:
    """The server environment's interpreter: $WORKBENCH_SGLANG_PYTHON, else the checkout's
    `.venv-sglang` (made by `make sglang-env`); None when neither exists."""
    env = os.environ.get("WORKBENCH_SGLANG_PYTHON")
    if env:
        return Path(env)
    p = REPO_ROOT / ".venv-sglang" / "bin" / "python"
    return p if p.exists() else None


# ---------------------------------------------------------------- validation


def check_rules(spec: ServeSpec) -> None:
    """SGLang's rules from sglang.md, without SGLang; ServeSpecError names the broken one."""
    alg = spec.speculative_algorithm
    nums = (spec.speculative_num_steps, spec.speculative_eagle_topk,
            spec.speculative_num_draft_tokens)  # fmt: skip
    if alg is not None and alg not in ALGORITHMS:
        raise ServeSpecError(f"speculative_algorithm {alg!r}: the workbench serves {ALGORITHMS}")
    if spec.draft is None and any(v is not None for v in nums):
        raise ServeSpecError("speculation settings given without a draft: set draft or drop them")
    if spec.speculative and alg == "EAGLE":
        warnings.warn(
            "speculative_algorithm EAGLE on an EAGLE-3 head skips fc and the aux states "
            "(tau ~ 1); use EAGLE3",
            stacklevel=2,
        )
    if any(v is not None for v in nums) and any(v is None for v in nums):
        raise ServeSpecError(f"SGLang rule: {RULE_ALL_OR_NONE}; got steps/topk/ndt = {nums}")
    if all(v is not None for v in nums):
        s, k, n = (int(v) for v in nums)  # type: ignore[arg-type]
        if min(s, k, n) < 1:
            raise ServeSpecError(f"steps/topk/draft tokens must be >= 1, got {s}/{k}/{n}")
        if k == 1 and n != s + 1:
            raise ServeSpecError(
                f"SGLang rule: {RULE_TOPK1}; got num_steps={s}, num_draft_tokens={n}: "
                f"use num_draft_tokens={s + 1}"
            )
        if n - 1 > k + (s - 1) * k * k:
            raise ServeSpecError(
                f"SGLang rule: {RULE_HARD_LIMIT}; got num_draft_tokens={n}, topk={k}, "
                f"num_steps={s}: {n - 1} > {k + (s - 1) * k * k}"
            )
    if spec.tp_size < 1:
        raise ServeSpecError(f"tp_size must be >= 1, got {spec.tp_size}")
    if spec.mem_fraction_static is not None and not 0 < spec.mem_fraction_static < 1:
        raise ServeSpecError(
            f"mem_fraction_static must be in (0, 1), got {spec.mem_fraction_static}"
        )
    if any(a == "--cuda-graph-max-bs" or a.startswith("--cuda-graph-max-bs=")
           for a in spec.extra_args):  # fmt: skip
        raise ServeSpecError(f"SGLang rule: {RULE_CUDA_GRAPH_MAX_BS}")


_PARSE_SCRIPT = """
import argparse, contextlib, io, json, sys
import sglang
from sglang.srt.server_args import ServerArgs
out = []
for argv in json.loads(sys.argv[1]):
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv)
        out.append({"ok": True, "args": vars(ns)})
    except SystemExit:
        out.append({"ok": False, "error": err.getvalue()})
print(json.dumps({"version": sglang.__version__, "results": out}, default=str))
"""


def parse_argvs_with_sglang(
    argvs: list[list[str]], python: str | os.PathLike | None = None
) -> list[dict] | None:
    """Parse each argv (the arguments after `sglang.launch_server`) with SGLang's own
    `ServerArgs.add_cli_args` parser, in the server environment, in one subprocess (importing
    SGLang takes seconds). Per argv: {"ok": True, "args": namespace} or {"ok": False,
    "error": SGLang's message}. None when no server environment is installed."""
    py = python or server_python()
    if py is None:
        return None
    r = subprocess.run(
        [str(py), "-c", _PARSE_SCRIPT, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    )
    if r.returncode != 0:
        tail = r.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise ServeSpecError(f"{py} cannot run SGLang's parser ({tail[0]}); run `make sglang-env`")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for x in res["results"]:
        x["version"] = res["version"]
    return res["results"]


def parse_with_sglang(spec: ServeSpec, python: str | os.PathLike | None = None) -> dict | None:
    """SGLang's parser on this spec's argv: the parsed arguments, None without a server
    environment; a rejected argv raises ServeSpecError with SGLang's own message."""
    res = parse_argvs_with_sglang([sglang_args(spec)], python)
    if res is None:
        return None
    if not res[0]["ok"]:
        lines = [ln for ln in res[0]["error"].splitlines() if ln.strip()]
        msg = next((ln for ln in reversed(lines) if "error:" in ln), lines[-1] if lines else "")
        raise ServeSpecError(f"SGLang {res[0]['version']}'s own parser rejects the command: {msg}")
    return res[0]["args"]


def validate(spec: ServeSpec, python: str | os.PathLike | None = None) -> dict | None:
    """The rules, then SGLang's parser when installed (its parsed args, else None)."""
    check_rules(spec)
    return parse_with_sglang(spec, python)


def draft_problems(spec: ServeSpec) -> list[str]:
    """What in the draft would make SGLang serve it wrong or fail, read without SGLang: the
    workbench loader's strict checks (SGLang skips unknown weight names silently, so a wrong
    key would serve a random weight) and the draft's fit to the target's config."""
    if not spec.speculative:
        return []
    from workbench.draft.errors import DraftImportError
    from workbench.draft.load import load_draft

    if not (Path(spec.draft) / "config.json").is_file():
        return [
            f"{spec.draft} has no config.json: SGLang loads a draft export; make one with "
            "`workbench export --draft RUN --out DIR`"
        ]
    try:
        loaded = load_draft(spec.draft, strict=True)
    except (DraftImportError, FileNotFoundError, ValueError) as e:
        return [str(e)]
    out = []
    tcfg = Path(spec.target) / "config.json"
    if tcfg.is_file():
        t = json.loads(tcfg.read_text())
        c = loaded.draft.config
        if int(t.get("hidden_size", c.target_hidden_size)) != c.target_hidden_size:
            out.append(
                f"draft target_hidden_size {c.target_hidden_size} != the target's hidden_size "
                f"{t['hidden_size']}: fc cannot read this target's aux states"
            )
        if int(t.get("vocab_size", c.vocab_size)) != c.vocab_size:
            out.append(f"draft vocab_size {c.vocab_size} != the target's {t['vocab_size']}")
        n = int(t.get("num_hidden_layers", 0))
        if n and max(loaded.layer_ids.canonical) >= n:
            out.append(
                f"aux layer ids {list(loaded.layer_ids.canonical)} exceed the target's {n} layers"
            )
    return out


# ---------------------------------------------------------------- launch and attach


def launch(
    spec: ServeSpec,
    log_path: str | os.PathLike,
    *,
    deadline_s: float = 600.0,
    python: str | os.PathLike | None = None,
    check_draft: bool = True,
    wait: bool = True,
) -> Server:
    """Validate, start SGLang (free loopback port unless the spec names one), wait for /health.

    The draft is checked first (`draft_problems`); `check_draft=False` leaves it to SGLang.
    `wait=False` returns once started (then `process.wait_healthy`; stop it on any error).
    Failures raise ServeSpecError (bad spec/draft, nothing started) or ServerError (SGLang
    died or never became healthy: the log tail in the message, the process group gone)."""
    py = python or server_python()
    if py is None:
        raise ServerError(
            "no SGLang server environment: run `make sglang-env` (creates .venv-sglang) or set "
            "WORKBENCH_SGLANG_PYTHON to a python with sglang==" + SGLANG_VERSION
        )
    spec = _replace(spec, target=resolve_target(spec.target))
    if spec.port is None:
        spec = _replace(spec, port=process.free_port(spec.host))
    elif process.port_in_use(spec.host, spec.port):
        raise ServerError(f"port {spec.port} on {spec.host} is in use; pick another or omit it")
    check_rules(spec)  # SGLang parses its own argv at start; a rejection surfaces from the log
    if check_draft:
        probs = draft_problems(spec)
        if spec.speculative:
            from workbench.serving.wiring_live import quirk_warnings

            for msg in quirk_warnings(spec.target, spec.draft):
                warnings.warn(msg, stacklevel=2)
        if probs:
            raise ServeSpecError(
                f"draft {spec.draft} would not serve correctly:\n  " + "\n  ".join(probs)
            )
    argv, env = command(spec, py), server_env(spec)
    if not wait:  # the caller does other work, then `process.wait_healthy(server, deadline)`
        return process.launch(argv, Path(log_path), spec.url(), env=env)
    return process.start(argv, Path(log_path), spec.url(), deadline_s=deadline_s, env=env)


def resolve_target(target: str) -> str:
    """The embedded target's name or a .gguf file → its converted HF directory (SGLang loads
    directories); anything else (a directory, a hub id on a GPU cluster) as given."""
    from workbench.target import EMBEDDED_NAME, resolve_target_dir

    if str(target) == EMBEDDED_NAME or str(target).lower().endswith(".gguf"):
        return str(resolve_target_dir(target)[1])
    return str(target)


def _replace(spec: ServeSpec, **kw: Any) -> ServeSpec:
    from dataclasses import replace

    return replace(spec, **kw)


attach = process.attach


# ---------------------------------------------------------------- talking to it


def _json(url: str, body: dict | None = None, timeout: float = 600.0) -> Any:
    req = urllib.request.Request(
        url,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def generate(
    url: str,
    input_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    timeout: float = 600.0,
    return_hidden_states: bool = False,
    **sampling: Any,
) -> dict:
    """One blocking `/generate` request on token ids; SGLang's response (output_ids, meta_info).
    `return_hidden_states`: meta_info["hidden_states"] (the aux states on a capture server)."""
    body = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": {"max_new_tokens": int(max_new_tokens),
                            "temperature": float(temperature), **sampling},
    }  # fmt: skip
    if return_hidden_states:
        body["return_hidden_states"] = True
    return _json(url.rstrip("/") + "/generate", body, timeout)
