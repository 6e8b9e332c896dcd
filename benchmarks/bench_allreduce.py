"""All-reduce latency and bandwidth at the verify and decode steps' message sizes.

Run under torchrun: `torchrun --nproc-per-node 2 benchmarks/bench_allreduce.py` (gloo on CPU,
NCCL on GPUs). Sizes default to batch x tokens x hidden x dtype bytes over batches and
tokens per request (1 = plain decode, N = a verify of N draft tokens), for the embedded
target's hidden size (576); `--sizes` gives bytes directly. Rank 0 prints a table
(latency, nccl-tests' algbw and busbw = algbw * 2(n-1)/n), writes `--json` (rows + comm
facts: NCCL version, driver, `nvidia-smi topo -m`, NCCL_* env) and ends with
`RESULT backend=<gloo|nccl> world=<n> small_us=<latency at the verify size> ...`.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from workbench.experiments.allreduce import (
    comm_facts,
    decode_bytes,
    message_sizes,
    result_line,
    run_benchmark,
    verify_bytes,
)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    ap.add_argument("--hidden", type=int, default=576, help="target hidden size")
    ap.add_argument("--dtype-bytes", type=int, default=2, help="2 = bf16/fp16 activations")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--tokens", default="1,4,8,16", help="tokens per request (1 = decode)")
    ap.add_argument("--verify-batch", type=int, default=1)
    ap.add_argument("--verify-tokens", type=int, default=8, help="num_draft_tokens of the RESULT")
    ap.add_argument("--sizes", default="", help="message sizes in bytes (overrides the grid)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default="", help="write rows + facts here (rank 0)")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc-per-node 2 " + __file__)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        vb = verify_bytes(args.verify_batch, args.verify_tokens, args.hidden, args.dtype_bytes)
        db = decode_bytes(args.verify_batch, args.hidden, args.dtype_bytes)
        if args.sizes:
            sizes = sorted(set(ints(args.sizes)))
        else:
            sizes = message_sizes(args.hidden, args.dtype_bytes, ints(args.batches),
                                  ints(args.tokens))  # fmt: skip
            sizes = sorted(set(sizes) | {vb, db})
        rows = run_benchmark(sizes, args.iters, args.warmup)
        if rank == 0:
            facts = comm_facts()
            print(f"backend {backend}, world {world}, {args.iters} iters, torch {facts['torch']}"
                  f", nccl {facts.get('nccl', '-')}")  # fmt: skip
            print(f"{'bytes':>10}{'latency us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}")
            for r in rows:
                print(f"{r['bytes']:>10}{r['us']:>12.1f}{r['algbw_GBps']:>12.4f}"
                      f"{r['busbw_GBps']:>12.4f}")  # fmt: skip
            if args.json:
                from workbench.fsutil import atomic_write_json

                atomic_write_json(args.json, {"backend": backend, "world": world, "rows": rows,
                                              "verify_bytes": vb, "decode_bytes": db,
                                              "facts": facts, "iters": args.iters})  # fmt: skip
            print(result_line(rows, backend, world, vb, db), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
