"""What verifying k tokens in one target forward costs relative to decoding one.

Decode at batch 1 is bound by reading the weights, so a k-token verify (the engine's
speculative step: k tokens, logits for all of them, the aux layers recorded, cache not
advanced) should cost little more than a one-token decode step. For k in {1, 2, 4, 8} and
both fp32 and bf16 this times exactly those two calls of `workbench.llama.Llama` after a
128-token prefill, interleaved (every repeat runs every k in turn) and reports medians, so
noise from other processes on a shared machine hits every k alike. Ratios are
median(k-token verify) / median(one-token decode).

On a machine other processes keep busy, wall times measure scheduler slices more than the
model (a 2-thread op waits for a slice at every step): `--threads 1 --clock cpu` times the
process's CPU time instead, which stays close to a quiet machine's one-core figures.
`--compare` adds the unpacked weights on plain F.linear (the path before oneDNN packing).

Last line: `RESULT verify_cost_k2=... k4=... k8=... bf16_k2=... bf16_k4=... bf16_k8=...`.
Run: `python benchmarks/bench_verify.py [--repeats 15] [--threads N] [--clock wall|cpu]
[--compare] [--target smollm2-135m]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("MKL_CBWR", "AVX512")  # before torch loads MKL

import torch  # noqa: E402

from workbench.layers import default_layer_ids  # noqa: E402
from workbench.llama import Llama  # noqa: E402

KS = (1, 2, 4, 8)
CLOCK = time.perf_counter


def time_verify(
    variants: dict[str, Llama], repeats: int, prefill: int = 128, seed: int = 0
) -> dict[str, dict[int, float]]:
    """Median seconds per call for each variant (a named Llama) and k.

    k=1 is a decode step (logits of the last token), k>1 a verify. Every repeat runs every
    variant and k in a rotating order, so load from other processes hits them alike.
    """
    g = torch.Generator().manual_seed(seed)
    llm0 = next(iter(variants.values()))
    V = int(llm0.config.vocab_size)
    aux = list(default_layer_ids(llm0.n_layers).canonical)
    prompt = torch.randint(0, V, (1, prefill), generator=g)
    toks = {k: torch.randint(0, V, (1, k), generator=g) for k in KS}
    caches = {}
    for name, llm in variants.items():
        caches[name] = llm.new_cache(1, prefill + max(KS) + 1)
        llm(prompt, caches[name], logits="none")

    def call(name: str, k: int) -> float:
        llm = variants[name]
        t0 = CLOCK()
        if k == 1:
            llm(toks[k], caches[name], logits="last", advance=False)
        else:
            llm(toks[k], caches[name], hidden_layers=aux, logits="all", advance=False)
        return CLOCK() - t0

    jobs = [(n, k) for n in variants for k in KS]
    times: dict[tuple[str, int], list[float]] = {j: [] for j in jobs}
    for r in range(repeats + 2):  # two warm-up rounds
        for j in jobs[r % len(jobs) :] + jobs[: r % len(jobs)]:
            dt = call(*j)
            if r >= 2:
                times[j].append(dt)
    return {n: {k: statistics.median(times[n, k]) for k in KS} for n in variants}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: process CPU time (with --threads 1, robust to other processes' load)",
    )
    ap.add_argument(
        "--compare",
        action="store_true",
        help="also time the unpacked weights on F.linear (the old path)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    from workbench.target import load_target

    target = load_target(args.target, dtype="float32")
    print(
        f"target {target.name}, threads {torch.get_num_threads()}, MKL_CBWR="
        f"{os.environ.get('MKL_CBWR')}, {args.clock} clock, {args.repeats} interleaved "
        "repeats, medians "
        f"(load average {os.getloadavg()[0]:.1f}: timings on a shared machine are noisy)"
    )
    variants: dict[str, Llama] = {}
    for name in args.dtypes.split(","):
        variants[name] = Llama(target.model, getattr(torch, name))
        if args.compare and variants[name].onednn:
            variants[f"{name} unpacked (before)"] = Llama(target.model, getattr(torch, name), False)
    med = time_verify(variants, args.repeats)
    ratios = {n: {k: m[k] / m[1] for k in KS} for n, m in med.items()}
    for n, m in med.items():
        print(f"{n:>26}: " + "  ".join(f"k={k} {m[k] * 1e3:6.1f} ms ({ratios[n][k]:.2f}x)"
                                       for k in KS))  # fmt: skip
    f32, b16 = ratios.get("float32", {}), ratios.get("bfloat16", {})
    parts = [f"verify_cost_k{k}={f32[k]:.3f}" if k == 2 else f"k{k}={f32[k]:.3f}" for k in KS[1:]
             if k in f32] + [f"bf16_k{k}={b16[k]:.3f}" for k in KS[1:] if k in b16]  # fmt: skip
    print("RESULT " + " ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
