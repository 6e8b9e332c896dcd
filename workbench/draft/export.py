"""Write a trained draft in the layouts serving engines load (the layouts: `layout.py`).

- `export_sglang`: the directory SGLang's `--speculative-draft-model-path` loads
  (`LlamaForCausalLMEagle3`, sglang.md). SGLang skips unknown weight names *silently* (the
  weight stays random) and a too-small `max_position_embeddings` silently kills acceptance,
  so the export validates names, shapes, the vocab map and the config before writing.
- `export_speculators`: the vLLM / speculators layout (eagle3.md): `midlayer.` renamed
  `layers.0.`, layer ids in vLLM's `input_of_layer` meaning, `norm_before_residual: false`
  written explicitly (vLLM defaults it to true).

Both write into a temp folder beside the target and rename it into place; an existing folder
is replaced only when an earlier export wrote it (its `workbench.json` says so), never a
folder that merely holds a `config.json`. Reading drafts back: `load.load_draft`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from workbench.draft.errors import DraftImportError, ExportError
from workbench.draft.layout import (
    FORMATS,
    PROVENANCE_FILE,
    SGLANG,
    SPECULATORS,
    WEIGHTS_FILE,
    config_problems,
    sglang_config,
    speculators_config,
    to_speculators_key,
    weight_problems,
)
from workbench.draft.load import LoadedDraft
from workbench.draft.model import Eagle3Draft
from workbench.fsutil import atomic_write_bytes, atomic_write_json
from workbench.layers import CANONICAL, LayerIds

__all__ = ["FORMATS", "SGLANG", "SPECULATORS", "DraftImportError", "ExportError",
           "export_sglang", "export_speculators", "reexport_provenance"]  # fmt: skip

WRITER = "workbench.draft.export"  # the marker in workbench.json: this folder is ours to replace
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_verifier_architectures(verifier: str) -> list[str] | None:
    """Architectures of a local verifier dir (None when it is a hub id or has no config)."""
    p = Path(verifier) / "config.json"
    if p.is_file():
        return json.loads(p.read_text()).get("architectures")
    return None


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


# ---------------------------------------------------------------- the output folder


def written_by_us(out: Path) -> bool:
    """An export folder this module wrote (the marker, or an older export's provenance)."""
    f = out / PROVENANCE_FILE
    if not f.is_file():
        return False
    try:
        wb = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(wb, dict):
        return False
    return wb.get("written_by") == WRITER or (
        wb.get("format") in FORMATS and "workbench_version" in wb
    )


def _atomic_dir(out_dir: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Build the directory in a sibling temp dir, then swap it in with renames."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not written_by_us(out):
        raise ExportError(
            f"{out} exists and is not a draft export written by workbench (no {PROVENANCE_FILE} "
            "of ours); refusing to replace it: choose an empty or new --out folder"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    old = None
    try:
        write(tmp)
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
        shutil.rmtree(old)
    return out


def _write_config(path: Path, obj: dict) -> None:
    atomic_write_json(path, obj, sort_keys=False)


def _write_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save

    atomic_write_bytes(path, save(tensors, metadata={"format": "pt"}))  # fsynced, mode 0644


def _provenance(draft: Eagle3Draft, fmt: str, provenance: dict | None) -> dict[str, Any]:
    """workbench.json: the marker, the layer ids once (canonical, with their convention),
    the draft config without them, and the caller's provenance."""
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
    dcfg = draft.config.to_dict()
    dcfg.pop("layer_ids")
    return {
        "written_by": WRITER,
        "format": fmt,
        "workbench_version": workbench.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "layer_ids": ours.to(CANONICAL).to_dict(),
        "draft_config": dcfg,
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


# ---------------------------------------------------------------- writers


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
    dt = _as_dtype(dtype, draft)
    tensors = sglang_tensors(draft, dt)
    _check_before_write(draft, tensors, _target_max_pos(provenance, target_max_position_embeddings))
    config = sglang_config(draft.config, dt)
    prov = _provenance(draft, SGLANG, provenance)

    def write(d: Path) -> None:
        _write_config(d / "config.json", config)
        _write_weights(d / WEIGHTS_FILE, tensors)
        _write_config(d / PROVENANCE_FILE, prov)

    return _atomic_dir(out_dir, write)


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
    dt = _as_dtype(dtype, draft)
    tensors = sglang_tensors(draft, dt)
    _check_before_write(draft, tensors, _target_max_pos(provenance, target_max_position_embeddings))
    archs = verifier_architectures or read_verifier_architectures(verifier_name_or_path)
    config = speculators_config(draft.config, verifier_name_or_path, speculative_tokens, archs, dt)
    prov = _provenance(draft, SPECULATORS, provenance)
    renamed = {to_speculators_key(k): v for k, v in tensors.items()}

    def write(d: Path) -> None:
        _write_config(d / "config.json", config)
        _write_weights(d / WEIGHTS_FILE, renamed)
        _write_config(d / PROVENANCE_FILE, prov)

    return _atomic_dir(out_dir, write)


def reexport_provenance(loaded: LoadedDraft) -> dict[str, Any]:
    """The provenance to write for a loaded draft: a run's training facts, or an export's
    workbench.json less what the new export writes itself, plus where it came from."""
    if loaded.source in ("run", "checkpoint"):
        return dict(loaded.provenance or {})
    drop = ("written_by", "format", "created", "layer_ids_in_config", "draft_config",
            "workbench_version")  # fmt: skip
    prov = {k: v for k, v in (loaded.provenance or {}).items() if k not in drop}
    prov["imported_from"] = str(loaded.path)
    return prov
