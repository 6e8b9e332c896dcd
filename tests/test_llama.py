"""The fused verify path of `Llama` (q/k RoPE in one pass, slice-copy cache writes, additive
mask) against the HF forward in fp32, and against its own batched index-write path."""

from __future__ import annotations

import pytest
import torch
import transformers

from workbench.errors import WorkbenchError
from workbench.llama import (
    Llama,
    Packed,
    default_mkl_packs,
    default_mkl_rows,
    linear,
    mkl_packs_available,
    onednn_packs,
    pack_weight,
    rms_norm,
)

NO_BF16_PACKS = pytest.mark.skipif(
    not onednn_packs(torch.bfloat16),
    reason="oneDNN does not pack bf16 weights on this CPU (no AVX-512 BW/VL/DQ, no AVX-NE-CONVERT)",
)

ATOL = 2e-5

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).eval()


MKL_PACKS = pytest.mark.skipif(not mkl_packs_available(), reason="torch without MKL sgemm packs")


@pytest.mark.parametrize(
    "onednn,mkl_rows,mkl_packs",
    [(True, 0, ()), (True, 2, ()), pytest.param(True, 3, (4, 8), marks=MKL_PACKS), (False, 0, ())],
)
@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_verify_then_decode_matches_hf(model, onednn, mkl_rows, mkl_packs, k):
    """A k-token verify (not advancing), rollback-free re-verify, then decode == HF logits."""
    llm = Llama(model, torch.float32, onednn=onednn, mkl_rows=mkl_rows, mkl_packs=mkl_packs)
    x = torch.randint(0, 256, (1, 30 + k + 3), generator=torch.Generator().manual_seed(k))
    with torch.no_grad():
        ref = model(x).logits[0]
        hs = model(x, output_hidden_states=True).hidden_states
    c = llm.new_cache(1, 64)
    llm(x[:, :30], c, logits="none")
    junk = torch.randint(0, 256, (1, k), generator=torch.Generator().manual_seed(99))
    llm(junk, c, logits="all", advance=False)  # stale slots the next verify must overwrite
    out = llm(x[:, 30 : 30 + k], c, hidden_layers=[0, 2], logits="all", advance=False)
    torch.testing.assert_close(out.logits[0], ref[30 : 30 + k], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden[0][0], hs[1][0, 30 : 30 + k], atol=ATOL, rtol=0)
    assert c.lengths.tolist() == [30]
    c.lengths += k  # accept all k, then decode on top of the verified slots
    for i in range(30 + k, x.shape[1]):
        got = llm(x[:, i : i + 1], c, logits="last").logits[0]
        torch.testing.assert_close(got, ref[i], atol=ATOL, rtol=0)


def test_equal_length_rows_match_ragged_rows(model):
    """Rows at equal lengths take the slice-copy cache write, ragged rows the index write:
    the same row gives the same logits and cache either way."""
    llm = Llama(model, torch.float32)
    x = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(5))
    ragged, alone = llm.new_cache(2, 32), llm.new_cache(1, 32)
    llm(x[:, :12], ragged, n_valid=torch.tensor([12, 9]), logits="none")
    llm(x[:1, :12], alone, logits="none")
    a = llm(x[:, 12:16], ragged, logits="all")  # lengths [12, 9]: index write
    b = llm(x[:1, 12:16], alone, logits="all")  # batch 1: slice copy
    torch.testing.assert_close(a.logits[:1], b.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(ragged.k[:, :1, :, :16], alone.k[:, :, :, :16], atol=ATOL, rtol=0)
    torch.testing.assert_close(ragged.v[:, :1, :, :16], alone.v[:, :, :, :16], atol=ATOL, rtol=0)
    assert ragged.lengths.tolist() == [16, 13] and alone.lengths.tolist() == [16]


def test_cache_overflow_is_refused(model):
    """A write past the cache's end fails loudly rather than being clipped by a slice."""
    llm = Llama(model, torch.float32)
    c = llm.new_cache(1, 8)
    llm(torch.zeros(1, 6, dtype=torch.long), c, logits="none")
    with pytest.raises(IndexError):
        llm(torch.zeros(1, 4, dtype=torch.long), c, logits="none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_hf_formula(dtype):
    """The fused norm gives HF LlamaRMSNorm's values (normalize in fp32, cast, scale)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 7, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    xf = x.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=NO_BF16_PACKS)]
)
def test_a_row_gets_the_same_bits_alone_or_among_others(dtype):
    """`linear` on a packed weight: each row of an 8-row call equals that row alone, bit for
    bit (a lone fp32 row runs as two; oneDNN's one-row kernel splits a 1536-long reduction its
    own way), in 2-D and 3-D inputs; unpacked weights keep plain F.linear."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    for n_in in (64, 1536):
        w = (torch.randn(576, n_in, generator=g) * 0.05).to(dtype)
        p = pack_weight(w)
        x = torch.randn(8, n_in, generator=g).to(dtype)
        many = linear(x, p)
        for i in range(8):
            assert torch.equal(linear(x[i : i + 1], p), many[i : i + 1]), (n_in, i)
            assert torch.equal(linear(x[None, i : i + 1], p), many[None, i : i + 1]), (n_in, i)
        torch.testing.assert_close(
            many, F.linear(x, w), atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=0
        )
    assert torch.equal(linear(x, w), F.linear(x, w))


def kernels_row_invariant(llm: Llama, rows: int = 6, S: int = 46) -> bool:
    """Whether this CPU's kernels give a row the same bits alone as among `rows` others: every
    packed matmul weight of `llm` (`linear`) and SDPA at its head layout. Seen true on Xeons
    and an earlier AMD EPYC; false on a Zen 5 EPYC, where fp32 SDPA (its inner GEMMs) and the
    bf16 1536-wide down projection differ in the last bit with the number of query rows."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    L = llm.layers[0]
    for w in (L.wqkv, L.wo, L.w13, L.w2, llm.head):
        x = torch.randn(rows, w.shape[1], generator=g).to(llm.dtype)
        many = linear(x, w)
        if not all(torch.equal(linear(x[i : i + 1], w), many[i : i + 1]) for i in range(rows)):
            return False
    G, D = llm.n_heads // llm.n_kv, llm.head_dim
    k, v = (torch.randn(1, llm.n_kv, S, D, generator=g).to(llm.dtype) for _ in range(2))
    q = torch.randn(1, llm.n_kv, G, rows, D, generator=g).to(llm.dtype)
    many = F.scaled_dot_product_attention(q.reshape(1, llm.n_kv, G * rows, D), k, v)
    one = F.scaled_dot_product_attention(q[:, :, :, 0].contiguous(), k, v)
    return torch.equal(many.view(1, llm.n_kv, G, rows, D)[:, :, :, 0], one)


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=NO_BF16_PACKS)]
)
def test_verify_gives_exactly_what_decode_steps_give_on_the_embedded_target(embedded_dir, dtype):
    """On SmolLM2 (30 layers, 1536-wide MLP), a k-token verify, chain or tree, computes the
    same logits, aux hidden states and cache entries as one-token decode steps, bit for bit,
    where the CPU's kernels give a row the same bits whatever the row count
    (`kernels_row_invariant`): greedy speculative decoding then reproduces plain decoding
    exactly, in bf16 too. Elsewhere (and with fp32 inputs of 1-3 rows on MKL, the Intel
    default) they agree to rounding, which this checks instead: a wrong mask, position or
    cache slot would still show."""
    from workbench.target import load_target

    t = load_target(embedded_dir)
    llm = Llama(t.model, dtype, mkl_rows=0)
    assert llm.onednn
    exact = kernels_row_invariant(llm)
    # rounding: relative L2 error ~1e-7 in fp32 and ~1e-3 in bf16 after 30 layers; a wrong
    # mask, position or cache slot gives errors of order 0.1-1
    fp32 = dtype == torch.float32
    limit = 1e-5 if fp32 else 2e-2

    def same(a, b, what):
        if exact:
            assert torch.equal(a, b), what
        else:
            err = float((a.float() - b.float()).norm() / b.float().norm())
            assert err < limit, f"{what}: relative error {err:.2e}"

    prompt = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(1))
    toks = torch.randint(0, 49152, (1, 6), generator=torch.Generator().manual_seed(2))
    c = llm.new_cache(1, 64)
    llm(prompt, c, logits="none")
    steps = [llm(toks[:, j : j + 1], c, hidden_layers=[1, 15, 27]) for j in range(6)]
    decoded_k = c.k[:, :, :, 40:46].clone()
    c.lengths[:] = 40
    v = llm(toks, c, hidden_layers=[1, 15, 27], advance=False)
    for j, st in enumerate(steps):
        same(v.logits[0, j], st.logits[0, 0], f"logits {j}")
        if fp32:  # bf16 logits tie often at their coarse steps
            assert v.logits[0, j].argmax() == st.logits[0, 0].argmax(), j
        for i in (1, 15, 27):
            same(v.hidden[i][0, j], st.hidden[i][0, 0], f"hidden {i} at {j}")
    same(c.k[:, :, :, 40:46], decoded_k, "cache")
    # a tree: token 2 is a child of token 0 and sits after its sibling 1 (masked for it)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    pos = torch.tensor([[40, 41, 41]])
    tv = llm(toks[:, [0, 3, 1]], c, tree_mask=tree, positions=pos, advance=False)
    same(tv.logits[0, 0], steps[0].logits[0, 0], "tree root")
    same(tv.logits[0, 2], steps[1].logits[0, 0], "tree child")


def test_small_inputs_take_plain_f_linear_and_larger_ones_the_packed_weight(model, monkeypatch):
    """`mkl_rows` decides which kernel a row count gets: bit-identical to that kernel alone."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g)
    p = Packed(pack_weight(w), w, 2)
    for rows in (1, 2, 3, 8):
        x = torch.randn(1, rows, 64, generator=g)
        want = F.linear(x, w) if rows <= 2 else linear(x, p.packed)
        assert torch.equal(linear(x, p), want), rows
    assert p.shape == w.shape
    monkeypatch.setenv("WORKBENCH_MKL_ROWS", "5")
    assert default_mkl_rows(torch.float32) == 5
    monkeypatch.setenv("WORKBENCH_MKL_ROWS", "two")
    with pytest.raises(WorkbenchError, match="WORKBENCH_MKL_ROWS='two'"):
        default_mkl_rows(torch.float32)
    monkeypatch.delenv("WORKBENCH_MKL_ROWS")
    assert default_mkl_rows(torch.bfloat16) == 0  # bf16 always packs
    assert Llama(model, torch.float32, mkl_rows=0).layers[0].wo.is_mkldnn
    assert isinstance(Llama(model, torch.float32, mkl_rows=2).head, Packed)


@MKL_PACKS
def test_verify_sized_inputs_take_mkl_packs_padded_with_zero_rows(model, monkeypatch):
    """Inputs above `mkl_rows` and up to a pack's size run MKL's packed sgemm: padding to
    the pack's size leaves the real rows as they would be next to any other rows (so the
    padding cannot leak), they agree with F.linear to fp32 rounding, and larger inputs
    still take the oneDNN weight."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g)
    p = Packed(pack_weight(w), w, 2, {4: torch.ops.mkl._mkl_reorder_linear_weight(w, 4),
                                       8: torch.ops.mkl._mkl_reorder_linear_weight(w, 8)})  # fmt: skip
    x = torch.randn(1, 12, 64, generator=g)
    for rows, bs in ((3, 4), (4, 4), (5, 8), (8, 8)):
        got = linear(x[:, :rows], p)
        torch.testing.assert_close(got, F.linear(x[:, :rows], w), atol=1e-5, rtol=0)
        full = linear(x[:, :bs], p)  # the same pack with real rows where the padding was
        assert torch.equal(got, full[:, :rows]), rows
    assert torch.equal(linear(x[:, :2], p), F.linear(x[:, :2], w))
    assert torch.equal(linear(x, p), linear(x, p.packed))  # 12 rows: oneDNN
    monkeypatch.setenv("WORKBENCH_MKL_PACKS", " 8, 4 ")
    assert default_mkl_packs(torch.float32) == (4, 8)
    assert default_mkl_packs(torch.bfloat16) == ()
    monkeypatch.setenv("WORKBENCH_MKL_PACKS", "")
    assert default_mkl_packs(torch.float32) == ()
    monkeypatch.setenv("WORKBENCH_MKL_PACKS", "4,eight")
    with pytest.raises(WorkbenchError, match="WORKBENCH_MKL_PACKS='4,eight'"):
        default_mkl_packs(torch.float32)
    monkeypatch.delenv("WORKBENCH_MKL_PACKS")
    llm = Llama(model, torch.float32, mkl_rows=3, mkl_packs=(8, 4))
    assert llm.mkl_packs == (4, 8) and sorted(llm.head.mkl_packs) == [4, 8]
    assert Llama(model, torch.float32, mkl_rows=0, mkl_packs=None).mkl_packs == ()
    with pytest.raises(WorkbenchError, match="need fp32"):
        Llama(model, torch.bfloat16, mkl_packs=(4,))


@MKL_PACKS
def test_default_packs_are_left_off_when_they_would_crowd_memory(model, monkeypatch):
    """Two more copies of a large target's weights must not exhaust RAM: the default packs
    are dropped, with a warning, above a quarter of the available memory; asked for, kept."""
    import workbench.llama as llama_mod

    monkeypatch.setenv("WORKBENCH_MKL_PACKS", "4,8")
    monkeypatch.setattr(llama_mod, "available_memory", lambda: 64 << 30)
    assert Llama(model, torch.float32, mkl_rows=3).mkl_packs == (4, 8)
    monkeypatch.setattr(llama_mod, "available_memory", lambda: 1 << 20)  # 1 MB
    with pytest.warns(UserWarning, match=r"MKL verify packs \(4, 8\) left off"):
        llm = Llama(model, torch.float32, mkl_rows=3)
    assert llm.mkl_packs == () and llm.head.mkl_packs == {}
    assert Llama(model, torch.float32, mkl_rows=3, mkl_packs=(4, 8)).mkl_packs == (4, 8)


def test_bf16_runs_unpacked_where_onednn_cannot_pack_it(model, monkeypatch):
    """A CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT (a Zen 3 EPYC) refuses oneDNN bf16
    packs: Llama then keeps plain bf16 weights on F.linear, and still decodes like fp32."""
    import workbench.llama as llama_mod

    monkeypatch.setattr(llama_mod, "onednn_packs", lambda dtype: dtype == torch.float32)
    bf = Llama(model, torch.bfloat16)
    assert not bf.onednn and not bf.layers[0].wqkv.is_mkldnn and bf.head.dtype == torch.bfloat16
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    fp = Llama(model, torch.float32)
    ref = fp(ids, fp.new_cache(2, 16))
    got = bf(ids, bf.new_cache(2, 16))
    torch.testing.assert_close(got.logits.float(), ref.logits, atol=0.1, rtol=0.05)
