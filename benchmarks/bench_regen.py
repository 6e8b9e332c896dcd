"""Regeneration throughput: HF `generate` vs `workbench.generate.generate_batch`.

Same chat-templated prompts, greedy, on the embedded target. Ends with one `RESULT` line.
--chunk-size N also runs `workbench.data.regenerate` in chunks of N prompts twice in this
process, the batch drained at each chunk end (the old way) and refilled across chunks, and
prints both (tok/s, decode steps, occupancy); --regen-only skips the HF / generate_batch table.
--attention-ab runs `regenerate` on the first --n-prompts training prompts twice in this process,
decode attention in torch's SDPA and in the C kernel (`workbench.decode_attention`), and ends
with their ratio. --threads-ab does the same with the kernel on threads of its own and on torch's
OpenMP threads (`WORKBENCH_KERNEL_THREADS`).
Usage: python benchmarks/bench_regen.py [--n-prompts 64] [--max-new-tokens 64] [--quick]
       [--chunk-size 16 --batch 16 --regen-only --dtypes bfloat16,float32]
       [--attention-ab --n-prompts 96 --max-new-tokens 512 --batch 64 --dtypes bfloat16]
       [--threads-ab --n-prompts 96 --max-new-tokens 512 --batch 64 --dtypes bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time

import torch

from workbench.generate import generate_batch_with_stats
from workbench.llama import Llama
from workbench.target import load_target

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis.",
    "Give me three tips for better sleep.", "What is a prime number?",
    "Summarize the plot of Romeo and Juliet.", "How do I boil an egg?",
    "Write a short poem about autumn.", "What causes rain?", "Explain recursion to a child.",
    "List five fruits that are red.", "Why is the sky blue?", "What is machine learning?",
    "Write a limerick about a cat.", "How does a bicycle work?", "What is the speed of light?",
    "Describe a sunset in two sentences.", "How can I learn Python quickly?",
    "What is the difference between weather and climate?", "Tell me a fun fact about octopuses.",
    "Write a thank-you note to a teacher.", "What are the planets of the solar system?",
    "How do vaccines work?", "Suggest a name for a coffee shop.", "What is gravity?",
    "Explain what a CPU does.", "Write a two-line story about a dragon.",
    "What should I pack for a beach trip?", "How do bees make honey?",
    "Translate 'good morning' into Spanish and French.", "What is the Pythagorean theorem?",
    "Give me a recipe idea with rice and beans.",
]  # fmt: skip


def chat_prompts(tok, n: int) -> list[list[int]]:
    """n chat-templated prompts (the question list repeats with a suffix beyond its length)."""
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" ({i})")
        msgs = [{"role": "user", "content": q}]
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)
        out.append(list(enc["input_ids"]))
    return out


def hf_generate(model, tok, prompts, max_new, eos, batch) -> tuple[int, float]:
    """HF generate with left padding, greedy; returns (new tokens until eos, seconds)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    n_tok, t0 = 0, time.perf_counter()
    for s in range(0, len(prompts), batch):
        group = prompts[s : s + batch]
        T = max(map(len, group))
        ids = torch.tensor([[pad] * (T - len(p)) + p for p in group])
        att = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in group])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=eos, pad_token_id=pad)  # fmt: skip
        for row in out[:, T:].tolist():
            n_tok += row.index(eos) + 1 if eos in row else len(row)
    return n_tok, time.perf_counter() - t0


def regen_paths(t, n: int, m: int, args) -> None:
    """`regenerate` per chunk (drained tails) vs across chunks on the first n training prompts
    (some have 2 turns, as in a pipeline run), one line each, in this process."""
    from workbench.data import RegenConfig, load_train_prompts, regenerate

    qs = load_train_prompts()[:n]
    print(f"regenerate: {n} training prompts, {sum(len(q.turns) for q in qs)} turns")
    res = {}
    for dt in args.dtypes.split(","):
        for cross in (False, True):
            cfg = RegenConfig(max_new_tokens=m, batch_size=args.batch, chunk_size=args.chunk_size,
                              dtype=dt)  # fmt: skip
            with tempfile.TemporaryDirectory() as d:
                info = regenerate(t, qs, d, cfg, progress=False, cross_chunk=cross)
            res[(dt, cross)] = info["tok_s"]
            print(f"  regenerate {dt} chunk {args.chunk_size} batch {args.batch} "
                  f"{'cross-chunk' if cross else 'per-chunk  '}: {info['new_tokens_this_run']} "
                  f"tokens {info['seconds_this_run']}s {info['tok_s']} tok/s, "
                  f"{info['decode_steps']} steps, occupancy {info['occupancy']}", flush=True)  # fmt: skip
    for dt in args.dtypes.split(","):
        print(f"regenerate {dt}: cross-chunk / per-chunk tok/s = "
              f"{res[(dt, True)] / res[(dt, False)]:.2f}")  # fmt: skip
    if "bfloat16" in args.dtypes and "float32" in args.dtypes:
        print(f"regenerate cross-chunk bfloat16 / float32 tok/s = "
              f"{res[('bfloat16', True)] / res[('float32', True)]:.2f}")  # fmt: skip
    if args.regen_only:
        dt = args.dtypes.split(",")[0]
        print(f"RESULT regen_tok_s={res[(dt, True)]:.1f} per_chunk_tok_s={res[(dt, False)]:.1f} "
              f"speedup={res[(dt, True)] / res[(dt, False)]:.2f} dtype={dt} batch={args.batch}")  # fmt: skip


def regen_ab(t, n: int, m: int, args, env: str, modes: tuple[str, str], key: str) -> None:
    """`regenerate` under `env`=modes[0], then modes[1], same prompts and settings, this process;
    ends with the RESULT line of modes[1] over modes[0]."""
    import os

    from workbench import decode_attention
    from workbench.data import RegenConfig, load_train_prompts, regenerate

    qs = load_train_prompts()[:n]
    dt = args.dtypes.split(",")[0]
    print(f"regenerate {dt}: {n} training prompts, {sum(len(q.turns) for q in qs)} turns, "
          f"max_new_tokens {m}, batch {args.batch}")  # fmt: skip
    res = {}
    for mode in modes:
        os.environ[env] = mode
        decode_attention._library.cache_clear()  # the kernel's build depends on the threads env
        cfg = RegenConfig(max_new_tokens=m, batch_size=args.batch, chunk_size=args.chunk_size or 128,
                          dtype=dt)  # fmt: skip
        with tempfile.TemporaryDirectory() as d:
            info = regenerate(t, qs, d, cfg, progress=False)
        res[mode] = info["tok_s"]
        print(f"  {env}={mode:<5}: {info['new_tokens_this_run']} tokens "
              f"{info['seconds_this_run']}s {info['tok_s']} tok/s, {info['decode_steps']} steps, "
              f"occupancy {info['occupancy']}", flush=True)  # fmt: skip
    del os.environ[env]
    decode_attention._library.cache_clear()
    a, b = modes
    print(f"RESULT regen_tok_s_{key}={res[b]:.1f} regen_tok_s_{a}={res[a]:.1f} "
          f"speedup={res[b] / res[a]:.2f} dtype={dt} batch={args.batch} prompts={n}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-prompts", type=int, default=64, help="64: batch 64 gets full rows")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="8 prompts, 16 new tokens")
    ap.add_argument("--chunk-size", type=int, default=0, help="also compare regenerate paths")
    ap.add_argument("--batch", type=int, default=32, help="regenerate batch size")
    ap.add_argument("--dtypes", default="bfloat16", help="regenerate dtypes, comma separated")
    ap.add_argument("--regen-only", action="store_true", help="skip HF and generate_batch")
    ap.add_argument("--attention-ab", action="store_true",
                    help="regenerate with SDPA vs the C decode-attention kernel, then stop")  # fmt: skip
    ap.add_argument("--threads-ab", action="store_true",
                    help="regenerate with the C kernel on its own threads vs torch's OpenMP "
                         "threads (WORKBENCH_KERNEL_THREADS own / auto), then stop")  # fmt: skip
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.n_prompts, args.max_new_tokens = 8, 16
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    t = load_target("smollm2-135m", dtype="float32")
    tok, eos = t.tokenizer, t.tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = chat_prompts(tok, args.n_prompts)
    n, m = len(prompts), args.max_new_tokens
    print(f"{n} prompts, {sum(map(len, prompts))} prompt tokens, max_new_tokens {m}")

    if args.attention_ab:  # SDPA, then the C kernel
        return regen_ab(t, n, m, args, "WORKBENCH_DECODE_ATTENTION", ("sdpa", "c"), "c")
    if args.threads_ab:  # the C kernel on threads of its own, then on torch's OpenMP threads
        return regen_ab(t, n, m, args, "WORKBENCH_KERNEL_THREADS", ("own", "auto"), "openmp")
    if args.chunk_size:
        regen_paths(t, n, m, args)
    if args.regen_only:
        return
    rows = []  # (name, tokens, seconds, tok/s)
    hf16 = copy.deepcopy(t.model).to(torch.bfloat16)
    hf_generate(hf16, tok, prompts[:2], 2, eos, 2)  # warm-up
    ntok, sec = hf_generate(hf16, tok, prompts, m, eos, args.hf_batch)
    rows.append((f"HF generate bf16 b{args.hf_batch}", ntok, sec))
    del hf16
    outs = {}
    for dt, bs in (("bfloat16", 32), ("bfloat16", 64), ("float32", 32)):
        llm = Llama(t.model, dt)
        generate_batch_with_stats(llm, prompts[:2], 2, [eos], progress=False)  # warm-up
        res, st = generate_batch_with_stats(llm, prompts, m, [eos], batch_size=bs, progress=False)
        outs[(dt, bs)] = res
        rows.append((f"generate_batch {dt} b{bs}", st.new_tokens, st.seconds))
        print(f"  {dt} b{bs}: {st}", flush=True)
    hf_tok_s = rows[0][1] / rows[0][2]
    print(f"\n{'config':<28}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'vs HF':>8}")
    for name, ntok, sec in rows:
        print(f"{name:<28}{ntok:>8}{sec:>9.1f}{ntok / sec:>9.1f}{ntok / sec / hf_tok_s:>7.2f}x")
    same = sum(a == b for a, b in zip(outs[("bfloat16", 32)], outs[("float32", 32)], strict=True))
    print(f"bf16 vs fp32 greedy outputs identical for {same}/{n} prompts")
    best = max(rows[1:3], key=lambda r: r[1] / r[2])
    tok_s = best[1] / best[2]
    bs = best[0].rsplit("b", 1)[1]
    print(f"RESULT regen_tok_s={tok_s:.1f} hf_tok_s={hf_tok_s:.1f} speedup={tok_s / hf_tok_s:.2f} "
          f"dtype=bfloat16 batch={bs}")  # fmt: skip


if __name__ == "__main__":
    main()
