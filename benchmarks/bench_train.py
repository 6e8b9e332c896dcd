"""Training throughput of the TTT trainer at the `quick` preset's configuration, before vs after.

SmolLM2-135M shapes (H 576, 9 heads / 3 KV heads, MLP 1536), 3 aux layers, on a synthetic batch
shaped like the quick preset's (batch 4 x 1024 tokens, draft vocab 4096, TTT-5, 1/4 of the
positions unrolled past step 0, bf16 autocast). One training step = target logits (draft-vocab
rows) + TTT forward/backward + grad clip + AdamW. The reference formulation
(`TTTModel(reference=True)`: full-batch target softmax, boolean gathers, log-softmax loss, the
first TTT attention) and the current one run interleaved in ONE process (min of reps: robust to
other load on a shared CPU), on the same batch and sampled positions; their losses must agree.
On a loaded machine use `--threads 1 --clock cpu` (CPU time of one thread, not wall time).

Last line: `RESULT train_tok_s=... ref_train_tok_s=... speedup=... loss_rel_diff=...
ttt_sample=...` (train_tok_s: the current code at the quick configuration). `--cost-ratio` adds
`ttt_cost_ratio`: a full (unsampled) TTT-N forward+backward relative to a single-step one
(goal <= N x: the unroll adds no waste beyond its N steps). `--soft-ce-ab` adds the step with the
C soft-CE vs torch's, `--threads-ab` the C soft-CE on torch's OpenMP threads vs threads of its own,
`--norm-ab` the draft's RMSNorm applying its weight in the input dtype (bf16 out under autocast) vs
the fp32 product it had before (`norm_speedup`; with `--capture`: packed rows both ways, alternating).
`--capture --cache-ab`: the trainer's target logits kept across epochs (`TargetHead.sample_logits`,
`--target-cache-mb`) vs one matmul per batch, timed over the second pass (`cache_speedup`).

`--lengths` measures what a fixed batch hides: real batches change length every step. Fresh
batches of capture-like lengths (log-normal, median 240, at most `--seq`; length-sorted as
`epoch_batches` does) go through the trainer's own `collate`, exact-length (`pad_multiple` 1)
vs padded to multiples of 64 vs padded with `keep_freed_memory` vs packed rows (`pack_rows`:
`--pack-rows` rows of `--seq` tokens a step, whole samples end to end, heap kept as the trainer
does), each in a fresh process (glibc's heap setting is process-wide) after the same 16 warm-up
steps. tok/s counts real tokens, not padding. Last line: `RESULT exact_tok_s=... padded_tok_s=...
padded_keep_tok_s=... packed_tok_s=... speedup=... packed_speedup=...` (padded + kept over
exact, packed over padded + kept). `--batch 8 --vocab 8192 --seq 1536`: the full preset's
batches.

`--capture DIR` does the same on a real capture's samples (not its targets: the in-vocab flags
are random, which only changes which rows count, not the work): the trainer's padded batches
and packed rows, alternating step by step in one process, so a machine whose speed drifts
slows both alike. Last line: `RESULT capture_padded_tok_s=... capture_packed_tok_s=...
packed_speedup=...`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from workbench.draft import soft_ce
from workbench.draft.data import (
    TargetHead,
    collate,
    collate_packed,
    epoch_batches,
    packed_epoch,
)
from workbench.draft.model import DraftConfig, Eagle3Draft, RMSNorm
from workbench.draft.ttt import TTTModel, keep_freed_memory, unroll_masks
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


class StandInTarget(torch.nn.Module):
    """What TargetHead reads of a target (a final norm, the output rows), random, at SmolLM2's
    shapes: the capture benchmark times the trainer's target logits without loading a model."""

    def __init__(self, hidden: int = 576, vocab: int = 49152) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, 1e-5)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        torch.nn.init.normal_(self.head.weight, std=0.02)

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.head


def random_draft(draft_vocab: int) -> Eagle3Draft:
    """A randomly initialised draft at SmolLM2 shapes (draft vocab spread over the target's)."""
    draft = Eagle3Draft(smollm2_config(draft_vocab))
    draft.set_vocab(torch.arange(draft_vocab) * (49152 // draft_vocab))
    draft.embed_tokens.normal_(0, 0.02)
    return draft


def timed_min(fns: list, reps: int, clock=time.perf_counter) -> list[float]:
    """Min time per fn over interleaved reps: robust to other processes on a shared CPU."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for j, fn in enumerate(fns):
            t0 = clock()
            fn()
            best[j] = min(best[j], clock() - t0)
    return best


def under(env: str, m: str, fn):
    """fn run with `env`=m (the soft-CE kernel reloaded: its build depends on the threads env)."""

    def run():
        old = os.environ.get(env)
        os.environ[env] = m
        soft_ce._library.cache_clear()
        try:
            return fn()
        finally:
            if old is None:
                del os.environ[env]
            else:
                os.environ[env] = old
            soft_ce._library.cache_clear()

    return run


def fp32_norm_product(x: torch.Tensor, self) -> torch.Tensor:
    """The draft's RMSNorm before it cast its weight to the input's dtype: under bf16 autocast
    an fp32 weight times the bf16 normalized input gave an fp32 output (the baseline)."""
    dt = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * x.to(dt)


def as_before(change: str | None, fn):
    """fn run with one change undone: "norm" patches back the RMSNorm's fp32 product; None and
    "cache" run the code as it is (the capture loop itself undoes the target-logit cache)."""

    def run():
        if change != "norm":
            return fn()
        saved = RMSNorm.forward
        RMSNorm.forward = lambda self, x: fp32_norm_product(x, self)
        try:
            return fn()
        finally:
            RMSNorm.forward = saved

    return run


def change_ab(change: str, step, loss, tokens: int, reps: int, clock) -> str:
    """The current step vs the same step with `change` undone (`as_before`), interleaved."""
    with torch.no_grad():
        l_n, l_o = as_before(None, loss)(), as_before(change, loss)()
    t_n, t_o = timed_min([as_before(None, step), as_before(change, step)], reps, clock)
    print(
        f"{change}: now {t_n * 1000:.0f} ms ({tokens / t_n:.0f} tok/s), before "
        f"{t_o * 1000:.0f} ms ({tokens / t_o:.0f} tok/s), {t_o / t_n:.2f}x; loss "
        f"{l_n:.6f} / {l_o:.6f}"
    )
    return (
        f" {change}_now_tok_s={tokens / t_n:.1f} {change}_before_tok_s={tokens / t_o:.1f} "
        f"{change}_speedup={t_o / t_n:.2f} {change}_loss_rel_diff={abs(l_n - l_o) / abs(l_o):.1e}"
    )


def soft_ce_ab(step, loss, tokens: int, reps: int, clock) -> str:
    """The current training step with `WORKBENCH_SOFT_CE=c` vs `=torch`, interleaved."""
    with torch.no_grad():
        l_c, l_t = under(soft_ce.ENV, "c", loss)(), under(soft_ce.ENV, "torch", loss)()
    t_c, t_t = timed_min([under(soft_ce.ENV, "c", step), under(soft_ce.ENV, "torch", step)],
                         reps, clock)  # fmt: skip
    print(
        f"soft-CE: C {t_c * 1000:.0f} ms ({tokens / t_c:.0f} tok/s), torch {t_t * 1000:.0f} ms "
        f"({tokens / t_t:.0f} tok/s), {t_t / t_c:.2f}x; loss C {l_c:.6f} torch {l_t:.6f}"
    )
    return (
        f" soft_ce_c_tok_s={tokens / t_c:.1f} soft_ce_torch_tok_s={tokens / t_t:.1f} "
        f"soft_ce_speedup={t_t / t_c:.2f} soft_ce_loss_rel_diff={abs(l_c - l_t) / abs(l_t):.1e}"
    )


def threads_ab(step, loss, tokens: int, reps: int, clock) -> str:
    """The current step with the C soft-CE on torch's OpenMP threads vs threads of its own
    (`WORKBENCH_KERNEL_THREADS` auto / own), interleaved; the losses must be the same."""
    env = "WORKBENCH_KERNEL_THREADS"
    with torch.no_grad():
        l_o, l_p = under(env, "auto", loss)(), under(env, "own", loss)()
    t_o, t_p = timed_min([under(env, "auto", step), under(env, "own", step)], reps, clock)
    print(
        f"soft-CE threads: torch's OpenMP {t_o * 1000:.0f} ms ({tokens / t_o:.0f} tok/s), own "
        f"{t_p * 1000:.0f} ms ({tokens / t_p:.0f} tok/s), {t_p / t_o:.2f}x; loss {l_o:.6f} / {l_p:.6f}"
    )
    return (
        f" openmp_tok_s={tokens / t_o:.1f} own_threads_tok_s={tokens / t_p:.1f} "
        f"threads_speedup={t_p / t_o:.2f} threads_loss_rel_diff={abs(l_o - l_p) / abs(l_p):.1e}"
    )


def varying_lengths(
    args, pad_multiple: int, steps: int = 32, warmup: int = 16, packed: bool = False
) -> float:
    """Real tokens/s over `steps` fresh batches of varying length (after `warmup` others);
    `packed`: the same samples in packed rows (fewer steps: each holds more samples)."""
    g = torch.Generator().manual_seed(0)
    V, H = args.vocab, 576
    n = (steps + warmup) * args.batch
    lens = (torch.randn(n, generator=g) * 0.6 + torch.log(torch.tensor(240.0))).exp()
    lens = lens.clamp(16, args.seq).long().tolist()
    reader = [
        {"input_ids": torch.randint(0, 49152, (m,), generator=g),
         "loss_mask": torch.rand(m, generator=g) < 0.7,
         "aux_hidden": torch.randn(m, 3 * H, generator=g),
         "last_hidden": torch.randn(m, H, generator=g)}
        for m in lens
    ]  # fmt: skip
    argmax = {i: torch.randint(0, V, (m,), generator=g) for i, m in enumerate(lens)}
    t2d = torch.rand(V, generator=g) < 0.9
    if packed:
        batches = packed_epoch(list(range(n)), lens, args.seq, args.pack_rows, 0, 0)
        per_step = n / len(batches)  # samples a step: warm up and time the same samples' worth
        warmup, steps = round(warmup * args.batch / per_step), round(steps * args.batch / per_step)
        batches = batches[: warmup + steps]
    else:
        batches = epoch_batches(list(range(n)), lens, args.batch, 0, 0)
    torch.manual_seed(0)
    draft = random_draft(V)
    head_rows = torch.randn(V, H) * 0.02
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4, fused=True)  # as the trainer
    model = TTTModel(draft, args.ttt, 0.8)
    toks, t0 = 0, 0.0
    for j, gb in enumerate(batches):
        if j == warmup:
            toks, t0 = 0, time.perf_counter()
        if packed:
            batch = collate_packed(reader, gb, argmax, t2d, args.seq, torch.device("cpu"))
            gb = [i for row in gb for i in row]
        else:
            batch = collate(reader, gb, argmax, t2d, args.seq, torch.device("cpu"), pad_multiple)
        masks, idx = unroll_masks(batch, args.ttt, args.ttt_sample, all_tokens=True)
        denom = torch.stack([m.sum() for m in masks]).float()
        tl = batch["last_hidden"] @ head_rows.T
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp == "bf16"):
            loss = model(batch, tl, masks, denom, idx=idx, stats=False)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
        opt.step()
        toks += sum(lens[i] for i in gb)
    return toks / (time.perf_counter() - t0)


def capture_main(args) -> None:
    """Padded batches vs packed rows of one real capture, alternating step by step in ONE process
    (heap kept, as the trainer does), so a drifting machine slows both alike."""
    from workbench.draft.data import open_capture

    assert keep_freed_memory(), "keep_freed_memory needs glibc"
    reader = open_capture(args.capture, verify=False)
    lengths = reader.lengths()
    idx = list(range(len(reader)))
    g = torch.Generator().manual_seed(0)
    V = args.vocab
    # in-vocab flags only pick which rows count: every row is scored, so timing ignores them
    argmax = {i: torch.randint(0, V, (n,), generator=g) for i, n in enumerate(lengths)}
    t2d = torch.rand(V, generator=g) < 0.87
    cpu = torch.device("cpu")
    plans = {
        "padded": [
            (lambda h, gb=gb: collate(reader, gb, argmax, t2d, args.seq, cpu, 64, h), len(gb))
            for gb in epoch_batches(idx, lengths, args.batch, 0, 0)
        ],
        "packed": [
            (lambda h, rows=rows: collate_packed(reader, rows, argmax, t2d, args.seq, cpu, 64, h),
             sum(map(len, rows)))
            for rows in packed_epoch(idx, lengths, args.seq, args.pack_rows, 0, 0)
        ],
    }  # fmt: skip
    # the trainer's TargetHead on a stand-in target (random final norm and output rows)
    head = TargetHead(StandInTarget(), torch.arange(V) * (49152 // V), cpu, args.target_cache_mb)
    undo = {name: None for name in plans}
    change = "norm" if args.norm_ab else "cache" if args.cache_ab else None
    if change:  # packed rows both ways: as the code is, and with the change undone
        plans = {"packed": plans["packed"], f"packed_before_{change}": plans["packed"]}
        undo = {"packed": None, f"packed_before_{change}": change}
    runs = {}
    for name in plans:
        torch.manual_seed(0)
        draft = random_draft(V)
        opt = torch.optim.AdamW(draft.parameters(), lr=1e-4, fused=True)
        runs[name] = (TTTModel(draft, args.ttt, 0.8), opt)

    def step(name: str, make) -> int:
        return as_before(undo[name], lambda: one_step(name, make))()

    def one_step(name: str, make) -> int:
        model, opt = runs[name]
        # as the trainer: the batch brings its target logits (kept across epochs), except with
        # the cache undone: one matmul over the batch, as before
        batch = make(None if undo[name] == "cache" else head)
        masks, idx_ = unroll_masks(batch, args.ttt, args.ttt_sample, all_tokens=True)
        denom = torch.stack([m.sum() for m in masks]).float()
        tl = batch.pop("target_logits", None)
        if tl is None:
            tl = head.draft_logits(batch["last_hidden"])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp == "bf16"):
            loss = model(batch, tl, masks, denom, idx=idx_, stats=False)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.draft.parameters(), 0.5)
        opt.step()
        return int(batch["token_mask"].sum())

    warm, n = 8, args.capture_steps
    if change == "cache":  # time the passes after the first, as 11 of the quick preset's 12
        warm = len(plans["packed"])
    toks = {k: 0 for k in plans}
    secs = {k: 0.0 for k in plans}
    samples = {k: 0 for k in plans}
    names = list(plans)
    for j in range(warm + n):
        for name in names if j % 2 else names[::-1]:
            make, k = plans[name][j % len(plans[name])]
            t0 = time.perf_counter()
            got = step(name, make)
            if j >= warm:
                secs[name] += time.perf_counter() - t0
                toks[name] += got
                samples[name] += k
    rate = {k: toks[k] / secs[k] for k in plans}
    if change:
        a, b = rate["packed"], rate[f"packed_before_{change}"]
        what = {"norm": "RMSNorm fp32 product", "cache": "target logits per batch"}[change]
        print(
            f"capture {args.capture}: {len(reader)} samples, {sum(lengths)} tokens; {n} steps "
            f"each after {warm}, alternating; packed ({args.pack_rows} x {args.seq}): now "
            f"{a:.0f} tok/s, before ({what}) {b:.0f} tok/s"
        )
        print(
            f"RESULT capture_packed_tok_s={a:.1f} capture_packed_before_{change}_tok_s={b:.1f} "
            f"{change}_speedup={a / b:.3f}"
        )
        return
    print(
        f"capture {args.capture}: {len(reader)} samples, {sum(lengths)} tokens; {n} steps each "
        f"after {warm}, alternating; padded (batch {args.batch}, x64): {rate['padded']:.0f} tok/s, "
        f"{samples['padded'] / n:.2f} samples a step; packed ({args.pack_rows} x {args.seq}): "
        f"{rate['packed']:.0f} tok/s, {samples['packed'] / n:.2f} samples a step"
    )
    print(
        f"RESULT capture_padded_tok_s={rate['padded']:.1f} capture_packed_tok_s="
        f"{rate['packed']:.1f} packed_speedup={rate['packed'] / rate['padded']:.3f}"
    )


def lengths_main(args) -> None:
    """Each variant in a fresh process (kernel caches cold alike; the heap setting is global)."""
    if args.child:
        if args.child in ("keep", "packed"):
            assert keep_freed_memory(), "keep_freed_memory needs glibc"
        pad = 1 if args.child == "exact" else 64
        tok_s = varying_lengths(args, pad, packed=args.child == "packed")
        print(json.dumps({"tok_s": tok_s}))
        return
    got = {}
    for variant in ("exact", "padded", "keep", "packed"):
        child = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--child", variant],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        got[variant] = json.loads(child.stdout.strip().splitlines()[-1])["tok_s"]
    exact, padded, keep, packed = got["exact"], got["padded"], got["keep"], got["packed"]
    print(
        f"varying lengths, batch {args.batch}, draft vocab {args.vocab}, amp {args.amp}, threads "
        f"{torch.get_num_threads()}: exact lengths {exact:.0f} tok/s, padded to x64 {padded:.0f}, "
        f"padded + large blocks kept in the heap {keep:.0f}, packed ({args.pack_rows} x "
        f"{args.seq} a step) {packed:.0f}"
    )
    print(
        f"RESULT exact_tok_s={exact:.1f} padded_tok_s={padded:.1f} padded_keep_tok_s={keep:.1f} "
        f"packed_tok_s={packed:.1f} speedup={keep / exact:.2f} packed_speedup={packed / keep:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--ttt", type=int, default=5)
    ap.add_argument("--ttt-sample", type=float, default=0.25)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--amp", choices=["off", "bf16"], default="bf16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (with --threads 1: robust on a loaded box)")  # fmt: skip
    ap.add_argument("--cost-ratio", action="store_true", help="also time full TTT-N vs 1 step")
    ap.add_argument("--soft-ce-ab", action="store_true",
                    help="also time the current step with the C vs the torch soft-CE")  # fmt: skip
    ap.add_argument("--norm-ab", action="store_true",
                    help="also time the norms' weight in the input dtype vs the fp32 product")  # fmt: skip
    ap.add_argument(
        "--cache-ab",
        action="store_true",
        help="--capture: target logits kept across epochs vs one matmul per batch",
    )
    ap.add_argument("--target-cache-mb", type=float, default=4096.0,
                    help="--capture: TargetHead's cache budget")  # fmt: skip
    ap.add_argument("--threads-ab", action="store_true",
                    help="also time the current step with the C soft-CE on torch's OpenMP "
                         "threads vs its own (WORKBENCH_KERNEL_THREADS auto / own)")  # fmt: skip
    ap.add_argument("--lengths", action="store_true",
                    help="fresh batches of varying length: exact vs padded, heap kept or not")  # fmt: skip
    ap.add_argument("--pack-rows", type=int, default=1, help="packed rows a step")
    ap.add_argument("--capture", default=None,
                    help="a real capture: its padded batches vs packed rows, alternating")  # fmt: skip
    ap.add_argument("--capture-steps", type=int, default=60, help="--capture: timed steps each")
    ap.add_argument("--child", choices=["exact", "padded", "keep", "packed"],
                    help=argparse.SUPPRESS)  # fmt: skip
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.capture:
        return capture_main(args)
    if args.lengths:
        return lengths_main(args)
    torch.manual_seed(0)
    draft = random_draft(args.vocab)
    B, T, H = args.batch, args.seq, 576
    batch = {
        "input_ids": torch.randint(0, 49152, (B, T)),
        "loss_mask": torch.rand(B, T) < 0.7,
        "token_mask": torch.ones(B, T, dtype=torch.bool),
        "in_vocab": torch.rand(B, T) < 0.9,
        "aux_hidden": torch.randn(B, T, 3 * H),
        "last_hidden": torch.randn(B, T, H),
    }
    head_rows = torch.randn(args.vocab, H) * 0.02
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4, fused=True)  # as the trainer
    amp = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        if args.amp == "bf16"
        else (lambda: torch.autocast("cpu", enabled=False))
    )
    f = args.ttt_sample
    masks, idx = unroll_masks(batch, args.ttt, f, all_tokens=True)  # loss_on=all, as quick
    denom = torch.stack([m.sum() for m in masks]).float()

    def loss_of(model: TTTModel, n_masks=masks, n_idx=idx, n_denom=denom) -> torch.Tensor:
        tl = batch["last_hidden"] @ head_rows.T
        with amp():
            # as 9 of the trainer's 10 steps: no accuracy statistics (the reference computes them)
            return model(batch, tl, n_masks, n_denom, idx=n_idx, stats=False)[0]

    def train_step(reference: bool):
        model = TTTModel(draft, args.ttt, 0.8, reference=reference)

        def run():
            loss = loss_of(model)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
            opt.step()

        return run

    with torch.no_grad():
        l_new = float(loss_of(TTTModel(draft, args.ttt, 0.8)))
        l_ref = float(loss_of(TTTModel(draft, args.ttt, 0.8, reference=True)))
    rel = abs(l_new - l_ref) / max(abs(l_ref), 1e-12)
    print(
        f"shapes: batch {B} x seq {T}, H {H}, 3 aux layers, draft vocab {args.vocab}, "
        f"TTT-{args.ttt}, ttt_sample {f:g}, amp {args.amp}, threads {torch.get_num_threads()}, "
        f"clock {args.clock}"
    )
    print(f"loss: current {l_new:.6f}  reference {l_ref:.6f}  relative difference {rel:.2e}")
    t_ref, t_new = timed_min([train_step(True), train_step(False)], args.reps, clock)
    tok_ref, tok_new = B * T / t_ref, B * T / t_new
    print(
        f"training step: reference {t_ref * 1000:.0f} ms ({tok_ref:.0f} tok/s), "
        f"current {t_new * 1000:.0f} ms ({tok_new:.0f} tok/s), {t_ref / t_new:.2f}x"
    )
    extra = ""
    if args.cost_ratio:
        full = unroll_masks(batch, args.ttt, 1.0, all_tokens=True)[0]
        fd = torch.stack([m.sum() for m in full]).float()

        def fwd_bwd(n: int):
            model = TTTModel(draft, n, 0.8)
            return lambda: (loss_of(model, full[:n], None, fd[:n]).backward(), draft.zero_grad())

        t1, tn = timed_min([fwd_bwd(1), fwd_bwd(args.ttt)], args.reps, clock)
        print(f"full TTT-{args.ttt} fwd+bwd {tn * 1000:.0f} ms vs 1 step {t1 * 1000:.0f} ms")
        extra = f" ttt_cost_ratio={tn / t1:.2f}"
    if args.soft_ce_ab:
        extra += soft_ce_ab(train_step(False), lambda: float(loss_of(TTTModel(draft, args.ttt, 0.8))),
                            B * T, args.reps, clock)  # fmt: skip
    if args.norm_ab:
        extra += change_ab("norm", train_step(False),
                           lambda: float(loss_of(TTTModel(draft, args.ttt, 0.8))),
                           B * T, args.reps, clock)  # fmt: skip
    if args.threads_ab:
        extra += threads_ab(train_step(False), lambda: float(loss_of(TTTModel(draft, args.ttt, 0.8))),
                            B * T, args.reps, clock)  # fmt: skip
    print(
        f"RESULT train_tok_s={tok_new:.1f} ref_train_tok_s={tok_ref:.1f} "
        f"speedup={t_ref / t_new:.2f} loss_rel_diff={rel:.1e} ttt_sample={f:g}{extra}"
    )


if __name__ == "__main__":
    main()
