"""The training presets: what `workbench train --profile quick|full` and the pipeline run.

Defined by epochs, never by time, so the same inputs give the same draft on any machine. The
comments record what each choice was measured against.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # 12 passes over the ~100K-token quick capture (~11 min of training on 2 idle cores)
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
        batch_size=4,  # evaluation batches; training steps are packed rows (below)
        max_len=1024,
        # one row of 1024 tokens a step, whole samples end to end (~4 samples: about batch 4's
        # steps per epoch): on the Zen 3 EPYC's quick capture (fp32) 1.09x tok/s in the loop
        # (966-971 vs 884-889, runs in turn), held out 0.395 / 1.667 vs 0.395 / 1.651 (same
        # split and seed)
        pack_rows=1,
        # 12 epochs (1,140 steps) once shape-stable batches made a step ~1.5x faster: 0.403 /
        # 1.65 held out vs 0.370 / 1.59 at 7 epochs, 11 min of training in the pipeline vs 8.6
        epochs=12,
        warmup=0.03,
        eval_every=100,
        ckpt_every=100,
        # ~5K distinct assistant tokens in the quick capture; 8192 (same steps, 18% slower)
        # lost on the neutral MT-bench capture: acc0 0.378 vs 0.403, MT-bench tau 1.39 vs 1.41
        draft_vocab_size=4096,
        init_layer=None,
        # a random lm_head beat one initialised from the target's rows at 665 steps, 2 seeds,
        # scored on 80 held-out prompts (benchmarks/bench_levers.py): acc0 0.373 vs 0.368,
        # sim tau 1.59 vs 1.57, HumanEval tau 1.47 vs 1.42, MT-bench tau 1.34 vs 1.34
        init_lm_head=False,
        # bf16 autocast (fp32 master weights) where bf16 is native: ~1.7x tokens/s on an
        # avx512_bf16 CPU; fp32 elsewhere (bf16 there is 3.6x slower: workbench.target.native_bf16)
        amp="auto",
    ),
    # the training part of the pipeline's `full` run: TTT-5 for the 5-step chain of the goal.
    # Measured on the full capture (647K tokens), 10 min each: TTT-5 lr 2e-3 all positions
    # 0.269 acc0 / sim tau 1.34; unrolling 1/4 of the positions past step 0 (2.4x tokens/s)
    # 0.354 / 1.51; + loss on user turns too 0.357 / 1.52; + lr 4e-3 0.362 / 1.54
    "full": dict(
        ttt_len=5,
        ttt_sample=0.25,
        loss_on="all",
        lr=4e-3,
        batch_size=8,
        max_len=1536,
        # 6 epochs (1,428 steps on the 553K-token capture, 33 min end to end) once shape-stable
        # batches made a step faster: 0.481 / 1.86 held out vs 0.440 / 1.76 at 4 epochs (22 min)
        # Packed rows stay off: on the Zen 3 EPYC's 551K-token full capture (fp32), 2 rows of
        # 1536 a step ran 1.17x tok/s (bench_train --capture, alternating) and 983 vs 614 tok/s
        # in the loop (separate days), but 6 epochs are then 1,044 steps: 0.480 / 1.84 held out
        # vs 0.502 / 1.92 padded (same split, seed). Equal-wall-time epochs are not measured yet.
        epochs=6,
        warmup=0.03,
        eval_every=200,
        ckpt_every=200,
        draft_vocab_size=8192,
        init_layer=None,
        amp="auto",
    ),
}
