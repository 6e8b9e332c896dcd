"""EAGLE-3 speculative decoding vs HF `generate` vs the engine without speculation.

MT-bench first turns (chat template), batch 1, greedy, one dtype, all methods in ONE run and
interleaved per prompt (the order rotates), so machine noise hits every method alike.
Prints a table (tok/s, tau, speedups against both baselines, output identical to plain?) and,
last, `RESULT dtype=... tau=... tok_s_hf=... tok_s_plain=... tok_s_spec=... speedup_vs_hf=...
speedup_vs_plain=... config=steps/topk/ndt` for the best reported setting.

`--auto` chooses the setting to serve on separate calibration prompts (MT-bench's last ones):
the fastest one if it beats plain decoding, else "no speculation" (config=none), and reports
only that on the other prompts (`engine.speed.speed_report`, the same function notebook 03
uses). Speedups are printed as measured, below 1 included.

Run: `python benchmarks/bench_spec.py [--draft PATH] [--dtype float32|bfloat16] [--auto]`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from workbench.engine.speed import DEFAULT_CONFIGS, parse_configs, speed_report, speed_table
from workbench.llama import Llama
from workbench.metrics import speedup


def default_draft_path() -> Path:
    """The draft the README's main command (`make demo` = `workbench pipeline`) trains."""
    from workbench.pipeline import default_draft_dir

    return default_draft_dir("quick")


def load_draft_for(target, path: str | None, random_draft: bool, dtype: torch.dtype):
    """The draft to measure: any directory `load_draft` reads, or an untrained one."""
    from workbench.draft.load import load_draft
    from workbench.draft.model import DraftConfig, Eagle3Draft, init_from_target
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
    loaded = load_draft(p, target.model)
    for w in loaded.warnings:
        print(f"warning ({p}): {w}")
    return loaded.draft.to(dtype).eval(), f"{p} ({loaded.source})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument(
        "--draft", default=None, help="trained draft (default: the one `make demo` trained)"
    )
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

    note = ""
    if args.auto:
        calib = [prompt_ids(target.tokenizer, q.messages(1)) for q in mt[-args.calib_prompts :]]
        sr = speed_report(target, llm, draft, calib, prompts, configs, args.max_new_tokens, eos,
                          with_hf=True, report_all=False)  # fmt: skip
        rows, meas, note = sr.rows, sr.measurements, sr.reason
        print(f"auto (chosen on {len(calib)} calibration prompts): {note}")
    else:
        rows, extra = speed_table(
            target, llm, draft, prompts, configs, args.max_new_tokens, eos, with_hf=True
        )
        meas = extra["measurements"]
    hf, plain = meas["hf"].tok_s, meas["plain"].tok_s
    print(
        f"\n{'method':<26}{'config':>7}{'tok/s':>9}{'tau':>7}{'vs hf':>8}{'vs plain':>10}{'same as plain':>15}"
    )
    for r in rows:
        print(f"{r['method']:<26}{r['config']:>7}{r['tok_s']:9.2f}{r['tau']:7.2f}{r['vs_hf']:8.2f}"
              f"{r['vs_plain']:10.2f}{r['same_as_plain']:>15}")  # fmt: skip
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
          f"tok_s_spec={tok_s:.2f} speedup_vs_hf={speedup(tok_s, hf):.3f} "
          f"speedup_vs_plain={speedup(tok_s, plain):.3f} config={cfg}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
