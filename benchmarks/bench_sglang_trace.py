"""Overhead of the workbench_trace SGLang plugin: the same EAGLE-3 server and prompts, served
once without the plugin and once with it (optionally with per-aux-layer norms), sequential
greedy requests; output tok/s of each and the ratio. One run each: on a shared CPU the
noise between two runs is of the same order as the overhead, so read it as a bound.

  .venv/bin/python benchmarks/bench_sglang_trace.py [--draft DIR] [--hidden] [--new-tokens N]

Without --draft it exports the tests' built "repeat" draft for the embedded target."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from workbench.serving import sglang

PROMPTS = [
    "a b c a b c a b c a b c a b c",
    "The capital of France is",
    "Water boils at a lower temperature on a high mountain because",
    "A good way to learn a new language is to",
]


def serve_and_time(spec: sglang.ServeSpec, prompts: list[list[int]], n: int, log: Path) -> float:
    srv = sglang.launch(spec, log, deadline_s=600)
    print(f"healthy after {srv.start_s:.1f} s (trace_dir={spec.trace_dir})", flush=True)
    try:
        sglang.generate(srv.url, prompts[0], 4)  # first-request effects out of the timing
        t0, toks = time.perf_counter(), 0
        for p in prompts:
            toks += sglang.generate(srv.url, p, n)["meta_info"]["completion_tokens"]
        return toks / (time.perf_counter() - t0)
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--hidden", action="store_true", help="also record per-aux-layer norms")
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args()
    from workbench.target import load_target

    target = load_target(a.target)
    work = Path(tempfile.mkdtemp(prefix="bench-trace-"))
    draft = a.draft
    if draft is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from sglang_common import export_repeat_draft

        draft = str(export_repeat_draft(target, work / "draft"))
    ids = [target.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    spec = sglang.ServeSpec(target=str(target.path), draft=draft, speculative_num_steps=3,
                            speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                            dtype="float32", device="cpu")  # fmt: skip
    off = serve_and_time(spec, ids, a.new_tokens, work / "off.log")
    traced = replace(spec, trace_dir=str(work / "trace"), trace_hidden=a.hidden)
    on = serve_and_time(traced, ids, a.new_tokens, work / "on.log")
    print(f"without plugin: {off:.2f} tok/s; with plugin (hidden={a.hidden}): {on:.2f} tok/s")
    print(f"RESULT sglang_trace_overhead tok_s_off={off:.2f} tok_s_on={on:.2f} "
          f"ratio_on_off={on / off:.3f} hidden={a.hidden}")  # fmt: skip


if __name__ == "__main__":
    main()
