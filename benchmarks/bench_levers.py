"""Draft-quality levers side by side: several drafts scored on ONE held-out capture and in the engine.

Each draft (`label=DIR`: a training run, checkpoint or export) is scored the same way:
- offline, on every sample of `--eval-capture` (a capture none of the drafts trained on; capture
  it in fp32 from prompts outside every training set): TTT-`--ttt` step-0 accuracy, simulated
  τ, and the same counting target tokens outside the draft vocab as misses (`acc0_all`,
  `tau_all`: what serving sees, and the fair figure across draft vocab sizes);
- in the embedded engine (fp32, greedy, chain of `--steps`), pooled τ on the first
  `--mtbench` MT-bench and `--humaneval` HumanEval prompts, `--new-tokens` each.

One line per draft: `RESULT label=... acc0=... tau=... acc0_all=... tau_all=... mtbench_tau=...
humaneval_tau=...`, a markdown table, then `RESULT drafts=N best_<figure>=<label> ...`.
Needs 2-4 min per draft on one thread (the engine part dominates); `--threads 1` lets two
copies share the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from workbench.draft.data import TargetHead, open_capture, target_argmax
from workbench.draft.evaluate import evaluate_stats
from workbench.draft.load import load_draft
from workbench.draft.ttt import TTTModel, summarize
from workbench.engine import SpecParams
from workbench.inspect import evaluate_draft, load_prompts
from workbench.llama import Llama
from workbench.target import load_target


def offline(loaded, reader, argmax, target, ttt: int) -> dict:
    draft = loaded.draft
    head = TargetHead(target.model, draft.draft_ids, torch.device("cpu"))
    model = TTTModel(draft, ttt, 0.8)
    idx = list(range(len(reader)))
    st = evaluate_stats(model, reader, idx, argmax, draft.t2d, head, 4, 2048,
                        torch.device("cpu"), contextlib.nullcontext)  # fmt: skip
    return summarize(st)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafts", nargs="+", help="label=DIR")
    ap.add_argument("--eval-capture", required=True)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--ttt", type=int, default=5)
    ap.add_argument("--mtbench", type=int, default=16)
    ap.add_argument("--humaneval", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pairs = []
    for spec in args.drafts:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            ap.error(f"draft {spec!r}: expected label=DIR")
        pairs.append((label, path))

    target = load_target(args.target, dtype="float32")
    reader = open_capture(args.eval_capture)
    head = TargetHead(target.model, torch.arange(8), torch.device("cpu"))
    argmax = target_argmax(reader, head, list(range(len(reader))), None, {})
    n_tok = sum(int(reader[i]["loss_mask"].sum()) for i in range(len(reader)))
    print(f"eval capture {args.eval_capture}: {len(reader)} samples, {n_tok} loss tokens")
    llm = Llama(target.model, "float32")
    sets = {"mtbench": args.mtbench, "humaneval": args.humaneval}
    prompts = {k: load_prompts(k, n) for k, n in sets.items() if n}
    rows = []
    for label, path in pairs:
        t0 = time.perf_counter()
        loaded = load_draft(path, target.model)
        loaded.draft.eval()
        s = offline(loaded, reader, argmax, target, args.ttt)
        row = {
            "label": label,
            "acc0": s["acc"][0],
            "tau": s["tau"],
            "acc0_all": s.get("acc_all", [float("nan")])[0],
            "tau_all": s.get("tau_all", float("nan")),
        }
        for k, ps in prompts.items():
            params = SpecParams(args.steps, 1, args.steps + 1)
            r = evaluate_draft(target, loaded.draft, ps, params, args.new_tokens, llm=llm)
            row[f"{k}_tau"] = r.tau
        rows.append(row)
        vals = " ".join(f"{k}={v:.4f}" for k, v in row.items() if k != "label")
        print(f"RESULT label={label} {vals}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    keys = [k for k in rows[0] if k != "label"]
    print("\n| draft | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['label']} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " |")
    best = {k: max(rows, key=lambda r, k=k: r[k])["label"] for k in keys}
    print(f"RESULT drafts={len(rows)} " + " ".join(f"best_{k}={v}" for k, v in best.items()))


if __name__ == "__main__":
    main()
