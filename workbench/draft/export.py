"""Export a trained draft in the layouts serving engines load, and import outside drafts.

- `export_sglang`: the directory SGLang's `--speculative-draft-model-path` loads
  (`LlamaForCausalLMEagle3`, sglang.md). SGLang skips unknown weight names *silently* (the
  weight stays random) and a too-small `max_position_embeddings` silently kills acceptance,
  so the export validates names, shapes, the vocab map and the config before writing.
- `export_speculators`: the vLLM / speculators layout (eagle3.md): `midlayer.` renamed
  `layers.0.`, layer ids in vLLM's `input_of_layer` meaning, `norm_before_residual: false`
  written explicitly (vLLM defaults it to true).
- `import_draft`: a SpecForge/EAGLE-style SGLang checkpoint, one of our exports, or a
  speculators export, back into an `Eagle3Draft` for inspection, with a list of what would
  go wrong when serving it (degenerate d2t, unknown/missing keys, short context, ...).

Layer ids: SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` mean `output_of_layer`;
speculators' top-level `eagle_aux_hidden_state_layer_ids` mean `input_of_layer`. All
conversion goes through `workbench.layers`. Writes are atomic (temp dir + rename).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench.draft.model import SGLANG_KEYS, DraftConfig, Eagle3Draft
from workbench.draft.vocab import VocabError, check_d2t
from workbench.layers import (
    CANONICAL,
    CONVENTIONS,
    INPUT_OF_LAYER,
    OUTPUT_OF_LAYER,
    LayerConventionError,
    LayerIds,
    check_convention,
)

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
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """The draft or its config would not load correctly (or would load silently wrong)."""


class DraftImportError(ValueError):
    """An outside checkpoint cannot be represented, or (strict) has problems."""


# ---------------------------------------------------------------- validation


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


def read_verifier_architectures(verifier: str) -> list[str] | None:
    """Architectures of a local verifier dir (None when it is a hub id or has no config)."""
    p = Path(verifier) / "config.json"
    if p.is_file():
        return json.loads(p.read_text()).get("architectures")
    return None


# ---------------------------------------------------------------- writing


def _as_dtype(dtype: torch.dtype | str | None, draft: Eagle3Draft) -> torch.dtype:
    if dtype is None or dtype == "":
        return draft.lm_head.weight.dtype
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ExportError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    return dtype


def sglang_tensors(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The draft's SGLang weight set, floats cast to `dtype`, d2t int64, t2d bool."""
    # not export_state_dict(): an off-layout key must reach weight_problems, named
    sd = {k: v.detach().cpu() for k, v in draft.state_dict().items()}
    out = {}
    for k, v in sd.items():
        if k == "d2t":
            out[k] = v.long().contiguous()
        elif k == "t2d":
            out[k] = v.bool().contiguous()
        else:
            out[k] = v.to(dtype).contiguous()
    return out


def _atomic_dir(out_dir: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Build the directory in a sibling temp dir, then swap it in with renames."""
    out = Path(out_dir)
    if out.exists() and (
        not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").is_file())
    ):
        raise ExportError(f"{out} exists and is not a draft export; refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    old = None
    try:
        write(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o755)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def _provenance(
    draft: Eagle3Draft, fmt: str, config_ids: LayerIds, provenance: dict | None
) -> dict[str, Any]:
    import workbench

    prov = dict(provenance or {})
    given = prov.pop("layer_ids", None)
    ours = draft.config.layer_ids
    if given is not None:
        g = given if isinstance(given, LayerIds) else LayerIds.from_dict(given)
        if g.canonical != ours.canonical:
            raise ExportError(
                f"provenance says layer ids {g} = {list(g.canonical)} ({CANONICAL}), the draft "
                f"was built for {ours} = {list(ours.canonical)} ({CANONICAL})"
            )
    return {
        "format": fmt,
        "workbench_version": workbench.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "layer_ids": ours.to(CANONICAL).to_dict(),
        "layer_ids_in_config": config_ids.to_dict(),
        "draft_config": draft.config.to_dict(),
        **prov,
    }


def _target_max_pos(provenance: dict | None, given: int | None) -> int | None:
    if given:
        return int(given)
    t = (provenance or {}).get("target") or {}
    return t.get("max_position_embeddings") if isinstance(t, dict) else None


def _check_before_write(
    draft: Eagle3Draft, tensors: dict[str, torch.Tensor], target_max_pos: int | None
) -> None:
    problems = config_problems(draft.config, target_max_pos) + weight_problems(
        tensors, draft.config
    )
    if problems:
        raise ExportError("refusing to export:\n  " + "\n  ".join(problems))


def export_sglang(
    draft: Eagle3Draft,
    out_dir: str | os.PathLike,
    provenance: dict | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    target_max_position_embeddings: int | None = None,
) -> Path:
    """Write the SGLang draft dir: config.json, model.safetensors, workbench.json.

    `provenance` (capture hash, target fingerprint, training summary, ...) goes into
    workbench.json; `target.max_position_embeddings` there (or the keyword) is checked
    against the draft's. Raises `ExportError` before writing anything on any problem.
    """
    from safetensors.torch import save_file

    dt = _as_dtype(dtype, draft)
    tensors = sglang_tensors(draft, dt)
    _check_before_write(draft, tensors, _target_max_pos(provenance, target_max_position_embeddings))
    config = sglang_config(draft.config, dt)
    ids = LayerIds(
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"], CONFIG_CONVENTION[SGLANG]
    )
    prov = _provenance(draft, SGLANG, ids, provenance)

    def write(d: Path) -> None:
        _write_json(d / "config.json", config)
        save_file(tensors, str(d / WEIGHTS_FILE), metadata={"format": "pt"})
        _write_json(d / PROVENANCE_FILE, prov)

    return _atomic_dir(out_dir, write)


def to_speculators_key(k: str) -> str:
    return "layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k


def from_speculators_key(k: str) -> str:
    return "midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k


def export_speculators(
    draft: Eagle3Draft,
    out_dir: str | os.PathLike,
    verifier_name_or_path: str,
    speculative_tokens: int = 3,
    provenance: dict | None = None,
    *,
    verifier_architectures: Sequence[str] | None = None,
    dtype: torch.dtype | str | None = None,
    target_max_position_embeddings: int | None = None,
) -> Path:
    """Write the vLLM/speculators draft dir (`Eagle3Speculator`, `layers.0.*` weights)."""
    from safetensors.torch import save_file

    dt = _as_dtype(dtype, draft)
    tensors = sglang_tensors(draft, dt)
    _check_before_write(draft, tensors, _target_max_pos(provenance, target_max_position_embeddings))
    archs = verifier_architectures or read_verifier_architectures(verifier_name_or_path)
    config = speculators_config(draft.config, verifier_name_or_path, speculative_tokens, archs, dt)
    ids = LayerIds(config["eagle_aux_hidden_state_layer_ids"], CONFIG_CONVENTION[SPECULATORS])
    prov = _provenance(draft, SPECULATORS, ids, provenance)
    renamed = {to_speculators_key(k): v for k, v in tensors.items()}

    def write(d: Path) -> None:
        _write_json(d / "config.json", config)
        save_file(renamed, str(d / WEIGHTS_FILE), metadata={"format": "pt"})
        _write_json(d / PROVENANCE_FILE, prov)

    return _atomic_dir(out_dir, write)


# ---------------------------------------------------------------- from a training run


def load_checkpoint(path: str | os.PathLike) -> tuple[Eagle3Draft, dict[str, Any]]:
    """Draft + provenance (capture hash, target, training summary) from a run or checkpoint dir.

    Same resolution as `train.load_draft` (a dir with state.pt, or a run dir's `latest`), but
    the state is read once for both. Embeddings stay zero: exports never carry them.
    """
    from workbench.draft.train import TrainError, latest_checkpoint

    p = Path(path)
    ck = p if (p / "state.pt").is_file() else latest_checkpoint(p)
    if ck is None:
        raise TrainError(f"{p}: no checkpoint (expected state.pt or checkpoints/latest)")
    state = torch.load(ck / "state.pt", map_location="cpu", weights_only=False, mmap=True)
    draft = Eagle3Draft(DraftConfig.from_dict(state["draft_config"]))
    draft.load_state_dict(state["draft"])
    return draft, run_provenance(state, ck)


def run_provenance(state: dict, checkpoint: Path | None = None) -> dict[str, Any]:
    """What workbench.json records about how a draft was trained."""
    cfg = state.get("config", {})
    metrics = state.get("metrics", [])
    last = {e.get("event"): e for e in metrics}
    keep = ("ttt_len", "lr", "batch_size", "epochs", "max_steps", "max_len", "seed",
            "draft_vocab_size", "init_from_target", "init_layer", "warmup", "loss_decay")  # fmt: skip
    ev = last.get("eval", {})
    tr = last.get("train", {})
    return {
        "capture": cfg.get("capture"),
        "capture_hash": state.get("capture_hash"),
        "target_fingerprint": state.get("target_fingerprint"),
        "target": {"name": cfg.get("target"), "fingerprint": state.get("target_fingerprint")},
        "checkpoint": str(checkpoint) if checkpoint else None,
        "training": {
            "step": state.get("step"),
            "world_size": state.get("world_size"),
            "config": {k: cfg.get(k) for k in keep if k in cfg},
            "held_out": {k: ev.get(k) for k in ("step", "acc", "a", "tau") if k in ev},
            "last_train": {k: tr.get(k) for k in ("step", "loss", "acc", "tok_s") if k in tr},
        },
    }


# ---------------------------------------------------------------- import


@dataclass
class ImportedDraft:
    """An outside (or our own) draft, loaded for inspection, with what looks wrong."""

    draft: Eagle3Draft
    format: str  # sglang | speculators
    layer_ids: LayerIds  # canonical
    config: dict
    warnings: list[str] = field(default_factory=list)
    provenance: dict | None = None
    path: str = ""

    def summary(self) -> str:
        c = self.draft.config
        n = sum(p.numel() for p in self.draft.parameters())
        lines = [
            f"{self.path}: {self.format} draft, {n:,} parameters",
            f"  hidden {c.hidden_size}, heads {c.num_attention_heads}/{c.num_key_value_heads}, "
            f"intermediate {c.intermediate_size}, target hidden {c.target_hidden_size}",
            f"  vocab: draft {c.draft_vocab_size} of target {c.vocab_size}; "
            f"max_position_embeddings {c.max_position_embeddings}",
            f"  aux layers {list(self.layer_ids.ids)} ({CANONICAL}) = "
            f"{list(self.layer_ids.to(INPUT_OF_LAYER).ids)} ({INPUT_OF_LAYER})",
        ]
        if self.provenance:
            tr = (self.provenance.get("training") or {}).get("held_out") or {}
            lines.append(
                f"  provenance: capture {self.provenance.get('capture_hash')}, target "
                f"{self.provenance.get('target_fingerprint')}, held-out tau {tr.get('tau')}"
            )
        lines.append(f"  {len(self.warnings)} warning(s)")
        lines += [f"  - {w}" for w in self.warnings]
        return "\n".join(lines)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    for name in ("pytorch_model.bin", "model.bin"):
        if (path / name).is_file():
            return dict(torch.load(path / name, map_location="cpu", weights_only=True))
    raise DraftImportError(f"{path}: no *.safetensors or pytorch_model.bin weights")


def _detect_format(config: dict) -> str:
    archs = config.get("architectures") or []
    if SPECULATORS_ARCH in archs or "speculators_config" in config:
        return SPECULATORS
    return SGLANG


def _rope(llama: dict) -> tuple[float, dict | None]:
    rp = dict(llama.get("rope_parameters") or {})
    theta = llama.get("rope_theta") or rp.get("rope_theta") or 10000.0
    rp.pop("rope_theta", None)
    scaling = llama.get("rope_scaling") or rp or None
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), (dict(scaling) if scaling else None)


def _no_ids_error(path: Path, fmt: str) -> LayerConventionError:
    return LayerConventionError(
        f"{path}: the config has no eagle_aux_hidden_state_layer_ids and no {PROVENANCE_FILE}; "
        f"say which target layers feed this draft: layer_ids=[...] with layer_convention one "
        f"of {', '.join(CONVENTIONS)} (canonical {CANONICAL}). Without ids the engine uses its "
        "own default, which depends on the target architecture (SGLang, Llama: input of layers "
        "[2, N//2, N-3] = output_of_layer [1, N//2-1, N-4]; Qwen, DeepSeek and gpt-oss differ)."
    )


def _resolve_ids(
    path: Path,
    fmt: str,
    config_ids: list[int] | None,
    wb: dict | None,
    layer_convention: str | None,
    layer_ids: str | Sequence[int] | LayerIds | None,
    warns: list[str],
) -> LayerIds:
    known = CONFIG_CONVENTION[fmt]
    stored = LayerIds.from_dict(wb["layer_ids"]) if wb and wb.get("layer_ids") else None
    if config_ids:
        conv = check_convention(layer_convention) if layer_convention else known
        if conv != known:
            warns.append(
                f"reading the config's layer ids {config_ids} as {conv} on request, although "
                f"{fmt} configs mean {known}: the serving engine will read them as {known}"
            )
        ids = LayerIds(tuple(config_ids), conv)
        if stored is not None and stored.canonical != ids.canonical:
            warns.append(
                f"config layer ids {ids} = {list(ids.canonical)} ({CANONICAL}) differ from the "
                f"ids the draft was trained with ({stored} = {list(stored.canonical)}): "
                "an off-by-one between training and serving"
            )
        return ids.to(CANONICAL)
    if layer_ids is not None:
        if isinstance(layer_ids, LayerIds):
            given = layer_ids
        else:
            raw = layer_ids.split(",") if isinstance(layer_ids, str) else layer_ids
            given = LayerIds(tuple(int(x) for x in raw), check_convention(layer_convention))
        warns.append(
            f"the config has no layer ids: the engine will use its architecture default, not "
            f"the given {given}; write them into the config before serving"
        )
        return given.to(CANONICAL)
    if stored is not None:
        warns.append(
            f"the config has no layer ids (engine default applies) but {PROVENANCE_FILE} says "
            f"the draft was trained on {stored}"
        )
        return stored.to(CANONICAL)
    raise _no_ids_error(path, fmt)


def import_draft(
    path: str | os.PathLike,
    layer_convention: str | None = None,
    *,
    layer_ids: str | Sequence[int] | LayerIds | None = None,
    target_max_position_embeddings: int | None = None,
    strict: bool = False,
    dtype: torch.dtype = torch.float32,
) -> ImportedDraft:
    """Load an SGLang-style or speculators draft dir into an `Eagle3Draft` for inspection.

    The layer convention comes from the config (SGLang `eagle_config` ids mean
    `output_of_layer`, speculators ids `input_of_layer`; our `workbench.json` is cross-
    checked); `layer_convention` overrides that reading, and when the config has no ids the
    caller must give `layer_ids` + `layer_convention`. Problems a serving engine would hit
    silently are returned as `warnings`; `strict=True` raises `DraftImportError` instead.
    Embeddings are zero unless the checkpoint carries `embed_tokens.weight`: fill them from
    the target before running the draft.
    """
    p = Path(path)
    if not (p / "config.json").is_file():
        raise DraftImportError(f"{p}: no config.json; not a draft directory")
    config = json.loads((p / "config.json").read_text())
    wb = None
    if (p / PROVENANCE_FILE).is_file():
        wb = json.loads((p / PROVENANCE_FILE).read_text())
    fmt = _detect_format(config)
    warns: list[str] = []
    raw = _read_weights(p)

    if fmt == SPECULATORS:
        llama = dict(config.get("transformer_layer_config") or {})
        config_ids = config.get("eagle_aux_hidden_state_layer_ids")
        if config.get("norm_before_residual", True):
            warns.append(
                "norm_before_residual is true or absent (vLLM's default is true): the residual "
                "is taken after hidden_norm, unlike SGLang/SpecForge; this draft's outputs differ"
            )
        tensors = {from_speculators_key(k): v for k, v in raw.items()}
        arch_ok = SPECULATORS_ARCH in (config.get("architectures") or [])
    else:
        llama = config
        eagle = config.get("eagle_config") or {}
        config_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if eagle.get("use_aux_hidden_state") is False:
            warns.append(
                "eagle_config.use_aux_hidden_state is false: SGLang skips fc and aux states (tau ~ 1)"
            )
        tensors = raw
        arch_ok = (config.get("architectures") or [None])[0] == SGLANG_ARCH
    if not arch_ok:
        want = SPECULATORS_ARCH if fmt == SPECULATORS else SGLANG_ARCH
        warns.append(
            f"architectures {config.get('architectures')}: expected [{want!r}] "
            "(e.g. LlamaForCausalLMEagle builds an EAGLE-2 head, which ignores the aux states)"
        )
    if int(llama.get("num_hidden_layers", 1)) != 1:
        raise DraftImportError(
            f"{p}: num_hidden_layers {llama.get('num_hidden_layers')}; only 1-layer EAGLE-3 "
            "drafts are supported"
        )
    if llama.get("tie_word_embeddings"):
        warns.append("tie_word_embeddings is true: the draft lm_head must not be tied")

    ids = _resolve_ids(p, fmt, config_ids, wb, layer_convention, layer_ids, warns)
    H = int(llama["hidden_size"])
    heads = int(llama["num_attention_heads"])
    vocab = int(llama.get("vocab_size") or config.get("vocab_size"))
    lm = tensors.get("lm_head.weight")
    dv = int(config.get("draft_vocab_size") or llama.get("draft_vocab_size") or 0)
    if not dv:
        dv = int(lm.shape[0]) if lm is not None else vocab
        warns.append(f"no draft_vocab_size in the config; took {dv} from lm_head")
    theta, scaling = _rope(llama)
    cfg = DraftConfig(
        hidden_size=H,
        intermediate_size=int(llama["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(llama.get("num_key_value_heads") or heads),
        head_dim=int(llama.get("head_dim") or H // heads),
        vocab_size=vocab,
        draft_vocab_size=dv,
        target_hidden_size=int(
            config.get("target_hidden_size") or llama.get("target_hidden_size") or H
        ),
        layer_ids=ids,
        rms_norm_eps=float(llama.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(llama.get("max_position_embeddings", 2048)),
        hidden_act=str(llama.get("hidden_act", "silu")),
    )
    fc = tensors.get("fc.weight")
    if fc is not None and fc.shape[1] != cfg.fc_in_features:
        raise DraftImportError(
            f"{p}: fc.weight takes {fc.shape[1]} features but {cfg.num_aux} aux layers x target "
            f"hidden {cfg.target_hidden_size} = {cfg.fc_in_features}: the layer ids or "
            "target_hidden_size in the config are wrong"
        )
    bad_shape = [w for w in weight_problems(tensors, cfg, OPTIONAL_KEYS) if ": shape " in w]
    if bad_shape:
        raise DraftImportError(f"{p}: weights do not fit the config:\n  " + "\n  ".join(bad_shape))
    # report problems the engine would hit (missing d2t handled below with a clearer message)
    probs = weight_problems(tensors, cfg, OPTIONAL_KEYS)
    for w in probs:
        if w.startswith("missing keys"):
            miss = [k for k in SGLANG_KEYS if k not in tensors and k not in ("d2t", "t2d")]
            if miss:
                warns.append(f"missing keys {miss}: the engine keeps random weights for them")
        else:
            warns.append(w)
    if "d2t" not in tensors and dv < vocab:
        warns.append(
            f"d2t missing: the draft vocab ({dv}) is smaller than the target's ({vocab}), so "
            "draft ids are read as target ids (identity map) and almost nothing is accepted"
        )
    if "t2d" not in tensors:
        warns.append("t2d missing (SGLang ignores it); rebuilt from d2t")
    warns += config_problems(cfg, _target_max_pos(wb, target_max_position_embeddings))

    draft = Eagle3Draft(cfg)
    own = set(draft.state_dict())
    load = {}
    for k, v in tensors.items():
        if k not in own:
            continue
        load[k] = v.long() if k == "d2t" else v.bool() if k == "t2d" else v.to(dtype)
    draft.load_state_dict(load, strict=False)
    if "t2d" not in tensors:
        draft.t2d.zero_()
        ids_t = draft.draft_ids.clamp(0, vocab - 1)
        draft.t2d[ids_t] = True
    if "embed_tokens.weight" in tensors:
        emb = tensors["embed_tokens.weight"]
        if tuple(emb.shape) == tuple(draft.embed_tokens.shape):
            draft.embed_tokens.copy_(emb.float())
        else:
            warns.append(f"embed_tokens.weight has shape {tuple(emb.shape)}; ignored")
    draft.to(dtype)
    if strict and warns:
        raise DraftImportError(f"{p}: problems found:\n  " + "\n  ".join(warns))
    return ImportedDraft(draft, fmt, ids, config, warns, wb, str(p))


def load_any(
    path: str | os.PathLike, **import_kw: Any
) -> tuple[Eagle3Draft, dict[str, Any], list[str]]:
    """A draft from a training run/checkpoint dir or from an export dir (for re-exporting).

    Returns (draft, provenance, warnings).
    """
    p = Path(path)
    if (p / "state.pt").is_file() or (p / "checkpoints" / "latest").is_file():
        d, prov = load_checkpoint(p)
        return d, prov, []
    imp = import_draft(p, **import_kw)
    prov = {k: v for k, v in (imp.provenance or {}).items() if k not in (
        "format", "created", "layer_ids_in_config", "draft_config", "workbench_version")}  # fmt: skip
    prov["imported_from"] = str(p)
    return imp.draft, prov, imp.warnings
