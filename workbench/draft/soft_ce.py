"""The soft cross-entropy of the TTT loss: draft logits against the target's distribution.

Per row, ce = -sum(softmax(t) * log_softmax(z)) = logsumexp(z) - sum(softmax(t) * z), and
argmax(z) for the accuracy statistics; the gradient is (softmax(z) - softmax(t)) * g. fp32 math
whatever the inputs' dtypes.

Two paths with the same results up to float rounding:
- C (`csrc/soft_ce.c`, built on first use by `workbench.kernels`): the target rows are read in
  place through a row index, and only two log-normalisers per row are kept for the backward.
  On CPU where a compiler is found (`WORKBENCH_SOFT_CE=auto`, the default; `=c` requires it).
- torch (`WORKBENCH_SOFT_CE=torch`, other devices, other dtypes): one chunked autograd function
  (no [N, V] log-prob, product or upcast tensors kept; chunks stay below glibc's 32 MB mmap
  threshold, so no page faults per step) over the gathered target rows.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from workbench import kernels
from workbench.kernels import KernelError

SOURCE = kernels.CSRC / "soft_ce.c"
ENV = "WORKBENCH_SOFT_CE"
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}


def mode() -> str:
    """'auto' (the default: the C kernel where a compiler is found), 'c' or 'torch'."""
    return kernels.mode(ENV, "torch")


@functools.cache
def _library() -> ctypes.CDLL:
    lib = kernels.build(SOURCE, ENV, "torch")
    P, N, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.soft_ce_forward.argtypes = [N, N, P, L, P, L, P, N, N, P, P, P, P, N]
    lib.soft_ce_backward.argtypes = [N, N, P, L, P, L, P, N, N, P, P, P, P, N]
    lib.soft_ce_forward.restype = lib.soft_ce_backward.restype = N
    return lib


def uses_c(z: Tensor, t: Tensor) -> bool:
    """Whether `soft_ce(z, t)` runs the C kernel (raises where `=c` is set but cannot be met)."""
    if not kernels.enabled(ENV, "torch"):
        return False
    fits = z.device.type == "cpu" and t.device.type == "cpu"
    fits = fits and z.dtype in _DTYPES and t.dtype in _DTYPES and z.dim() == t.dim() == 2
    if not fits and mode() == "c":
        raise KernelError(f"{ENV}=c takes 2-D CPU bf16/fp32 tensors, got z {z.dtype} "
                          f"{tuple(z.shape)} on {z.device}, t {t.dtype} {tuple(t.shape)} on "
                          f"{t.device}; set {ENV}=auto")  # fmt: skip
    return fits


class _TorchSoftCE(torch.autograd.Function):
    """The torch path over already gathered target rows t [N, V], `chunk` rows at a time."""

    @staticmethod
    def forward(ctx, z: Tensor, t: Tensor, chunk: int, want_top: bool = True):
        N = z.shape[0]
        ce = torch.empty(N, dtype=torch.float32, device=z.device)
        top = torch.empty(N if want_top else 0, dtype=torch.long, device=z.device)
        p = torch.empty(t.shape, dtype=torch.float32, device=z.device)
        for a in range(0, N, chunk):
            zc = z[a : a + chunk].float()
            pc = p[a : a + chunk]
            torch.softmax(t[a : a + chunk].float(), -1, out=pc)
            ce[a : a + chunk] = zc.logsumexp(-1) - (pc * zc).sum(-1)
            if want_top:
                top[a : a + chunk] = zc.argmax(-1)
        ctx.save_for_backward(z, p)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(top)
        return ce, top

    @staticmethod
    def backward(ctx, g: Tensor, _top: Tensor):
        z, p = ctx.saved_tensors
        gz = torch.empty_like(z)
        c = ctx.chunk
        for a in range(0, z.shape[0], c):
            sz = z[a : a + c].float().softmax(-1)
            gz[a : a + c] = (sz.sub_(p[a : a + c])).mul_(g[a : a + c, None])
        return gz, None, None, None


class _CSoftCE(torch.autograd.Function):
    """The C path: z [N, V] against t[rows] ([*, V], read in place)."""

    @staticmethod
    def forward(ctx, z: Tensor, t: Tensor, rows: Tensor, want_top: bool = True):
        N, V = z.shape
        ce, lz, lt = (torch.empty(N, dtype=torch.float32) for _ in range(3))
        top = torch.empty(N if want_top else 0, dtype=torch.long)
        rc = _library().soft_ce_forward(
            _DTYPES[z.dtype], _DTYPES[t.dtype], z.data_ptr(), z.stride(0), t.data_ptr(),
            t.stride(0), rows.data_ptr(), N, V, ce.data_ptr(),
            top.data_ptr() if want_top else None, lz.data_ptr(), lt.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise KernelError(f"soft_ce_forward returned {rc} for z {tuple(z.shape)}")
        ctx.save_for_backward(z, t, rows, lz, lt)
        ctx.mark_non_differentiable(top)
        return ce, top

    @staticmethod
    def backward(ctx, g: Tensor, _top: Tensor):
        z, t, rows, lz, lt = ctx.saved_tensors
        g = g.float().contiguous()
        gz = torch.empty(z.shape, dtype=z.dtype)
        rc = _library().soft_ce_backward(
            _DTYPES[z.dtype], _DTYPES[t.dtype], z.data_ptr(), z.stride(0), t.data_ptr(),
            t.stride(0), rows.data_ptr(), z.shape[0], z.shape[1], lz.data_ptr(), lt.data_ptr(),
            g.data_ptr(), gz.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise KernelError(f"soft_ce_backward returned {rc} for z {tuple(z.shape)}")
        return gz, None, None, None


def soft_ce(
    z: Tensor, t: Tensor, rows: Tensor | None = None, chunk: int = 1024, top: bool = True
) -> tuple[Tensor, Tensor]:
    """(soft cross-entropy of draft logits z [N, V] against softmax(t[rows]), argmax(z)).

    `t` holds target logits [M, V]; row r of z is scored against t[rows[r]] (`rows=None`: t is
    already [N, V], one row per z row). Equals `-(t[rows].softmax(-1) *
    z.float().log_softmax(-1)).sum(-1)` up to float rounding. `top=False` skips the argmax (an
    empty tensor instead): it only feeds accuracy statistics. `chunk`: the torch path's rows at
    a time.
    """
    t = t.detach()
    if z.dim() != 2 or t.dim() != 2 or z.shape[1] != t.shape[1]:
        raise KernelError(f"soft_ce takes z [N, V] and t [M, V], got {tuple(z.shape)} and "
                          f"{tuple(t.shape)}")  # fmt: skip
    n_rows = t.shape[0] if rows is None else rows.numel()
    if n_rows != z.shape[0]:
        raise KernelError(f"soft_ce: {z.shape[0]} rows of z against {n_rows} target rows")
    if not uses_c(z, t):
        return _TorchSoftCE.apply(z, t if rows is None else t.index_select(0, rows), chunk, top)
    rows = torch.arange(z.shape[0]) if rows is None else rows.to(torch.int64).contiguous()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= t.shape[0]):
        raise KernelError(f"soft_ce: target rows {int(rows.min())}..{int(rows.max())} outside "
                          f"t's {t.shape[0]} rows")  # fmt: skip
    z = z if z.stride(1) == 1 else z.contiguous()
    t = t if t.stride(1) == 1 else t.contiguous()
    return _CSoftCE.apply(z, t, rows, top)
