"""Draft model: SGLang key set, fc skipping, TTT attention vs a naive reference, RoPE, dtypes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from workbench.draft.attention import ttt_attention, ttt_attention_reference
from workbench.draft.model import (
    SGLANG_KEYS,
    DraftConfig,
    Eagle3Draft,
    KVCache,
    RMSNorm,
    apply_rope,
    init_from_target,
)
from workbench.draft.vocab import (
    DraftVocab,
    VocabError,
    check_d2t,
    coverage,
    coverage_curve,
    d2t_problems,
    vocab_from_counts,
)
from workbench.layers import LayerIds


def tiny_llama(seed: int = 0, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=layers,
        vocab_size=256,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_draft(dvocab: int = 64, seed: int = 0) -> Eagle3Draft:
    t = tiny_llama()
    cfg = DraftConfig.from_target(t.config, LayerIds((0, 1, 2)), dvocab)
    torch.manual_seed(seed)
    d = Eagle3Draft(cfg)
    d.set_vocab(torch.sort(torch.randperm(256)[:dvocab]).values)
    init_from_target(d, t)
    return d


def test_state_dict_keys_are_sglang_exact():
    d = tiny_draft()
    sd = d.state_dict()
    assert set(sd) == set(SGLANG_KEYS)
    assert "embed_tokens" not in " ".join(sd)
    assert set(d.export_state_dict()) == set(SGLANG_KEYS)
    assert sd["d2t"].dtype == torch.long and sd["t2d"].dtype == torch.bool
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (4 * 16, 128)  # 2H input
    assert sd["fc.weight"].shape == (64, 3 * 64)
    assert sd["lm_head.weight"].shape == (64, 64)
    # draft params exclude the frozen embeddings
    assert all(p.shape[0] != 256 for p in d.parameters())


def test_config_roundtrip_and_from_target():
    d = tiny_draft()
    c = d.config
    c2 = DraftConfig.from_dict(c.to_dict())
    assert c2 == c and c.to_dict()["layer_ids"] == {
        "ids": [0, 1, 2],
        "convention": "output_of_layer",
    }
    assert (c.head_dim, c.num_key_value_heads, c.rope_theta) == (16, 2, 10000.0)
    assert c.draft_vocab_size == 64 and c.vocab_size == 256 and c.target_hidden_size == 64


def test_fc_only_for_wide_hidden():
    d = tiny_draft()
    calls = []
    d.fc.register_forward_hook(lambda *a: calls.append(1))
    ids = torch.randint(0, 256, (2, 5))
    pos = torch.arange(5)
    logits, h = d(ids, torch.randn(2, 5, 192), pos)
    assert len(calls) == 1 and logits.shape == (2, 5, 64) and h.shape == (2, 5, 64)
    d(ids, h, pos)
    assert len(calls) == 1  # H-wide hidden skips fc
    with pytest.raises(ValueError, match="expected 64"):
        d(ids, torch.randn(2, 5, 100), pos)


def naive_ttt(d: Eagle3Draft, ids, aux, steps: int):
    """Reference: explicit concatenated keys [step0 | step1 | ... | step i] + hand-built mask."""
    B, T = ids.shape
    m = d.midlayer
    a = m.self_attn
    h = aux
    ks, vs, outs = [], [], []
    for i in range(steps):
        inp = F.pad(ids[:, 1 + i :], (0, 1 + i))
        hh = d.project(h)
        x = torch.cat([m.input_layernorm(d.embed(inp)), m.hidden_norm(hh)], -1)
        cos, sin = d.rope(torch.arange(T)[None].expand(B, T) + i, x.dtype)
        q = apply_rope(a.q_proj(x).view(B, T, a.nh, a.hd).transpose(1, 2), cos, sin)
        k = apply_rope(a.k_proj(x).view(B, T, a.nkv, a.hd).transpose(1, 2), cos, sin)
        v = a.v_proj(x).view(B, T, a.nkv, a.hd).transpose(1, 2)
        ks.append(k)
        vs.append(v)
        K = torch.cat(ks, 2).repeat_interleave(a.nh // a.nkv, 1)
        V = torch.cat(vs, 2).repeat_interleave(a.nh // a.nkv, 1)
        mask = torch.zeros(T, T * (i + 1), dtype=torch.bool)
        mask[:, :T] = torch.ones(T, T).tril().bool()
        for j in range(1, i + 1):
            mask[:, j * T : (j + 1) * T] = torch.eye(T, dtype=torch.bool)
        s = (q @ K.transpose(-1, -2)) / math.sqrt(a.hd)
        att = s.masked_fill(~mask, float("-inf")).softmax(-1) @ V
        hh = hh + a.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        hh = hh + m.mlp(m.post_attention_layernorm(hh))
        outs.append(d.lm_head(d.norm(hh)))
        h = hh
    return outs


def test_ttt_attention_matches_naive_reference():
    d = tiny_draft()
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 9))
    aux = torch.randn(2, 9, 192)
    ref = naive_ttt(d, ids, aux, 4)
    kv, h = [], aux
    for i in range(4):
        inp = F.pad(ids[:, 1 + i :], (0, 1 + i))
        logits, h = d(inp, h, torch.arange(9)[None].expand(2, 9) + i, ttt=kv)
        torch.testing.assert_close(logits, ref[i], atol=1e-5, rtol=1e-5)
    assert len(kv) == 4


def test_ttt_attention_gqa_shapes():
    q = torch.randn(1, 4, 6, 8)
    kv = [(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)) for _ in range(3)]
    assert ttt_attention(q, kv).shape == (1, 4, 6, 8)


@pytest.mark.parametrize("sampled", [False, True])
def test_ttt_attention_equals_the_reference_formulation(sampled):
    """The fast step-i attention (folded scale, fp32 softmax out of the scores, split, stacked
    diagonal) gives the reference's output and gradients, full and sampled queries."""
    torch.manual_seed(5)
    B, nh, nkv, hd, T, steps = 2, 6, 2, 8, 23, 3
    Q = 9 if sampled else T  # >= 2 x 4 chunks: the sampled path runs chunked
    qpos = torch.rand(B, T).topk(Q, dim=1).indices.sort(dim=1).values if sampled else None

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    q = leaf(B, nh, Q, hd)
    kv = [(leaf(B, nkv, T, hd), leaf(B, nkv, T, hd))]
    kv += [(leaf(B, nkv, Q, hd), leaf(B, nkv, Q, hd)) for _ in range(steps)]
    w = torch.randn(B, nh, Q, hd, dtype=torch.float64)
    leaves = [q] + [t for pair in kv for t in pair]
    outs, grads = [], []
    for fn in (ttt_attention, ttt_attention_reference):
        out = fn(q, kv, qpos)
        outs.append(out)
        grads.append(torch.autograd.grad((out * w).sum(), leaves))
    # both softmax in fp32: agreement to fp32 rounding (summation order differs when chunked)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_cache_path_matches_full_forward_and_tree_mask():
    d = tiny_draft()
    ids = torch.randint(0, 256, (1, 8))
    aux = torch.randn(1, 8, 192)
    full, hf = d(ids, aux, torch.arange(8))
    cache = KVCache()
    l1, _ = d(ids[:, :5], aux[:, :5], torch.arange(5), cache=cache)
    l2, _ = d(ids[:, 5:], aux[:, 5:], torch.arange(5, 8), cache=cache)
    torch.testing.assert_close(torch.cat([l1, l2], 1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 8
    # a tree: two siblings at depth 1 after a 5-token prefix each see the prefix and themselves only
    cache.crop(5)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[:, :5] = True
    mask[0, 5] = mask[1, 6] = True
    lt, _ = d(ids[:, 5:7], aux[:, 5:7], torch.tensor([5, 5]), cache=cache, attn_mask=mask)
    cache2 = KVCache()
    d(ids[:, :5], aux[:, :5], torch.arange(5), cache=cache2)
    lone, _ = d(ids[:, 6:7], aux[:, 6:7], torch.tensor([5]), cache=cache2)
    torch.testing.assert_close(lt[:, 1:2], lone, atol=1e-5, rtol=1e-5)


def test_rope_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    t = tiny_llama()
    d = tiny_draft()
    pos = torch.arange(20)[None]
    cos, sin = LlamaRotaryEmbedding(t.config)(torch.zeros(1, dtype=torch.float32), pos)
    c2, s2 = d.rope(pos, torch.float32)
    torch.testing.assert_close(c2, cos)
    torch.testing.assert_close(s2, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_dtypes(dtype):
    d = tiny_draft().to(dtype)
    ids = torch.randint(0, 256, (2, 6))
    kv, h = [], torch.randn(2, 6, 192, dtype=dtype)
    for i in range(3):
        logits, h = d(ids, h, torch.arange(6) + i, ttt=kv)
        assert logits.dtype == dtype and torch.isfinite(logits).all()
    ref = tiny_draft()(ids, torch.randn(2, 6, 192), torch.arange(6))[0]
    assert ref.dtype == torch.float32


def test_rms_norm_applies_its_weight_in_the_input_dtype():
    """Llama's formula (normalize in fp32, cast, scale) in the input's dtype: under bf16
    autocast with fp32 master weights the output stays bf16, so no fp32 activations (and
    their casts, forward and backward) reach the next linear; fp32 is unchanged."""
    torch.manual_seed(0)
    n = RMSNorm(64, 1e-5)
    with torch.no_grad():
        n.weight.copy_(1 + 0.1 * torch.randn(64))
    x = torch.randn(5, 64)
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(n(x), n.weight * xn)
    xb = x.bfloat16()
    xbn = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = n(xb)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, n.weight.bfloat16() * xbn)
    y.float().sum().backward()  # the fp32 master weight still gets its gradient
    assert n.weight.grad is not None and n.weight.grad.dtype == torch.float32


def test_init_from_target_copies_head_and_layer():
    t = tiny_llama()
    d = tiny_draft()
    init_from_target(d, t, layer_index=3, embed_half_scale=0.5)
    W = t.get_output_embeddings().weight
    torch.testing.assert_close(d.lm_head.weight, W[d.draft_ids])
    torch.testing.assert_close(d.embed_tokens, t.get_input_embeddings().weight)
    torch.testing.assert_close(d.norm.weight, t.model.norm.weight)
    q = t.model.layers[3].self_attn.q_proj.weight
    torch.testing.assert_close(d.midlayer.self_attn.q_proj.weight[:, 64:], q)
    torch.testing.assert_close(d.midlayer.self_attn.q_proj.weight[:, :64], 0.5 * q)
    torch.testing.assert_close(
        d.midlayer.mlp.down_proj.weight, t.model.layers[3].mlp.down_proj.weight
    )


def test_init_from_target_without_lm_head_leaves_it_random():
    t = tiny_llama()
    torch.manual_seed(0)
    cfg = DraftConfig.from_target(t.config, LayerIds((0, 1, 2)), 64)
    d = Eagle3Draft(cfg)
    d.set_vocab(torch.arange(64) * 4)
    before = d.lm_head.weight.clone()
    init_from_target(d, t, lm_head=False)
    assert torch.equal(d.lm_head.weight, before)  # untouched random init
    torch.testing.assert_close(d.norm.weight, t.model.norm.weight)  # the rest still copied
    init_from_target(d, t)
    torch.testing.assert_close(d.lm_head.weight, t.get_output_embeddings().weight[d.draft_ids])


# ---------------------------------------------------------------- vocab


class ListReader:
    def __init__(self, samples, V=256):
        self.samples = samples
        self.manifest = {"target": {"vocab_size": V}, "shards": [{"sha256": "x"}]}

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def test_vocab_build_pad_coverage_and_d2t():
    from workbench.draft.vocab import build_vocab

    ids = torch.tensor([5, 5, 5, 9, 9, 200, 7, 7, 7, 7])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)  # 7 is prompt-only
    r = ListReader([{"input_ids": ids, "loss_mask": mask}])
    with pytest.warns(UserWarning, match="padded"):
        v = build_vocab(r, size=4)
    assert v.ids.tolist() == [
        0,
        5,
        9,
        200,
    ]  # 3 seen + the lowest unseen id as padding; 7 is prompt-only
    assert v.draft_vocab_size == 4 and v.num_seen == 3 and v.num_tokens == 6
    assert torch.equal(v.d2t + torch.arange(4), v.ids)
    assert v.t2d.sum() == 4 and v.t2d[v.ids].all()
    assert coverage(v, r) == 1.0
    v2 = build_vocab(r, size=2)
    assert v2.ids.tolist() == [5, 9] and abs(coverage(v2, r) - 5 / 6) < 1e-9
    check_d2t(v2.d2t, 256, v2.t2d)
    with pytest.warns(UserWarning):
        assert build_vocab(r, size=10_000).draft_vocab_size == 256  # capped at the target vocab


def test_vocab_tie_break_and_save_load(tmp_path):
    counts = torch.zeros(256, dtype=torch.long)
    counts[[3, 10, 11]] = torch.tensor([5, 2, 2])
    v = vocab_from_counts(counts, 2, "abc")
    assert v.ids.tolist() == [3, 10]
    p = v.save(tmp_path / "vocab.json")
    w = DraftVocab.load(p)
    assert torch.equal(w.ids, v.ids) and w.capture_hash == "abc" and w.target_vocab_size == 256
    assert coverage_curve(counts, [1, 3]) == {1: 5 / 9, 3: 1.0}


def test_check_d2t_flags_degenerate_maps():
    with pytest.raises(VocabError, match="all zeros"):
        check_d2t(torch.zeros(64, dtype=torch.long), 256)
    with pytest.raises(VocabError, match="arange"):
        check_d2t(torch.arange(64), 256)
    with pytest.raises(VocabError, match="int64"):
        check_d2t(torch.tensor([1, 1, 1], dtype=torch.int32), 256)
    with pytest.raises(VocabError, match="outside"):
        check_d2t(torch.tensor([254, 254, 254]), 256)
    assert check_d2t(torch.zeros(256, dtype=torch.long), 256) == []  # full vocab: identity is right
    with pytest.warns(UserWarning):
        assert d2t_problems(torch.zeros(8, dtype=torch.long), 256)
        check_d2t(torch.zeros(8, dtype=torch.long), 256, strict=False)
    t2d = torch.zeros(256, dtype=torch.bool)
    with pytest.raises(VocabError, match="t2d"):
        check_d2t(torch.tensor([1, 1, 1]), 256, t2d)
