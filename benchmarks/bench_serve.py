"""Served speed: the same prompts through a server with and without speculation, over HTTP.

    python benchmarks/bench_serve.py --draft DRAFT [--backend local|sglang] [--n 8] ...

With the local backend at concurrency 1, both servers are up at once and the requests alternate
between them, one at a time, the order rotating (`client.run_paired`): a shared machine's drift
then hits both alike (one server after the other, one draft ranged 0.97-1.31x between runs).
Otherwise (SGLang, or concurrency > 1) each server is launched, loaded and torn down in turn,
so the two never compete for the CPU or memory. Prints both summaries and ends in a RESULT
line with tok/s of each, their ratio, the pooled accept length in both conventions, whether
greedy outputs match, and the mode (paired or one after another).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from workbench import metrics
from workbench.serving import client as lc
from workbench.serving.local import LocalConfig
from workbench.serving.session import Served, load_servers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", required=True, help="draft export or training run")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--backend", default="local", choices=("local", "sglang"))
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--steps", default="3/1/4", help="num_steps/eagle_topk/num_draft_tokens")
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="", help="folder for the two results files (default: temp)")
    args = ap.parse_args(argv)
    s, k, n = (int(x) for x in args.steps.split("/"))
    reqs = lc.build_requests(args.prompts, args.n, lc.load_tokenizer(args.target))
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-serve-"))
    servers = {
        "eagle3": Served(LocalConfig(args.target, args.draft, "EAGLE3", s, k, n, args.dtype)),
        "plain": Served(LocalConfig(args.target, dtype=args.dtype)),
    }
    load = dict(max_new_tokens=args.max_new_tokens, concurrency=args.concurrency)
    runs, mode = load_servers(args.backend, servers, load, reqs, out, tp_size=args.tp_size)
    for name, run in runs.items():
        print(f"--- {name} ({mode})\n{lc.format_summary(run)}")
    sp, pl = runs["eagle3"].summary, runs["plain"].summary
    same = sum(a.output_ids == b.output_ids
               for a, b in zip(runs["eagle3"].requests, runs["plain"].requests, strict=True))  # fmt: skip
    print(f"RESULT backend={args.backend} steps={args.steps} n={len(reqs)} mode={mode.split()[0]} "
          f"concurrency={args.concurrency} tok_s_plain={pl['output_tok_s']:.2f} "
          f"tok_s_spec={sp['output_tok_s']:.2f} "
          f"speedup={metrics.speedup(sp['output_tok_s'], pl['output_tok_s']):.3f} "
          f"tau_sglang={sp.get('pooled_tau_sglang', 0):.3f} tau={sp.get('pooled_tau', 0):.3f} "
          f"same_as_plain={same}/{len(reqs)} identities_ok={sp['identities_ok']} "
          f"threads={os.environ.get('OMP_NUM_THREADS', 'default')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
