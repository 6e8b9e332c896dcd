"""The one draft loader: a training run, a checkpoint, or an SGLang / speculators / SpecForge
directory → an `Eagle3Draft` with its layer ids, provenance and what looks wrong.

- run / checkpoint (`state.pt`, read without pickle): the trained weights and how they were
  trained (`run_provenance`).
- sglang (our export: config.json + model.safetensors + workbench.json), specforge (the same
  SGLang layout written elsewhere, no workbench.json), speculators (vLLM's layout).

The layer convention comes from the layout (SGLang `eagle_config` ids mean
`output_of_layer`, speculators ids `input_of_layer`); our `workbench.json` is cross-checked
against it. Problems a serving engine would hit silently (degenerate d2t, unknown or missing
keys, short context, ...) come back as `warnings`; `strict=True` raises instead. Embeddings
are never exported: they are zero unless the checkpoint carries them or `target_model` is
given.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workbench.draft.checkpoint import read_state, resolve_checkpoint
from workbench.draft.errors import DraftImportError
from workbench.draft.layout import (
    CONFIG_CONVENTION,
    OPTIONAL_KEYS,
    PROVENANCE_FILE,
    SGLANG,
    SGLANG_ARCH,
    SPECULATORS,
    SPECULATORS_ARCH,
    config_problems,
    detect_format,
    from_speculators_key,
    rope_fields,
    weight_problems,
)
from workbench.draft.model import SGLANG_KEYS, DraftConfig, Eagle3Draft
from workbench.draft.vocab import t2d_from_ids
from workbench.layers import (
    CANONICAL,
    CONVENTIONS,
    INPUT_OF_LAYER,
    LayerConventionError,
    LayerIds,
    check_convention,
    parse_layer_spec,
)

RUN, CHECKPOINT, SPECFORGE = "run", "checkpoint", "specforge"
SOURCES = (RUN, CHECKPOINT, SGLANG, SPECULATORS, SPECFORGE)
# Ids given for an outside draft are range-checked against the target later (audit); here only
# their form (integers, sorted, distinct) is: a bound no real target reaches.
_ANY_DEPTH = 1 << 20


@dataclass
class LoadedDraft:
    """A draft with where it came from, its aux-layer wiring and what looks wrong."""

    draft: Eagle3Draft
    layer_ids: LayerIds  # canonical
    source: str  # run | checkpoint | sglang | speculators | specforge
    path: Path
    config: dict  # config.json as read (exports) or the checkpoint's draft_config
    provenance: dict | None = None  # run_provenance (runs) or workbench.json (our exports)
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        c = self.draft.config
        n = sum(p.numel() for p in self.draft.parameters())
        lines = [
            f"{self.path}: {self.source} draft, {n:,} parameters",
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


def load_draft(
    path: str | os.PathLike,
    target_model: nn.Module | None = None,
    *,
    layer_ids: str | Sequence[int] | LayerIds | None = None,
    layer_convention: str | None = None,
    target_max_position_embeddings: int | None = None,
    strict: bool = False,
    dtype: torch.dtype = torch.float32,
) -> LoadedDraft:
    """Load any draft directory (see the module doc).

    `layer_ids` + `layer_convention` name the wiring of an export whose config has none;
    `layer_convention` alone overrides how the config's ids are read (warned). With
    `target_model`, the frozen embeddings are filled from it.
    """
    p = Path(path)
    ck = resolve_checkpoint(p)
    if ck is not None:
        loaded = _from_checkpoint(p, ck)
    elif (p / "config.json").is_file():
        loaded = _from_export(p, layer_ids, layer_convention, target_max_position_embeddings)
    else:
        raise DraftImportError(
            f"{p}: not a draft: expected a training run (checkpoints/latest), a checkpoint "
            "folder (state.pt) or an export (config.json + model.safetensors)"
        )
    loaded.draft.to(dtype)
    if target_model is not None:
        emb = target_model.get_input_embeddings().weight.detach()
        loaded.draft.embed_tokens.copy_(emb.to(loaded.draft.embed_tokens))
    if strict and loaded.warnings:
        raise DraftImportError(f"{p}: problems found:\n  " + "\n  ".join(loaded.warnings))
    return loaded


# ---------------------------------------------------------------- training runs


def _from_checkpoint(p: Path, ck: Path) -> LoadedDraft:
    state = read_state(ck, mmap=True)
    draft = Eagle3Draft(DraftConfig.from_dict(state["draft_config"]))
    draft.load_state_dict(state["draft"])
    return LoadedDraft(
        draft=draft,
        layer_ids=draft.config.layer_ids.to(CANONICAL),
        source=CHECKPOINT if ck == p else RUN,
        path=p,
        config=dict(state["draft_config"]),
        provenance=run_provenance(state, ck),
    )


def run_provenance(state: dict, checkpoint: Path | None = None) -> dict[str, Any]:
    """What workbench.json records about how a draft was trained."""
    cfg = state.get("config", {})
    metrics = state.get("metrics", [])
    last = {e.get("event"): e for e in metrics}
    keep = ("ttt_len", "ttt_sample", "loss_on", "lr", "batch_size", "epochs", "max_steps",
            "max_len", "seed", "val_fraction", "val_max_samples", "draft_vocab_size",
            "init_from_target", "init_layer", "warmup", "loss_decay", "time_budget_s",
            "pack_rows")  # fmt: skip
    ev = last.get("eval", {})
    tr = last.get("train", {})
    start = last.get("start", {})
    step, planned = state.get("step"), start.get("total_steps")
    return {
        "capture": cfg.get("capture"),
        "capture_hash": state.get("capture_hash"),
        "target_fingerprint": state.get("target_fingerprint"),
        "target": {"name": cfg.get("target"), "fingerprint": state.get("target_fingerprint")},
        "checkpoint": str(checkpoint) if checkpoint else None,
        "training": {
            "step": step,
            "steps_planned": planned,
            "stopped_early": bool(planned and step is not None and step < planned),
            "world_size": state.get("world_size"),
            "config": {k: cfg.get(k) for k in keep if k in cfg},
            "held_out": {k: ev.get(k) for k in ("step", "acc", "a", "tau") if k in ev},
            "last_train": {k: tr.get(k) for k in ("step", "loss", "acc", "tok_s") if k in tr},
        },
    }


# ---------------------------------------------------------------- export directories


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    for name in ("pytorch_model.bin", "model.bin"):
        f = path / name
        if f.is_file():
            try:
                return dict(torch.load(f, map_location="cpu", weights_only=True))
            except pickle.UnpicklingError as e:
                raise DraftImportError(
                    f"{f}: refusing to load: it needs Python objects beyond tensors (loading "
                    f"it could run code); convert it to safetensors. ({str(e)[:200]})"
                ) from None
    raise DraftImportError(f"{path}: no *.safetensors or pytorch_model.bin weights")


def _no_ids_error(path: Path) -> LayerConventionError:
    return LayerConventionError(
        f"{path}: the config has no eagle_aux_hidden_state_layer_ids and no {PROVENANCE_FILE}; "
        f"say which target layers feed this draft: layer_ids=[...] with layer_convention one "
        f"of {', '.join(CONVENTIONS)} (canonical {CANONICAL}). Without ids the engine uses its "
        "own default, which depends on the target architecture (SGLang, Llama: input of layers "
        "[2, N//2, N-3] = output_of_layer [1, N//2-1, N-4]; Qwen, DeepSeek and gpt-oss differ)."
    )


def given_layer_ids(spec: str | Sequence[int] | LayerIds, convention: str | None) -> LayerIds:
    """Ids a user typed, with the convention they said (range is checked against a target
    later; `layers.parse_layer_spec` does the parsing)."""
    if isinstance(spec, LayerIds):
        return spec
    return parse_layer_spec(spec, _ANY_DEPTH, check_convention(convention))


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
        given = given_layer_ids(layer_ids, layer_convention)
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
    raise _no_ids_error(path)


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftImportError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict) or not obj:
        raise DraftImportError(f"{path}: expected a JSON object with the draft's config")
    return obj


def _from_export(
    p: Path,
    layer_ids: str | Sequence[int] | LayerIds | None,
    layer_convention: str | None,
    target_max_position_embeddings: int | None,
) -> LoadedDraft:
    config = _read_json(p / "config.json")
    wb = _read_json(p / PROVENANCE_FILE) if (p / PROVENANCE_FILE).is_file() else None
    fmt = detect_format(config)
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
    missing = [
        k for k in ("hidden_size", "num_attention_heads", "intermediate_size") if k not in llama
    ]
    if missing:
        raise DraftImportError(f"{p}/config.json: missing {missing}; not a Llama draft config")
    if int(llama.get("num_hidden_layers", 1)) != 1:
        raise DraftImportError(
            f"{p}: num_hidden_layers {llama.get('num_hidden_layers')}; only 1-layer EAGLE-3 "
            "drafts are supported"
        )
    if llama.get("tie_word_embeddings"):
        warns.append("tie_word_embeddings is true: the draft lm_head must not be tied")

    ids = _resolve_ids(p, fmt, config_ids, wb, layer_convention, layer_ids, warns)
    cfg = _draft_config(llama, config, ids, tensors, warns)
    fc = tensors.get("fc.weight")
    if fc is not None and fc.shape[1] != cfg.fc_in_features:
        raise DraftImportError(
            f"{p}: fc.weight takes {fc.shape[1]} features but {cfg.num_aux} aux layers x target "
            f"hidden {cfg.target_hidden_size} = {cfg.fc_in_features}: the layer ids or "
            "target_hidden_size in the config are wrong"
        )
    probs = weight_problems(tensors, cfg, OPTIONAL_KEYS)
    bad_shape = [w for w in probs if ": shape " in w]
    if bad_shape:
        raise DraftImportError(f"{p}: weights do not fit the config:\n  " + "\n  ".join(bad_shape))
    for w in probs:  # what the engine would hit (missing d2t: a clearer message below)
        if w.startswith("missing keys"):
            miss = [k for k in SGLANG_KEYS if k not in tensors and k not in ("d2t", "t2d")]
            if miss:
                warns.append(f"missing keys {miss}: the engine keeps random weights for them")
        else:
            warns.append(w)
    dv, vocab = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" not in tensors and dv < vocab:
        warns.append(
            f"d2t missing: the draft vocab ({dv}) is smaller than the target's ({vocab}), so "
            "draft ids are read as target ids (identity map) and almost nothing is accepted"
        )
    if "t2d" not in tensors:
        warns.append("t2d missing (SGLang ignores it); rebuilt from d2t")
    tmax = target_max_position_embeddings or ((wb or {}).get("target") or {}).get(
        "max_position_embeddings"
    )
    warns += config_problems(cfg, tmax)

    draft = Eagle3Draft(cfg)
    own = set(draft.state_dict())
    load = {}
    for k, v in tensors.items():
        if k in own:
            load[k] = v.long() if k == "d2t" else v.bool() if k == "t2d" else v.float()
    draft.load_state_dict(load, strict=False)
    if "t2d" not in tensors:
        draft.t2d.copy_(t2d_from_ids(draft.draft_ids.clamp(0, vocab - 1), vocab))
    if "embed_tokens.weight" in tensors:
        emb = tensors["embed_tokens.weight"]
        if tuple(emb.shape) == tuple(draft.embed_tokens.shape):
            draft.embed_tokens.copy_(emb.float())
        else:
            warns.append(f"embed_tokens.weight has shape {tuple(emb.shape)}; ignored")
    source = fmt if fmt == SPECULATORS or wb is not None else SPECFORGE
    return LoadedDraft(draft, ids, source, p, config, wb, warns)


def _draft_config(
    llama: dict, config: dict, ids: LayerIds, tensors: dict, warns: list[str]
) -> DraftConfig:
    H = int(llama["hidden_size"])
    heads = int(llama["num_attention_heads"])
    vocab = int(llama.get("vocab_size") or config.get("vocab_size"))
    lm = tensors.get("lm_head.weight")
    dv = int(config.get("draft_vocab_size") or llama.get("draft_vocab_size") or 0)
    if not dv:
        dv = int(lm.shape[0]) if lm is not None else vocab
        warns.append(f"no draft_vocab_size in the config; took {dv} from lm_head")
    theta, scaling = rope_fields(llama)
    return DraftConfig(
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
