"""Step-count sweep of the embedded engine (local backend) and the cost model's prediction.

Grid over speculative_num_steps x eagle_topk x num_draft_tokens (SGLang's rules applied;
the no-speculation baseline always included), MT-bench first turns, batch 1, greedy. The
cost model is fitted on `--calibration` configs (the baseline, the deepest and shallowest
chain, the widest tree, ...) and predicts every config. Resumable: the sweep folder
(`--out`, default `$WORKBENCH_HOME/sweeps/steps-<workload hash>`) keeps one JSON line per
finished config, and a rerun skips them.

Prints the table (measured and predicted tau and tok/s, error, speedup over plain decoding)
and ends with `RESULT configs=N best=<s/k/n> predicted=<s/k/n> best_gap=<1 - measured tok/s
at the predicted config / measured best> rank_corr=<Spearman> mean_abs_error=...`.

Run: `python benchmarks/bench_steps.py [--draft RUN_DIR] [--steps 1,2,3,4,5] [--topk 1,2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["engine", "local", "sglang"], default="engine",
                    help="engine: in process; local/sglang: a server per config over HTTP")  # fmt: skip
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="draft run/export (default: the demo's)")
    ap.add_argument("--steps", default="1,2,3,4,5")
    ap.add_argument("--topk", default="1,2")
    ap.add_argument("--ndt", default="0,6", help="draft tokens; 0 = steps + 1")
    ap.add_argument("--batch", default="1", help="batch sizes (client concurrency when served)")
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--calibration", type=int, default=3, help="speculative configs to fit on")
    ap.add_argument("--out", default=None, help="sweep folder (resumable)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("MKL_CBWR", "AVX512")
    if args.threads:
        torch.set_num_threads(args.threads)

    from workbench.errors import WorkbenchError
    from workbench.experiments.steps import (
        adaptive_line,
        drift_warning,
        format_table,
        result_line,
        run_step_sweep,
    )
    from workbench.pipeline import default_draft_dir

    draft = args.draft or str(default_draft_dir("quick"))
    try:
        out = run_step_sweep(
            args.out, backend=args.backend, target=args.target, draft=draft,
            batch_size=ints(args.batch), num_steps=ints(args.steps),
            eagle_topk=ints(args.topk), num_draft_tokens=[n or None for n in ints(args.ndt)],
            n_prompts=args.n_prompts, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
            calibration=args.calibration,
        )  # fmt: skip
    except WorkbenchError as e:
        sys.exit(f"error: {e}")
    print(f"target {args.target} {args.dtype}, draft {draft}, {args.n_prompts} MT-bench prompts, "
          f"{args.max_new_tokens} new tokens, threads {torch.get_num_threads()}, "
          f"sweep folder {out['out_dir']}")  # fmt: skip
    for cfg, why in out["rejected"]:
        print(f"skipped {cfg['num_steps']}/{cfg['eagle_topk']}/{cfg['num_draft_tokens']}: {why}")
    for r in out["rows"]:
        if r["status"] != "ok":
            print(f"FAILED {r['label']}: {r['error']}")
    rep = out["report"]
    if rep is None:
        sys.exit(f"no cost model: {out['model_error']}")
    m = rep["model"]
    print(f"\nmodel: acceptance {[round(a, 3) for a in m['acceptance']]} ({m['acceptance_source']})"
          f", gamma {m['gamma']} ({m['gamma_source']}), other {m['other_ms']:.2f} ms/cycle")  # fmt: skip
    print(json.dumps({k: [round(v, 4) for v in m[k]] for k in
                      ("draft_coef", "verify_coef", "extend_coef")}))  # fmt: skip
    print("\n" + format_table(rep) + "\n(* = calibration config the model was fitted on)")
    print(adaptive_line(rep))
    if warn := drift_warning(rep):
        print(warn)
    print(result_line(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
