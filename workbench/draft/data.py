"""Capture → training batches: the capture/target guard rails, the target's head (logits
and the full-vocab argmax, cached), the held-out split, epoch batching and collation.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workbench.draft.errors import TrainError
from workbench.draft.ttt import release_freed_memory
from workbench.fsutil import atomic_write_bytes
from workbench.layers import CANONICAL, LayerIds, validate


def open_capture(path: str | os.PathLike, verify: bool = True):
    from workbench.capture import CaptureReader

    return CaptureReader(path, verify=verify)


def check_capture(reader: Any, target: Any, layer_ids: LayerIds | None = None) -> LayerIds:
    """Refuse a capture made with another target, layer wiring or hidden size; say what differs."""
    man = reader.manifest
    t = man.get("target", {})
    problems = []
    if reader.target_fingerprint != target.fingerprint:
        problems.append(
            f"target fingerprint: capture {reader.target_fingerprint} ({t.get('name')}), "
            f"given target {target.fingerprint} ({target.name})"
        )
    cap_ids = reader.layer_ids
    if cap_ids.convention != CANONICAL:
        problems.append(
            f"layer convention: capture stores {cap_ids} but training expects {CANONICAL} ids"
        )
    else:
        try:
            validate(cap_ids, target.num_layers)
        except ValueError as e:
            problems.append(f"layer ids: {e}")
    if layer_ids is not None:
        if not isinstance(layer_ids, LayerIds):
            raise TypeError(
                f"layer_ids must be LayerIds (ids with their convention), got {layer_ids!r}"
            )
        want = layer_ids
        try:
            validate(want, target.num_layers)
        except ValueError as e:
            problems.append(f"requested layer ids: {e}")
        if want.canonical != cap_ids.canonical:
            problems.append(
                f"layer ids: capture has {list(cap_ids.canonical)} ({CANONICAL}), requested "
                f"{list(want.canonical)} ({CANONICAL}; given as {want})"
            )
    for key, have in (
        ("hidden_size", man.get("hidden_size")),
        ("target.hidden_size", t.get("hidden_size")),
    ):
        if have is not None and int(have) != target.hidden_size:
            problems.append(
                f"hidden size: capture {key}={have}, target hidden_size={target.hidden_size}"
            )
    if t.get("vocab_size") is not None and int(t["vocab_size"]) != target.vocab_size:
        problems.append(f"vocab size: capture {t['vocab_size']}, target {target.vocab_size}")
    if len(reader) > 0 and not problems:
        s = reader[0]
        k, H = len(cap_ids.ids), target.hidden_size
        if s["aux_hidden"].shape[-1] != k * H or s["last_hidden"].shape[-1] != H:
            problems.append(
                f"hidden size: capture rows have aux width {s['aux_hidden'].shape[-1]} and last "
                f"width {s['last_hidden'].shape[-1]}; {k} aux layers x hidden {H} needs {k * H} and {H}"
            )
    if problems:
        raise TrainError(
            "capture does not match the target:\n  "
            + "\n  ".join(problems)
            + "\nRecapture with this target, or train against the target the capture was made with."
        )
    return cap_ids


# ---------------------------------------------------------------- target head


class TargetHead:
    """Target final norm + lm_head: recomputes target logits from the stored pre-norm state."""

    def __init__(
        self,
        target_model: nn.Module,
        draft_ids: torch.Tensor,
        device: torch.device,
        cache_mb: float = 0.0,
    ) -> None:
        inner = getattr(target_model, "model", target_model)
        self._cache: dict[int, torch.Tensor] = {}
        self._cache_left = int(cache_mb * 2**20)
        self.norm_w = inner.norm.weight.detach().float().to(device)
        self.eps = float(getattr(inner.norm, "variance_epsilon", getattr(inner.norm, "eps", 1e-6)))
        self.full = (
            target_model.get_output_embeddings().weight.detach().float()
        )  # stays where it is
        self.rows = self.full[draft_ids.to(self.full.device)].to(device)

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        h = h.float()
        return self.norm_w.to(h.device) * (
            h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        )

    @torch.no_grad()
    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.normed(h) @ self.rows.T

    @torch.no_grad()
    def sample_logits(self, i: int, last_hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab target logits [n, V] of sample i, computed over the whole sample and kept
        (fp32) while the `cache_mb` budget lasts. A preset passes over its capture many times
        (the quick one 12), and this fp32 matmul was ~6% of a packed CPU step (bench_train
        --cache-ab: 1.057x); a sample the budget cannot hold is computed the same way each
        time, so the bits never depend on which samples were kept."""
        if (z := self._cache.get(i)) is not None:
            return z
        z = self.draft_logits(last_hidden.to(self.rows.device))
        if z.numel() * z.element_size() <= self._cache_left:
            self._cache[i] = z
            self._cache_left -= z.numel() * z.element_size()
        return z

    @property
    def cached_samples(self) -> int:
        return len(self._cache)

    @torch.no_grad()
    def argmax(self, h: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """Full-vocab argmax per row (chunked: a [T, V] logit block at a time)."""
        out = []
        W = self.full
        for a in range(0, h.shape[0], chunk):
            out.append((self.normed(h[a : a + chunk].to(W.device)) @ W.T).argmax(-1))
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def target_argmax(
    reader: Any,
    head: TargetHead,
    indices: list[int],
    cache: Path | None,
    key: dict,
    progress: bool = False,
) -> dict[int, torch.Tensor]:
    """Target argmax ids per sample (int32), cached on disk: the 'in draft vocab' filter."""
    if cache is not None and cache.is_file():
        try:  # tensors and plain data only: a cache file can never run code
            blob = torch.load(cache, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise TrainError(
                f"{cache}: refusing to load: it needs Python objects beyond tensors (loading it "
                f"could run code); delete it and rerun to rebuild the cache ({str(e)[:200]})"
            ) from None
        if blob.get("key") == key:
            return blob["argmax"]
    from workbench.progress import progress as tqdm

    out = {}
    for i in tqdm(indices, desc="target argmax", disable=not progress, leave=False):
        out[i] = head.argmax(reader[i]["last_hidden"]).to(torch.int32)
    if cache is not None:
        buf = io.BytesIO()
        torch.save({"key": key, "argmax": out}, buf)
        atomic_write_bytes(cache, buf.getvalue())
    release_freed_memory()  # the [1024, vocab] logit blocks are not a training step's sizes
    return out


# ---------------------------------------------------------------- data


def split_indices(
    n: int, val_fraction: float, val_max: int, seed: int, groups: list[str] | None = None
) -> tuple[list[int], list[int]]:
    """Deterministic train/held-out split of sample indices.

    With `groups` (one name per sample), whole groups go to one side: two answers to the
    same prompt in train and held-out would flatter the held-out accuracy.
    """
    g = torch.Generator().manual_seed(seed + 7919)
    n_val = min(val_max, int(round(n * val_fraction))) if n > 1 else 0
    n_val = max(n_val, 1) if val_fraction > 0 and n > 1 else n_val
    if groups is None:
        perm = torch.randperm(n, generator=g).tolist()
        return sorted(perm[n_val:]), sorted(perm[:n_val])
    members: dict[str, list[int]] = {}
    for i, name in enumerate(groups):
        members.setdefault(name, []).append(i)
    names = list(members)
    val: list[int] = []
    for j in torch.randperm(len(names), generator=g).tolist():
        if len(val) >= n_val or len(val) + len(members[names[j]]) >= n:
            break
        val += members[names[j]]
    held = set(val)
    return [i for i in range(n) if i not in held], sorted(val)


def epoch_batches(
    train_idx: list[int],
    lengths: list[int],
    batch_size: int,
    epoch: int,
    seed: int,
    bucket: int = 16,
) -> list[list[int]]:
    """Batches for one epoch: shuffled, then sorted by length within chunks of `bucket`
    batches (less padding the larger it is; batch order is shuffled again after)."""
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    order = [train_idx[j] for j in torch.randperm(len(train_idx), generator=g).tolist()]
    chunk = batch_size * max(1, bucket)
    batches = []
    for a in range(0, len(order), chunk):
        part = sorted(order[a : a + chunk], key=lambda i: lengths[i])
        batches += [part[b : b + batch_size] for b in range(0, len(part), batch_size)]
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[j] for j in perm]


def packed_epoch(
    train_idx: list[int],
    lengths: list[int],
    row_len: int,
    rows_per_step: int,
    epoch: int,
    seed: int,
    window: int = 16,
) -> list[list[list[int]]]:
    """Steps for one epoch, each `rows_per_step` rows of whole samples laid end to end
    (`collate_packed`): every step has the same shape and almost no padding.

    Samples are shuffled (the same order `epoch_batches` draws), then each goes into the first
    of the last `window` open rows it fits in (a sample longer than `row_len` is truncated to
    it, as `max_len` does); a row that leaves the window is closed. So rows mix lengths at
    random and differ from epoch to epoch. A last step of fewer rows joins the step before it
    (so every step has at least one row per rank, whatever the world size).
    """
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    order = [train_idx[j] for j in torch.randperm(len(train_idx), generator=g).tolist()]
    rows: list[list[int]] = []
    open_rows: list[tuple[list[int], list[int]]] = []  # ([free tokens], members)
    for i in order:
        n = min(lengths[i], row_len)
        for free, members in open_rows:
            if free[0] >= n:
                free[0] -= n
                members.append(i)
                break
        else:
            open_rows.append(([row_len - n], [i]))
            if len(open_rows) > window:
                rows.append(open_rows.pop(0)[1])
    rows += [members for _, members in open_rows]
    steps = [rows[a : a + rows_per_step] for a in range(0, len(rows), rows_per_step)]
    if len(steps) > 1 and len(steps[-1]) < rows_per_step:
        last = steps.pop()
        steps[-1] += last
    perm = torch.randperm(len(steps), generator=g).tolist()
    return [steps[j] for j in perm]


class EpochPlan:
    """Which samples each training step takes: `epoch_batches` (batch_size samples a step, the
    same count every epoch) or `packed_epoch` (pack_rows rows of row_len tokens a step; the
    count can differ by a step or so between epochs, so a step is located through the epochs'
    counts). Epochs are built on demand from (seed, epoch) alone, so a resumed run draws
    exactly the same steps."""

    def __init__(
        self,
        train_idx: list[int],
        lengths: list[int],
        seed: int,
        batch_size: int,
        bucket: int,
        pack_rows: int = 0,
        row_len: int = 0,
    ) -> None:
        self.train_idx, self.lengths, self.seed = train_idx, lengths, seed
        self.batch_size, self.bucket, self.pack_rows, self.row_len = (
            batch_size, bucket, pack_rows, row_len
        )  # fmt: skip
        self._epoch: tuple[int, list] = (-1, [])  # the loop needs one epoch at a time
        self._counts: dict[int, int] = {}

    def epoch(self, ep: int) -> list:
        if self._epoch[0] != ep:
            if self.pack_rows:
                got = packed_epoch(self.train_idx, self.lengths, self.row_len, self.pack_rows,
                                   ep, self.seed)  # fmt: skip
            else:
                got = epoch_batches(self.train_idx, self.lengths, self.batch_size, ep,
                                    self.seed, self.bucket)  # fmt: skip
            self._epoch = (ep, got)
            self._counts[ep] = len(got)
        return self._epoch[1]

    def count(self, ep: int) -> int:
        return self._counts[ep] if ep in self._counts else len(self.epoch(ep))

    def total_steps(self, epochs: float) -> int:
        if not self.pack_rows:  # the same count every epoch (as runs before packing)
            return max(1, int(math.ceil(epochs * self.count(0))))
        whole = int(epochs)
        total = sum(self.count(e) for e in range(whole))
        if epochs > whole:
            total += int(math.ceil((epochs - whole) * self.count(whole)))
        return max(1, total)

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, index in it) of a global step."""
        ep = 0
        while step >= (n := self.count(ep)):
            step -= n
            ep += 1
        return ep, step

    def step(self, step: int) -> list:
        ep, bi = self.locate(step)
        return self.epoch(ep)[bi]


def collate_packed(
    reader: Any,
    rows: list[list[int]],
    argmax: dict[int, torch.Tensor],
    t2d: torch.Tensor,
    row_len: int,
    device: torch.device,
    pad_multiple: int = 64,
    head: TargetHead | None = None,
) -> dict[str, torch.Tensor]:
    """A batch of packed rows: each row holds whole samples end to end, `position_ids` restart
    at 0 per sample (and per padding tail), and the rows are right-padded to one length, the
    longest row rounded up to `pad_multiple` (at most `row_len`; `row_len` once rows are full).

    `step_masks` and `TTTModel` read `position_ids`: no position scores a token of another
    sample and attention stays inside a sample, so a packed row trains exactly as its samples
    would in rows of their own (tested). With `head`, the batch also holds the draft-vocab
    `target_logits` [B, T, V] (zeros on padding), sample by sample (`TargetHead.sample_logits`)."""
    samples = {i: reader[i] for row in rows for i in row}
    fill = [sum(min(int(samples[i]["input_ids"].numel()), row_len) for i in row) for row in rows]
    T = min(row_len, -(-max(fill) // pad_multiple) * pad_multiple)
    first = next(iter(samples.values()))
    k_h, H = first["aux_hidden"].shape[-1], first["last_hidden"].shape[-1]
    B = len(rows)
    out = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
        "token_mask": torch.zeros(B, T, dtype=torch.bool),
        "in_vocab": torch.zeros(B, T, dtype=torch.bool),
        "aux_hidden": torch.zeros(B, T, k_h),
        "last_hidden": torch.zeros(B, T, H),
        "position_ids": torch.zeros(B, T, dtype=torch.long),
    }
    if head is not None:
        out["target_logits"] = torch.zeros(B, T, head.rows.shape[0])
    for b, row in enumerate(rows):
        a = 0
        for i in row:
            s = samples[i]
            n = min(row_len - a, s["input_ids"].numel())
            sl = slice(a, a + n)
            out["input_ids"][b, sl] = s["input_ids"][:n]
            out["loss_mask"][b, sl] = s["loss_mask"][:n].bool()
            out["token_mask"][b, sl] = True
            out["in_vocab"][b, sl] = t2d[argmax[i][:n].long()]
            out["aux_hidden"][b, sl] = s["aux_hidden"][:n].float()
            out["last_hidden"][b, sl] = s["last_hidden"][:n].float()
            out["position_ids"][b, sl] = torch.arange(n)
            if head is not None:
                out["target_logits"][b, sl] = head.sample_logits(i, s["last_hidden"])[:n]
            a += n
        out["position_ids"][b, a:] = torch.arange(T - a)
    return {k: v.to(device, non_blocking=True) for k, v in out.items()}


def collate(
    reader: Any,
    indices: list[int],
    argmax: dict[int, torch.Tensor],
    t2d: torch.Tensor,
    max_len: int,
    device: torch.device,
    pad_multiple: int = 64,
    head: TargetHead | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded batch; right padding needs no attention mask under causal attention.

    The length is rounded up to a multiple of `pad_multiple` (at most `max_len`): on a CPU,
    oneDNN builds its GEMM kernels per shape, and a new length every step cost a 4 x 240-token
    step about twice its compute (benchmarks/bench_train.py --lengths). `head`: as in
    `collate_packed`."""
    samples = [reader[i] for i in indices]
    longest = max(int(s["input_ids"].numel()) for s in samples)
    T = min(max_len, -(-longest // pad_multiple) * pad_multiple)
    B = len(samples)
    k_h = samples[0]["aux_hidden"].shape[-1]
    H = samples[0]["last_hidden"].shape[-1]
    ids = torch.zeros(B, T, dtype=torch.long)
    lmask = torch.zeros(B, T, dtype=torch.bool)
    tmask = torch.zeros(B, T, dtype=torch.bool)
    inv = torch.zeros(B, T, dtype=torch.bool)
    aux = torch.zeros(B, T, k_h)
    last = torch.zeros(B, T, H)
    tl = torch.zeros(B, T, head.rows.shape[0]) if head is not None else None
    for b, (i, s) in enumerate(zip(indices, samples, strict=True)):
        n = min(T, s["input_ids"].numel())
        ids[b, :n] = s["input_ids"][:n]
        lmask[b, :n] = s["loss_mask"][:n].bool()
        tmask[b, :n] = True
        inv[b, :n] = t2d[argmax[i][:n].long()]
        aux[b, :n] = s["aux_hidden"][:n].float()
        last[b, :n] = s["last_hidden"][:n].float()
        if tl is not None:
            tl[b, :n] = head.sample_logits(i, s["last_hidden"])[:n]
    out = {
        "input_ids": ids,
        "loss_mask": lmask,
        "token_mask": tmask,
        "in_vocab": inv,
        "aux_hidden": aux,
        "last_hidden": last,
    }
    if tl is not None:
        out["target_logits"] = tl
    return {k: v.to(device, non_blocking=True) for k, v in out.items()}
