"""Draft vocabulary: the most frequent assistant tokens of a capture, as `d2t`/`t2d` maps.

The draft's lm_head covers only `draft_vocab_size` target ids (on CPU the lm_head dominates
draft cost, so the embedded default wants ~8192 of SmolLM2's 49152). `d2t[i]` is an
*offset*: target_id = i + d2t[i] (SGLang's convention); `t2d` is a bool mask over the target
vocab. The map is stored with both vocab sizes and the hash of the capture it came from, so
a stale or regenerated map is detectable (regenerating d2t while fine-tuning misaligns
lm_head rows: one of the known vocab-map bugs, with all-zero and arange d2t).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workbench.errors import WorkbenchError
from workbench.fsutil import atomic_write_json

DEFAULT_DRAFT_VOCAB = 32000
EMBEDDED_DRAFT_VOCAB = 8192  # recommended for SmolLM2-135M on CPU


class VocabError(WorkbenchError):
    """A draft vocabulary map is degenerate, inconsistent or stale."""


def d2t_from_ids(ids: torch.Tensor) -> torch.Tensor:
    """SGLang's offsets: d2t[i] = target id of draft id i, minus i."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    return ids - torch.arange(ids.numel(), device=ids.device)


def ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of each draft id (the inverse of `d2t_from_ids`)."""
    d2t = torch.as_tensor(d2t).long()
    return d2t + torch.arange(d2t.numel(), device=d2t.device)


def t2d_from_ids(ids: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """Bool mask over the target vocab: True where a target id is in the draft vocab."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    m = torch.zeros(int(target_vocab_size), dtype=torch.bool, device=ids.device)
    m[ids] = True
    return m


@dataclass
class DraftVocab:
    ids: torch.Tensor  # sorted target ids, LongTensor [draft_vocab_size]
    target_vocab_size: int
    capture_hash: str = ""
    num_seen: int = 0  # distinct ids seen under the loss mask (the rest is padding)
    num_tokens: int = 0  # assistant tokens counted

    @property
    def draft_vocab_size(self) -> int:
        return int(self.ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        return d2t_from_ids(self.ids)

    @property
    def t2d(self) -> torch.Tensor:
        return t2d_from_ids(self.ids, self.target_vocab_size)

    def to_dict(self) -> dict:
        return {
            "format_version": 1,
            "draft_vocab_size": self.draft_vocab_size,
            "target_vocab_size": self.target_vocab_size,
            "capture_hash": self.capture_hash,
            "num_seen": self.num_seen,
            "num_tokens": self.num_tokens,
            "ids": self.ids.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> DraftVocab:
        v = cls(
            ids=torch.tensor(d["ids"], dtype=torch.long),
            target_vocab_size=int(d["target_vocab_size"]),
            capture_hash=d.get("capture_hash", ""),
            num_seen=int(d.get("num_seen", 0)),
            num_tokens=int(d.get("num_tokens", 0)),
        )
        if v.draft_vocab_size != int(d["draft_vocab_size"]):
            raise VocabError(
                f"vocab file lists {v.draft_vocab_size} ids, header says {d['draft_vocab_size']}"
            )
        check_d2t(v.d2t, v.target_vocab_size)
        return v

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON atomically (temp file + rename)."""
        path = Path(path)
        atomic_write_json(path, self.to_dict())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> DraftVocab:
        return cls.from_dict(json.loads(Path(path).read_text()))


# The manifest fields that say what a capture holds. Left out: facts about the run that wrote
# the manifest (`git_sha`, `versions`, regeneration timings, norm statistics derived from the
# shards), which change when a finished capture is resumed by newer code and would otherwise
# make every draft trained on it refuse to resume.
CAPTURE_IDENTITY = ("format_version", "target", "layer_ids", "hidden_size", "dtype", "max_length",
                    "num_samples", "num_tokens", "num_loss_tokens", "shards", "groups",
                    "capture_backend")  # fmt: skip


def capture_hash(reader: Any) -> str:
    """Stable hash of what a capture holds: shard sha256s, target, layers, counts, the prompt
    set's hashes (CAPTURE_IDENTITY); not of the code or package versions that wrote it."""
    man = reader.manifest
    ident = {k: man.get(k) for k in CAPTURE_IDENTITY}
    ps = man.get("prompt_set") or {}
    ident["prompt_set"] = {k: ps.get(k) for k in ("name", "hash", "data_hash")}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def token_counts(reader: Any, vocab_size: int, indices: Any = None) -> torch.Tensor:
    """Frequency of each target id among assistant tokens (input_ids under loss_mask)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(len(reader)) if indices is None else indices:
        s = reader[i]
        ids = s["input_ids"][s["loss_mask"].bool()]
        counts += torch.bincount(ids.long(), minlength=vocab_size)[:vocab_size]
    return counts


def vocab_from_counts(counts: torch.Tensor, size: int, capture: str = "") -> DraftVocab:
    """Top-`size` ids by count (ties: lower id first), sorted; pad with unseen ids.

    The one place the draft vocab size is clamped (to the target vocab)."""
    V = counts.numel()
    size = min(int(size), V)
    # stable sort on -count keeps lower ids first among equal counts (deterministic)
    order = torch.sort(-counts, stable=True).indices
    ids = torch.sort(order[:size]).values
    return DraftVocab(
        ids=ids,
        target_vocab_size=V,
        capture_hash=capture,
        num_seen=int((counts > 0).sum()),
        num_tokens=int(counts.sum()),
    )


def build_vocab(
    reader: Any,
    size: int = DEFAULT_DRAFT_VOCAB,
    target_vocab_size: int | None = None,
    indices: Any = None,
) -> DraftVocab:
    """Build the draft vocab from a capture (optionally only the training `indices`)."""
    V = int(target_vocab_size or reader.manifest["target"]["vocab_size"])
    counts = token_counts(reader, V, indices)
    v = vocab_from_counts(counts, size, capture_hash(reader))
    if v.num_seen < v.draft_vocab_size:
        warnings.warn(
            f"only {v.num_seen} distinct assistant tokens seen; padded the draft vocab with "
            f"{v.draft_vocab_size - v.num_seen} unseen ids (consider a smaller draft vocab)",
            stacklevel=2,
        )
    return v


def coverage(vocab: DraftVocab | torch.Tensor, reader: Any, indices: Any = None) -> float:
    """Share of assistant tokens (input_ids under loss_mask) inside the draft vocab."""
    t2d = vocab.t2d if isinstance(vocab, DraftVocab) else vocab.bool()
    hit = total = 0
    for i in range(len(reader)) if indices is None else indices:
        s = reader[i]
        ids = s["input_ids"][s["loss_mask"].bool()].long()
        hit += int(t2d[ids].sum())
        total += ids.numel()
    return hit / max(total, 1)


def coverage_curve(counts: torch.Tensor, sizes: list[int]) -> dict[int, float]:
    """Coverage of the top-k vocab for several k (pick a draft vocab size by its cost)."""
    s = torch.sort(counts, descending=True).values.cumsum(0)
    total = max(int(s[-1]), 1)
    return {k: float(s[min(k, s.numel()) - 1]) / total for k in sizes}


def d2t_problems(d2t: torch.Tensor, target_vocab_size: int | None = None) -> list[str]:
    """What is wrong with a d2t offset map (empty list: looks right)."""
    d2t = torch.as_tensor(d2t)
    n = d2t.numel()
    out: list[str] = []
    if d2t.dtype != torch.long:
        out.append(f"d2t dtype is {d2t.dtype}, SGLang expects int64 offsets")
    d2t = d2t.long()
    ids = ids_from_d2t(d2t)
    full = target_vocab_size is not None and n == target_vocab_size
    if n > 1 and not full and bool((d2t == 0).all()):
        out.append(
            "d2t is all zeros: draft id i maps to target id i, i.e. the map was never filled "
            f"(draft vocab {n} < target vocab {target_vocab_size or '?'})"
        )
    if n > 1 and torch.equal(d2t, torch.arange(n)):
        out.append(
            "d2t equals arange: it holds target ids, not offsets (target_id = i + d2t[i]); "
            "store used_ids - arange"
        )
    if n > 1 and not bool((ids[1:] > ids[:-1]).all()):
        out.append("d2t gives target ids that are not strictly increasing (unsorted or duplicated)")
    if int(ids.min()) < 0 or (
        target_vocab_size is not None and int(ids.max()) >= target_vocab_size
    ):
        out.append(
            f"d2t maps outside the target vocab: ids span [{int(ids.min())}, {int(ids.max())}], "
            f"target vocab {target_vocab_size}"
        )
    return out


def check_d2t(
    d2t: torch.Tensor,
    target_vocab_size: int | None = None,
    t2d: torch.Tensor | None = None,
    strict: bool = True,
) -> list[str]:
    """Raise `VocabError` (strict) or warn on a degenerate/inconsistent d2t (and t2d)."""
    problems = d2t_problems(d2t, target_vocab_size)
    if t2d is not None and not problems:
        want = t2d_from_ids(ids_from_d2t(d2t), torch.as_tensor(t2d).numel())
        if not torch.equal(want, torch.as_tensor(t2d).bool()):
            problems.append("t2d does not mark exactly the target ids that d2t maps to")
    if problems:
        msg = "bad draft vocab map: " + "; ".join(problems)
        if strict:
            raise VocabError(msg)
        warnings.warn(msg, stacklevel=2)
    return problems
