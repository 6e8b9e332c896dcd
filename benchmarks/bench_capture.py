"""Capture cost vs a plain forward on the same conversations, measured in one run.

Plain = the target's base model over the same padded batches, no hooks, nothing stored.
Capture = hooks + bf16 copies + norm statistics + shard writes (workbench.capture.capture).
A ratio near 1 means capture adds little beyond the forward it must run anyway.

`--verify DIR` instead measures what opening an existing capture for training costs with
sha256 verification (the default) against without, next to one pass reading every sample.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from workbench.capture import CaptureConfig, CaptureReader, _pack_batches, capture
from workbench.chat import encode_conversation
from workbench.data import load_mtbench
from workbench.layers import default_layer_ids
from workbench.target import load_target


def verify_cost(path: str) -> None:
    """Seconds to open a capture with and without verification, and to read it once."""

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    t_verify_first, r = timed(lambda: CaptureReader(path, verify=True))
    t_verify, _ = timed(lambda: CaptureReader(path, verify=True))
    t_open, _ = timed(lambda: CaptureReader(path, verify=False))
    t_epoch, _ = timed(lambda: sum(int(s["aux_hidden"].shape[0]) for s in r))
    size = sum((r.path / e["file"]).stat().st_size for e in r.manifest["shards"])
    print(f"{path}: {len(r.manifest['shards'])} shards, {size / 1e6:.1f} MB, {len(r)} samples")
    print(f"open without verification {t_open:.3f}s; with: {t_verify_first:.2f}s first, "
          f"{t_verify:.2f}s again ({size / 1e9 / t_verify:.2f} GB/s); one read pass {t_epoch:.2f}s")  # fmt: skip
    print(
        f"RESULT verify_s={t_verify:.2f} verify_first_s={t_verify_first:.2f} "
        f"open_s={t_open:.3f} read_pass_s={t_epoch:.2f} capture_mb={size / 1e6:.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument(
        "--n", type=int, default=48, help="conversations (MT-bench first turns + a filler answer)"
    )
    ap.add_argument("--dtype", default="float32", help="target compute dtype")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--verify", default="", metavar="DIR", help="time verifying this capture")
    args = ap.parse_args()
    if args.verify:
        return verify_cost(args.verify)

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
