"""The EAGLE-3 draft head, laid out exactly as SGLang's `LlamaForCausalLMEagle3` loads it.

One Llama decoder layer (`midlayer`) whose q/k/v read `cat(input_layernorm(emb),
hidden_norm(h))` (2H wide); the residual is the un-normalized `h`. `fc` folds the
concatenated target aux states (k*H_target) to H and runs only when the incoming hidden is
wider than H (the first draft step); later steps feed back the draft's own pre-norm hidden.
`embed_tokens` is frozen and copied from the target: it is a non-persistent buffer, so
`state_dict()` holds exactly SGLang's keys and an export is a rename-free save.

Attention has three paths, all with Llama RoPE:
- plain: causal (or a given boolean mask) over the current tokens, via SDPA;
- cache: past K/V concatenated with the new ones + a boolean mask (tree drafting);
- TTT (training-time test): step i attends the causal step-0 keys plus the same-position
  keys of steps 1..i. Per-step K/V are kept in a list; scores against step 0 are a [T, T]
  matrix, against later steps a diagonal (one dot product per position), so each step costs
  O(T^2) once instead of materializing a [T, (i+1)T] mask (SpecForge's trick).
  `ttt_attention_reference` is the first version of that path, kept (select it with
  `TTTKV(reference=True)`) as the baseline that tests and benchmarks/bench_train.py compare to.
  Packed training rows (several samples end to end, `TTTKV.starts` / `segments`) keep every
  score inside its sample: step 0 runs one causal SDPA per sample, later steps mask the step-0
  keys before the query's sample start.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench.draft.vocab import d2t_from_ids, ids_from_d2t, t2d_from_ids
from workbench.layers import LayerIds

# The exact parameter/buffer names SGLang's llama_eagle3 loader expects.
SGLANG_KEYS = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


@dataclass
class DraftConfig:
    """Shapes of the draft (Llama fields SGLang's config.json needs) + the aux wiring."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocab (embeddings, t2d)
    draft_vocab_size: int
    target_hidden_size: int
    layer_ids: LayerIds  # the aux layers fc reads, with their convention (no default)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_parameters minus rope_theta; None = default
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"

    @property
    def num_aux(self) -> int:
        return len(self.layer_ids.ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_aux * self.target_hidden_size

    @classmethod
    def from_target(cls, hf_config: Any, layer_ids: LayerIds, draft_vocab_size: int) -> DraftConfig:
        """Mirror the target's layer shapes (what SpecForge does for Llama targets)."""
        c = hf_config
        H = int(c.hidden_size)
        heads = int(c.num_attention_heads)
        rp = dict(getattr(c, "rope_parameters", None) or {})
        theta = float(rp.pop("rope_theta", getattr(c, "rope_theta", 10000.0)))
        scaling = getattr(c, "rope_scaling", None) if not rp else rp
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        return cls(
            hidden_size=H,
            intermediate_size=int(c.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or H // heads),
            vocab_size=int(c.vocab_size),
            draft_vocab_size=int(draft_vocab_size),  # clamped once, by vocab.vocab_from_counts
            target_hidden_size=H,
            layer_ids=layer_ids,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 8192)),
            hidden_act=str(getattr(c, "hidden_act", "silu")),
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_ids"] = self.layer_ids.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DraftConfig:
        d = dict(d)
        d["layer_ids"] = LayerIds.from_dict(d.get("layer_ids"))
        return cls(**d)


# ---------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """Llama's RMSNorm (fp32 statistics, weight applied in the input dtype)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope_inv_freq(cfg: DraftConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies + attention scaling, identical to transformers' Llama RoPE."""
    if not cfg.rope_scaling:
        dim = cfg.head_dim
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = {"rope_theta": cfg.rope_theta, **cfg.rope_scaling}
    rp.setdefault("rope_type", rp.pop("type", "default"))
    lc = LlamaConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=rp,
    )
    inv, scale = ROPE_INIT_FUNCTIONS[rp["rope_type"]](lc, None)
    return inv.float(), float(scale)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [B, T, hd]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


@dataclass
class KVCache:
    """Past draft K/V for inference: [B, kv_heads, S, hd] each; `crop` drops rejected tails."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def select(self, index: torch.Tensor) -> None:
        """Keep positions `index` (e.g. the accepted path of a tree)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, index], self.v[:, :, index]


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        H, nh, nkv, hd = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
        ttt: list | None = None,
        ttt_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ttt is not None and len(ttt) > 0:
            ttt.append((k, v))
            attend = ttt_attention_reference if getattr(ttt, "reference", False) else ttt_attention
            out = attend(q, ttt, ttt_pos)
        else:
            if ttt is not None:
                ttt.append((k, v))
            if ttt is not None and getattr(ttt, "segments", None) is not None:
                # packed rows (the first TTT step): causal within each sample only
                out = segment_attention(q, k, v, ttt.segments)
                return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))
            if cache is not None:
                past = cache.length
                k, v = cache.append(k, v)
                if attn_mask is None and past > 0:
                    # causal with an offset: query j sees keys <= past + j
                    S = k.shape[2]
                    attn_mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(past)
            rep = self.nh // self.nkv
            if attn_mask is not None and attn_mask.dim() == 3:
                attn_mask = attn_mask[:, None]
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                is_causal=attn_mask is None and T > 1,
                enable_gqa=rep > 1,
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class TTTKV(list):
    """The per-step (k, v) of one TTT unroll; `reference=True` selects
    `ttt_attention_reference` (the baseline) instead of `ttt_attention`.

    Packed rows (several samples end to end in one row, `data.collate_packed`) set `starts`
    [B, T] (the row index where each position's sample begins) and `segments` (per row, the
    (begin, end) of each sample): attention then stays inside a sample, exactly as if each
    sample were a row of its own."""

    def __init__(
        self,
        reference: bool = False,
        starts: torch.Tensor | None = None,
        segments: list[list[tuple[int, int]]] | None = None,
    ) -> None:
        super().__init__()
        self.reference, self.starts, self.segments = reference, starts, segments


def packed_segments(position_ids: torch.Tensor) -> tuple[torch.Tensor, list[list[tuple[int, int]]]]:
    """(starts [B, T], segments) of packed rows whose position ids restart at 0 per sample."""
    B, T = position_ids.shape
    starts = torch.arange(T, device=position_ids.device)[None] - position_ids
    segments = []
    for row in position_ids.cpu():
        begins = (row == 0).nonzero().flatten().tolist()
        segments.append(list(zip(begins, begins[1:] + [T], strict=True)))
    return starts, segments


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[list[tuple[int, int]]]
) -> torch.Tensor:
    """Causal attention within each (begin, end) segment of each row: one SDPA call per sample,
    so no [T, T] mask and no scores across samples are computed (a packed 1 x 1024 row of ~4
    samples: 28 vs 103 ms forward + backward with a block-diagonal mask, fp32, 2 cores)."""
    rep = q.shape[1] // k.shape[1]
    rows = []
    for b, segs in enumerate(segments):
        parts = [
            F.scaled_dot_product_attention(
                q[b : b + 1, :, a:e], k[b : b + 1, :, a:e], v[b : b + 1, :, a:e],
                is_causal=e - a > 1, enable_gqa=rep > 1,
            )
            for a, e in segs
        ]  # fmt: skip
        rows.append(torch.cat(parts, 2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, 0) if len(rows) > 1 else rows[0]


def _ttt_causal(
    T: int,
    qpos: torch.Tensor | None,
    device: torch.device,
    starts_q: torch.Tensor | None = None,
    lo: int = 0,
) -> torch.Tensor:
    """Which step-0 keys each query sees: [T, T] (query t: keys <= t) or [B, 1, 1, Q, T].

    The keys are row positions lo .. lo+T-1. With `starts_q` (packed rows: where each query's
    sample begins, [B, Q]), a query sees only the keys of its own sample: [B, 1, 1, Q, T]."""
    keys = torch.arange(lo, lo + T, device=device)
    if qpos is None:
        m = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        if starts_q is None:
            return m
        return (m[None] & (keys[None, None, :] >= starts_q[:, :, None]))[:, None, None]
    m = keys[None, None, :] <= qpos[:, :, None]
    if starts_q is not None:
        m = m & (keys[None, None, :] >= starts_q[:, :, None])
    return m[:, None, None]


def _starts_at(kv: list, qpos: torch.Tensor | None) -> torch.Tensor | None:
    """Where each query's sample begins (packed rows), or None (one sample per row)."""
    starts = getattr(kv, "starts", None)
    if starts is None or qpos is None:
        return starts
    return starts.gather(1, qpos)


def ttt_attention(
    q: torch.Tensor,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    qpos: torch.Tensor | None = None,
    chunks: int = 4,
) -> torch.Tensor:
    """Step-i attention: causal over step-0 keys + diagonal over steps 1..i keys.

    Same contract and math as `ttt_attention_reference`, with fewer passes over the [Q, T]
    score block (the cost of a sampled unroll step): the scale is folded into q (1/8 for
    head_dim 64: exact), the softmax writes fp32 straight from the low-precision scores
    (no separate upcast copy), and the result is split rather than sliced (no zero-filled
    slice gradients); the diagonal terms run as one stacked [.., i] block. Sampled queries
    (sorted `qpos`) go in `chunks` groups, each against the step-0 keys up to its last
    position only: the keys past it are masked for every query of the group anyway.
    """
    Q = q.shape[2]
    sq = _starts_at(kv, qpos)
    if qpos is None or chunks <= 1 or Q < 2 * chunks:
        return _ttt_attention_block(q, kv, qpos, sq)
    outs = []
    for a in range(0, Q, -(-Q // chunks)):
        b = min(Q, a - (-Q // chunks))
        n_keys = int(qpos[:, b - 1].max()) + 1
        # packed rows: the group's queries see no key before its first query's sample
        lo = 0 if sq is None else int(sq[:, a].min())
        part = [(kv[0][0][:, :, lo:n_keys], kv[0][1][:, :, lo:n_keys])]
        part += [(k[:, :, a:b], v[:, :, a:b]) for k, v in kv[1:]]
        s_ab = None if sq is None else sq[:, a:b]
        outs.append(_ttt_attention_block(q[:, :, a:b], part, qpos[:, a:b], s_ab, lo))
    return torch.cat(outs, 2)


def _ttt_attention_block(
    q: torch.Tensor,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    qpos: torch.Tensor | None,
    starts_q: torch.Tensor | None = None,
    lo: int = 0,
) -> torch.Tensor:
    B, nh, Q, hd = q.shape
    k0, v0 = kv[0]
    nkv, T = k0.shape[1], k0.shape[2]
    g, n = nh // nkv, len(kv) - 1
    qg = (q * (1.0 / math.sqrt(hd))).view(B, nkv, g, Q, hd)
    s0 = torch.matmul(qg, k0[:, :, None].transpose(-1, -2))  # [B, nkv, g, Q, T]
    s0 = s0.masked_fill(~_ttt_causal(T, qpos, q.device, starts_q, lo), float("-inf"))
    kd = torch.stack([kj for kj, _ in kv[1:]], -2)  # [B, nkv, Q, i, hd]
    diag = torch.matmul(qg.unsqueeze(-2), kd[:, :, None].transpose(-1, -2)).squeeze(-2)
    p = torch.cat([s0, diag], -1).softmax(-1, dtype=torch.float32).to(q.dtype)
    p0, pd = p.split([T, n], -1)
    vd = torch.stack([vj for _, vj in kv[1:]], -2)  # [B, nkv, Q, i, hd]
    out = torch.matmul(p0, v0[:, :, None]) + torch.matmul(pd.unsqueeze(-2), vd[:, :, None]).squeeze(
        -2
    )
    return out.reshape(B, nh, Q, hd)


def ttt_attention_reference(
    q: torch.Tensor,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    qpos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Step-i attention: causal over step-0 keys + diagonal over steps 1..i keys.

    q [B, nh, Q, hd]; kv[0] = step-0 (k, v) [B, nkv, T, hd]; kv[j>0] [B, nkv, Q, hd], kv[-1]
    is this step's own. Without `qpos`, Q = T and query t is position t. With `qpos` [B, Q],
    the queries are the unrolls of positions qpos only (subsampled TTT): each still sees the
    step-0 keys <= its position and its own chain, so the result equals the full unroll's
    rows at those positions. GQA: q is viewed as [B, nkv, g, Q, hd] (no K/V repeat copies).
    Packed rows (`kv.starts`): a query sees the step-0 keys of its own sample only.
    """
    B, nh, Q, hd = q.shape
    k0, v0 = kv[0]
    nkv, T = k0.shape[1], k0.shape[2]
    g = nh // nkv
    qg = q.view(B, nkv, g, Q, hd)
    scale = 1.0 / math.sqrt(hd)
    s0 = torch.matmul(qg, k0[:, :, None].transpose(-1, -2)) * scale  # [B, nkv, g, Q, T]
    s0 = s0.masked_fill(~_ttt_causal(T, qpos, q.device, _starts_at(kv, qpos)), float("-inf"))
    diag = [(qg * kj[:, :, None]).sum(-1, keepdim=True) * scale for kj, _ in kv[1:]]
    p = torch.cat([s0, *diag], dim=-1).float().softmax(-1).to(q.dtype)  # [B, nkv, g, Q, T+i]
    out = torch.matmul(p[..., :T], v0[:, :, None])
    for j, (_, vj) in enumerate(kv[1:]):
        out = out + p[..., T + j : T + j + 1] * vj[:, :, None]
    return out.view(B, nh, Q, hd)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        H, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)
        if cfg.hidden_act != "silu":
            raise ValueError(f"draft supports hidden_act 'silu' (Llama), got {cfg.hidden_act!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """SGLang's LlamaDecoderLayer for EAGLE-3: 2H attention input, residual on raw h."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(H, eps)

    def forward(
        self, emb, h, cos, sin, cache=None, attn_mask=None, ttt=None, ttt_pos=None
    ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        h = h + self.self_attn(
            x, cos, sin, cache=cache, attn_mask=attn_mask, ttt=ttt, ttt_pos=ttt_pos
        )
        return h + self.mlp(self.post_attention_layernorm(h))


# ---------------------------------------------------------------- the draft


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft head; `state_dict()` keys are exactly `SGLANG_KEYS`."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(cfg.fc_in_features, H, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer(
            "t2d", t2d_from_ids(torch.arange(cfg.draft_vocab_size), cfg.vocab_size)
        )
        # frozen, from the target; non-persistent so it never reaches a checkpoint/export
        self.register_buffer("embed_tokens", torch.zeros(cfg.vocab_size, H), persistent=False)
        # a plain attribute, not a buffer: `.to(bfloat16)` must not round the frequencies
        self.inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    # -- vocab map ------------------------------------------------------------------

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """Install the draft vocabulary (sorted target ids) as `d2t` offsets + `t2d`."""
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long, device=self.d2t.device)
        if draft_ids.numel() != self.config.draft_vocab_size:
            raise ValueError(
                f"draft vocab has {draft_ids.numel()} ids, config says {self.config.draft_vocab_size}"
            )
        self.d2t.copy_(d2t_from_ids(draft_ids))
        self.t2d.copy_(t2d_from_ids(draft_ids, self.config.vocab_size))

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft-vocab entry."""
        return ids_from_d2t(self.d2t)

    def to_target_ids(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        return draft_tokens + self.d2t[draft_tokens]

    # -- forward --------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def rope(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply fc only when the hidden is wider than H (target aux states, first step)."""
        H = self.config.hidden_size
        if hidden.shape[-1] == H:
            return hidden
        if hidden.shape[-1] != self.config.fc_in_features:
            raise ValueError(
                f"draft got hidden of width {hidden.shape[-1]}; expected {H} (own hidden) or "
                f"{self.config.fc_in_features} ({self.config.num_aux} aux layers x "
                f"{self.config.target_hidden_size})"
            )
        return self.fc(hidden.to(self.fc.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
        ttt: list | None = None,
        logits: bool = True,
        ttt_pos: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One draft step.

        input_ids [B, T] (the *next* tokens), hidden [B, T, k*H_t or H], position_ids [B, T].
        `cache` + `attn_mask` (bool [T, S] or [B, T, S] or [B, 1, T, S], True = attend,
        S = past + T) is the inference path; `ttt` (a list, appended to) the training path,
        with `ttt_pos` [B, Q] when only the unrolls of those positions are computed.
        Returns (draft-vocab logits or None, pre-norm hidden for the next step).
        """
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(input_ids.shape[0], -1)
        h = self.project(hidden)
        emb = self.embed(input_ids).to(h.dtype)
        cos, sin = self.rope(position_ids, h.dtype)
        h = self.midlayer(
            emb, h, cos, sin, cache=cache, attn_mask=attn_mask, ttt=ttt, ttt_pos=ttt_pos
        )
        out = self.lm_head(self.norm(h)) if logits else None
        return out, h

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """SGLang's weight set (no embed_tokens), contiguous, CPU."""
        sd = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        missing = set(SGLANG_KEYS) ^ set(sd)
        if missing:
            raise RuntimeError(f"draft state dict differs from SGLang's key set: {sorted(missing)}")
        return sd


@torch.no_grad()
def init_from_target(
    draft: Eagle3Draft,
    target_model: nn.Module,
    layer_index: int | None = None,
    embed_half_scale: float = 0.0,
    lm_head: bool = True,
) -> Eagle3Draft:
    """Copy frozen embeddings, final norm and the draft-vocab rows of lm_head from the target.

    `lm_head=False` leaves the draft's lm_head as initialised (random): the ablation of that
    lever.

    With `layer_index`, also start the decoder layer from that target layer: MLP,
    post-attention norm, o_proj as is; q/k/v take the target weights in their hidden half
    (columns H:2H, which read `hidden_norm(h)`) and `embed_half_scale` x the same weights in
    the embedding half; both input norms take the target layer's input norm.
    """
    emb = target_model.get_input_embeddings().weight
    draft.embed_tokens.copy_(emb.to(draft.embed_tokens))
    inner = getattr(target_model, "model", target_model)
    draft.norm.weight.copy_(inner.norm.weight)
    if lm_head:
        head = target_model.get_output_embeddings().weight
        draft.lm_head.weight.copy_(head[draft.draft_ids.to(head.device)].to(draft.lm_head.weight))
    if layer_index is None:
        return draft
    layer = inner.layers[layer_index]
    m, H = draft.midlayer, draft.config.hidden_size
    for name in ("gate_proj", "up_proj", "down_proj"):
        src, dst = getattr(layer.mlp, name).weight, getattr(m.mlp, name).weight
        if src.shape == dst.shape:
            dst.copy_(src)
    m.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
    m.input_layernorm.weight.copy_(layer.input_layernorm.weight)
    m.hidden_norm.weight.copy_(layer.input_layernorm.weight)
    if layer.self_attn.o_proj.weight.shape == m.self_attn.o_proj.weight.shape:
        m.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
    for name in ("q_proj", "k_proj", "v_proj"):
        src, dst = getattr(layer.self_attn, name).weight, getattr(m.self_attn, name).weight
        if dst.shape == (src.shape[0], 2 * src.shape[1]) and src.shape[1] == H:
            dst[:, H:].copy_(src)
            dst[:, :H].copy_(src * embed_half_scale)
    return draft
