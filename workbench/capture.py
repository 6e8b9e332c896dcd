"""Capture the target's aux hidden states into resumable safetensors shards.

Forward hooks on the decoder layers record the pre-norm residual stream at the aux layers
(`output_of_layer` ids; -1 = embedding output) and after the last layer (`last_hidden`,
from which training recomputes target logits with the final norm + lm_head). Only the base
model runs: no lm_head, no `output_hidden_states` for all layers.

Layout: `capture-args.json` (claimed at start, after the arguments are validated),
`hashes.json` (each shard's sha256, recorded just before the shard is written),
`shard-NNNNN.safetensors` (each written to a temp name, fsynced, renamed: a shard exists only
when complete; its metadata records its layer ids), `manifest.json` (last). Shard i always
holds samples [i*S, (i+1)*S), so a killed run resumed with the same arguments gives the same
bytes as an uninterrupted one. A rerun re-verifies the shards it finds against their recorded
hashes instead of trusting them, and `.workbench.lock` keeps a second writer out.

Readers verify every shard's sha256 by default (`CaptureReader(verify=True)`): hashing reads
each shard once (about a second per GB), small next to an epoch over the same bytes.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.errors import WorkbenchError
from workbench.fsutil import (
    atomic_write_bytes,
    atomic_write_json,
    claim_dir,
    locked_dir,
    sha256_file,
)
from workbench.layers import CANONICAL, LayerConventionError, LayerIds, validate
from workbench.normstats import hist_edges, merge_stats, norm_stats
from workbench.provenance import git_facts, package_versions

FORMAT_VERSION = 1
HASHES_FILE = "hashes.json"
# Shard metadata: one key (safetensors orders several keys at random, which would make the
# bytes of a resumed capture differ) holding {"layer_ids": canonical LayerIds, "norm_stats"}.
# Shards from before layer ids were recorded hold only "workbench_norm_stats".
_META = "workbench"
_META_OLD_STATS = "workbench_norm_stats"


class CaptureError(WorkbenchError):
    """A capture directory is incomplete, corrupt, or was made with other arguments."""


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class CaptureConfig:
    layer_ids: LayerIds
    dtype: str = "bfloat16"  # storage dtype of hidden states
    max_length: int = 2048
    samples_per_shard: int = 256
    batch_tokens: int = 8192  # padded tokens per forward batch

    def __post_init__(self) -> None:
        """Refuse bad arguments at construction, before a folder records them."""
        if not isinstance(self.layer_ids, LayerIds):
            raise CaptureError(
                f"layer_ids must be LayerIds (ids + convention), got {self.layer_ids!r}"
            )
        _storage_dtype(self.dtype)
        for name in ("max_length", "samples_per_shard", "batch_tokens"):
            if getattr(self, name) < 1:
                raise CaptureError(f"{name}={getattr(self, name)}: must be at least 1")


# ---------------------------------------------------------------- small utilities


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

    name = "hf"  # the capture backend, recorded in the manifest

    def forward(
        self, target, batch_ids: list[list[int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return forward_aux(target, batch_ids, self)

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
    hashes: dict[str, str] | None = None,
) -> dict:
    """Capture one shard and write it atomically; returns its entry for the manifest.

    `hashes` (file name -> sha256, the capture's `hashes.json`) gets this shard's hash,
    saved before the shard itself."""
    from safetensors.torch import save

    dtype = _storage_dtype(cfg.dtype)
    results: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(samples)
    for batch in _pack_batches([len(s[0]) for s in samples], cfg.batch_tokens):
        outs = recorder.forward(target, [samples[i][0] for i in batch])
        for i, o in zip(batch, outs, strict=True):
            results[i] = o
    ids = torch.tensor([t for s in samples for t in s[0]], dtype=torch.long)
    mask = torch.tensor([m for s in samples for m in s[1]], dtype=torch.bool)
    offsets = torch.tensor([0] + [len(s[0]) for s in samples], dtype=torch.long).cumsum(0)
    aux = torch.cat([r[0] for r in results]).to(dtype)  # type: ignore[index]
    last = torch.cat([r[1] for r in results]).to(dtype)  # type: ignore[index]
    H = last.shape[-1]
    k = aux.shape[-1] // H
    stats = {f"aux{j}": norm_stats(aux[:, j * H : (j + 1) * H]) for j in range(k)}
    stats["last"] = norm_stats(last)
    tensors = {
        "input_ids": ids,
        "loss_mask": mask,
        "offsets": offsets,
        "aux_hidden": aux.contiguous(),
        "last_hidden": last.contiguous(),
    }
    meta = {"layer_ids": cfg.layer_ids.to(CANONICAL).to_dict(), "norm_stats": stats}
    data = save(tensors, metadata={_META: json.dumps(meta, sort_keys=True)})
    sha = hashlib.sha256(data).hexdigest()
    if hashes is not None:  # recorded first: every shard on disk has a hash to check against
        hashes[path.name] = sha
        atomic_write_json(path.parent / HASHES_FILE, hashes)
    atomic_write_bytes(path, data)
    return {
        "file": path.name,
        "sha256": sha,
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
    recorder: Callable = AuxRecorder,
) -> dict:
    """Capture aux hidden states for conversations (lists of messages); resumable.

    `conversations` are message lists ending with assistant turns (see data.Prompt.messages).
    `groups` (one name per conversation, e.g. the prompt id) keeps several answers to one
    prompt on the same side of training's held-out split. Everything is validated before the
    folder is touched; the folder is locked against a second writer while this runs.
    `recorder(target, layer_ids)`: the backend (a context manager with `forward(target,
    batch_ids)` -> per-sample (aux, last)); `serving.capture_sglang` has SGLang's.
    """
    validate(cfg.layer_ids, target.num_layers)
    if groups is not None and len(groups) != len(conversations):
        raise CaptureError(f"{len(groups)} groups for {len(conversations)} conversations")
    with locked_dir(out_dir, "capture folder"):
        return _capture(target, conversations, Path(out_dir), cfg, prompt_set, progress, groups,
                        recorder)  # fmt: skip


def _capture(
    target,
    conversations: list,
    out: Path,
    cfg: CaptureConfig,
    prompt_set: dict | None,
    progress: bool,
    groups: list[str] | None,
    recorder: Callable = AuxRecorder,
) -> dict:
    from workbench.chat import encode_conversation
    from workbench.progress import progress as tqdm
    from workbench.target import tokenizer_hash

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
    hashes = _recorded_hashes(out)
    S = cfg.samples_per_shard
    n_shards = (len(encoded) + S - 1) // S
    total_tokens = sum(len(e[0]) for e in encoded)
    bar = tqdm(
        total=total_tokens, desc="capture", unit="tok", unit_scale=True, disable=not progress
    )
    entries = []
    with recorder(target, layer_ids) as rec:
        for si in range(n_shards):
            chunk = encoded[si * S : (si + 1) * S]
            path = out / _shard_name(si)
            if path.exists():
                entries.append(_entry_from_existing(path, len(chunk), hashes.get(path.name)))
            else:
                entries.append(write_shard(target, chunk, cfg, path, rec, hashes))
            bar.update(sum(len(e[0]) for e in chunk))
    bar.close()
    stats_parts: dict[str, list] = {}
    for e in entries:
        for name, st in read_shard_stats(out / e["file"]).items():
            stats_parts.setdefault(name, []).append(st)
    names = [f"aux{j}" for j in range(len(layer_ids.ids))]
    layer_stats = {"bin_edges": hist_edges(), "layers": {}}
    for j, name in enumerate(names):
        layer_stats["layers"][str(layer_ids.ids[j])] = {"slot": j, **merge_stats(stats_parts[name])}
    layer_stats["last"] = {"layer": target.num_layers - 1, **merge_stats(stats_parts["last"])}
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
        "norm_stats": layer_stats,
        "shards": entries,
        "groups": list(groups) if groups is not None else None,
        "capture_backend": rec.name,
        "versions": package_versions(),
        "git_sha": git_facts()["sha"],
    }
    atomic_write_json(out / "manifest.json", manifest)
    return manifest


def _recorded_hashes(out: Path) -> dict[str, str]:
    """Shard hashes known from earlier runs into `out`: `hashes.json`, and the shards of
    a finished capture's manifest (captures made before the hashes file existed)."""
    known: dict[str, str] = {}
    for f in (out / "manifest.json", out / HASHES_FILE):
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text())
        except ValueError as e:
            raise CaptureError(
                f"{f}: unreadable ({e}); it records the shards' hashes: move the folder aside "
                "and capture again"
            ) from e
        if f.name == "manifest.json":
            data = {e["file"]: e["sha256"] for e in data.get("shards", [])}
        for name, sha in data.items():
            if known.get(name, sha) != sha:
                raise CaptureError(
                    f"{out}: manifest.json and {HASHES_FILE} record different hashes for {name}; "
                    "delete that shard and rerun to recapture it"
                )
            known[name] = sha
    return known


def _entry_from_existing(path: Path, n_samples: int, recorded: str | None) -> dict:
    """Manifest entry of a shard an earlier run wrote, checked against the hash it recorded
    (a rerun must never adopt a corrupted shard's hash)."""
    from safetensors import safe_open

    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    if recorded is not None and sha != recorded:
        raise CaptureError(
            f"{path}: checksum mismatch (sha256 {sha[:12]}…, recorded when written "
            f"{recorded[:12]}…): the shard is corrupt; delete it and rerun to recapture it"
        )
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
        "sha256": sha,
        "num_samples": n_samples,
        "num_tokens": int(n_tok),
        "num_loss_tokens": int(mask.sum()),
    }


def read_shard_stats(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if _META in meta:
        return json.loads(meta[_META])["norm_stats"]
    if _META_OLD_STATS in meta:
        return json.loads(meta[_META_OLD_STATS])
    raise CaptureError(f"{path}: shard has no workbench metadata; recapture it")


# ---------------------------------------------------------------- reader


class CaptureReader:
    """Memory-mapped access to a finished capture, one sample at a time.

    `r[i]` → dict(input_ids [T], loss_mask [T], aux_hidden [T, k*H], last_hidden [T, H]).
    `verify` (default) checks every shard's sha256 against the manifest before use. Each
    shard's recorded layer ids must equal the manifest's; shards from before ids were
    recorded are read with the manifest's ids and one warning.
    """

    def __init__(self, path: str | os.PathLike, verify: bool = True):
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
        unlabelled = []
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
            if not self._shard_ids_match(p, f):
                unlabelled.append(p.name)
            self._files.append(f)
            self._offsets.append(offs.tolist())
            self._starts.append(self._starts[-1] + e["num_samples"])
        if unlabelled:
            warnings.warn(
                f"{self.path}: {len(unlabelled)} shard(s) ({unlabelled[0]}, ...) record no layer "
                f"ids (captured by an older workbench); using manifest.json's {self.layer_ids} "
                "unchecked. Re-capture to have them checked.",
                stacklevel=2,
            )

    def _shard_ids_match(self, p: Path, f) -> bool:
        """Refuse a shard whose layer ids or width disagree with the manifest; False when the
        shard records no ids (older captures)."""
        mine = self.layer_ids.to(CANONICAL)
        width = f.get_slice("aux_hidden").get_shape()[-1]
        if width != len(mine.ids) * self.hidden_size:
            raise CaptureError(
                f"{p}: aux_hidden is {width} wide = {width / self.hidden_size:g} layers of "
                f"{self.hidden_size}, but manifest.json lists {len(mine.ids)} layer ids "
                f"{list(mine.ids)}; the manifest does not describe this shard: recapture"
            )
        raw = (f.metadata() or {}).get(_META)
        if raw is None:
            return False
        try:
            theirs = LayerIds.from_dict(json.loads(raw).get("layer_ids")).to(CANONICAL)
        except (ValueError, LayerConventionError) as ex:
            raise CaptureError(f"{p}: unreadable layer ids in shard metadata ({ex})") from ex
        if theirs != mine:
            raise CaptureError(
                f"{p}: shard was captured at layers {list(theirs.ids)} but manifest.json says "
                f"{list(mine.ids)} ({CANONICAL}); the manifest was edited or mixes captures: "
                "restore it or recapture"
            )
        return True

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
