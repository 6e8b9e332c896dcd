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
  keys of steps 1..i (`attention.py`, with the packed-row variants that keep every score
  inside its sample).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench.draft import attention as ttt_attn
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
    """Llama's RMSNorm (fp32 statistics, weight applied in the input dtype).

    The weight is cast to the input's dtype, so under bf16 autocast (fp32 master weights)
    the output stays bf16: an fp32 product would make the q/k/v input, the lm_head input
    and their gradients fp32 tensors that autocast then casts back: about 1.05x the packed
    quick training step (1.01-1.09x over four runs, benchmarks/bench_train.py --norm-ab). Same values where the weight and
    the input share a dtype (fp32 training, inference)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dt) * x.to(dt)


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
            ref = getattr(ttt, "reference", False)
            attend = ttt_attn.ttt_attention_reference if ref else ttt_attn.ttt_attention
            out = attend(q, ttt, ttt_pos)
        else:
            if ttt is not None:
                ttt.append((k, v))
            if ttt is not None and getattr(ttt, "segments", None) is not None:
                # packed rows (the first TTT step): causal within each sample only
                out = ttt_attn.segment_attention(q, k, v, ttt.segments)
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
