"""The TTT loss's soft cross-entropy: the C kernel against a float64 reference and the torch path."""

from __future__ import annotations

import shutil

import pytest
import torch

from workbench.draft import soft_ce as sc

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")


def reference(z, t, rows):
    """(ce, d ce/dz for upstream g = 1..N) in float64 from the definition."""
    z64 = z.detach().double().requires_grad_(True)
    ce = -(t.double()[rows].softmax(-1) * z64.log_softmax(-1)).sum(-1)
    g = torch.arange(1, z.shape[0] + 1, dtype=torch.float64) / z.shape[0]
    (gz,) = torch.autograd.grad((ce * g).sum(), z64)
    return ce, gz, g


def problem(zdtype, tdtype, N=37, V=4099, M=50, seed=0):
    """Logits at a trained model's scale; target rows gathered with repeats, out of order."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(N, V, generator=g) * 3).to(zdtype)
    t = (torch.randn(M, V, generator=g) * 4).to(tdtype)
    rows = torch.randint(0, M, (N,), generator=g)
    rows[:3] = torch.tensor([M // 2, M // 2, M - 1])
    return z, t, rows


@needs_cc
@pytest.mark.parametrize("zdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [4096, 4099])
def test_the_kernel_equals_the_float64_definition(zdtype, tdtype, V, monkeypatch):
    monkeypatch.setenv(sc.ENV, "c")
    z, t, rows = problem(zdtype, tdtype, V=V)
    z.requires_grad_(True)
    assert sc.uses_c(z, t)
    ce, top = sc.soft_ce(z, t, rows)
    ref, gref, g = reference(z, t, rows)
    (gz,) = torch.autograd.grad((ce * g.float()).sum(), z)
    assert ce.dtype == torch.float32 and gz.dtype == zdtype
    torch.testing.assert_close(ce.double(), ref, atol=2e-5, rtol=2e-6)
    assert torch.equal(top, z.detach().float().argmax(-1))  # the first maximum, as torch
    # fp32 math on softmax(z) - softmax(t) (here at most 2.4e-6 of the scale, torch's path 1.7e-6),
    # rounded once to z's dtype
    scale = (z.detach().double().softmax(-1) + t.double()[rows].softmax(-1)) * g[:, None]
    err = (gz.double() - gref).abs()
    assert bool((err <= 5e-6 * scale + 2**-8 * gref.abs() * (zdtype == torch.bfloat16)).all())


@needs_cc
def test_the_kernel_and_the_torch_path_agree(monkeypatch):
    """Same inputs through both paths: loss and argmax, and gradients through a matmul."""
    out = {}
    for m in ("c", "torch"):
        monkeypatch.setenv(sc.ENV, m)
        torch.manual_seed(1)
        w = torch.randn(64, 300, requires_grad=True)
        h = torch.randn(90, 64)
        t = torch.randn(120, 300) * 3
        rows = torch.randperm(120)[:90]
        ce, top = sc.soft_ce(h @ w, t, rows, chunk=7)
        ce.sum().backward()
        out[m] = ce.detach(), top, w.grad
    (c_ce, c_top, c_g), (t_ce, t_top, t_g) = out["c"], out["torch"]
    torch.testing.assert_close(c_ce, t_ce, atol=1e-5, rtol=1e-6)
    assert torch.equal(c_top, t_top)
    torch.testing.assert_close(c_g, t_g, atol=1e-5, rtol=1e-5)


@needs_cc
def test_without_top_and_without_rows(monkeypatch):
    monkeypatch.setenv(sc.ENV, "c")
    z, t, _ = problem(torch.float32, torch.float32, N=9, V=33, M=9)
    ce, top = sc.soft_ce(z, t, top=False)  # rows=None: t is already one row per z row
    assert top.numel() == 0
    torch.testing.assert_close(ce.double(), reference(z, t, torch.arange(9))[0], atol=2e-5, rtol=0)
    assert sc.soft_ce(z[:0], t[:0])[0].shape == (0,)  # an empty step scores nothing


def test_bad_arguments_say_what_was_wrong(monkeypatch):
    z, t, rows = problem(torch.float32, torch.float32, N=4, V=8, M=5)
    with pytest.raises(sc.KernelError, match=r"4 rows of z against 3 target rows"):
        sc.soft_ce(z, t, rows[:3])
    with pytest.raises(sc.KernelError, match=r"z \[N, V\] and t \[M, V\]"):
        sc.soft_ce(z, t[:, :7], rows)
    if shutil.which("cc") is not None:
        monkeypatch.setenv(sc.ENV, "c")
        with pytest.raises(sc.KernelError, match=r"target rows 0\.\.5 outside t's 5 rows"):
            sc.soft_ce(z, t, torch.tensor([0, 1, 5, 2]))
        with pytest.raises(sc.KernelError, match="takes 2-D CPU bf16/fp32"):
            sc.soft_ce(z.double(), t.double(), rows)


def test_mode_and_a_missing_compiler(monkeypatch):
    z, t, rows = problem(torch.float32, torch.float32, N=4, V=8, M=5)
    monkeypatch.setenv(sc.ENV, "fast")
    with pytest.raises(sc.KernelError, match="expected 'auto', 'c' or 'torch'"):
        sc.soft_ce(z, t, rows)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv(sc.ENV, "auto")
    assert not sc.uses_c(z, t)  # no compiler: the torch path
    ce, _ = sc.soft_ce(z, t, rows)
    torch.testing.assert_close(ce.double(), reference(z, t, rows)[0], atol=2e-5, rtol=0)
    monkeypatch.setenv(sc.ENV, "c")
    with pytest.raises(sc.KernelError, match="no C compiler"):
        sc.soft_ce(z, t, rows)
    monkeypatch.setenv(sc.ENV, "auto")
    assert not sc.uses_c(z.double(), t.double())  # other dtypes: the torch path, no error
