"""The engine's draft on packed weights (`engine.spec.packed_draft`) vs on `nn.Linear`.

The engine runs the draft at 1 row (the extend of a chain, each chain step) or `topk` rows
(tree steps). `nn.Linear` sends those small fp32 matmuls to MKL's sgemm, which runs slower
kernels on AMD CPUs; the packed copy runs them like the target's (`llama.linear`). Two parts,
both in ONE run:

1. one draft forward after a 300-token draft cache, at 1 and at `topk` rows (tree-step
   shape), interleaved, medians;
2. speculative decoding on MT-bench first turns (greedy, batch 1), for each setting the
   engine with the packed draft and with the `nn.Linear` one, plus plain decoding,
   interleaved per prompt (`engine.speed.run_all`); outputs must be identical.

Last line: `RESULT draft_ms_1=... packed_ms_1=... draft_ms_4=... packed_ms_4=...
speedup_<s>_<k>_<n>=...` (speedup: tok/s with the packed draft / with nn.Linear).
Run: `python benchmarks/bench_draft_pack.py [--draft PATH] [--configs 1/1/2,4/4/8]
[--n-prompts 6]` (default draft: the one `make demo` trains).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spec import load_draft_for  # noqa: E402

from workbench.engine.spec import SpecDecoder, check_draft, packed_draft  # noqa: E402
from workbench.engine.speed import PLAIN, parse_configs, run_all  # noqa: E402
from workbench.llama import Llama  # noqa: E402


def forward_ms(draft, rows: int, reps: int = 40) -> float:
    """Median ms of one cached draft forward over `rows` new tokens (300 cached before)."""
    from workbench.draft.model import KVCache

    g = torch.Generator().manual_seed(0)
    H, n = draft.config.hidden_size, 300
    ids = torch.randint(0, draft.config.vocab_size, (1, n), generator=g)
    cache = KVCache()
    with torch.no_grad():
        draft(
            ids,
            torch.randn(1, n, draft.config.fc_in_features, generator=g),
            torch.arange(n)[None],
            cache=cache,
        )
        mask = torch.ones(rows, n + rows, dtype=torch.bool)
        h, pos = torch.randn(1, rows, H, generator=g), torch.full((1, rows), n)
        times = []
        for _ in range(reps):
            cache.crop(n)
            t = time.perf_counter()
            draft(ids[:, :rows], h, pos, cache=cache, attn_mask=mask)
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", default=None, help="trained draft (default: the demo's)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--configs", default="1/1/2,2/1/3,3/2/6,4/4/8")
    ap.add_argument("--n-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    os.environ.setdefault("MKL_CBWR", "AVX512")
    from workbench.data import eos_ids, load_mtbench, prompt_ids
    from workbench.target import load_target

    target = load_target(args.target, dtype="float32")
    llm = Llama(target.model, torch.float32)
    draft, name = load_draft_for(target, args.draft, False, torch.float32)
    configs = parse_configs(args.configs)
    check_draft(llm, draft)  # fills the embedding from the target where the export has none
    packed = packed_draft(llm, draft)
    if packed is draft:
        sys.exit("this target is not packed here (no oneDNN): nothing to compare")
    topk = max(c.eagle_topk for c in configs)
    f = {}
    for _ in range(3):  # interleaved rounds
        for label, d in (("draft", draft), ("packed", packed)):
            for rows in sorted({1, topk}):
                f.setdefault((label, rows), []).append(forward_ms(d, rows))
    fm = {key: statistics.median(v) for key, v in f.items()}
    print(f"target {target.name} float32, draft {name}, threads {torch.get_num_threads()}")
    for rows in sorted({1, topk}):
        print(f"one draft forward, {rows} row(s): nn.Linear {fm['draft', rows]:.2f} ms, "
              f"packed {fm['packed', rows]:.2f} ms")  # fmt: skip

    eos = eos_ids(target.tokenizer)
    prompts = [
        prompt_ids(target.tokenizer, q.messages(1)) for q in load_mtbench()[: args.n_prompts]
    ]

    def run(dec):
        def go(p):
            g = dec.generate(p, args.max_new_tokens, eos)
            return g.tokens, g.stats.verify_forwards

        return go

    methods = {PLAIN: run(SpecDecoder(llm, None))}
    for c in configs:
        methods[f"{c} packed"] = run(SpecDecoder(llm, draft, c))
        methods[f"{c} nn.Linear"] = run(SpecDecoder(llm, draft, c, pack_draft=False))
    run_all(methods, prompts[:1], 8, eos)  # warm-up
    res = run_all(methods, prompts, args.max_new_tokens, eos)
    tok_s = {n: r["tokens"] / r["seconds"] for n, r in res.items()}
    print(
        f"\n{len(prompts)} MT-bench prompts, {args.max_new_tokens} new tokens; plain {tok_s[PLAIN]:.1f} tok/s"
    )
    print(f"{'config':>7}{'packed':>9}{'nn.Linear':>11}{'ratio':>7}{'vs plain':>10}  same output")
    parts = [
        f"draft_ms_{r}={fm['draft', r]:.2f} packed_ms_{r}={fm['packed', r]:.2f}"
        for r in sorted({1, topk})
    ]

    def same_as_plain(name: str) -> int:
        return sum(x == y for x, y in zip(res[name]["outs"], res[PLAIN]["outs"], strict=True))

    for c in configs:
        a, b = tok_s[f"{c} packed"], tok_s[f"{c} nn.Linear"]
        same, same_b = same_as_plain(f"{c} packed"), same_as_plain(f"{c} nn.Linear")
        print(
            f"{str(c):>7}{a:9.1f}{b:11.1f}{a / b:7.3f}{a / tok_s[PLAIN]:10.3f}  {same}/{same_b} of {len(prompts)}"
        )
        parts.append(f"speedup_{c.num_steps}_{c.eagle_topk}_{c.num_draft_tokens}={a / b:.3f}")
    print("RESULT " + " ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
