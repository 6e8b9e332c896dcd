"""Training throughput and TTT overhead on a synthetic batch with the embedded default's shapes.

SmolLM2-135M shapes (H 576, 9 heads / 3 KV heads, MLP 1536), 3 aux layers, 8K draft vocab.
Prints tokens/s of a full training step (target logits + TTT-7 forward/backward + AdamW) and
the cost of one TTT-7 forward+backward relative to a single-step one (goal: <= 8x, i.e. the
unroll adds no waste beyond its 7 steps). Last line: `RESULT train_tok_s=... ttt_cost_ratio=...`.
"""

from __future__ import annotations

import argparse
import time

import torch

from workbench.draft.model import DraftConfig, Eagle3Draft
from workbench.draft.ttt import TTTModel, unroll_masks
from workbench.layers import LayerIds


def smollm2_config(draft_vocab: int) -> DraftConfig:
    return DraftConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        draft_vocab_size=draft_vocab,
        target_hidden_size=576,
        layer_ids=LayerIds((1, 14, 26)),
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
    )


def timed_min(fns: list, reps: int) -> list[float]:
    """Min wall time per fn over interleaved reps: robust to other processes on a shared CPU."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for j, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[j] = min(best[j], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--ttt-sample", type=float, default=0.25)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--amp", choices=["off", "bf16"], default="off")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = smollm2_config(args.vocab)
    draft = Eagle3Draft(cfg)
    draft.set_vocab(torch.arange(args.vocab) * (49152 // args.vocab))
    draft.embed_tokens.normal_(0, 0.02)
    B, T, H = args.batch, args.seq, 576
    batch = {
        "input_ids": torch.randint(0, 49152, (B, T)),
        "loss_mask": torch.ones(B, T, dtype=torch.bool),
        "in_vocab": torch.ones(B, T, dtype=torch.bool),
        "aux_hidden": torch.randn(B, T, 3 * H),
        "last_hidden": torch.randn(B, T, H),
    }
    head_rows = torch.randn(args.vocab, H) * 0.02
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    amp = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        if args.amp == "bf16"
        else (lambda: torch.autocast("cpu", enabled=False))
    )

    def masks_for(n: int, frac: float):
        masks, idx = unroll_masks(batch, n, frac)
        return masks, idx, torch.stack([m.sum() for m in masks]).float()

    def fwd_bwd(n: int, frac: float = 1.0):
        model = TTTModel(draft, n, 0.8)
        masks, idx, denom = masks_for(n, frac)

        def run():
            tl = batch["last_hidden"] @ head_rows.T
            with amp():
                loss, _ = model(batch, tl, masks, denom, idx=idx)
            loss.backward()
            draft.zero_grad(set_to_none=True)

        return run

    def train_step(frac: float = 1.0):
        model = TTTModel(draft, args.ttt, 0.8)
        masks, idx, denom = masks_for(args.ttt, frac)

        def run():
            tl = batch["last_hidden"] @ head_rows.T
            with amp():
                loss, _ = model(batch, tl, masks, denom, idx=idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
            opt.step()

        return run

    print(
        f"shapes: batch {B} x seq {T}, H {H}, 3 aux layers, draft vocab {args.vocab}, TTT-{args.ttt}, "
        f"amp {args.amp}, threads {torch.get_num_threads()}"
    )
    f = args.ttt_sample
    t1, tn, ts, tns, tss = timed_min(
        [fwd_bwd(1), fwd_bwd(args.ttt), train_step(), fwd_bwd(args.ttt, f), train_step(f)],
        args.reps,
    )
    tok_s, tok_s_f = B * T / ts, B * T / tss
    print(
        f"single-step fwd+bwd: {t1 * 1000:.0f} ms   TTT-{args.ttt} fwd+bwd: {tn * 1000:.0f} ms   "
        f"ratio {tn / t1:.2f}x (goal <= 8x)"
    )
    print(
        f"full training step (target logits + TTT-{args.ttt} + AdamW): {ts * 1000:.0f} ms, {tok_s:.0f} tok/s"
    )
    print(
        f"with {f:g} of positions unrolled past step 0: TTT-{args.ttt} fwd+bwd {tns * 1000:.0f} ms "
        f"(ratio {tns / t1:.2f}x), full training step {tss * 1000:.0f} ms, {tok_s_f:.0f} tok/s "
        f"({tok_s_f / tok_s:.2f}x)"
    )
    print(
        f"RESULT train_tok_s={tok_s:.1f} ttt_cost_ratio={tn / t1:.2f} "
        f"sampled_train_tok_s={tok_s_f:.1f} sampled_ttt_cost_ratio={tns / t1:.2f} ttt_sample={f:g}"
    )


if __name__ == "__main__":
    main()
