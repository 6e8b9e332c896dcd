"""The C decode-attention kernel against a float64 reference, in the forward and in run_queue."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from test_generate import tiny

from workbench import decode_attention as da
from workbench.generate import generate_batch_with_stats
from workbench.llama import Llama

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")


def reference(q, k, v, lo, hi):
    """softmax(q k^T / sqrt(D)) v per row over slots [lo, hi), in float64."""
    B, H, G, D = q.shape
    out = torch.empty(B, H, G, D, dtype=torch.float64)
    for b in range(B):
        kk, vv = k[b, :, lo[b] : hi[b]].double(), v[b, :, lo[b] : hi[b]].double()
        out[b] = F.scaled_dot_product_attention(q[b].double(), kk, vv)
    return out


def ragged(dtype, B=5, H=3, G=3, D=64, T=90, seed=0):
    """q and one layer of a [layers, B, H, T, D] cache (strided like a KVCache's), ragged rows."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, B, H, T, D, generator=g).to(dtype)  # [k/v, layers, ...]
    q = torch.randn(B, H, G, D, generator=g).to(dtype) * 2
    lo = torch.tensor([0, 3, 0, 10, 0][:B])
    hi = torch.tensor([1, 40, 77, 11, 90][:B])
    return q, kv[0, 1], kv[1, 1], lo, hi


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,D", [(3, 64), (2, 16)])  # the specialised and the generic body
def test_kernel_matches_float64_as_closely_as_sdpa(dtype, G, D):
    q, k, v, lo, hi = ragged(dtype, G=G, D=D)
    ref = reference(q, k, v, lo, hi)
    got = da.decode_attention(q, k, v, lo, hi)
    assert got.dtype == dtype and got.shape == q.shape
    sdpa = torch.stack([F.scaled_dot_product_attention(q[b], k[b, :, lo[b] : hi[b]],
                                                       v[b, :, lo[b] : hi[b]]) for b in range(5)])  # fmt: skip
    err, err_sdpa = (got.double() - ref).abs().max(), (sdpa.double() - ref).abs().max()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert err < tol and err <= 2 * err_sdpa + 1e-6, (err, err_sdpa)
    # the row with one slot is that slot's value, exactly
    assert torch.equal(got[0], v[0, :, :1].expand(-1, G, -1))


@needs_cc
def test_bad_arguments_are_refused_with_what_was_wrong():
    q, k, v, lo, hi = ragged(torch.float32)
    with pytest.raises(da.KernelError, match="out of the cache's 90 slots"):
        da.decode_attention(q, k, v, lo, hi + 1)
    with pytest.raises(da.KernelError, match="out of the cache"):
        da.decode_attention(q, k, v, hi, hi)  # an empty row
    with pytest.raises(da.KernelError, match="one dtype"):
        da.decode_attention(q, k.bfloat16(), v, lo, hi)
    with pytest.raises(da.KernelError, match="do not fit"):
        da.decode_attention(q[:, :2], k, v, lo, hi)


@needs_cc
@pytest.mark.usefixtures("one_thread")
def test_forward_with_the_kernel_matches_sdpa_on_ragged_left_padded_rows():
    llm = Llama(tiny(), torch.float32)
    ids = torch.randint(2, 256, (4, 12), generator=torch.Generator().manual_seed(1))
    caches = []
    for _ in range(2):
        c = llm.new_cache(4, 40)
        c.start[:] = torch.tensor([0, 2, 0, 5])
        llm(ids, c, n_valid=torch.tensor([12, 7, 1, 9]), logits="none")
        caches.append(c)
    tok = ids[:, -1:]
    for _ in range(5):
        a = llm(tok, caches[0], logits="all").logits
        b = llm(tok, caches[1], logits="all", attention="c").logits
        torch.testing.assert_close(b, a, atol=2e-5, rtol=0)
        tok = a.argmax(-1)
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="expected 'sdpa' or 'c'"):
        llm(tok, caches[0], attention="flash")


@needs_cc
@pytest.mark.usefixtures("one_thread")
def test_run_queue_decodes_through_the_kernel_unless_told_not_to(monkeypatch):
    llm = Llama(tiny(), torch.float32)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 256, (int(n),), generator=g).tolist() for n in (3, 17, 8, 30, 5)]
    got = {}
    for mode in ("c", "sdpa"):
        monkeypatch.setenv(da.ENV, mode)
        got[mode] = generate_batch_with_stats(llm, prompts, 24, None, batch_size=3,
                                              progress=False)  # fmt: skip
    assert got["c"][1].attention == "c" and got["sdpa"][1].attention == "sdpa"
    assert got["c"][0] == got["sdpa"][0]  # fp32 greedy: the same tokens


def test_mode_and_a_missing_compiler(monkeypatch):
    monkeypatch.setenv(da.ENV, "fast")
    with pytest.raises(da.KernelError, match="expected 'auto', 'c' or 'sdpa'"):
        da.mode()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv(da.ENV, "auto")
    assert da.enabled() is False  # no compiler: run_queue keeps SDPA
    monkeypatch.setenv(da.ENV, "c")
    with pytest.raises(da.KernelError, match="no C compiler"):
        da.enabled()
    monkeypatch.setenv(da.ENV, "sdpa")
    assert da.enabled() is False


@needs_cc
def test_the_build_is_cached_per_source_and_a_failed_build_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path))
    da._library.cache_clear()
    try:
        da._library()
        (built,) = (tmp_path / "kernels").glob("decode_attention-*.so")
        bad = tmp_path / "bad.c"
        bad.write_text("this is not C\n")
        monkeypatch.setattr(da, "SOURCE", bad)
        da._library.cache_clear()
        with pytest.raises(da.KernelError, match=f"building {bad} .* failed"):
            da._library()
        assert list((tmp_path / "kernels").glob("*.so")) == [built]  # nothing half-written
        assert not [p for p in (tmp_path / "kernels").iterdir() if p.is_dir()]
    finally:
        da._library.cache_clear()


@needs_cc
def test_torch_openmp_and_own_threads_builds_give_the_same_bits(tmp_path, monkeypatch):
    """The kernel runs on torch's OpenMP threads where torch uses libgomp (one libgomp in the
    process, not a second pool), else on threads of its own; the split over 2 threads, or 1,
    gives the same bits either way."""
    from workbench import kernels

    q, k, v, lo, hi = ragged(torch.bfloat16, B=5)
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path))
    old = torch.get_num_threads()
    got = {}
    try:
        for omp in (True, False):
            monkeypatch.setenv("WORKBENCH_KERNEL_THREADS", "auto" if omp else "own")
            assert kernels.openmp() == (omp and kernels.torch_openmp())
            da._library.cache_clear()
            for n in (2, 1):
                torch.set_num_threads(n)
                got[omp, n] = da.decode_attention(q, k, v, lo, hi)
    finally:
        torch.set_num_threads(old)
        da._library.cache_clear()
    assert len(list((tmp_path / "kernels").glob("decode_attention-*.so"))) == 2
    first = got[True, 2]
    assert all(torch.equal(first, g) for g in got.values())
    assert torch.equal(first, da.decode_attention(q, k, v, lo, hi))
    with open("/proc/self/maps") as f:
        gomps = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomps) <= 1, gomps  # the -fopenmp build reused torch's runtime
    monkeypatch.setenv("WORKBENCH_KERNEL_THREADS", "many")
    with pytest.raises(kernels.KernelError, match="expected 'auto' or 'own'"):
        kernels.openmp()
