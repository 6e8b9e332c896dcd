"""The draft's attention for the training-time test (TTT): per-step K/V, the step-i attention
(causal over the step-0 keys plus the same-position keys of steps 1..i), and the packed-row
variants that keep every score inside its sample.

Step i attends the causal step-0 keys plus one key per earlier step at its own position, so
scores against step 0 are a [T, T] block and against later steps a diagonal (one dot product
per position): each step costs O(T^2) once instead of a [T, (i+1)T] mask (SpecForge's trick).
`ttt_attention_reference` is the first formulation, kept (`TTTKV(reference=True)`) as the
baseline for tests and benchmarks/bench_train.py. `model.Attention` calls into this module.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class TTTKV(list):
    """The per-step (k, v) of one TTT unroll; `reference=True` selects
    `ttt_attention_reference` (the baseline) instead of `ttt_attention`.

    Packed rows (several samples end to end in one row, `data.collate_packed`) set `starts`
    [B, T] (the row index where each position's sample begins) and `segments` (per row, the
    (begin, end) of each sample): attention then stays inside a sample, exactly as if each
    sample were a row of its own."""

    def __init__(
        self,
        reference: bool = False,
        starts: torch.Tensor | None = None,
        segments: list[list[tuple[int, int]]] | None = None,
    ) -> None:
        super().__init__()
        self.reference, self.starts, self.segments = reference, starts, segments


def packed_segments(position_ids: torch.Tensor) -> tuple[torch.Tensor, list[list[tuple[int, int]]]]:
    """(starts [B, T], segments) of packed rows whose position ids restart at 0 per sample."""
    B, T = position_ids.shape
    starts = torch.arange(T, device=position_ids.device)[None] - position_ids
    segments = []
    for row in position_ids.cpu():
        begins = (row == 0).nonzero().flatten().tolist()
        segments.append(list(zip(begins, begins[1:] + [T], strict=True)))
    return starts, segments


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[list[tuple[int, int]]]
) -> torch.Tensor:
    """Causal attention within each (begin, end) segment of each row: one SDPA call per sample,
    so no [T, T] mask and no scores across samples are computed (a packed 1 x 1024 row of ~4
    samples: 24-36 vs 80-83 ms forward + backward with a block-diagonal mask, fp32, 2 cores of
    a Zen 4 EPYC; 57-60 ms for plain causal attention over the whole row)."""
    rep = q.shape[1] // k.shape[1]
    rows = []
    for b, segs in enumerate(segments):
        parts = [
            F.scaled_dot_product_attention(
                q[b : b + 1, :, a:e], k[b : b + 1, :, a:e], v[b : b + 1, :, a:e],
                is_causal=e - a > 1, enable_gqa=rep > 1,
            )
            for a, e in segs
        ]  # fmt: skip
        rows.append(torch.cat(parts, 2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, 0) if len(rows) > 1 else rows[0]


def _ttt_causal(
    T: int,
    qpos: torch.Tensor | None,
    device: torch.device,
    starts_q: torch.Tensor | None = None,
    lo: int = 0,
) -> torch.Tensor:
    """Which step-0 keys each query sees: [T, T] (query t: keys <= t) or [B, 1, 1, Q, T].

    The keys are row positions lo .. lo+T-1. With `starts_q` (packed rows: where each query's
    sample begins, [B, Q]), a query sees only the keys of its own sample: [B, 1, 1, Q, T]."""
    keys = torch.arange(lo, lo + T, device=device)
    if qpos is None:
        m = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        if starts_q is None:
            return m
        return (m[None] & (keys[None, None, :] >= starts_q[:, :, None]))[:, None, None]
    m = keys[None, None, :] <= qpos[:, :, None]
    if starts_q is not None:
        m = m & (keys[None, None, :] >= starts_q[:, :, None])
    return m[:, None, None]


def _starts_at(kv: list, qpos: torch.Tensor | None) -> torch.Tensor | None:
    """Where each query's sample begins (packed rows), or None (one sample per row)."""
    starts = getattr(kv, "starts", None)
    if starts is None or qpos is None:
        return starts
    return starts.gather(1, qpos)


def ttt_attention(
    q: torch.Tensor,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    qpos: torch.Tensor | None = None,
    chunks: int = 4,
) -> torch.Tensor:
    """Step-i attention: causal over step-0 keys + diagonal over steps 1..i keys.

    Same contract and math as `ttt_attention_reference`, with fewer passes over the [Q, T]
    score block (the cost of a sampled unroll step): the scale is folded into q (1/8 for
    head_dim 64: exact), the softmax writes fp32 straight from the low-precision scores
    (no separate upcast copy), and the result is split rather than sliced (no zero-filled
    slice gradients); the diagonal terms run as one stacked [.., i] block. Sampled queries
    (sorted `qpos`) go in `chunks` groups, each against the step-0 keys up to its last
    position only: the keys past it are masked for every query of the group anyway.
    """
    Q = q.shape[2]
    sq = _starts_at(kv, qpos)
    if qpos is None or chunks <= 1 or Q < 2 * chunks:
        return _ttt_attention_block(q, kv, qpos, sq)
    outs = []
    for a in range(0, Q, -(-Q // chunks)):
        b = min(Q, a - (-Q // chunks))
        n_keys = int(qpos[:, b - 1].max()) + 1
        # packed rows: the group's queries see no key before its first query's sample
        lo = 0 if sq is None else int(sq[:, a].min())
        part = [(kv[0][0][:, :, lo:n_keys], kv[0][1][:, :, lo:n_keys])]
        part += [(k[:, :, a:b], v[:, :, a:b]) for k, v in kv[1:]]
        s_ab = None if sq is None else sq[:, a:b]
        outs.append(_ttt_attention_block(q[:, :, a:b], part, qpos[:, a:b], s_ab, lo))
    return torch.cat(outs, 2)


def _ttt_attention_block(
    q: torch.Tensor,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    qpos: torch.Tensor | None,
    starts_q: torch.Tensor | None = None,
    lo: int = 0,
) -> torch.Tensor:
    B, nh, Q, hd = q.shape
    k0, v0 = kv[0]
    nkv, T = k0.shape[1], k0.shape[2]
    g, n = nh // nkv, len(kv) - 1
    qg = (q * (1.0 / math.sqrt(hd))).view(B, nkv, g, Q, hd)
    s0 = torch.matmul(qg, k0[:, :, None].transpose(-1, -2))  # [B, nkv, g, Q, T]
    s0 = s0.masked_fill(~_ttt_causal(T, qpos, q.device, starts_q, lo), float("-inf"))
    kd = torch.stack([kj for kj, _ in kv[1:]], -2)  # [B, nkv, Q, i, hd]
    diag = torch.matmul(qg.unsqueeze(-2), kd[:, :, None].transpose(-1, -2)).squeeze(-2)
    p = torch.cat([s0, diag], -1).softmax(-1, dtype=torch.float32).to(q.dtype)
    p0, pd = p.split([T, n], -1)
    vd = torch.stack([vj for _, vj in kv[1:]], -2)  # [B, nkv, Q, i, hd]
    out = torch.matmul(p0, v0[:, :, None]) + torch.matmul(pd.unsqueeze(-2), vd[:, :, None]).squeeze(
        -2
    )
    return out.reshape(B, nh, Q, hd)


def ttt_attention_reference(
    q: torch.Tensor,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    qpos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Step-i attention: causal over step-0 keys + diagonal over steps 1..i keys.

    q [B, nh, Q, hd]; kv[0] = step-0 (k, v) [B, nkv, T, hd]; kv[j>0] [B, nkv, Q, hd], kv[-1]
    is this step's own. Without `qpos`, Q = T and query t is position t. With `qpos` [B, Q],
    the queries are the unrolls of positions qpos only (subsampled TTT): each still sees the
    step-0 keys <= its position and its own chain, so the result equals the full unroll's
    rows at those positions. GQA: q is viewed as [B, nkv, g, Q, hd] (no K/V repeat copies).
    Packed rows (`kv.starts`): a query sees the step-0 keys of its own sample only.
    """
    B, nh, Q, hd = q.shape
    k0, v0 = kv[0]
    nkv, T = k0.shape[1], k0.shape[2]
    g = nh // nkv
    qg = q.view(B, nkv, g, Q, hd)
    scale = 1.0 / math.sqrt(hd)
    s0 = torch.matmul(qg, k0[:, :, None].transpose(-1, -2)) * scale  # [B, nkv, g, Q, T]
    s0 = s0.masked_fill(~_ttt_causal(T, qpos, q.device, _starts_at(kv, qpos)), float("-inf"))
    diag = [(qg * kj[:, :, None]).sum(-1, keepdim=True) * scale for kj, _ in kv[1:]]
    p = torch.cat([s0, *diag], dim=-1).float().softmax(-1).to(q.dtype)  # [B, nkv, g, Q, T+i]
    out = torch.matmul(p[..., :T], v0[:, :, None])
    for j, (_, vj) in enumerate(kv[1:]):
        out = out + p[..., T + j : T + j + 1] * vj[:, :, None]
    return out.view(B, nh, Q, hd)
