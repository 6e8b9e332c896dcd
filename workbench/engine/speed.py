"""Measured speed of speculative vs plain decoding, interleaved in one run.

Used by `benchmarks/bench_spec.py` and notebook 03. Every method decodes the same prompts
(batch 1) with the order rotated per prompt, so machine noise hits all methods alike.
"""

from __future__ import annotations

import time

import torch

from workbench.engine.spec import (
    Measurement,
    SpecDecoder,
    SpecParams,
    choose_params,
    resolve_params,
)

DEFAULT_CONFIGS = "1/1/2,2/1/3,3/1/4,3/2/6,5/4/8"


def parse_configs(spec: str) -> list[SpecParams]:
    out = []
    for item in spec.split(","):
        s, k, n = (int(x) for x in item.strip().split("/"))
        out.append(resolve_params(s, k, n))
    return out


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


def speed_table(
    target,
    llm,
    draft,
    prompts: list[list[int]],
    configs: list[SpecParams],
    max_new: int,
    eos: list[int],
    with_hf: bool = True,
) -> tuple[list[dict], dict]:
    """Rows (method, config, tok/s, tau, ratios, same-output count) plus the raw results and
    the setting to serve, chosen against the engine's own plain decoding (never HF generate)."""
    run_all(
        build_methods(target, llm, draft, configs, 8, eos, with_hf), prompts[:1], 8, eos
    )  # warm-up
    res = run_all(
        build_methods(target, llm, draft, configs, max_new, eos, with_hf), prompts, max_new, eos
    )
    meas = {n: measurement(n, r) for n, r in res.items()}
    plain = meas["plain"].tok_s
    hf = meas["hf"].tok_s if with_hf else None
    rows = []
    for name, m in meas.items():
        same = sum(a == b for a, b in zip(res[name]["outs"], res["plain"]["outs"], strict=True))
        rows.append(
            {
                "method": {"hf": "HF generate", "plain": "engine (no speculation)"}.get(
                    name, "EAGLE-3"
                ),
                "config": "-" if name in ("hf", "plain") else name,
                "tok_s": m.tok_s,
                "tau": m.tau,
                "vs_hf": m.tok_s / hf if hf else None,
                "vs_plain": m.tok_s / plain,
                "same_as_plain": f"{same}/{len(prompts)}",
            }
        )
    chosen, reason = choose_params([m for n, m in meas.items() if n != "hf"])
    return rows, {"measurements": meas, "results": res, "chosen": chosen, "reason": reason}
