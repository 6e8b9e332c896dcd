"""The training-time test (TTT) unroll: step masks, position sampling, the unrolled model and
its step statistics.

Alignment (eagle3.md): at position t, step i of the unroll reads emb(tok[t+1+i]) and (step 0)
the target aux states at t or (step i>0) the draft's own hidden from step i-1, uses position
id t+i, and is scored against the target distribution for tok[t+2+i], recomputed from the
stored pre-norm final residual `last_hidden[t+1+i]`. A position counts when tok[t+2+i] is an
assistant token (or any token, `loss_on=all`) and the target's full-vocab argmax at t+1+i lies
in the draft vocab. In packed rows (`position_ids` in the batch, restarting at 0 per sample),
t is a row index, the position id is t's within its sample, and t+2+i must lie in t's sample.

Loss: sum_i decay^i * soft-CE_i, each step normalized by its token count over the *global*
batch. `ttt_sample < 1` unrolls steps >= 1 for a random subset of positions only (each
sampled chain is exactly the full unroll there): the unroll, not step 0, is what makes TTT
costly.

Speed (benchmarks/bench_train.py): the soft cross-entropy is `soft_ce.soft_ce` (a C kernel
reading the target rows in place by flat index, or a chunked torch function), so the target
softmax runs on the scored rows only and no [N, V] intermediates are kept; the attention is
`attention.ttt_attention`. `TTTModel(reference=True)` is the earlier formulation, kept as the
baseline the tests and the benchmark compare against.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench.draft.attention import TTTKV, packed_segments
from workbench.draft.model import Eagle3Draft
from workbench.draft.soft_ce import soft_ce
from workbench.metrics import simulated_tau_curve


def step_masks(
    batch: dict[str, torch.Tensor], ttt_len: int, all_tokens: bool = False
) -> list[torch.Tensor]:
    """m_i[b, t] for t < T - 1 - i: tok[t+2+i] is assistant and argmax(t+1+i) in draft vocab.

    `all_tokens` drops the assistant condition (any real token): the target's distribution
    over user turns is free extra signal, since those positions are computed anyway.
    Packed rows (`position_ids`, restarting at 0 per sample) also need t+2+i in t's sample:
    its position id is then exactly 2+i more than t's.
    """
    lm = batch["token_mask"] if all_tokens else batch["loss_mask"]
    inv = batch["in_vocab"]
    pos = batch.get("position_ids")
    T = lm.shape[1]
    out = []
    for i in range(ttt_len):
        s = 1 + i
        L = T - s  # positions with an input token tok[t+s]
        m = torch.zeros(lm.shape[0], L, dtype=torch.bool, device=lm.device)
        if L > 1:
            m[:, : L - 1] = lm[:, s + 1 :] & inv[:, s : T - 1]
            if pos is not None:
                m[:, : L - 1] &= pos[:, s + 1 :] == pos[:, : L - 1] + (s + 1)
        out.append(m)
    return out


# ---------------------------------------------------------------- the TTT unroll


def keep_freed_memory() -> bool:
    """Serve large CPU tensors from the heap, not from fresh pages (glibc; process-wide).

    glibc maps every block above 32 MB afresh and unmaps it on free, so a step's logits and
    their gradients were page-faulted in again each step: 150-590K minor faults per step of
    the full preset, about 12% of its time. With mmap off (M_MMAP_MAX 0) and a high trim
    threshold, freed blocks stay in the heap for the next step. False where libc is not glibc.
    """
    libc = _glibc()
    if libc is None:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc `malloc_trim`): after work whose blocks
    a training step does not reuse (the target argmax, an evaluation: +0.9 GB kept otherwise)."""
    if (libc := _glibc()) is not None:  # not glibc: nothing was kept
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc with its allocator controls, or None (another C library)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


class TTTModel(nn.Module):
    """The unrolled training-time test as one module (one forward per backward under DDP).

    `reference=True`: the earlier formulation (full-batch target softmax, boolean gathers,
    log-softmax loss, `ttt_attention_reference`), the baseline for tests and benchmarks.
    """

    def __init__(
        self, draft: Eagle3Draft, ttt_len: int, decay: float, reference: bool = False
    ) -> None:
        super().__init__()
        self.draft, self.ttt_len, self.decay = draft, ttt_len, decay
        self.reference = reference

    def forward(
        self,
        batch: dict[str, torch.Tensor],
        tlogits: torch.Tensor,
        masks: list[torch.Tensor],
        denom: torch.Tensor,
        scale: float = 1.0,
        idx: torch.Tensor | None = None,
        masks_all: list[torch.Tensor] | None = None,
        stats: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (loss, stats [ttt_len, 9]): ce_sum, correct, count, cond_correct,
        cond_count, then correct, count, cond_correct, cond_count over `masks_all` (zeros
        without it). `stats=False` leaves all but ce_sum at zero and skips the argmaxes over
        the draft and target vocabularies behind them (the trainer logs every 10th step).

        With `idx` [B, Q] (see `sample_positions`), steps >= 1 unroll only those positions
        and `masks[i>=1]` are [B, Q] (from `subsample_masks`); step 0 always runs on all.
        `masks_all` (evaluation, no `idx`) are the masks without the draft-vocab condition:
        a position whose target token the draft cannot emit counts as a miss there.
        """
        d = self.draft
        ids = batch["input_ids"]
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)[None].expand(B, T)  # row positions
        ref = self.reference
        tprob = tlogits.float().softmax(-1) if ref else None
        tflat = tlogits.reshape(B * T, -1)
        targ = tlogits.argmax(-1) if stats or ref else None
        ids_ext = F.pad(ids, (0, self.ttt_len + 1)) if idx is not None else None
        h = batch["aux_hidden"]
        if (rope_pos := batch.get("position_ids")) is None:  # one sample per row
            rope_pos = pos
            kv = TTTKV(reference=ref)
        else:  # packed rows: RoPE positions restart per sample, attention stays inside it
            kv = TTTKV(ref, *packed_segments(rope_pos))
        loss = torch.zeros((), device=ids.device)
        out = torch.zeros(self.ttt_len, 9, device=ids.device)
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
                _, h = d(in_ids, h, rope_pos + i, ttt=kv, logits=False)
                at_all = pos[:, :L] + s
            else:
                if i == 1:
                    h = h.gather(1, idx[..., None].expand(-1, -1, h.shape[-1]))
                    prefix = prefix.gather(1, idx)
                    rope_pos = rope_pos.gather(1, idx)
                _, h = d(ids_ext.gather(1, idx + s), h, rope_pos + i, ttt=kv, ttt_pos=idx,
                         logits=False)  # fmt: skip
                at_all = idx + s
            if ref:
                hs = h[:, :L][m] if idx is None or i == 0 else h[m]
                rows, cols = m.nonzero(as_tuple=True)
                at = at_all[rows, cols]
                z = d.lm_head(d.norm(hs))
                p = tprob[rows, at]
                logp = z.float().log_softmax(-1)
                ce, top = -(p * logp).sum(-1), logp.argmax(-1)
                ok = torch.zeros_like(m)
                ok[m] = top == targ[rows, at]
            else:
                # every row of the step is scored and the mask weights the loss: shapes then
                # depend on T only, not on how many positions a batch's masks keep, so the
                # CPU's GEMM kernels (oneDNN creates one per shape) are made once per T bucket
                hs = h[:, :L] if idx is None or i == 0 else h
                at = at_all.clamp(max=T - 1)  # rows past the end are masked out anyway
                flat = torch.arange(B, device=ids.device)[:, None] * T + at
                z = d.lm_head(d.norm(hs.reshape(-1, hs.shape[-1])))
                ce, top = soft_ce(z, tflat, flat.reshape(-1), top=stats)
                ce = ce.view(m.shape) * m
                ok = (top.view(m.shape) == targ.gather(1, at)) & m if stats else None
            loss = loss + (self.decay**i) * ce.sum() / denom[i].clamp(min=1) * scale
            with torch.no_grad():
                out[i, 0] = ce.sum().detach()
                if ok is None:
                    continue
                out[i, 1:5], prefix = _step_counts(ok, m, prefix)
                if masks_all is not None:
                    out[i, 5:], prefix_all = _step_counts(ok, masks_all[i], prefix_all)
        return loss, out


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
    taus = simulated_tau_curve(a)
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
        taus_all = simulated_tau_curve(a_all)
        out.update(
            acc_all=(st[:, 5] / st[:, 6].clamp(min=1)).tolist(),
            a_all=a_all,
            tau_all=taus_all[-1] if taus_all else 1.0,
            in_vocab=float(st[0, 2] / st[0, 6].clamp(min=1)),
        )
    return out
