"""Offline acceptance views of an EAGLE-3 draft served by the embedded engine.

Why: high training accuracy with low serving τ is the common failure. These views (pooled τ,
per-position acceptance, τ by category, the cycle's time split, which tokens the draft misses)
run on one machine before any cluster is involved; `workbench.audit` then checks the wiring.

Every figure comes from `workbench.metrics` (conventions named there): `tau` excludes the
prefill's token, `tau_sglang` is SGLang's `spec_accept_length` (it counts it), the mean of
per-request τ is a different number and labelled so, per-position acceptance is conditional
(exact for chain drafting), simulated τ includes the bonus token.
"""

from __future__ import annotations

import html
import time
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from workbench import metrics
from workbench.data import spread
from workbench.engine import CycleRecord, SpecDecoder, SpecParams, TraceWriter
from workbench.layers import CANONICAL, LayerIds

# ---------------------------------------------------------------- prompts


@dataclass
class EvalPrompt:
    id: str
    category: str
    ids: list[int]


def prepare_prompts(target: Any, prompts: Sequence[Any]) -> list[EvalPrompt]:
    """First user turn of each `data.Prompt` (chat template + generation prompt), or raw id lists."""
    from workbench.data import Prompt, prompt_ids

    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, EvalPrompt):
            out.append(p)
        elif isinstance(p, Prompt):
            out.append(EvalPrompt(p.id, p.category, prompt_ids(target.tokenizer, p.messages(1))))
        else:
            out.append(EvalPrompt(str(i), "-", [int(t) for t in p]))
    return out


def load_prompts(prompt_set: str, n: int | None) -> list[Any]:
    """The first n prompts of a set ('mtbench', 'humaneval', 'train', a .jsonl), first turns only."""
    from workbench.data import load_prompt_set, select

    return select(load_prompt_set(prompt_set), n or None, first_turn_only=True)


def calibration_prompts(
    pool: Sequence[Any], n: int, report_ids: Iterable[str], inspected_ids: Iterable[str] = ()
) -> list[Any]:
    """The prompts on which the setting to serve is chosen: never a reporting prompt, not an
    inspected one while enough others remain, and spread evenly over the rest of the set.
    Sets like MT-bench are ordered by category (8 blocks of 10); a setting chosen on the set's
    last prompts was chosen on one category (humanities essays, where a draft accepts least)."""
    report, inspected = set(report_ids), set(inspected_ids)
    allowed = [p for p in pool if p.id not in report]
    fresh = [p for p in allowed if p.id not in inspected]
    return spread(fresh if len(fresh) >= n else allowed, n)


# ---------------------------------------------------------------- offline metrics


@dataclass
class RequestResult:
    """One prompt's generation. `accepted[c]` = tokens emitted in decode cycle c, bonus included."""

    id: str
    category: str
    prompt: list[int]
    tokens: list[int]  # tokens[0] comes from prefill, the rest from decode cycles
    accepted: list[int]
    num_steps: int

    @property
    def verify_forwards(self) -> int:
        return len(self.accepted)

    @property
    def decode_tokens(self) -> int:
        return sum(self.accepted)

    @property
    def tau(self) -> float:
        """Decode tokens per verify forward (prefill token excluded, bonus included)."""
        return metrics.tau(self.decode_tokens, self.verify_forwards)

    def sources(self) -> list[str]:
        """Per generated token: prefill | draft (accepted) | bonus (all drafts accepted) | correction.

        A cycle with count a emitted a-1 accepted draft tokens then one target token; the last
        cycle may have been cut at eos / max_new_tokens, which the counts cannot show (at most
        one token per request is labelled 'correction' where it was a draft token)."""
        out = ["prefill"] if self.tokens else []
        for a in self.accepted:
            out += ["draft"] * (a - 1) + ["bonus" if a - 1 >= self.num_steps else "correction"]
        return out[: len(self.tokens)]


@dataclass
class EvalResult:
    """Offline metrics of one draft + wiring over a prompt set (greedy unless temperature > 0)."""

    params: SpecParams
    layer_ids: LayerIds  # the aux layers served
    requests: list[RequestResult]
    cycles: list[CycleRecord] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def accepted(self) -> list[list[int]]:
        return [r.accepted for r in self.requests]

    @property
    def tau(self) -> float:
        """Pooled τ: Σ decode tokens / Σ verify forwards (bonus in, prefill token out)."""
        return metrics.pooled_tau(self.accepted)

    @property
    def tau_sglang(self) -> float:
        """SGLang's spec_accept_length: Σ completion tokens (prefill token in) / Σ verify forwards."""
        return metrics.pooled_tau_sglang(
            [len(r.tokens) for r in self.requests], [r.verify_forwards for r in self.requests]
        )

    @property
    def mean_request_tau(self) -> float:
        """Mean of per-request τ (not the pooled τ)."""
        return metrics.mean_request_tau(self.accepted)

    @property
    def accept_counts(self) -> tuple[list[int], list[int]]:
        return metrics.acceptance_counts(self.accepted, self.params.num_steps)

    @property
    def accept_pos(self) -> list[float]:
        return metrics.per_position_acceptance(self.accepted, self.params.num_steps)

    @property
    def sim_tau(self) -> float:
        return metrics.simulated_tau(self.accept_pos)

    def by_category(self) -> list[dict]:
        return category_table(self)

    def time_breakdown(self) -> dict:
        return time_breakdown(self.cycles)

    def summary(self) -> dict:
        return {
            "params": str(self.params),
            "layer_ids": self.layer_ids.to_dict(),
            "requests": len(self.requests),
            "completion_tokens": sum(len(r.tokens) for r in self.requests),
            "verify_forwards": sum(r.verify_forwards for r in self.requests),
            "tau": round(self.tau, 4),
            "tau_sglang": round(self.tau_sglang, 4),
            "mean_request_tau": round(self.mean_request_tau, 4),
            "sim_tau": round(self.sim_tau, 4),
            "accept_pos": [round(a, 4) for a in self.accept_pos],
            "seconds": round(self.seconds, 2),
        }


def evaluate_draft(
    target: Any,
    draft: Any,
    prompts: Sequence[Any],
    params: SpecParams | None = None,
    max_new_tokens: int = 128,
    *,
    llm: Any = None,
    dtype: str = "float32",
    layer_ids: LayerIds | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    eos: Sequence[int] | None = None,
    progress: bool = False,
) -> EvalResult:
    """Generate every prompt with the embedded engine, batch 1; keep counts, tokens and the trace.

    `target` is a `workbench.target.Target` (its tokenizer formats `data.Prompt`s and gives eos);
    `prompts` are `Prompt`s or token-id lists. `layer_ids` overrides the draft's aux wiring (the
    audit's what-if). Default params: chain, 5 steps (per-position acceptance is exact for chains).
    """
    from tqdm.auto import tqdm

    from workbench.llama import Llama

    if llm is None:
        llm = Llama(target.model, dtype)
    if eos is None:
        from workbench.data import eos_ids

        eos = eos_ids(target.tokenizer) if target is not None else ()
    params = params or SpecParams(5, 1, 6)
    items = prepare_prompts(target, prompts)
    trace = TraceWriter(hidden_norms=True)
    dec = SpecDecoder(llm, draft, params, temperature=temperature, seed=seed, trace=trace,
                      layer_ids=layer_ids)  # fmt: skip
    t0 = time.perf_counter()
    reqs = []
    for it in tqdm(items, desc="evaluate", disable=not progress):
        g = dec.generate(it.ids, max_new_tokens, eos, it.id)
        reqs.append(RequestResult(it.id, it.category, it.ids, g.tokens, list(g.stats.accepted),
                                  params.num_steps))  # fmt: skip
    served = LayerIds(tuple(dec.aux_ids), CANONICAL)
    return EvalResult(params, served, reqs, trace.records, time.perf_counter() - t0)


def category_table(result: EvalResult) -> list[dict]:
    """Pooled τ and first-position acceptance per prompt category (e.g. MT-bench's 8)."""
    groups: dict[str, list[RequestResult]] = {}
    for r in result.requests:
        groups.setdefault(r.category, []).append(r)
    rows = []
    for cat, rs in sorted(groups.items()):
        acc = [r.accepted for r in rs]
        a = metrics.per_position_acceptance(acc, result.params.num_steps)
        rows.append({"category": cat, "requests": len(rs), "tokens": sum(len(r.tokens) for r in rs),
                     "tau": metrics.pooled_tau(acc), "accept_pos0": a[0] if a else 0.0,
                     "sim_tau": metrics.simulated_tau(a)})  # fmt: skip
    return rows


def time_breakdown(cycles: Sequence[CycleRecord]) -> dict:
    """Mean ms per decode cycle: draft steps, draft extend (over accepted tokens), verify, other.

    `other` is the cycle's remainder and is not clamped: each cycle's total spans its parts, so a
    negative `other` means the trace is inconsistent (parts timed on another pass than the cycle),
    and hiding it would hide that bug.
    """
    n = len(cycles)
    if not n:
        return {"cycles": 0}
    d = sum(c.draft_ms for c in cycles) / n
    e = sum(c.extend_ms for c in cycles) / n
    v = sum(c.verify_ms for c in cycles) / n
    t = sum(c.total_ms for c in cycles) / n
    o = t - d - e - v
    parts = {"draft_ms": d, "extend_ms": e, "verify_ms": v, "other_ms": o}
    return {"cycles": n, **parts, "total_ms": t,
            "share": {k[:-3]: p / t if t else 0.0 for k, p in parts.items()}}  # fmt: skip


def cycle_anatomy(
    cycles: Sequence[CycleRecord], request_ids: Collection[str] | None = None
) -> dict:
    """One trace's cycle views (the engine's or the SGLang plugin's: same schema).

    `time`: `time_breakdown` (the share of draft / verify / extend per cycle); `accepted`:
    request id → [(cycle, tokens emitted that cycle, bonus included)] in cycle order, the
    accept length over time SGLang's counters average away (only `request_ids` when given:
    a load's own requests, not the others that shared its batches); `hidden_in_dims`: each
    distinct list of widths fed to the draft steps ([k*H, H, ...] when wired right) with its
    cycle count.
    """
    want = None if request_ids is None else set(request_ids)
    accepted: dict[str, list[tuple[int, int]]] = {}
    for c in sorted(cycles, key=lambda c: (c.rank, c.cycle)):
        for rid, a in zip(c.request_ids, c.accepted, strict=True):
            if want is None or rid in want:
                accepted.setdefault(rid, []).append((c.cycle, a))
    dims = Counter(tuple(c.hidden_in_dims) for c in cycles if c.hidden_in_dims)
    return {"time": time_breakdown(cycles), "accepted": accepted,
            "hidden_in_dims": [{"dims": list(d), "cycles": n} for d, n in dims.most_common()]}  # fmt: skip


def _piece(tokenizer: Any, tok: int) -> str:
    return tokenizer.decode([tok]) if tokenizer is not None else f"<{tok}>"


def missed_tokens(result: EvalResult, tokenizer: Any = None, top: int = 15) -> list[dict]:
    """Target tokens the draft failed to propose (a 'correction' after a rejection), most often
    first, with how often each occurred in the answers: where the draft is systematically weak."""
    seen, missed = Counter(), Counter()
    for r in result.requests:
        for tok, src in zip(r.tokens, r.sources(), strict=True):
            seen[tok] += 1
            missed[tok] += src == "correction"
    rows = [{"token": _piece(tokenizer, t), "id": t, "missed": m, "seen": seen[t],
             "miss_rate": m / seen[t]} for t, m in missed.most_common() if m]  # fmt: skip
    return rows[:top]


_COLORS = {"prefill": "#e0e0e0", "draft": "#b7e4c7", "bonus": "#a0c4ff", "correction": "#ffadad"}


def token_html(result: EvalResult, tokenizer: Any = None, n: int = 3, max_tokens: int = 200) -> str:
    """Self-contained HTML: the first n answers, each token coloured by who produced it."""
    legend = " ".join(
        f'<span style="background:{c};padding:0 4px">{k}</span>' for k, c in _COLORS.items()
    )
    parts = [f'<div style="font-family:monospace;font-size:13px;line-height:1.7">'
             f"<div>{legend} (draft = accepted from the draft; correction = the target's token "
             "where the draft's was rejected; bonus = target token after all drafts accepted)</div>"]  # fmt: skip
    for r in result.requests[:n]:
        spans = []
        for tok, src in list(zip(r.tokens, r.sources(), strict=True))[:max_tokens]:
            text = html.escape(_piece(tokenizer, tok)).replace("\n", "↵<br>")
            spans.append(f'<span title="{src}" style="background:{_COLORS[src]}">{text}</span>')
        parts.append(f'<div style="margin:8px 0;padding:6px;border:1px solid #ccc">'
                     f"<b>{html.escape(r.id)}</b> ({html.escape(r.category)}, τ {r.tau:.2f})<br>"
                     + "".join(spans) + "</div>")  # fmt: skip
    return "".join(parts) + "</div>"
