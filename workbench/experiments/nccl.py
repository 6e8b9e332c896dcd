"""Communication settings as sweep configs: NCCL / CUDA environment variables and SGLang's
all-reduce backend flags, applied at launch (environment + argv), never inside a process.

A config is `{"env": {NAME: value}, "flags": [--sglang-flag, ...]}`; values are checked
against what NCCL and SGLang accept before anything launches, so a typo fails at once and
not as a silently ignored variable (NCCL ignores unknown values with only a warning).
`allreduce_backend` runs the all-reduce microbenchmark under torchrun per config, the
cheapest real measurement of a setting; a server backend passes the same env and flags to
its launch.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError
from workbench.experiments.sweep import RunConfig, config_key, run_command

# NCCL / CUDA variables the matrix may set, with a check of each value.
NCCL_ALGOS = ("Ring", "Tree", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT")
NCCL_PROTOS = ("LL", "LL128", "Simple")
ENV_VARS = (
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_NVLS_ENABLE",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_BUFFSIZE",
    "CUDA_DEVICE_MAX_CONNECTIONS",
)
# SGLang's communication flags (0.5.23); there is no flag to enable custom all-reduce.
SGLANG_FLAGS = (
    "--disable-custom-all-reduce",
    "--enable-nccl-nvls",
    "--enable-symm-mem",
    "--enable-torch-symm-mem",
    "--enable-mscclpp",
)


class CommConfigError(WorkbenchError):
    """A communication setting NCCL, CUDA or SGLang would not accept."""


def _check_list(name: str, value: str, allowed: Sequence[str]) -> None:
    # NCCL accepts a comma list and a leading ^ to exclude
    items = value.lstrip("^").split(",")
    bad = [x for x in items if x.split(":")[0] not in allowed]
    if bad:
        raise CommConfigError(f"{name}={value}: unknown {bad}; expected some of {list(allowed)}")


def _check_int(name: str, value: str, lo: int, hi: int) -> int:
    try:
        v = int(value)
    except ValueError:
        raise CommConfigError(f"{name}={value}: expected an integer in [{lo}, {hi}]") from None
    if not lo <= v <= hi:
        raise CommConfigError(f"{name}={value}: expected an integer in [{lo}, {hi}]")
    return v


def check(config: dict[str, Any]) -> dict[str, Any]:
    """Validate a communication config; returns it with env values as strings."""
    env = {str(k): str(v) for k, v in (config.get("env") or {}).items()}
    for k, v in env.items():
        if k not in ENV_VARS:
            raise CommConfigError(f"{k} is not in the matrix's variables {list(ENV_VARS)}")
        if k == "NCCL_ALGO":
            _check_list(k, v, NCCL_ALGOS)
        elif k == "NCCL_PROTO":
            _check_list(k, v, NCCL_PROTOS)
        elif k == "NCCL_NVLS_ENABLE":
            _check_int(k, v, 0, 1)
        elif k in ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"):
            _check_int(k, v, 1, 64)
        elif k == "NCCL_BUFFSIZE":
            _check_int(k, v, 1 << 12, 1 << 30)
        elif k == "CUDA_DEVICE_MAX_CONNECTIONS":
            _check_int(k, v, 1, 32)
    lo, hi = env.get("NCCL_MIN_NCHANNELS"), env.get("NCCL_MAX_NCHANNELS")
    if lo and hi and int(lo) > int(hi):
        raise CommConfigError(f"NCCL_MIN_NCHANNELS={lo} > NCCL_MAX_NCHANNELS={hi}")
    flags = list(config.get("flags") or [])
    for f in flags:
        if f not in SGLANG_FLAGS:
            raise CommConfigError(f"{f} is not an SGLang communication flag; expected one of "
                                  f"{list(SGLANG_FLAGS)}")  # fmt: skip
    return {**config, "env": env, "flags": flags}


def env_matrix(
    axes: dict[str, Sequence[Any]] | None = None,
    flags: Sequence[Sequence[str]] = ((),),
    base: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The product of env values and flag sets, the default setting (nothing set) first.

    `axes` maps a variable to values (None = leave unset); `flags` lists flag sets; `base`
    merges other config fields (steps, batch) into every config."""
    axes = axes or {}
    names = list(axes)
    out, seen = [], set()
    for values in itertools.product(*(axes[n] for n in names)):
        env = {n: v for n, v in zip(names, values, strict=True) if v is not None}
        for fl in flags:
            cfg = check({**(base or {}), "env": env, "flags": list(fl)})
            key = config_key(cfg)
            if key not in seen:
                seen.add(key)
                out.append(cfg)
    out.sort(key=lambda c: bool(c["env"]) or bool(c["flags"]))  # the default first
    return out


def launch_env(config: dict[str, Any]) -> dict[str, str]:
    """The environment additions a launch applies for `config`."""
    return dict(check(config)["env"])


def launch_flags(config: dict[str, Any]) -> list[str]:
    """The server argv additions for `config`."""
    return list(check(config)["flags"])


def allreduce_backend(
    out_dir: str | Path,
    *,
    nproc: int = 2,
    sizes: Sequence[int] = (1152, 9216),
    iters: int = 20,
    timeout_s: float = 300.0,
    extra_args: Sequence[str] = (),
) -> RunConfig:
    """`run_config` that runs benchmarks/bench_allreduce.py under torchrun with the config's
    env; returns its rows. SGLang flags have no meaning there and are refused."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_allreduce.py"
    out = Path(out_dir)

    def run(config: dict[str, Any]) -> dict[str, Any]:
        cfg = check(config)
        if cfg["flags"]:
            raise CommConfigError("SGLang flags need a server backend, not the all-reduce bench")
        key = config_key(cfg)
        js = out / f"allreduce-{key}.json"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}", str(script), "--sizes",
                ",".join(map(str, sizes)), "--iters", str(iters), "--json", str(js),
                *extra_args]  # fmt: skip
        text = run_command(argv, env=cfg["env"], timeout_s=timeout_s,
                           log_path=out / f"allreduce-{key}.log")  # fmt: skip
        data = json.loads(js.read_text())
        result = next(ln for ln in text.splitlines() if ln.startswith("RESULT "))
        return {"rows": data["rows"], "world": data["world"], "backend": data["backend"],
                "result_line": result, "facts": data["facts"]}  # fmt: skip

    return run
