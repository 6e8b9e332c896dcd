"""Train an EAGLE-3 draft with the training-time test (TTT), resumable, single or DDP.

Alignment (eagle3.md): at position t, step i of the unroll reads emb(tok[t+1+i]) and (step 0)
the target aux states at t or (step i>0) the draft's own hidden from step i-1, uses position
id t+i, and is scored against the target distribution for tok[t+2+i], recomputed from the
stored pre-norm final residual `last_hidden[t+1+i]` with the target's final RMSNorm and the
lm_head rows of the draft vocab. A position counts when tok[t+2+i] is an assistant token and
the target's full-vocab argmax at t+1+i lies in the draft vocab (computed once per capture).

Loss: sum_i 0.8^i * soft-CE_i, each step normalized by its token count over the *global*
batch (counts are all-reduced), so N DDP ranks give the same gradient as one process.
`ttt_sample < 1` unrolls steps >= 1 for a random subset of positions only (each sampled chain
is exactly the full unroll there): the unroll, not step 0, is what makes TTT costly.

Run: `python -m workbench.draft.train --capture DIR --out DIR` or under
`torchrun --nproc-per-node N -m workbench.draft.train ...` (NCCL on GPU, gloo on CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workbench.draft.model import DraftConfig, Eagle3Draft, init_from_target
from workbench.draft.vocab import (
    EMBEDDED_DRAFT_VOCAB,
    DraftVocab,
    build_vocab,
    capture_hash,
    coverage,
)
from workbench.fsutil import atomic_write_json, atomic_write_text
from workbench.layers import CANONICAL, LayerIds, parse_layer_spec, validate


class TrainError(ValueError):
    """The capture, target, vocab or checkpoint do not fit together."""


@dataclass
class TrainConfig:
    capture: str = ""
    out: str = "runs/draft"
    target: str = "smollm2-135m"
    layer_ids: str | None = None  # expected aux ids (canonical); None = take the capture's
    draft_vocab_size: int = EMBEDDED_DRAFT_VOCAB
    vocab: str | None = None  # reuse a stored vocab.json (fine-tuning must not rebuild d2t)
    ttt_len: int = 7
    loss_decay: float = 0.8
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup: float = 0.05  # fraction of total steps (or steps if >= 1)
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.5
    batch_size: int = 8  # samples per optimizer step, global (split across ranks)
    max_len: int = 2048  # truncate longer samples
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    val_fraction: float = 0.05
    val_max_samples: int = 256
    eval_every: int = 100
    ckpt_every: int = 100
    keep_ckpts: int = 2
    log_every: int = 10
    seed: int = 0
    init_from_target: bool = True  # norm + lm_head rows from the target
    init_layer: int | None = None  # also start the decoder layer from this target layer
    embed_half_scale: float = 0.0
    ttt_sample: float = 1.0  # fraction of positions unrolled past step 0 (1 = all)
    loss_on: str = "assistant"  # assistant | all (also learn the target's view of user turns)
    amp: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | off
    device: str = "auto"
    threads: int | None = None
    resume: bool = False
    progress: bool = True
    time_budget_s: float | None = None  # stop early (with a checkpoint) past this
    stop_after: int | None = None  # end this invocation after N steps w/o final ckpt (tests)

    def to_dict(self) -> dict:
        return asdict(self)


PROFILES: dict[str, dict[str, Any]] = {
    # ~15 min on 2 cores: a few passes over a ~100K-token capture
    "quick": dict(
        # measured on a 95K-token capture (400 regenerated prompts; 20 held out), 5 min each:
        # lr 5e-4/b8/TTT-5: acc0 0.24 after 8 min; lr 1e-3/b4/TTT-3: 0.32; lr 2e-3: 0.34;
        # starting the decoder layer from target layer 29 did not help (0.31);
        # TTT-3, 7 epochs, 4096 draft vocab: 0.41 acc0, simulated tau 1.61 (3 steps) in 6.9 min;
        # TTT-5 with 1/4 of positions unrolled, loss on all tokens, 7 epochs: 0.39 / 1.59
        # (5 steps) in 5.7 min; the same with lr 4e-3 and 5 epochs: 0.36 / 1.52 in 3.8 min
        ttt_len=5,
        ttt_sample=0.25,
        loss_on="all",
        lr=2e-3,
        batch_size=4,
        max_len=1024,
        epochs=7,
        warmup=0.03,
        eval_every=100,
        ckpt_every=100,
        draft_vocab_size=4096,  # ~5K distinct assistant tokens in the quick capture
        init_layer=None,
        amp="bf16",  # bf16 autocast, fp32 master weights: ~1.7x tokens/s on the 2-core CPU
        time_budget_s=8 * 60,
    ),
    # the training part of the pipeline's 2-hour `full` run (regeneration and capture take
    # the first 70 min): TTT-5 for the 5-step chain of the goal. Measured on the full capture
    # (647K tokens), 10 min each: TTT-5 lr 2e-3 all positions 0.269 acc0 / sim tau 1.34;
    # unrolling 1/4 of the positions past step 0 (2.4x tokens/s) 0.354 / 1.51; + loss on user
    # turns too 0.357 / 1.52; + lr 4e-3 0.362 / 1.54
    "full": dict(
        ttt_len=5,
        ttt_sample=0.25,
        loss_on="all",
        lr=4e-3,
        batch_size=8,
        max_len=1536,
        epochs=5,
        warmup=0.03,
        eval_every=200,
        ckpt_every=200,
        draft_vocab_size=8192,
        init_layer=None,
        amp="bf16",
        time_budget_s=40 * 60,
    ),
}


def profile(name: str, **overrides: Any) -> TrainConfig:
    """A preset TrainConfig (`quick` ~15 min, `full` ~2 h on 2 CPU cores) plus overrides."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; expected one of {sorted(PROFILES)}")
    return TrainConfig(**{**PROFILES[name], **overrides})


# ---------------------------------------------------------------- distributed


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_dist(device: torch.device) -> Dist:
    """Join the torchrun group if WORLD_SIZE > 1 (NCCL on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    owns = False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns = True
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), owns)


def all_sum(x: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world > 1:
        dist.all_reduce(x)
    return x


# ---------------------------------------------------------------- capture + guard rails


def open_capture(path: str | os.PathLike, verify: bool = False):
    from workbench.capture import CaptureReader

    return CaptureReader(path, verify=verify)


def check_capture(reader: Any, target: Any, layer_ids: str | LayerIds | None = None) -> LayerIds:
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
        want = (
            layer_ids
            if isinstance(layer_ids, LayerIds)
            else parse_layer_spec(layer_ids, target.num_layers)
        )
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
        self, target_model: nn.Module, draft_ids: torch.Tensor, device: torch.device
    ) -> None:
        inner = getattr(target_model, "model", target_model)
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
        blob = torch.load(cache, weights_only=False)
        if blob.get("key") == key:
            return blob["argmax"]
    from workbench.progress import progress as tqdm

    out = {}
    for i in tqdm(indices, desc="target argmax", disable=not progress, leave=False):
        out[i] = head.argmax(reader[i]["last_hidden"]).to(torch.int32)
    if cache is not None:
        tmp = cache.with_suffix(".tmp")
        torch.save({"key": key, "argmax": out}, tmp)
        os.replace(tmp, cache)
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
    train_idx: list[int], lengths: list[int], batch_size: int, epoch: int, seed: int
) -> list[list[int]]:
    """Batches for one epoch: shuffled, length-bucketed within chunks of 16 batches."""
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    order = [train_idx[j] for j in torch.randperm(len(train_idx), generator=g).tolist()]
    chunk = batch_size * 16
    batches = []
    for a in range(0, len(order), chunk):
        part = sorted(order[a : a + chunk], key=lambda i: lengths[i])
        batches += [part[b : b + batch_size] for b in range(0, len(part), batch_size)]
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[j] for j in perm]


def collate(
    reader: Any,
    indices: list[int],
    argmax: dict[int, torch.Tensor],
    t2d: torch.Tensor,
    max_len: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Right-padded batch; right padding needs no attention mask under causal attention."""
    samples = [reader[i] for i in indices]
    T = min(max_len, max(int(s["input_ids"].numel()) for s in samples))
    B = len(samples)
    k_h = samples[0]["aux_hidden"].shape[-1]
    H = samples[0]["last_hidden"].shape[-1]
    ids = torch.zeros(B, T, dtype=torch.long)
    lmask = torch.zeros(B, T, dtype=torch.bool)
    tmask = torch.zeros(B, T, dtype=torch.bool)
    inv = torch.zeros(B, T, dtype=torch.bool)
    aux = torch.zeros(B, T, k_h)
    last = torch.zeros(B, T, H)
    for b, (i, s) in enumerate(zip(indices, samples, strict=True)):
        n = min(T, s["input_ids"].numel())
        ids[b, :n] = s["input_ids"][:n]
        lmask[b, :n] = s["loss_mask"][:n].bool()
        tmask[b, :n] = True
        inv[b, :n] = t2d[argmax[i][:n].long()]
        aux[b, :n] = s["aux_hidden"][:n].float()
        last[b, :n] = s["last_hidden"][:n].float()
    out = {
        "input_ids": ids,
        "loss_mask": lmask,
        "token_mask": tmask,
        "in_vocab": inv,
        "aux_hidden": aux,
        "last_hidden": last,
    }
    return {k: v.to(device, non_blocking=True) for k, v in out.items()}


def step_masks(
    batch: dict[str, torch.Tensor], ttt_len: int, all_tokens: bool = False
) -> list[torch.Tensor]:
    """m_i[b, t] for t < T - 1 - i: tok[t+2+i] is assistant and argmax(t+1+i) in draft vocab.

    `all_tokens` drops the assistant condition (any real token): the target's distribution
    over user turns is free extra signal, since those positions are computed anyway.
    """
    lm = batch["token_mask"] if all_tokens else batch["loss_mask"]
    inv = batch["in_vocab"]
    T = lm.shape[1]
    out = []
    for i in range(ttt_len):
        s = 1 + i
        L = T - s  # positions with an input token tok[t+s]
        m = torch.zeros(lm.shape[0], L, dtype=torch.bool, device=lm.device)
        if L > 1:
            m[:, : L - 1] = lm[:, s + 1 :] & inv[:, s : T - 1]
        out.append(m)
    return out


# ---------------------------------------------------------------- the TTT unroll


class TTTModel(nn.Module):
    """The unrolled training-time test as one module (one forward per backward under DDP)."""

    def __init__(self, draft: Eagle3Draft, ttt_len: int, decay: float) -> None:
        super().__init__()
        self.draft, self.ttt_len, self.decay = draft, ttt_len, decay

    def forward(
        self,
        batch: dict[str, torch.Tensor],
        tlogits: torch.Tensor,
        masks: list[torch.Tensor],
        denom: torch.Tensor,
        scale: float = 1.0,
        idx: torch.Tensor | None = None,
        masks_all: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (loss, stats [ttt_len, 9]): ce_sum, correct, count, cond_correct,
        cond_count, then correct, count, cond_correct, cond_count over `masks_all` (zeros
        without it).

        With `idx` [B, Q] (see `sample_positions`), steps >= 1 unroll only those positions
        and `masks[i>=1]` are [B, Q] (from `subsample_masks`); step 0 always runs on all.
        `masks_all` (evaluation, no `idx`) are the masks without the draft-vocab condition:
        a position whose target token the draft cannot emit counts as a miss there.
        """
        d = self.draft
        ids = batch["input_ids"]
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)[None].expand(B, T)
        tprob = tlogits.float().softmax(-1)
        targ = tlogits.argmax(-1)
        ids_ext = F.pad(ids, (0, self.ttt_len + 1)) if idx is not None else None
        h = batch["aux_hidden"]
        kv: list = []
        loss = torch.zeros((), device=ids.device)
        stats = torch.zeros(self.ttt_len, 9, device=ids.device)
        prefix = torch.ones(B, T, dtype=torch.bool, device=ids.device)  # steps < i all correct
        prefix_all = prefix.clone()
        for i in range(self.ttt_len):
            s = 1 + i
            L = T - s
            if L <= 0:
                break
            m = masks[i]
            if idx is None or i == 0:
                in_ids = F.pad(ids[:, s:], (0, s))
                _, h = d(in_ids, h, pos + i, ttt=kv, logits=False)
                hs = h[:, :L][m]
                p = tprob[:, s:][m]
                tg = targ[:, s:][m]
                ok = torch.zeros(B, L, dtype=torch.bool, device=ids.device)
            else:
                if i == 1:
                    h = h.gather(1, idx[..., None].expand(-1, -1, h.shape[-1]))
                    prefix = prefix.gather(1, idx)
                _, h = d(ids_ext.gather(1, idx + s), h, idx + i, ttt=kv, ttt_pos=idx, logits=False)
                hs = h[m]
                rows, cols = m.nonzero(as_tuple=True)
                p = tprob[rows, idx[rows, cols] + s]
                tg = targ[rows, idx[rows, cols] + s]
                ok = torch.zeros_like(m)
            logp = d.lm_head(d.norm(hs)).float().log_softmax(-1)
            ce = -(p * logp).sum(-1)
            loss = loss + (self.decay**i) * ce.sum() / denom[i].clamp(min=1) * scale
            with torch.no_grad():
                ok[m] = logp.argmax(-1) == tg
                stats[i, 0] = ce.sum().detach()
                stats[i, 1:5], prefix = _step_counts(ok, m, prefix)
                if masks_all is not None:
                    stats[i, 5:], prefix_all = _step_counts(ok, masks_all[i], prefix_all)
        return loss, stats


def _step_counts(
    ok: torch.Tensor, m: torch.Tensor, prefix: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, count, cond_correct, cond_count) of one step over mask m, and the new prefix
    (positions whose chain is all correct so far; a masked-out position counts as a miss)."""
    n = ok.shape[1]
    cand = prefix[:, :n] & m
    counts = torch.stack([(ok & m).sum(), m.sum(), (cand & ok).sum(), cand.sum()]).float()
    prefix = prefix.clone()
    prefix[:, :n] &= ok
    prefix[:, n:] = False
    return counts, prefix


def sample_positions(first: torch.Tensor, frac: float) -> torch.Tensor:
    """Positions [B, Q] whose unroll continues past step 0, Q = ceil(frac * T).

    `first` is step 1's mask [B, L]. Valid positions are taken first, at random (the global
    torch RNG, so a resumed run draws the same); rows with fewer fill up with masked ones.
    Steps >= 1 then cost ~frac of a full step: the unroll is what makes TTT expensive, and
    step 0 (the acceptance that matters most) still trains on every position.
    """
    B, L = first.shape
    q = max(1, min(L, math.ceil(frac * (L + 2))))
    score = torch.rand(B, L, device=first.device) + first.float()
    return score.topk(q, dim=1).indices.sort(dim=1).values


def subsample_masks(masks: list[torch.Tensor], idx: torch.Tensor) -> list[torch.Tensor]:
    """masks[i >= 1] at the sampled positions: [B, Q] each (False past a step's length)."""
    width = int(idx.max()) + 1
    return [masks[0]] + [
        F.pad(m, (0, max(0, width - m.shape[1]))).gather(1, idx) for m in masks[1:]
    ]


def unroll_masks(
    batch: dict[str, torch.Tensor], ttt_len: int, ttt_sample: float = 1.0, all_tokens: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """A training batch's step masks and sampled positions (None: every position unrolled)."""
    masks = step_masks(batch, ttt_len, all_tokens=all_tokens)
    if ttt_sample >= 1 or ttt_len < 2 or masks[1].shape[1] == 0:
        return masks, None
    idx = sample_positions(masks[1], ttt_sample)
    return subsample_masks(masks, idx), idx


def _tau(a: list[float]) -> list[float]:
    taus, tau, prod = [], 1.0, 1.0
    for ai in a:
        prod *= ai
        tau += prod
        taus.append(tau)
    return taus


def summarize(stats: torch.Tensor) -> dict[str, Any]:
    """acc_i, conditional acceptance a_i, simulated tau = 1 + sum_k prod_{j<=k} a_j.

    These count positions whose target token is in the draft vocab (as SpecForge does). With
    the extra columns of an evaluation, `acc_all` / `a_all` / `tau_all` also count the others
    as misses: what serving sees, and the fair number when comparing draft vocab sizes.
    """
    st = stats.double().cpu()
    acc = (st[:, 1] / st[:, 2].clamp(min=1)).tolist()
    a = (st[:, 3] / st[:, 4].clamp(min=1)).tolist()
    loss = (st[:, 0] / st[:, 2].clamp(min=1)).tolist()
    taus = _tau(a)
    out = {
        "loss_i": loss,
        "acc": acc,
        "a": a,
        "tau": taus[-1] if taus else 1.0,
        "tau_k": taus,
        "count": st[:, 2].tolist(),
    }
    if st.shape[1] >= 9 and st[:, 6].sum() > 0:
        a_all = (st[:, 7] / st[:, 8].clamp(min=1)).tolist()
        taus_all = _tau(a_all)
        out.update(
            acc_all=(st[:, 5] / st[:, 6].clamp(min=1)).tolist(),
            a_all=a_all,
            tau_all=taus_all[-1] if taus_all else 1.0,
            in_vocab=float(st[0, 2] / st[0, 6].clamp(min=1)),
        )
    return out


# ---------------------------------------------------------------- schedule / rng / checkpoints


def lr_lambda(total: int, warmup: float, min_ratio: float):
    w = int(warmup if warmup >= 1 else round(warmup * total))

    def f(step: int) -> float:
        if step < w:
            return (step + 1) / max(w, 1)
        prog = min(1.0, (step - w) / max(total - w, 1))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

    return f


def rng_state() -> dict:
    st = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(out: Path, step: int, state: dict, keep: int) -> Path:
    """Write checkpoints/step-N/ via a temp dir + rename, then repoint `latest` atomically."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    atomic_write_json(tmp / "draft_config.json", state["draft_config"])
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(root / "latest", final.name + "\n")
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    for p in done[: max(0, len(done) - keep)]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(out: str | os.PathLike) -> Path | None:
    p = Path(out) / "checkpoints" / "latest"
    if not p.is_file():
        return None
    d = p.parent / p.read_text().strip()
    return d if (d / "state.pt").is_file() else None


def load_draft(path: str | os.PathLike, target_model: nn.Module | None = None) -> Eagle3Draft:
    """A trained draft from a run dir (latest checkpoint) or a checkpoint dir.

    With `target_model`, the frozen embeddings are filled from it (they are never stored).
    """
    p = Path(path)
    ck = p if (p / "state.pt").is_file() else latest_checkpoint(p)
    if ck is None:
        raise TrainError(f"{p}: no checkpoint (expected state.pt or checkpoints/latest)")
    state = torch.load(ck / "state.pt", map_location="cpu", weights_only=False)
    draft = Eagle3Draft(DraftConfig.from_dict(state["draft_config"]))
    draft.load_state_dict(state["draft"])
    if target_model is not None:
        draft.embed_tokens.copy_(target_model.get_input_embeddings().weight.detach().float())
    return draft


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(
    model: TTTModel, reader, indices, argmax, t2d, head, cfg: TrainConfig, device, amp_ctx, d: Dist
) -> dict[str, Any]:
    """Held-out per-step metrics (each rank a slice of the held-out set, summed)."""
    model.eval()
    stats = torch.zeros(cfg.ttt_len, 9, device=device)
    mine = indices[d.rank :: d.world]
    for a in range(0, len(mine), max(1, cfg.batch_size // d.world)):
        chunk = mine[a : a + max(1, cfg.batch_size // d.world)]
        batch = collate(reader, chunk, argmax, t2d, cfg.max_len, device)
        masks = step_masks(batch, cfg.ttt_len)
        masks_all = step_masks(
            {**batch, "in_vocab": torch.ones_like(batch["in_vocab"])}, cfg.ttt_len
        )
        denom = torch.stack([m.sum() for m in masks]).float()
        with amp_ctx():
            _, st = model(
                batch, head.draft_logits(batch["last_hidden"]), masks, denom, masks_all=masks_all
            )
        stats += st
    model.train()
    return summarize(all_sum(stats, d))


# ---------------------------------------------------------------- train


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device != "auto":
        return torch.device(cfg.device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _amp(cfg: TrainConfig, device: torch.device):
    mode = cfg.amp if cfg.amp != "auto" else ("bf16" if device.type == "cuda" else "off")
    if mode == "off":
        return lambda: torch.autocast(device.type, enabled=False)
    if mode != "bf16":
        raise ValueError(f"amp must be auto, bf16 or off; got {cfg.amp!r}")
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def train(cfg: TrainConfig, target: Any = None, reader: Any = None) -> dict[str, Any]:
    """Train (or resume) a draft; returns held-out acc per step, tau, tokens/s, checkpoint dir."""
    device = _device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    d = setup_dist(device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, target, reader, device, d)
    finally:
        if d.owns_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, target, reader, device: torch.device, d: Dist) -> dict[str, Any]:
    from workbench.progress import progress as tqdm

    if not 0 < cfg.ttt_sample <= 1:
        raise TrainError(
            f"ttt_sample must be in (0, 1] (a fraction of positions), got {cfg.ttt_sample}"
        )
    if cfg.loss_on not in ("assistant", "all"):
        raise TrainError(f"loss_on must be 'assistant' or 'all', got {cfg.loss_on!r}")

    out = Path(cfg.out)
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
    if target is None:
        from workbench.target import load_target

        target = load_target(cfg.target, device=str(device))
    reader = reader if reader is not None else open_capture(cfg.capture)
    cap_ids = check_capture(reader, target, cfg.layer_ids)
    chash = capture_hash(reader)

    ckpt_dir = latest_checkpoint(out) if cfg.resume else None
    state = (
        torch.load(ckpt_dir / "state.pt", map_location="cpu", weights_only=False)
        if ckpt_dir
        else None
    )
    if state is not None:
        _check_resume(state, cfg, chash, target)

    train_idx, val_idx = split_indices(
        len(reader), cfg.val_fraction, cfg.val_max_samples, cfg.seed, reader.manifest.get("groups")
    )
    # --- vocab: never rebuilt on resume or when given (a rebuilt d2t misaligns lm_head)
    if state is not None:
        vocab = DraftVocab.from_dict(state["vocab"])
    elif cfg.vocab:
        vocab = DraftVocab.load(cfg.vocab)
    else:
        vocab = build_vocab(
            reader, min(cfg.draft_vocab_size, target.vocab_size), target.vocab_size, train_idx
        )
    if vocab.target_vocab_size != target.vocab_size:
        raise TrainError(
            f"vocab is for a {vocab.target_vocab_size}-token target, target has {target.vocab_size}"
        )

    torch.manual_seed(cfg.seed)
    dcfg = DraftConfig.from_target(target.config, cap_ids, vocab.draft_vocab_size)
    draft = Eagle3Draft(dcfg)
    draft.set_vocab(vocab.ids)
    if cfg.init_from_target:
        init_from_target(draft, target.model, cfg.init_layer, cfg.embed_half_scale)
    else:
        draft.embed_tokens.copy_(target.model.get_input_embeddings().weight.detach().float())
    draft.to(device)
    head = TargetHead(target.model, vocab.ids, device)
    t2d = vocab.t2d

    key = {"capture": chash, "target": target.fingerprint}
    amax_cache = out / "target_argmax.pt"
    if d.main:
        argmax = target_argmax(
            reader, head, list(range(len(reader))), amax_cache, key, cfg.progress
        )
    if d.world > 1:
        dist.barrier()
    if not d.main:
        argmax = target_argmax(reader, head, list(range(len(reader))), amax_cache, key)

    model = TTTModel(draft, cfg.ttt_len, cfg.loss_decay)
    ddp = model
    if d.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False,
        )
    opt = torch.optim.AdamW(
        draft.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
    )
    lengths = (
        reader.lengths()
        if hasattr(reader, "lengths")
        else [int(reader[i]["input_ids"].numel()) for i in range(len(reader))]
    )
    if cfg.batch_size < d.world:
        raise TrainError(
            f"batch_size {cfg.batch_size} < world size {d.world}: every rank needs samples"
        )
    per_epoch = len(epoch_batches(train_idx, lengths, cfg.batch_size, 0, cfg.seed))
    if per_epoch == 0:
        raise TrainError("no training samples (capture too small for the held-out split?)")
    total = cfg.max_steps or max(1, int(math.ceil(cfg.epochs * per_epoch)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, cfg.warmup, cfg.min_lr_ratio))
    amp_ctx = _amp(cfg, device)

    step, metrics = 0, []
    if state is not None:
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step, metrics = state["step"], state["metrics"]
        set_rng_state(state["rng"])
    log = out / "log.jsonl"
    if d.main:  # the log holds exactly the checkpointed history (a killed run's tail is redone)
        atomic_write_text(log, "".join(json.dumps(m) + "\n" for m in metrics))
        vocab.save(out / "vocab.json")
        atomic_write_json(out / "draft_config.json", dcfg.to_dict())
        atomic_write_json(out / "train_config.json", cfg.to_dict())

    def emit(rec: dict) -> None:
        metrics.append(rec)
        if d.main:
            with open(log, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def checkpoint() -> Path | None:
        path = None
        if d.main:
            st = {
                "draft": draft.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "step": step,
                "epoch": step // per_epoch,
                "batch_in_epoch": step % per_epoch,
                "rng": rng_state(),
                "metrics": metrics,
                "config": cfg.to_dict(),
                "draft_config": dcfg.to_dict(),
                "vocab": vocab.to_dict(),
                "capture_hash": chash,
                "target_fingerprint": target.fingerprint,
                "world_size": d.world,
            }
            path = save_checkpoint(out, step, st, cfg.keep_ckpts)
        if d.world > 1:
            dist.barrier()
        return path

    if d.main and state is None:
        cov = coverage(vocab, reader, val_idx or train_idx)
        emit(
            {
                "event": "start",
                "step": 0,
                "train_samples": len(train_idx),
                "val_samples": len(val_idx),
                "total_steps": total,
                "draft_vocab_size": vocab.draft_vocab_size,
                "val_coverage": cov,
                "world_size": d.world,
            }
        )
    bar = tqdm(
        total=total,
        initial=step,
        desc="train",
        disable=not (cfg.progress and d.main),
        dynamic_ncols=True,
    )
    t0, toks, run_steps = time.perf_counter(), 0.0, 0
    last_eval: dict[str, Any] = {}
    batches, batches_epoch = None, -1
    stopped = False
    while step < total:
        ep, bi = divmod(step, per_epoch)
        if ep != batches_epoch:
            batches, batches_epoch = (
                epoch_batches(train_idx, lengths, cfg.batch_size, ep, cfg.seed),
                ep,
            )
        gb = batches[bi]
        batch = collate(reader, gb[d.rank :: d.world], argmax, t2d, cfg.max_len, device)
        masks, idx = unroll_masks(batch, cfg.ttt_len, cfg.ttt_sample, cfg.loss_on == "all")
        ntok = torch.tensor([_ntok(gb, lengths, cfg.max_len, d)], device=device)
        counts = all_sum(torch.cat([torch.stack([m.sum() for m in masks]).float(), ntok]), d)
        tl = head.draft_logits(batch["last_hidden"])
        with amp_ctx():
            loss, st = ddp(batch, tl, masks, counts[:-1], float(d.world), idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        step += 1
        run_steps += 1
        toks += float(counts[-1])
        if step % cfg.log_every == 0 or step == total:
            s = summarize(all_sum(st.detach(), d))
            lval = float(all_sum(loss.detach().clone(), d)) / d.world
            rate = toks / max(time.perf_counter() - t0, 1e-9)
            emit(
                {
                    "event": "train",
                    "step": step,
                    "loss": lval,
                    "acc": s["acc"],
                    "loss_i": s["loss_i"],
                    "lr": sched.get_last_lr()[0],
                    "grad_norm": float(gnorm),
                    "tok_s": rate,
                }
            )
            bar.set_postfix(
                loss=f"{lval:.3f}",
                acc0=f"{s['acc'][0]:.3f}",
                tau=f"{last_eval.get('tau', float('nan')):.2f}",
            )
        bar.update(1)
        if val_idx and (step % cfg.eval_every == 0 or step == total):
            last_eval = evaluate(model, reader, val_idx, argmax, t2d, head, cfg, device, amp_ctx, d)
            emit({"event": "eval", "step": step, **last_eval})
            bar.set_postfix(acc0=f"{last_eval['acc'][0]:.3f}", tau=f"{last_eval['tau']:.2f}")
        if cfg.stop_after is not None and run_steps >= cfg.stop_after:
            stopped = True  # simulated kill: no checkpoint
            break
        over = False
        if cfg.time_budget_s is not None:  # every rank votes each step (a collective on all)
            flag = torch.tensor(
                [float(time.perf_counter() - t0 > cfg.time_budget_s)], device=device
            )
            over = bool(all_sum(flag, d) > 0)
        if step % cfg.ckpt_every == 0 or step == total or over:
            checkpoint()
        if over:
            break
    bar.close()
    elapsed = time.perf_counter() - t0
    ck = latest_checkpoint(out) if not stopped else None
    if (
        val_idx
        and (not last_eval or (metrics and metrics[-1].get("event") != "eval"))
        and not stopped
    ):  # the run ended off the eval grid (time budget, last partial interval): log it too
        last_eval = evaluate(model, reader, val_idx, argmax, t2d, head, cfg, device, amp_ctx, d)
        emit({"event": "eval", "step": step, **last_eval})
    return {
        "step": step,
        "total_steps": total,
        "stopped": stopped,
        "acc": last_eval.get("acc"),
        "a": last_eval.get("a"),
        "tau": last_eval.get("tau"),
        "tau_k": last_eval.get("tau_k"),
        "acc_all": last_eval.get("acc_all"),
        "tau_all": last_eval.get("tau_all"),
        "in_vocab": last_eval.get("in_vocab"),
        "tok_s": toks / max(elapsed, 1e-9),
        "elapsed_s": elapsed,
        "checkpoint": str(ck) if ck else None,
        "out": str(out),
        "world_size": d.world,
    }


def _ntok(gb: list[int], lengths: list[int], max_len: int, d: Dist) -> float:
    """Tokens this rank trains on this step (for tokens/s after the all-reduce)."""
    return float(sum(min(lengths[i], max_len) for i in gb[d.rank :: d.world]))


def _check_resume(state: dict, cfg: TrainConfig, chash: str, target: Any) -> None:
    problems = []
    if state["capture_hash"] != chash:
        problems.append(f"capture hash: checkpoint {state['capture_hash']}, now {chash}")
    if state["target_fingerprint"] != target.fingerprint:
        problems.append(
            f"target fingerprint: checkpoint {state['target_fingerprint']}, now {target.fingerprint}"
        )
    old = state["config"]
    for k in (
        "ttt_len",
        "batch_size",
        "seed",
        "max_len",
        "val_fraction",
        "val_max_samples",
        "lr",
        "epochs",
        "max_steps",
        "warmup",
        "min_lr_ratio",
        "loss_decay",
        "ttt_sample",
        "loss_on",
    ):
        was = old.get(k, getattr(TrainConfig, k))  # keys added later: the old default
        if was != getattr(cfg, k):
            problems.append(f"{k}: checkpoint {was!r}, now {getattr(cfg, k)!r}")
    if problems:
        raise TrainError(
            "cannot resume: the run differs from the checkpoint:\n  " + "\n  ".join(problems)
        )


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench.draft.train", description=__doc__.split("\n")[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default=None)
    for f in fields(TrainConfig):
        name = "--" + f.name.replace("_", "-")
        default = f.default
        if f.type in ("bool",) or isinstance(default, bool):
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=None)
        elif f.name == "betas":
            p.add_argument(name, type=float, nargs=2, default=None)
        else:
            conv = {int: int, float: float}.get(type(default), None)
            if f.name in ("max_steps", "init_layer", "threads", "stop_after"):
                conv = int
            elif f.name in ("time_budget_s",):
                conv = float
            p.add_argument(name, type=conv or str, default=None)
    return p


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    args = vars(build_parser().parse_args(argv))
    prof = args.pop("profile")
    given = {k: v for k, v in args.items() if v is not None}
    if "betas" in given:
        given["betas"] = tuple(given["betas"])
    cfg = profile(prof, **given) if prof else replace(TrainConfig(), **given)
    if not cfg.capture:
        raise SystemExit("--capture DIR is required")
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(argv)
    summary = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in summary.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
