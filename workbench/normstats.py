"""Per-token L2-norm statistics of hidden states, mergeable across shards and ranks.

Capture records them per aux layer (sums and a log-spaced histogram in each shard's metadata,
merged into the manifest); the norm check and the live wiring check compare served states
against them.
"""

from __future__ import annotations

import torch

HIST_EDGES = torch.logspace(-2, 5, 141)  # token-norm histogram bins (0.01 .. 1e5)


def norm_stats(x: torch.Tensor) -> dict:
    """Mergeable per-token L2-norm statistics of x [T, H] (fp32 sums + histogram)."""
    n = x.float().norm(dim=-1)
    hist = torch.histogram(n.clamp(HIST_EDGES[0], HIST_EDGES[-1]), bins=HIST_EDGES).hist
    return {
        "count": int(n.numel()),
        "sum": float(n.sum()),
        "sumsq": float((n * n).sum()),
        "min": float(n.min()) if n.numel() else None,
        "max": float(n.max()) if n.numel() else None,
        "hist": [int(v) for v in hist.tolist()],
    }


def merge_stats(parts: list[dict]) -> dict:
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
        "p05": hist_quantile(hist, 0.05),
        "p50": hist_quantile(hist, 0.5),
        "p95": hist_quantile(hist, 0.95),
        "hist": hist,
    }


def hist_quantile(hist: list[int], q: float) -> float:
    total, acc = sum(hist), 0
    for i, c in enumerate(hist):
        acc += c
        if acc >= q * total:
            return float((HIST_EDGES[i] * HIST_EDGES[i + 1]).sqrt())
    return float(HIST_EDGES[-1])


def hist_edges() -> list[float]:
    return [float(x) for x in HIST_EDGES]
