"""Capture cost vs a plain forward on the same conversations, measured in one run.

Plain = the target's base model over the same padded batches, no hooks, nothing stored.
Capture = hooks + bf16 copies + norm statistics + shard writes (workbench.capture.capture).
A ratio near 1 means capture adds little beyond the forward it must run anyway.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from workbench.capture import CaptureConfig, _pack_batches, capture
from workbench.data import encode_conversation, load_mtbench
from workbench.layers import default_layer_ids
from workbench.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument(
        "--n", type=int, default=48, help="conversations (MT-bench first turns + a filler answer)"
    )
    ap.add_argument("--dtype", default="float32", help="target compute dtype")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    args = ap.parse_args()

    t = load_target(args.target, dtype=args.dtype)
    answer = "Here is a careful answer. " * 12
    convs = [
        [{"role": "user", "content": p.turns[0]}, {"role": "assistant", "content": answer}]
        for p in load_mtbench()[: args.n]
    ]
    enc = [encode_conversation(t.tokenizer, c, 1024) for c in convs]
    tokens = sum(len(e[0]) for e in enc)
    batches = _pack_batches([len(e[0]) for e in enc], args.batch_tokens)

    def plain() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for b in batches:
                T = max(len(enc[i][0]) for i in b)
                ids = torch.zeros((len(b), T), dtype=torch.long)
                att = torch.zeros((len(b), T), dtype=torch.long)
                for r, i in enumerate(b):
                    ids[r, : len(enc[i][0])] = torch.tensor(enc[i][0])
                    att[r, : len(enc[i][0])] = 1
                t.model.model(input_ids=ids, attention_mask=att, use_cache=False)
        return time.perf_counter() - t0

    def cap() -> float:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            capture(
                t,
                convs,
                d,
                CaptureConfig(
                    default_layer_ids(t.num_layers),
                    batch_tokens=args.batch_tokens,
                    samples_per_shard=len(convs),
                ),
                progress=False,
            )
            return time.perf_counter() - t0

    plain()  # warm-up
    p1, c1, p2, c2 = plain(), cap(), plain(), cap()  # interleaved to share machine noise
    tp, tc = min(p1, p2), min(c1, c2)
    print(f"{'mode':<10}{'seconds':>10}{'tok/s':>10}")
    print(f"{'plain':<10}{tp:>10.2f}{tokens / tp:>10.0f}")
    print(f"{'capture':<10}{tc:>10.2f}{tokens / tc:>10.0f}")
    print(
        f"tokens={tokens} conversations={len(convs)} dtype={args.dtype} threads={torch.get_num_threads()}"
    )
    print(
        f"RESULT capture_tok_s={tokens / tc:.0f} plain_tok_s={tokens / tp:.0f} "
        f"capture_over_plain={tc / tp:.2f} dtype={args.dtype}"
    )


if __name__ == "__main__":
    main()
