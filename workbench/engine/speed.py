"""Measured speed of speculative vs plain decoding, interleaved in one run, and the setting to
serve: chosen on calibration prompts, reported on other prompts.

Used by `benchmarks/bench_spec.py` and notebook 03. Every method decodes the same prompts
(batch 1) with the order rotated per prompt, so machine noise hits all methods alike. Choosing
the setting on the prompts it is then reported on would bias the reported speedup upward (the
winner of a noisy race looks faster than it is), so `speed_report` keeps the two apart.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from workbench import metrics
from workbench.engine.spec import SpecDecoder, SpecParams, resolve_params

DEFAULT_CONFIGS = "1/1/2,2/1/3,3/1/4,3/2/6,5/4/8"
PLAIN = "plain"  # the served setting when no speculative one beats plain decoding


@dataclass
class Measurement:
    """Decode speed of one setting (None = no speculation), measured in the same run."""

    params: SpecParams | None
    tokens: int
    seconds: float
    tau: float = 1.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def choose_params(
    measured: Sequence[Measurement], min_gain: float = 1.02
) -> tuple[SpecParams | None, str]:
    """Pick the setting to serve: the fastest speculative one if it beats plain decoding by
    `min_gain`, else no speculation. A weak draft's extra steps cost more draft forwards and a
    wider verify than its accepts earn, so fewer steps (down to none) win; the reason says so.
    This is a decision, not a figure: the speedups themselves are reported as measured.
    """
    plain = [m for m in measured if m.params is None]
    spec = sorted((m for m in measured if m.params is not None), key=lambda m: -m.tok_s)
    if len(plain) != 1:
        raise ValueError(
            f"choose_params needs exactly one baseline measurement (params=None), got {len(plain)}; "
            "leave out other baselines such as HF generate, or the ratio is taken against the wrong one"
        )
    if not spec:
        return None, "no speculative setting measured: decoding without speculation"
    best = spec[0]
    ratio = metrics.speedup(best.tok_s, plain[0].tok_s)
    if ratio >= min_gain:
        return best.params, (
            f"speculation {best.params} (tau {best.tau:.2f}): {ratio:.2f}x plain decoding"
        )
    return None, (
        f"no speculation: the best setting {best.params} (tau {best.tau:.2f}) reaches only "
        f"{ratio:.2f}x plain decoding; the draft is too weak to pay for its steps"
    )


def parse_config(item: str) -> SpecParams:
    """One "steps/topk/tokens" setting (e.g. "3/1/4"), validated by SGLang's rules."""
    parts = item.strip().split("/")
    if len(parts) != 3 or not all(x.strip().isdigit() for x in parts):
        raise ValueError(
            f"speculative setting {item.strip()!r}: expected steps/topk/tokens as three whole "
            "numbers, e.g. 3/1/4 (num_steps 3, eagle_topk 1, num_draft_tokens 4)"
        )
    return resolve_params(*(int(x) for x in parts))


def parse_configs(spec: str) -> list[SpecParams]:
    """Comma-separated settings, e.g. "1/1/2,3/1/4"."""
    return [parse_config(item) for item in spec.split(",")]


def served_setting(spec_config: str, fallback: SpecParams) -> tuple[SpecParams, str]:
    """The setting a server is launched with: `spec_config` ("steps/topk/tokens", typically
    notebook 03's `served_config`, chosen on calibration prompts) or `fallback`. When the
    calibration chose plain decoding, speculation is still measured, at `fallback`, so the
    report shows what it would cost; the returned note says which case applied."""
    value = spec_config.strip()
    if not value:
        return fallback, f"setting {fallback} (the notebook's num_steps/eagle_topk/tokens)"
    if value == PLAIN:
        return fallback, (
            f"the calibration chose plain decoding (no setting beat it); speculation is still "
            f"measured, at {fallback}, to show what it costs"
        )
    return parse_config(value), f"setting {value} (spec_config, chosen by a calibration)"


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

    methods[PLAIN] = run(plain)
    for c in configs:
        methods[str(c)] = run(SpecDecoder(llm, draft, c))
    return methods


def measurement(name: str, r: dict) -> Measurement:
    params = None if name in (PLAIN, "hf") else SpecParams(*map(int, name.split("/")))
    if name == "hf":  # HF generate counts no forwards; it decodes one token per forward
        return Measurement(params, r["tokens"], r["seconds"], 1.0)
    decode_tokens = r["tokens"] - len(r["outs"])  # the prefill's token is not a decode token
    return Measurement(params, r["tokens"], r["seconds"], metrics.tau(decode_tokens, r["verify"]))


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
    """Rows (method, config, tok/s, tau, speedups as measured, same-output count) plus the raw
    measurements and outputs. Speedups are against the engine's own plain decoding (and HF
    generate, shown apart). It chooses nothing: `speed_report` chooses on other prompts."""
    run_all(
        build_methods(target, llm, draft, configs, 8, eos, with_hf), prompts[:1], 8, eos
    )  # warm-up
    res = run_all(
        build_methods(target, llm, draft, configs, max_new, eos, with_hf), prompts, max_new, eos
    )
    meas = {n: measurement(n, r) for n, r in res.items()}
    plain = meas[PLAIN].tok_s
    hf = meas["hf"].tok_s if with_hf else None
    rows = []
    for name, m in meas.items():
        same = sum(a == b for a, b in zip(res[name]["outs"], res[PLAIN]["outs"], strict=True))
        rows.append(
            {
                "method": {"hf": "HF generate", PLAIN: "engine (no speculation)"}.get(
                    name, "EAGLE-3"
                ),
                "config": "-" if name in ("hf", PLAIN) else name,
                "tok_s": m.tok_s,
                "tau": m.tau,
                "vs_hf": metrics.speedup(m.tok_s, hf) if hf else None,
                "vs_plain": metrics.speedup(m.tok_s, plain),
                "same_as_plain": f"{same}/{len(prompts)}",
            }
        )
    return rows, {"measurements": meas, "results": res}


def speed_figures(served: SpecParams | None, rows: Sequence[dict]) -> dict:
    """Key figures of a speed table, as measured (below 1 included, never clamped):

    - best_speedup: the fastest speculative setting's tok/s over plain decoding's (None when no
      speculative setting was measured), and best_speedup_config, the setting it belongs to;
    - served_config: the setting chosen to serve ("plain" when none beat plain decoding);
    - served_speedup: the served setting's speedup on these rows (None when serving plain);
    - served_speedup_vs_hf: the served setting (or plain decoding) against HF generate.
    """
    spec = [r for r in rows if r["config"] != "-"]
    best = max(spec, key=lambda r: r["vs_plain"], default=None)
    served_row = next((r for r in spec if r["config"] == str(served)), None)
    if served is not None and served_row is None:
        raise ValueError(f"served setting {served} was not measured in these rows")
    base = served_row or next(r for r in rows if r["method"].startswith("engine"))
    return {
        "best_speedup": best["vs_plain"] if best else None,
        "best_speedup_config": best["config"] if best else None,
        "served_config": str(served) if served is not None else PLAIN,
        "served_speedup": served_row["vs_plain"] if served_row else None,
        "served_speedup_vs_hf": base["vs_hf"],
    }


@dataclass
class SpeedReport:
    """The served setting, chosen on calibration prompts, and the table measured on other
    (reporting) prompts; `figures` are the reporting prompts' figures."""

    served: SpecParams | None
    reason: str
    calibration: list[dict]
    rows: list[dict]
    measurements: dict[str, Measurement] = field(default_factory=dict)
    results: dict = field(default_factory=dict)

    @property
    def figures(self) -> dict:
        return speed_figures(self.served, self.rows)


def speed_report(
    target,
    llm,
    draft,
    calibration_prompts: list[list[int]],
    report_prompts: list[list[int]],
    configs: list[SpecParams],
    max_new: int,
    eos: list[int],
    *,
    with_hf: bool = True,
    report_all: bool = True,
) -> SpeedReport:
    """Choose the setting to serve on `calibration_prompts`, measure on `report_prompts`.

    `report_all` measures every candidate on the reporting prompts (the best raw speedup is then
    known even when plain decoding is served); otherwise only plain decoding and the served one."""
    if not calibration_prompts or not report_prompts:
        raise ValueError(
            f"speed_report needs calibration and reporting prompts, got {len(calibration_prompts)} "
            f"and {len(report_prompts)}; use a larger prompt set or fewer reporting prompts"
        )
    overlap = {tuple(p) for p in calibration_prompts} & {tuple(p) for p in report_prompts}
    if overlap:
        raise ValueError(
            f"{len(overlap)} prompt(s) are both calibration and reporting prompts; take the "
            "calibration prompts from another slice of the prompt set"
        )
    calib, extra = speed_table(
        target, llm, draft, calibration_prompts, configs, max_new, eos, with_hf=False
    )
    plain_and_spec = [m for n, m in extra["measurements"].items() if n != "hf"]
    served, reason = choose_params(plain_and_spec)
    chosen = configs if report_all else [c for c in configs if c == served]
    rows, extra = speed_table(target, llm, draft, report_prompts, chosen, max_new, eos, with_hf)
    return SpeedReport(served, reason, calib, rows, extra["measurements"], extra["results"])
