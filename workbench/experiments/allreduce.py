"""All-reduce microbenchmark (torch.distributed under torchrun) and a TP-scaling model.

Tensor parallelism all-reduces each layer's attention and MLP outputs: two all-reduces per
layer, each of batch x tokens x hidden x dtype bytes. A verify step sends `num_draft_tokens`
tokens per request, a plain decode step one. Those messages are small (KBs), where latency,
not bandwidth, rules, which is why EAGLE's speedup can shrink as TP grows (SGLang #6949).

Bandwidths follow nccl-tests (doc/PERFORMANCE.md): algbw = bytes / time; for all-reduce
busbw = algbw * 2 (n - 1) / n, the per-link rate comparable across world sizes.

Run the benchmark with `torchrun --nproc-per-node N benchmarks/bench_allreduce.py`: NCCL on
GPUs, gloo on CPUs (gloo takes float32 buffers of the same byte size).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Published small-message all-reduce latencies (µs by message bytes), from elsewhere.
PUBLISHED = {
    "sglang-custom-ar-h100-tp8": {
        "points": [(512, 5.9), (32 * 1024, 7.8), (256 * 1024, 16.7), (1024 * 1024, 33.8)],
        "world": 8,
        "source": "published: SGLang custom all-reduce, H100, TP=8 (sglang #2904)",
    },
    "nccl-h100-tp8": {
        "points": [(1024, 33.0), (32 * 1024, 33.0)],
        "world": 8,
        "source": "published: plain NCCL all-reduce ~33 us flat 1-32 KB, TP=8 (NCCL #2094)",
    },
}


def verify_bytes(batch: int, draft_tokens: int, hidden: int, dtype_bytes: int = 2) -> int:
    """Bytes of one verify-step all-reduce: batch x draft tokens x hidden x dtype bytes."""
    return batch * draft_tokens * hidden * dtype_bytes


def decode_bytes(batch: int, hidden: int, dtype_bytes: int = 2) -> int:
    """Bytes of one plain decode-step all-reduce (one token per request)."""
    return verify_bytes(batch, 1, hidden, dtype_bytes)


def message_sizes(
    hidden: int,
    dtype_bytes: int = 2,
    batches: Sequence[int] = (1, 4, 16, 64),
    draft_tokens: Sequence[int] = (1, 4, 8, 16),
) -> list[int]:
    """Sorted distinct sizes around decode (draft_tokens 1) and verify steps."""
    return sorted({verify_bytes(b, t, hidden, dtype_bytes) for b in batches for t in draft_tokens})


def bus_bandwidth(algbw: float, world: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw * 2 (n - 1) / n."""
    return algbw * 2 * (world - 1) / world


# ---------------------------------------------------------------- measuring (inside torchrun)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_allreduce(nbytes: int, device: torch.device, iters: int, warmup: int) -> float:
    """Seconds per all-reduce of `nbytes` (the slowest rank's mean over `iters`)."""
    import torch.distributed as dist

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elem = max(1, nbytes // (torch.finfo(dtype).bits // 8))
    x = torch.ones(elem, dtype=dtype, device=device)
    for _ in range(warmup):
        dist.all_reduce(x)
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    _sync(device)
    dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    if device.type == "cuda":
        dt = dt.to(device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt.item())


def run_benchmark(sizes: Sequence[int], iters: int = 50, warmup: int = 5) -> list[dict]:
    """Latency, algbw and busbw per size, in an initialized process group."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    else:
        device = torch.device("cpu")
    rows = []
    for n in sizes:
        s = time_allreduce(int(n), device, iters, warmup)
        algbw = n / s / 1e9
        rows.append({"bytes": int(n), "us": s * 1e6, "algbw_GBps": algbw,
                     "busbw_GBps": bus_bandwidth(algbw, world)})  # fmt: skip
    return rows


def comm_facts() -> dict:
    """Facts for the run manifest: `provenance.accelerator_facts` (GPUs, CUDA, NCCL version,
    driver) plus the topology (`nvidia-smi topo -m`) and the NCCL_* environment."""
    from workbench.provenance import accelerator_facts

    out: dict = {"torch": torch.__version__, **accelerator_facts()}
    if smi := shutil.which("nvidia-smi"):
        r = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30)
        out["topology"] = r.stdout.strip() if r.returncode == 0 else f"failed: {r.stderr.strip()}"
    out["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    return out


# ---------------------------------------------------------------- latency model


@dataclass
class LatencyModel:
    """us(bytes, n) = alpha * (n - 1) / (world - 1) + bytes * 2 (n - 1) / n / busbw.

    Fitted at one world size; the latency term is scaled like a ring's 2 (n - 1) steps to
    other sizes (an assumption: NCCL's tree/LL protocols grow slower), `source` says where
    the points came from."""

    alpha_us: float
    busbw_GBps: float
    world: int
    source: str

    def us(self, nbytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        lat = self.alpha_us * (n - 1) / max(self.world - 1, 1)
        bw = nbytes * 2 * (n - 1) / n / (self.busbw_GBps * 1e9) * 1e6 if self.busbw_GBps > 0 else 0
        return lat + bw


def fit_latency(points: Sequence[tuple[float, float]], world: int, source: str) -> LatencyModel:
    """Least squares of us = alpha + bytes * 2 (n - 1) / n / busbw over (bytes, us) points."""
    x = np.array([[1.0, b * 2 * (world - 1) / world] for b, _ in points])
    y = np.array([u for _, u in points])
    (alpha, inv), *_ = np.linalg.lstsq(x, y, rcond=None)
    alpha = max(float(alpha), 0.0) if len(points) > 1 else float(y[0])
    busbw = 1e6 / float(inv) / 1e9 if inv > 0 else math.inf
    return LatencyModel(alpha, busbw if math.isfinite(busbw) else 0.0, world, source)


def measured_latency(rows: Sequence[dict], world: int, backend: str) -> LatencyModel:
    return fit_latency([(r["bytes"], r["us"]) for r in rows], world,
                       f"measured here: {backend}, {world} ranks")  # fmt: skip


def published_latency(name: str) -> LatencyModel:
    p = PUBLISHED[name]
    return fit_latency(p["points"], p["world"], p["source"])


# ---------------------------------------------------------------- TP scaling


def tp_scaling(
    compute_ms_tp1: float,
    n_layers: int,
    message_bytes: int,
    latency: LatencyModel | Callable[[float, int], float],
    tps: Sequence[int] = (1, 2, 4, 8),
    allreduces_per_layer: int = 2,
) -> list[dict]:
    """Predicted verify (or decode) step time vs TP size.

    step(tp) = compute_ms_tp1 / tp (ideal split of the matmuls) + n_layers x
    allreduces_per_layer x allreduce(message_bytes, tp). Speedup is step(1) / step(tp);
    `comm_share` shows where communication overtakes compute (> 0.5)."""
    lat = latency.us if isinstance(latency, LatencyModel) else latency
    rows = []
    for tp in tps:
        comp = compute_ms_tp1 / tp
        comm = n_layers * allreduces_per_layer * lat(message_bytes, tp) / 1e3
        rows.append({"tp": tp, "compute_ms": comp, "comm_ms": comm, "step_ms": comp + comm})
    base = rows[0]["step_ms"] if rows and rows[0]["tp"] == 1 else compute_ms_tp1
    for r in rows:
        r["speedup"] = base / r["step_ms"]
        r["comm_share"] = r["comm_ms"] / r["step_ms"]
    return rows


def crossover_tp(rows: Sequence[dict]) -> int | None:
    """The smallest TP size where communication takes longer than compute (None: never)."""
    return next((r["tp"] for r in rows if r["comm_ms"] > r["compute_ms"]), None)


def spec_speedup_vs_tp(
    *,
    tau: float,
    decode_compute_ms: float,
    verify_compute_ms: float,
    draft_ms: float,
    n_layers: int,
    batch: int,
    draft_tokens: int,
    hidden: int,
    latency: LatencyModel,
    dtype_bytes: int = 2,
    tps: Sequence[int] = (1, 2, 4, 8),
) -> list[dict]:
    """EAGLE's speedup over plain decoding vs TP size (#6949's question, on paper).

    plain step(tp) and verify(tp) from `tp_scaling` at the decode and verify message sizes;
    a cycle adds the draft's own time (one layer, taken as not split). speedup = tau x
    plain step / (draft + verify). Compute times are at TP=1."""
    plain = tp_scaling(decode_compute_ms, n_layers, decode_bytes(batch, hidden, dtype_bytes),
                       latency, tps)  # fmt: skip
    ver = tp_scaling(verify_compute_ms, n_layers,
                     verify_bytes(batch, draft_tokens, hidden, dtype_bytes), latency, tps)  # fmt: skip
    return [
        {
            "tp": p["tp"],
            "plain_ms": p["step_ms"],
            "verify_ms": v["step_ms"],
            "cycle_ms": draft_ms + v["step_ms"],
            "spec_speedup": tau * p["step_ms"] / (draft_ms + v["step_ms"]),
        }  # fmt: skip
        for p, v in zip(plain, ver, strict=True)
    ]


def result_line(rows: Sequence[dict], backend: str, world: int, verify: int, decode: int) -> str:
    """`RESULT backend=... world=... small_us=<latency at the verify size> ...`."""

    def at(n: int) -> dict:
        return min(rows, key=lambda r: abs(r["bytes"] - n))

    big = max(rows, key=lambda r: r["bytes"])
    return (
        f"RESULT backend={backend} world={world} small_us={at(verify)['us']:.1f} "
        f"verify_bytes={at(verify)['bytes']} decode_us={at(decode)['us']:.1f} "
        f"decode_bytes={at(decode)['bytes']} max_bytes={big['bytes']} "
        f"max_busbw_GBps={big['busbw_GBps']:.3f}"
    )
