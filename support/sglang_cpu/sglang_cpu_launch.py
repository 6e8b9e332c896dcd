"""`python -m sglang_cpu_launch ARGS...` = `python -m sglang.launch_server ARGS...` on a CPU
without AMX, keeping `--attention-backend intel_amx` (test support; see README.md).

SGLang 0.5.23 allows EAGLE on CPU only with the intel_amx attention backend, and its
argument resolution silently replaces intel_amx with torch_native when the CPU lacks AMX
(`sglang.srt.arg_groups.overrides._attention_backend_platform_fallbacks`, imported by name
into `attention_hook`). The pure-torch `sgl_kernel` stand-in provides intel_amx's attention
ops without AMX, so this launcher drops only that one fallback (every other case still goes
to SGLang's own pass) and then runs SGLang's launcher unchanged. Resolution happens in this
launching process; the spawned scheduler processes receive the resolved arguments.
"""

from __future__ import annotations

import runpy
from typing import Any

from sglang.srt.arg_groups import attention_hook

_sglang_fallbacks = attention_hook._attention_backend_platform_fallbacks


def _keep_intel_amx_on_cpu(view: Any) -> dict:
    if view.attention_backend == "intel_amx" and view.device == "cpu":
        return {}
    return _sglang_fallbacks(view)


_keep_intel_amx_on_cpu.__qualname__ = _sglang_fallbacks.__qualname__
attention_hook._attention_backend_platform_fallbacks = _keep_intel_amx_on_cpu

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
