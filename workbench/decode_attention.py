"""Decode attention in C for batched generation: one new token per row over a static cache.

Why: regeneration decodes 32-64 rows at hundreds of cached slots, where torch's CPU SDPA reads
a bf16 cache at ~8 GB/s (fp32 ~18) on the 2-core AMD machines and attends to every row up to
the longest one under a mask. `csrc/decode_attention.c` reads each row's own slots once: on a
Zen 4 EPYC, 48 rows at up to 680 slots took 0.67 ms a layer against SDPA's 3.2 ms.

The kernel is compiled on first use for this CPU and cached (`workbench.kernels`). Only
`generate.run_queue` (regeneration, self prompts) uses it; the engine's decode and verify keep
SDPA, whose k-token verify reproduces k one-token steps bit for bit. `WORKBENCH_DECODE_ATTENTION=sdpa` turns it off, `=c` requires it.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from workbench import kernels
from workbench.kernels import KernelError

SOURCE = kernels.CSRC / "decode_attention.c"
ENV = "WORKBENCH_DECODE_ATTENTION"
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}


def mode() -> str:
    """'auto' (the default: use the kernel where a compiler is found), 'c' or 'sdpa'."""
    return kernels.mode(ENV, "sdpa")


def enabled() -> bool:
    """Whether `run_queue` attends through the kernel on this machine."""
    return kernels.enabled(ENV, "sdpa")


@functools.cache
def _library() -> ctypes.CDLL:
    lib = kernels.build(SOURCE, ENV, "sdpa")
    P, N, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.decode_attention.argtypes = [N, P, P, P, P, P, P, N, N, N, N, L, L, L, L, ctypes.c_float, N]
    lib.decode_attention.restype = N
    return lib


def decode_attention(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(D)) v for q [B, H, G, D] over slots [lo[b], hi[b]) of k, v
    [B, H, T, D] (a layer of a `KVCache`; head_dim contiguous); returns [B, H, G, D]."""
    B, H, G, D = q.shape
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise KernelError(f"decode_attention takes bf16 or fp32 q/k/v of one dtype, got "
                          f"{q.dtype}/{k.dtype}/{v.dtype}")  # fmt: skip
    if k.shape != v.shape or k.shape[:2] != (B, H) or k.shape[3] != D or k.stride() != v.stride():
        raise KernelError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    if k.stride(3) != 1 or q.device.type != "cpu":
        raise KernelError("decode_attention needs CPU tensors with head_dim contiguous")
    if lo.shape != (B,) or hi.shape != (B,):
        raise KernelError(
            f"lo {tuple(lo.shape)} / hi {tuple(hi.shape)}: expected one per row ({B})"
        )
    # the kernel checks the ranges itself (a loop over B pairs): a decode step calls this once
    # per layer, and a check here took three torch reductions and two syncs to Python each time
    lo, hi = lo.to(torch.int64).contiguous(), hi.to(torch.int64).contiguous()
    q = q.contiguous()
    out = torch.empty_like(q)
    rc = _library().decode_attention(
        _DTYPES[q.dtype], q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
        lo.data_ptr(), hi.data_ptr(), B, H, G, D, k.shape[2], k.stride(0), k.stride(1),
        k.stride(2), D**-0.5, torch.get_num_threads(),
    )  # fmt: skip
    if rc == -3:
        raise KernelError(f"slot ranges out of the cache's {k.shape[2]} slots (each row needs "
                          f"0 <= lo < hi <= {k.shape[2]}): lo {lo.tolist()}, hi {hi.tolist()}")  # fmt: skip
    if rc != 0:
        raise KernelError(f"decode_attention returned {rc} for q {tuple(q.shape)}")
    return out
