"""The serving layouts as data: config fields, weight names and shapes, and what breaks them.

SGLang's `LlamaForCausalLMEagle3` (sglang.md) and vLLM / speculators' `Eagle3Speculator`
(eagle3.md) load the same weights under two naming schemes and two meanings of the layer
ids: SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` mean `output_of_layer`,
speculators' top-level `eagle_aux_hidden_state_layer_ids` mean `input_of_layer`. The writer
(`export.py`) and the loader (`load.py`) both check against these key sets and shapes: SGLang
skips unknown weight names silently, so a wrong name is a random weight at serving time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from workbench.draft.model import SGLANG_KEYS, DraftConfig
from workbench.draft.vocab import VocabError, check_d2t
from workbench.layers import INPUT_OF_LAYER, OUTPUT_OF_LAYER

SGLANG_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3Speculator"
SGLANG = "sglang"
SPECULATORS = "speculators"
FORMATS = (SGLANG, SPECULATORS)
# What the `eagle_aux_hidden_state_layer_ids` field of each layout means.
CONFIG_CONVENTION = {SGLANG: OUTPUT_OF_LAYER, SPECULATORS: INPUT_OF_LAYER}
PROVENANCE_FILE = "workbench.json"
WEIGHTS_FILE = "model.safetensors"
# Known to loaders but never written by us (embeddings come from the target).
OPTIONAL_KEYS = ("embed_tokens.weight",)


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every SGLang weight for a config (the layout contract, key by key)."""
    H, I = cfg.hidden_size, cfg.intermediate_size  # noqa: E741
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "fc.weight": (H, cfg.fc_in_features),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "midlayer.post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def weight_problems(
    tensors: dict[str, torch.Tensor], cfg: DraftConfig, optional: Sequence[str] = ()
) -> list[str]:
    """Everything wrong with an SGLang-named weight set for `cfg` (empty: loads correctly)."""
    out: list[str] = []
    want = expected_shapes(cfg)
    missing = [k for k in SGLANG_KEYS if k not in tensors]
    unknown = sorted(k for k in tensors if k not in want and k not in optional)
    if missing:
        out.append(f"missing keys {missing}: the loader keeps random weights for them")
    if unknown:
        out.append(f"unknown keys {unknown}: SGLang skips them silently")
    for k, shape in want.items():
        t = tensors.get(k)
        if t is not None and tuple(t.shape) != shape:
            out.append(f"{k}: shape {tuple(t.shape)}, config implies {shape}")
    for k, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            out.append(f"{k}: holds NaN or inf")
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is not None and d2t.dtype != torch.long:
        out.append(f"d2t dtype {d2t.dtype}: SGLang expects int64 offsets")
    if t2d is not None and t2d.dtype != torch.bool:
        out.append(f"t2d dtype {t2d.dtype}: expected bool over the target vocab")
    if d2t is not None and tuple(d2t.shape) == want["d2t"]:
        ok_t2d = t2d if t2d is not None and tuple(t2d.shape) == want["t2d"] else None
        try:
            check_d2t(d2t, cfg.vocab_size, ok_t2d, strict=True)
        except VocabError as e:
            out.append(str(e))
    return out


def config_problems(
    cfg: DraftConfig, target_max_position_embeddings: int | None = None
) -> list[str]:
    """What in a draft config would make an engine serve it silently wrong."""
    out = []
    if target_max_position_embeddings and cfg.max_position_embeddings < int(
        target_max_position_embeddings
    ):
        out.append(
            f"max_position_embeddings {cfg.max_position_embeddings} < the target's "
            f"{target_max_position_embeddings}: the engine caps the draft context there and "
            "acceptance silently collapses on longer requests"
        )
    if cfg.draft_vocab_size > cfg.vocab_size:
        out.append(f"draft_vocab_size {cfg.draft_vocab_size} > vocab_size {cfg.vocab_size}")
    if cfg.fc_in_features % max(cfg.target_hidden_size, 1):
        out.append(
            f"fc takes {cfg.fc_in_features} features, not a multiple of target hidden "
            f"{cfg.target_hidden_size}"
        )
    return out


# ---------------------------------------------------------------- configs


def llama_fields(cfg: DraftConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The Llama config fields both engines build the draft's decoder layer from."""
    name = str(dtype).replace("torch.", "")
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": name,
        "dtype": name,
    }


def sglang_config(cfg: DraftConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    ids = cfg.layer_ids.to(CONFIG_CONVENTION[SGLANG]).ids
    return {
        "architectures": [SGLANG_ARCH],
        **llama_fields(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(ids),
            "use_aux_hidden_state": True,
        },
    }


def speculators_config(
    cfg: DraftConfig,
    verifier_name_or_path: str,
    speculative_tokens: int = 3,
    verifier_architectures: Sequence[str] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    ids = cfg.layer_ids.to(CONFIG_CONVENTION[SPECULATORS]).ids
    layer = llama_fields(cfg, dtype)
    return {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}
            ],
            "verifier": {
                "name_or_path": str(verifier_name_or_path),
                "architectures": list(verifier_architectures or ["LlamaForCausalLM"]),
            },
        },
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **layer},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "torch_dtype": layer["torch_dtype"],
        "dtype": layer["dtype"],
    }


def detect_format(config: dict) -> str:
    archs = config.get("architectures") or []
    if SPECULATORS_ARCH in archs or "speculators_config" in config:
        return SPECULATORS
    return SGLANG


def to_speculators_key(k: str) -> str:
    return "layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k


def from_speculators_key(k: str) -> str:
    return "midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k


def rope_fields(llama: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from a Llama config in either HF spelling."""
    rp = dict(llama.get("rope_parameters") or {})
    theta = llama.get("rope_theta") or rp.get("rope_theta") or 10000.0
    rp.pop("rope_theta", None)
    scaling = llama.get("rope_scaling") or rp or None
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), (dict(scaling) if scaling else None)
