"""Capture the target's aux hidden states into resumable safetensors shards.

Forward hooks on the decoder layers record the pre-norm residual stream at the aux layers
(`output_of_layer` ids; -1 = embedding output) and after the last layer (`last_hidden`,
from which training recomputes target logits with the final norm + lm_head). Only the base
model runs: no lm_head, no `output_hidden_states` for all layers.

Layout: `capture-args.json` (claimed at start), `shard-NNNNN.safetensors` (each written to
a temp name, fsynced, renamed: a shard exists only when complete), `manifest.json` (last).
Shard i always holds samples [i*S, (i+1)*S), so a killed run resumed with the same
arguments gives the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from workbench.fsutil import atomic_write_bytes, atomic_write_json, claim_dir, sha256_file
from workbench.layers import CANONICAL, LayerConventionError, LayerIds, validate
from workbench.reports import git_facts, package_versions

FORMAT_VERSION = 1
_HIST_EDGES = torch.logspace(-2, 5, 141)  # token-norm histogram bins (0.01 .. 1e5)


class CaptureError(ValueError):
    """A capture directory is incomplete, corrupt, or was made with other arguments."""


@dataclass
class CaptureConfig:
    layer_ids: LayerIds
    dtype: str = "bfloat16"  # storage dtype of hidden states
    max_length: int = 2048
    samples_per_shard: int = 256
    batch_tokens: int = 8192  # padded tokens per forward batch


# ---------------------------------------------------------------- small utilities


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _storage_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CaptureError(f"unknown storage dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


# ---------------------------------------------------------------- hooks


class AuxRecorder:
    """Forward hooks that keep the residual stream at chosen layers for one forward."""

    def __init__(self, target, layer_ids: LayerIds):
        self.ids = list(layer_ids.canonical)
        self.last = target.num_layers - 1
        self.out: dict[int, torch.Tensor] = {}
        layers = target.decoder_layers()
        self.handles = []
        for i in sorted(set(self.ids) | {self.last}):
            module = target.embed_tokens() if i == -1 else layers[i]
            self.handles.append(module.register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def fn(_module, _inp, output):
            h = output[0] if isinstance(output, tuple) else output
            self.out[i] = h.detach()

        return fn

    def pop(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [B, T, k*H], last [B, T, H]) from the forward just run."""
        dev = self.out[self.last].device
        aux = torch.cat([self.out[i].to(dev) for i in self.ids], dim=-1)
        last = self.out[self.last]
        self.out = {}
        return aux, last

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def __enter__(self) -> AuxRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


@torch.no_grad()
def forward_aux(
    target, batch_ids: list[list[int]], recorder: AuxRecorder
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run the base model (no lm_head) over a right-padded batch; per-sample (aux, last)."""
    dev = target.device
    T = max(len(x) for x in batch_ids)
    pad = target.tokenizer.pad_token_id or 0
    ids = torch.full((len(batch_ids), T), pad, dtype=torch.long)
    att = torch.zeros((len(batch_ids), T), dtype=torch.long)
    for b, x in enumerate(batch_ids):
        ids[b, : len(x)] = torch.tensor(x)
        att[b, : len(x)] = 1
    target.model.model(input_ids=ids.to(dev), attention_mask=att.to(dev), use_cache=False)
    aux, last = recorder.pop()
    return [(aux[b, : len(x)].cpu(), last[b, : len(x)].cpu()) for b, x in enumerate(batch_ids)]


# ---------------------------------------------------------------- norm statistics


def _norm_stats(x: torch.Tensor) -> dict:
    """Mergeable per-token L2-norm statistics of x [T, H] (fp32 sums + histogram)."""
    n = x.float().norm(dim=-1)
    hist = torch.histogram(n.clamp(_HIST_EDGES[0], _HIST_EDGES[-1]), bins=_HIST_EDGES).hist
    return {
        "count": int(n.numel()),
        "sum": float(n.sum()),
        "sumsq": float((n * n).sum()),
        "min": float(n.min()) if n.numel() else None,
        "max": float(n.max()) if n.numel() else None,
        "hist": [int(v) for v in hist.tolist()],
    }


def _merge_stats(parts: list[dict]) -> dict:
    parts = [p for p in parts if p["count"]]
    count = sum(p["count"] for p in parts)
    if not count:
        return {"count": 0}
    s = sum(p["sum"] for p in parts)
    ss = sum(p["sumsq"] for p in parts)
    mean = s / count
    hist = [sum(col) for col in zip(*(p["hist"] for p in parts), strict=True)]
    return {
        "count": count,
        "mean": mean,
        "std": max(ss / count - mean * mean, 0.0) ** 0.5,
        "min": min(p["min"] for p in parts),
        "max": max(p["max"] for p in parts),
        "p05": _hist_quantile(hist, 0.05),
        "p50": _hist_quantile(hist, 0.5),
        "p95": _hist_quantile(hist, 0.95),
        "hist": hist,
    }


def _hist_quantile(hist: list[int], q: float) -> float:
    total, acc = sum(hist), 0
    for i, c in enumerate(hist):
        acc += c
        if acc >= q * total:
            return float((_HIST_EDGES[i] * _HIST_EDGES[i + 1]).sqrt())
    return float(_HIST_EDGES[-1])


def hist_edges() -> list[float]:
    return [float(x) for x in _HIST_EDGES]


# ---------------------------------------------------------------- writer


def _shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def _pack_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices (sorted by length) so padded batch size stays under batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * max(lengths[i], max(lengths[j] for j in cur)) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def write_shard(
    target,
    samples: list[tuple[list[int], list[bool]]],
    cfg: CaptureConfig,
    path: Path,
    recorder: AuxRecorder,
) -> dict:
    """Capture one shard and write it atomically; returns its entry for the manifest."""
    from safetensors.torch import save

    dtype = _storage_dtype(cfg.dtype)
    results: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(samples)
    for batch in _pack_batches([len(s[0]) for s in samples], cfg.batch_tokens):
        outs = forward_aux(target, [samples[i][0] for i in batch], recorder)
        for i, o in zip(batch, outs, strict=True):
            results[i] = o
    ids = torch.tensor([t for s in samples for t in s[0]], dtype=torch.long)
    mask = torch.tensor([m for s in samples for m in s[1]], dtype=torch.bool)
    offsets = torch.tensor([0] + [len(s[0]) for s in samples], dtype=torch.long).cumsum(0)
    aux = torch.cat([r[0] for r in results]).to(dtype)  # type: ignore[index]
    last = torch.cat([r[1] for r in results]).to(dtype)  # type: ignore[index]
    H = last.shape[-1]
    k = aux.shape[-1] // H
    stats = {f"aux{j}": _norm_stats(aux[:, j * H : (j + 1) * H]) for j in range(k)}
    stats["last"] = _norm_stats(last)
    tensors = {
        "input_ids": ids,
        "loss_mask": mask,
        "offsets": offsets,
        "aux_hidden": aux.contiguous(),
        "last_hidden": last.contiguous(),
    }
    data = save(tensors, metadata={"workbench_norm_stats": json.dumps(stats)})
    atomic_write_bytes(path, data)
    return {
        "file": path.name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "num_samples": len(samples),
        "num_tokens": int(ids.numel()),
        "num_loss_tokens": int(mask.sum()),
    }


def capture(
    target,
    conversations: list,
    out_dir: str | os.PathLike,
    cfg: CaptureConfig,
    prompt_set: dict | None = None,
    progress: bool = True,
    groups: list[str] | None = None,
) -> dict:
    """Capture aux hidden states for conversations (lists of messages); resumable.

    `conversations` are message lists ending with assistant turns (see data.Prompt.messages).
    `groups` (one name per conversation, e.g. the prompt id) keeps several answers to one
    prompt on the same side of training's held-out split.
    """
    from workbench.data import encode_conversation
    from workbench.progress import progress as tqdm
    from workbench.target import tokenizer_hash

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    validate(cfg.layer_ids, target.num_layers)
    if groups is not None and len(groups) != len(conversations):
        raise CaptureError(f"{len(groups)} groups for {len(conversations)} conversations")
    layer_ids = cfg.layer_ids.to(CANONICAL)
    encoded = [
        encode_conversation(target.tokenizer, msgs, cfg.max_length) for msgs in conversations
    ]
    data_hash = hashlib.sha256(json.dumps(encoded).encode()).hexdigest()[:16]
    args = {
        "format_version": FORMAT_VERSION,
        "target_fingerprint": target.fingerprint,
        "layer_ids": layer_ids.to_dict(),
        "dtype": cfg.dtype,
        "max_length": cfg.max_length,
        "samples_per_shard": cfg.samples_per_shard,
        "data_hash": data_hash,
        "num_samples": len(encoded),
    }
    if diff := claim_dir(out / "capture-args.json", args):
        raise CaptureError(
            f"{out} holds a capture made with different arguments:\n{diff}\n"
            "Rerun with the original arguments to resume, or capture into a new directory."
        )
    S = cfg.samples_per_shard
    n_shards = (len(encoded) + S - 1) // S
    total_tokens = sum(len(e[0]) for e in encoded)
    bar = tqdm(
        total=total_tokens, desc="capture", unit="tok", unit_scale=True, disable=not progress
    )
    entries = []
    with AuxRecorder(target, layer_ids) as rec:
        for si in range(n_shards):
            chunk = encoded[si * S : (si + 1) * S]
            path = out / _shard_name(si)
            if path.exists():
                entries.append(_entry_from_existing(path, len(chunk)))
            else:
                entries.append(write_shard(target, chunk, cfg, path, rec))
            bar.update(sum(len(e[0]) for e in chunk))
    bar.close()
    stats_parts: dict[str, list] = {}
    for e in entries:
        for name, st in read_shard_stats(out / e["file"]).items():
            stats_parts.setdefault(name, []).append(st)
    names = [f"aux{j}" for j in range(len(layer_ids.ids))]
    norm_stats = {"bin_edges": hist_edges(), "layers": {}}
    for j, name in enumerate(names):
        norm_stats["layers"][str(layer_ids.ids[j])] = {"slot": j, **_merge_stats(stats_parts[name])}
    norm_stats["last"] = {"layer": target.num_layers - 1, **_merge_stats(stats_parts["last"])}
    manifest = {
        "format_version": FORMAT_VERSION,
        "target": {k: v for k, v in target.describe().items() if k != "path"}
        | {"tokenizer_hash": tokenizer_hash(target.tokenizer)},
        "layer_ids": layer_ids.to_dict(),
        "hidden_size": target.hidden_size,
        "dtype": cfg.dtype,
        "max_length": cfg.max_length,
        "num_samples": len(encoded),
        "num_tokens": sum(e["num_tokens"] for e in entries),
        "num_loss_tokens": sum(e["num_loss_tokens"] for e in entries),
        "prompt_set": (prompt_set or {}) | {"data_hash": data_hash},
        "norm_stats": norm_stats,
        "shards": entries,
        "groups": list(groups) if groups is not None else None,
        "versions": package_versions(),
        "git_sha": git_facts()["sha"],
    }
    atomic_write_json(out / "manifest.json", manifest)
    return manifest


def _entry_from_existing(path: Path, n_samples: int) -> dict:
    from safetensors import safe_open

    data = path.read_bytes()
    try:
        with safe_open(str(path), framework="pt") as f:
            mask = f.get_tensor("loss_mask")
            n_tok = f.get_slice("input_ids").get_shape()[0]
    except Exception as e:  # noqa: BLE001
        raise CaptureError(
            f"{path}: unreadable shard ({e}); delete it and rerun to recapture it"
        ) from e
    return {
        "file": path.name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "num_samples": n_samples,
        "num_tokens": int(n_tok),
        "num_loss_tokens": int(mask.sum()),
    }


def read_shard_stats(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["workbench_norm_stats"])


# ---------------------------------------------------------------- reader


class CaptureReader:
    """Memory-mapped access to a finished capture, one sample at a time.

    `r[i]` → dict(input_ids [T], loss_mask [T], aux_hidden [T, k*H], last_hidden [T, H]).
    """

    def __init__(self, path: str | os.PathLike, verify: bool = False):
        from safetensors import safe_open

        self.path = Path(path)
        mf = self.path / "manifest.json"
        if not mf.is_file():
            hint = (
                " (a capture was started here but did not finish: rerun the same command to resume)"
                if (self.path / "capture-args.json").exists()
                else ""
            )
            raise CaptureError(
                f"{self.path}: no manifest.json; not a finished capture directory{hint}"
            )
        self.manifest = json.loads(mf.read_text())
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise CaptureError(
                f"{mf}: format_version {self.manifest.get('format_version')} != {FORMAT_VERSION}"
            )
        try:
            self.layer_ids = LayerIds.from_dict(self.manifest.get("layer_ids"))
        except LayerConventionError as e:
            raise CaptureError(f"{mf}: {e}") from e
        if verify:
            self.verify()
        self._files = []
        self._offsets = []
        self._starts = [0]
        for e in self.manifest["shards"]:
            p = self.path / e["file"]
            if not p.is_file():
                raise CaptureError(f"{p}: shard listed in the manifest is missing")
            try:
                f = safe_open(str(p), framework="pt")
                offs = f.get_tensor("offsets")
            except Exception as ex:  # noqa: BLE001 - safetensors raises several types
                raise CaptureError(
                    f"{p}: corrupt or truncated shard ({ex}); recapture it "
                    "(delete the file and rerun the capture command)"
                ) from ex
            if len(offs) != e["num_samples"] + 1:
                raise CaptureError(
                    f"{p}: holds {len(offs) - 1} samples, manifest says {e['num_samples']}"
                )
            self._files.append(f)
            self._offsets.append(offs.tolist())
            self._starts.append(self._starts[-1] + e["num_samples"])

    def verify(self) -> None:
        """Check every shard's sha256 against the manifest (names the bad file)."""
        for e in self.manifest["shards"]:
            p = self.path / e["file"]
            if not p.is_file():
                raise CaptureError(f"{p}: shard listed in the manifest is missing")
            got = sha256_file(p)
            if got != e["sha256"]:
                raise CaptureError(
                    f"{p}: checksum mismatch (sha256 {got[:12]}…, manifest {e['sha256'][:12]}…): "
                    "the shard is corrupt or truncated; recapture it"
                )

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def target_fingerprint(self) -> str:
        return self.manifest["target"]["fingerprint"]

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = bisect.bisect_right(self._starts, i) - 1
        j = i - self._starts[s]
        a, b = self._offsets[s][j], self._offsets[s][j + 1]
        f = self._files[s]
        try:
            return {
                name: f.get_slice(name)[a:b]
                for name in ("input_ids", "loss_mask", "aux_hidden", "last_hidden")
            }
        except Exception as ex:  # noqa: BLE001
            raise CaptureError(
                f"{self.path / self.manifest['shards'][s]['file']}: cannot read sample {j} ({ex})"
            ) from ex

    def __iter__(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield self[i]

    def lengths(self) -> list[int]:
        return [offs[j + 1] - offs[j] for offs in self._offsets for j in range(len(offs) - 1)]

    def token_ids(self, loss_only: bool = True) -> torch.Tensor:
        """All input ids (optionally only under the loss mask): for vocab building."""
        parts = []
        for f in self._files:
            ids = f.get_tensor("input_ids")
            parts.append(ids[f.get_tensor("loss_mask")] if loss_only else ids)
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def config_dict(self) -> dict:
        return asdict(
            CaptureConfig(self.layer_ids, self.manifest["dtype"], self.manifest["max_length"])
        )


def summarize(reader: CaptureReader) -> dict:
    """Headline numbers of a capture: sizes, assistant share, bytes per token on disk."""
    m = reader.manifest
    disk = sum((reader.path / e["file"]).stat().st_size for e in m["shards"])
    H = reader.hidden_size
    k = len(reader.layer_ids.ids)
    elt = torch.empty(0, dtype=_storage_dtype(m["dtype"])).element_size()
    lengths = reader.lengths()
    return {
        "samples": len(reader),
        "tokens": m["num_tokens"],
        "assistant_tokens": m["num_loss_tokens"],
        "assistant_share": round(m["num_loss_tokens"] / max(m["num_tokens"], 1), 3),
        "mean_length": round(sum(lengths) / max(len(lengths), 1), 1),
        "max_length": max(lengths, default=0),
        "layer_ids": str(reader.layer_ids),
        "dtype": m["dtype"],
        "disk_bytes": disk,
        "bytes_per_token": round(disk / max(m["num_tokens"], 1), 1),
        "bytes_per_token_parts": {
            "aux_hidden": k * H * elt,
            "last_hidden": H * elt,
            "input_ids": 8,
            "loss_mask": 1,
        },
    }
