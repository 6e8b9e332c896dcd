"""What verifying k tokens in one target forward costs relative to decoding one.

Decode at batch 1 is bound by reading the weights, so a k-token verify (the engine's
speculative step: k tokens, logits for all of them, the aux layers recorded, cache not
advanced) should cost little more than a one-token decode step. For k in {1, 2, 3, 4, 8} and
both fp32 and bf16 this times exactly those two calls of `workbench.llama.Llama` after a
128-token prefill, interleaved (every repeat runs every k in turn) and reports medians, so
noise from other processes on a shared machine hits every k alike. Ratios are
median(k-token verify) / median(one-token decode).

On a machine other processes keep busy, wall times measure scheduler slices more than the
model (a 2-thread op waits for a slice at every step): `--threads 1 --clock cpu` times the
process's CPU time instead, which stays close to a quiet machine's one-core figures.
`--compare` adds the unpacked weights on plain F.linear (the path before oneDNN packing).

`--against REV` adds workbench/llama.py as of git REV (before/after from one run);
`--breakdown` first prints per-op times of k=1 and k=8 (timers around every matmul, norm,
RoPE and attention call; "rest" is cache writes, masks, reshapes and Python).

Why fp32 k=8 stays above 1.15 on one core of this AMD EPYC (Zen 5, AVX-512; issue 14, timed
with this script's --breakdown and a matmul-only stream over all 30 layers, loaded machine):
the matmuls read 134.5M weights = 538 MB (fp32) per step. At 1 row oneDNN streams them at
~29 GB/s (18.7 ms of the ~27 ms step; the other ~8 ms are norms, RoPE, attention and Python,
which barely grow with k). 8 rows are 2 x 8 x 134.5M = 2.15 GFLOP; oneDNN's brgemm reaches
~168 GFLOP/s at 8 rows on cache-resident weights (~230 at 256 rows) = 12.8 ms of pure compute.
A single core both issues the loads and does the FMAs, and only about half of that compute
hides under the stream: the same matmuls take 25.6 ms at 8 rows (85 GFLOP/s) vs 18.7 at 1 row
(1.37x on their own). k=8 <= 1.15 would need ~70% of the compute hidden; no weight layout
(PACK_ROWS 1-128 pick the same AB16b64a kernel), MKL packed sgemm (1.74x) or F.linear (1.9x)
does better. bf16 halves the bytes and (avx512_bf16) the compute alike, so its ratio is similar
(matmuls alone 1.34x). Two threads on this 2-core shared box measure the scheduler, not the model.
On a quiet AMD EPYC of a later kind (Zen 5, avx512_bf16), two threads: fp32 k2 0.93, k3 0.95,
k4 0.88, k8 1.01 (25.4 ms decode; 0.98 / 1.00 / 0.96 / 1.09 in another run), bf16 1.08 / 1.12 /
1.11 / 1.21: there the fp32 default meets <= 1.15 for every k, bf16 not at k=8.
On a Zen 3 EPYC (AVX2, no AVX-512: fp32 only), two threads: k2-k4 0.98-1.07, k8 1.29-1.36
(81 ms decode). The packed matmuls alone stream the weights at 7.2-7.7 GB/s for one row, half
what a plain sum reads there, and run 8 rows at 23 GFLOP/s (1.25x one row); MKL's F.linear and
torch.mv were no faster at one row and slower at 8, so the limit is the AVX2 few-row kernels.

Since fp32 inputs of 1-3 rows go to MKL on Intel CPUs (`llama.default_mkl_rows`: faster
there), the fp32 ratios divide by that faster one-token decode, and verifies of 4-8 rows run
MKL's packed sgemm there (`llama.default_mkl_packs`; on a Xeon with AMX, two threads, against
the oneDNN weights of before, from one `--against` run: k4 1.34 -> 1.25, k8 1.58 -> 1.43 with
a 40 ms decode step). "float32 oneDNN only" is the all-packed path (where a verify is bit-identical to decode steps, `llama.linear`), and the
RESULT line carries both, with each one-token decode time.

Last line: `RESULT verify_cost_k2=... k3=... k4=... k8=... bf16_k2=... bf16_k3=... bf16_k4=...
bf16_k8=... decode_ms=... [onednn_k2=... onednn_k3=... onednn_k4=... onednn_k8=...
onednn_decode_ms=...] [against_k2=... against_k3=... against_k4=... against_k8=...
against_decode_ms=...]` (against_: fp32 at REV, ratios to its own
decode step).
Run: `python benchmarks/bench_verify.py [--repeats 10] [--threads N] [--clock wall|cpu]
[--compare] [--against REV] [--breakdown] [--target smollm2-135m]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("MKL_CBWR", "AVX512")  # before torch loads MKL

import torch  # noqa: E402

from workbench.layers import default_layer_ids  # noqa: E402
from workbench.llama import Llama, default_mkl_packs, default_mkl_rows  # noqa: E402

KS = (1, 2, 3, 4, 8)  # 3: the 2-step chain (2/1/3), the last row count on plain MKL (Intel)
CLOCK = time.perf_counter


def llama_at(rev: str) -> type:
    """`Llama` from workbench/llama.py as of git `rev`, imported from a temporary file."""
    import importlib.util
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{rev}:workbench/llama.py"], cwd=root, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"llama_at_{abs(hash(rev))}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return mod.Llama


def make_calls(variants: dict[str, Llama], prefill: int = 128, seed: int = 0):
    """`call(name, k)` -> seconds: k=1 a decode step (logits of the last token), k>1 a verify
    (k tokens, aux layers, all logits, cache not advanced), each after a `prefill` prompt."""
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

    return call


def time_verify(variants: dict[str, Llama], repeats: int, burst: int = 3):
    """Median seconds per call for each variant (a named Llama) and k.

    Every repeat runs every variant and k in a rotating order, so load from other processes
    hits them alike. Each turn is `burst` back-to-back calls, the first not timed: a decode
    loop runs one model step after step, so its weights stay as warm in the caches as they
    get (a 480 MB L3 holds most of SmolLM2's 540 MB of fp32 weights), while a call right
    after another variant's finds them cold. Single calls in rotation (this script before
    2026-12) made a 2-token verify look cheaper than a decode step (88 vs 152 ms).
    """
    call = make_calls(variants)
    jobs = [(n, k) for n in variants for k in KS]
    times: dict[tuple[str, int], list[float]] = {j: [] for j in jobs}
    for r in range(repeats + 1):  # one warm-up round
        for j in jobs[r % len(jobs) :] + jobs[: r % len(jobs)]:
            for b in range(burst):
                dt = call(*j)
                if r >= 1 and b >= 1:
                    times[j].append(dt)
    return {n: {k: statistics.median(times[n, k]) for k in KS} for n in variants}


def print_breakdown(variants: dict[str, Llama], repeats: int) -> None:
    """Per-op median ms of a decode step (k=1) and an 8-token verify, from timers.

    The matmuls are told apart by their weight's output size; "rest" is the forward's time
    not inside a timed call (cache writes, mask, embedding, reshapes, Python). Each timer
    costs about a microsecond, ~250 per forward.
    """
    import torch.nn.functional as F

    acc: dict[str, float] = {}
    sdpa = F.scaled_dot_product_attention

    def timed(name: str, fn):
        def run(*a, **kw):
            t0 = CLOCK()
            out = fn(*a, **kw)
            acc[name] = acc.get(name, 0.0) + CLOCK() - t0
            return out

        return run

    def timed_linear(x, w, b=None):
        name = names.get(int(w.shape[0]), f"linear {w.shape[0]}")
        return timed(name, originals["linear"])(x, w, b)

    for vname, llm in variants.items():
        wl = sys.modules[type(llm).__module__]  # the module whose globals forward() calls
        originals = {"linear": wl.linear, "rms_norm": wl.rms_norm, "apply_rope": wl.apply_rope}
        H, Hkv, D = llm.n_heads, llm.n_kv, llm.head_dim
        inter = int(llm.config.intermediate_size)
        names = {(H + 2 * Hkv) * D: "qkv", llm.dim: "o / down", 2 * inter: "gate+up",
                 int(llm.config.vocab_size): "lm_head"}  # fmt: skip
        if llm.dim == (H + 2 * Hkv) * D or llm.dim == 2 * inter:
            raise ValueError("breakdown tells matmuls apart by output size; these collide")
        wl.linear, wl.rms_norm = timed_linear, timed("norms", wl.rms_norm)
        wl.apply_rope, F.scaled_dot_product_attention = (
            timed("rope", wl.apply_rope),
            timed("attention", sdpa),
        )
        try:
            per: dict[int, dict[str, list[float]]] = {1: {}, 8: {}}
            call = make_calls({vname: llm})
            for r in range(repeats + 2):
                for k in (1, 8):
                    acc.clear()
                    total = call(vname, k)
                    if r < 2:  # warm-up
                        continue
                    acc["rest"] = total - sum(acc.values())
                    acc["total"] = total
                    for n, t in acc.items():
                        per[k].setdefault(n, []).append(t)
        finally:
            wl.linear, wl.rms_norm = originals["linear"], originals["rms_norm"]
            wl.apply_rope, F.scaled_dot_product_attention = originals["apply_rope"], sdpa
        print(f"{vname} per-op ms (median): k=1 -> k=8 (delta)")
        for n in per[8]:
            a, b = (statistics.median(per[k].get(n, [0.0])) * 1e3 for k in (1, 8))
            print(f"  {n:>10}: {a:6.2f} -> {b:6.2f} ({b - a:+.2f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=10)
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
    ap.add_argument(
        "--against",
        metavar="REV",
        help="also time workbench/llama.py as of git REV (before/after ratios from one run)",
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="first print per-op times of k=1 and k=8 (timers around each call)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    from workbench.target import load_target

    target = load_target(args.target, dtype="float32")
    print(
        f"target {target.name}, threads {torch.get_num_threads()}, fp32 inputs of <= "
        f"{default_mkl_rows(torch.float32)} rows on MKL (packs for {default_mkl_packs(torch.float32)} "
        "rows), MKL_CBWR="
        f"{os.environ.get('MKL_CBWR')}, {args.clock} clock, {args.repeats} interleaved "
        "repeats, medians "
        f"(load average {os.getloadavg()[0]:.1f}: timings on a shared machine are noisy)"
    )
    variants: dict[str, Llama] = {}
    old = llama_at(args.against) if args.against else None  # one module for both dtypes
    for name in args.dtypes.split(","):
        variants[name] = Llama(target.model, getattr(torch, name))
        if variants[name].onednn and variants[name].mkl_rows:  # small inputs on MKL (llama.py)
            variants[f"{name} oneDNN only"] = Llama(target.model, getattr(torch, name), mkl_rows=0)
        if args.compare and variants[name].onednn:
            variants[f"{name} unpacked (before)"] = Llama(target.model, getattr(torch, name), False)
        if args.against:
            variants[f"{name} @{args.against}"] = old(target.model, getattr(torch, name))
    if args.breakdown:
        print_breakdown(variants, args.repeats)
    med = time_verify(variants, args.repeats)
    ratios = {n: {k: m[k] / m[1] for k in KS} for n, m in med.items()}
    for n, m in med.items():
        print(f"{n:>26}: " + "  ".join(f"k={k} {m[k] * 1e3:6.1f} ms ({ratios[n][k]:.2f}x)"
                                       for k in KS))  # fmt: skip
    f32, b16 = ratios.get("float32", {}), ratios.get("bfloat16", {})
    parts = [f"verify_cost_k{k}={f32[k]:.3f}" if k == 2 else f"k{k}={f32[k]:.3f}" for k in KS[1:]
             if k in f32] + [f"bf16_k{k}={b16[k]:.3f}" for k in KS[1:] if k in b16]  # fmt: skip
    parts.append(f"decode_ms={med['float32'][1] * 1e3:.1f}" if "float32" in med else "")
    if only := ratios.get("float32 oneDNN only"):  # the ratios before MKL took 1-2 rows
        parts += [f"onednn_k{k}={only[k]:.3f}" for k in KS[1:]]
        parts.append(f"onednn_decode_ms={med['float32 oneDNN only'][1] * 1e3:.1f}")
    if before := ratios.get(f"float32 @{args.against}"):
        parts += [f"against_k{k}={before[k]:.3f}" for k in KS[1:]]
        parts.append(f"against_decode_ms={med[f'float32 @{args.against}'][1] * 1e3:.1f}")
    print("RESULT " + " ".join(p for p in parts if p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
