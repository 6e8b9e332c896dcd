"""EAGLE-3 speculative decoding vs HF `generate` vs the engine without speculation.

MT-bench first turns (chat template), batch 1, greedy, one dtype, all methods in ONE run and
interleaved per prompt (the order rotates), so machine noise hits every method alike.
Prints a table (tok/s, tau, speedups against both baselines, output identical to plain?) and,
last, `RESULT dtype=... tau=... tok_s_hf=... tok_s_plain=... tok_s_spec=... speedup_vs_hf=...
speedup_vs_plain=... config=steps/topk/ndt` for the best reported setting.

`--auto` first measures every setting on separate calibration prompts, keeps the fastest one
only if it beats plain decoding (else "no speculation", config=none) and reports only that:
a weak draft must never make the demo slower than plain decoding.

Run: `python benchmarks/bench_spec.py [--draft PATH] [--dtype float32|bfloat16] [--auto]`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from workbench.engine import Measurement, SpecDecoder, SpecParams, choose_params, resolve_params
from workbench.llama import Llama

# The draft the README's main command (`make demo` / `workbench pipeline`) trains. Change here.
DEFAULT_DRAFT = "{WORKBENCH_HOME}/runs/demo/draft"
DEFAULT_CONFIGS = "1/1/2,2/1/3,3/1/4,3/2/6,5/4/8"


def default_draft_path() -> Path:
    from workbench.target import workbench_home

    return Path(DEFAULT_DRAFT.format(WORKBENCH_HOME=workbench_home()))


def parse_configs(spec: str) -> list[SpecParams]:
    out = []
    for item in spec.split(","):
        s, k, n = (int(x) for x in item.strip().split("/"))
        out.append(resolve_params(s, k, n))
    return out


def load_draft_for(target, path: str | None, random_draft: bool, dtype: torch.dtype):
    from workbench.draft.model import DraftConfig, Eagle3Draft, init_from_target
    from workbench.draft.train import load_draft
    from workbench.draft.vocab import EMBEDDED_DRAFT_VOCAB
    from workbench.layers import default_layer_ids

    if random_draft:
        cfg = DraftConfig.from_target(
            target.config, default_layer_ids(target.num_layers), EMBEDDED_DRAFT_VOCAB
        )
        torch.manual_seed(0)
        d = init_from_target(Eagle3Draft(cfg), target.model)  # untrained: shows overheads
        return d.to(dtype).eval(), "random (init_from_target, untrained)"
    p = Path(path) if path else default_draft_path()
    if not p.exists():
        sys.exit(
            f"no trained draft at {p}\n"
            "  run the README's main command first (`make demo`), pass --draft PATH, or use\n"
            "  --random-draft to measure the engine's overheads with an untrained draft"
        )
    return load_draft(p, target.model).to(dtype).eval(), str(p)


def hf_generate(model, ids: list[int], max_new: int, eos: list[int], pad: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=eos, pad_token_id=pad)  # fmt: skip
    return out[0, len(ids) :].tolist()


def run_all(methods: dict, prompts: list[list[int]], max_new: int, eos: list[int]) -> dict:
    """Interleaved: for each prompt, every method once, order rotated per prompt."""
    res = {name: {"tokens": 0, "seconds": 0.0, "verify": 0, "outs": []} for name in methods}
    names = list(methods)
    for i, p in enumerate(prompts):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t0 = time.perf_counter()
            toks, verify = methods[name](p)
            dt = time.perf_counter() - t0
            r = res[name]
            r["tokens"] += len(toks)
            r["seconds"] += dt
            r["verify"] += verify
            r["outs"].append(toks)
    return res


def build_methods(target, llm, draft, configs, max_new, eos, with_hf: bool) -> dict:
    pad = target.tokenizer.pad_token_id or 0
    methods: dict = {}
    if with_hf:
        methods["hf"] = lambda p: (hf_generate(target.model, p, max_new, eos, pad), 0)
    plain = SpecDecoder(llm, None)

    def run(dec):
        def f(p):
            g = dec.generate(p, max_new, eos)
            return g.tokens, g.stats.verify_forwards

        return f

    methods["plain"] = run(plain)
    for c in configs:
        methods[str(c)] = run(SpecDecoder(llm, draft, c))
    return methods


def measurement(name: str, r: dict) -> Measurement:
    # decode tokens exclude the prefill token; tau = decode tokens / verify forwards
    dec_tok = r["tokens"] - len(r["outs"])
    tau = dec_tok / r["verify"] if r["verify"] else 1.0
    params = None if name in ("plain", "hf") else SpecParams(*map(int, name.split("/")))
    return Measurement(params, r["tokens"], r["seconds"], tau)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--draft", default=None, help=f"trained draft (default {DEFAULT_DRAFT})")
    ap.add_argument("--random-draft", action="store_true", help="untrained draft (overheads)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="steps/topk/ndt,...")
    ap.add_argument("--auto", action="store_true", help="calibrate, keep only the best setting")
    ap.add_argument("--calib-prompts", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("MKL_CBWR", "AVX512")
    if args.threads:
        torch.set_num_threads(args.threads)

    from workbench.data import eos_ids, load_mtbench, prompt_ids
    from workbench.target import load_target

    target = load_target(args.target, dtype=args.dtype)
    dtype = getattr(torch, args.dtype)
    llm = Llama(target.model, dtype)
    draft, draft_name = load_draft_for(target, args.draft, args.random_draft, dtype)
    eos = eos_ids(target.tokenizer)
    mt = load_mtbench()
    prompts = [prompt_ids(target.tokenizer, q.messages(1)) for q in mt[: args.n_prompts]]
    configs = parse_configs(args.configs)
    print(f"target {target.name} {args.dtype}, draft {draft_name}, {len(prompts)} MT-bench "
          f"prompts, {args.max_new_tokens} new tokens, threads {torch.get_num_threads()}")  # fmt: skip

    warm = build_methods(target, llm, draft, configs, 8, eos, with_hf=True)
    run_all(warm, prompts[:1], 8, eos)  # warm-up (first-call allocations, kernels)

    note = ""
    if args.auto:
        calib = [prompt_ids(target.tokenizer, q.messages(1)) for q in mt[-args.calib_prompts :]]
        methods = build_methods(target, llm, draft, configs, args.max_new_tokens, eos, False)
        res = run_all(methods, calib, args.max_new_tokens, eos)
        chosen, note = choose_params([measurement(n, r) for n, r in res.items()])
        print(f"auto (on {len(calib)} calibration prompts): {note}")
        configs = [chosen] if chosen else []

    methods = build_methods(target, llm, draft, configs, args.max_new_tokens, eos, True)
    res = run_all(methods, prompts, args.max_new_tokens, eos)
    meas = {n: measurement(n, r) for n, r in res.items()}
    hf, plain = meas["hf"].tok_s, meas["plain"].tok_s
    plain_outs = res["plain"]["outs"]

    print(f"\n{'method':<10}{'config':>9}{'tok/s':>9}{'tau':>7}{'vs hf':>8}{'vs plain':>10}"
          f"{'same as plain':>15}")  # fmt: skip
    for name, m in meas.items():
        kind = {"hf": "HF generate", "plain": "engine"}.get(name, "EAGLE-3")
        cfg = "-" if name in ("hf", "plain") else name
        same = sum(a == b for a, b in zip(res[name]["outs"], plain_outs, strict=True))
        print(f"{kind:<12}{cfg:>7}{m.tok_s:9.2f}{m.tau:7.2f}{m.tok_s / hf:8.2f}"
              f"{m.tok_s / plain:10.2f}{f'{same}/{len(plain_outs)}':>15}")  # fmt: skip
    spec = [m for m in meas.values() if m.params is not None]
    slower = [str(m.params) for m in spec if m.tok_s < plain]
    if slower:
        print(f"note: slower than plain decoding: {', '.join(slower)} (draft too weak for these "
              "steps; use fewer steps or --auto)")  # fmt: skip
    if spec:
        best = max(spec, key=lambda m: m.tok_s)
        tau, tok_s, cfg = best.tau, best.tok_s, str(best.params)
    else:  # --auto chose no speculation: the engine decodes plainly
        tau, tok_s, cfg = 1.0, plain, "none"
        print(f"note: {note}")
    print(f"RESULT dtype={args.dtype} tau={tau:.3f} tok_s_hf={hf:.2f} tok_s_plain={plain:.2f} "
          f"tok_s_spec={tok_s:.2f} speedup_vs_hf={tok_s / hf:.3f} "
          f"speedup_vs_plain={tok_s / plain:.3f} config={cfg}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
