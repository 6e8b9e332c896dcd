"""Every accept-length figure, named once.

Two conventions exist and are never mixed:
- `tau`: decode tokens per target verify forward. The prefill's token is not counted; the
  bonus token is. Plain decoding gives exactly 1.0.
- `tau_sglang`: what SGLang reports as `spec_accept_length`: completion tokens /
  `spec_verify_ct`, so the prefill's token is counted (tau_sglang > tau on short outputs).

Pooled figures are Σ tokens / Σ verify forwards over requests; a mean of per-request τ is a
different number and is named `mean_request_tau`. Per-position acceptance a_i is conditional:
P(draft token i accepted | tokens < i accepted). Simulated τ = 1 + Σ_k Π_{j≤k} a_j includes
the bonus token; SpecForge's `simulated_acc_len` omits the 1.

SGLang's identities (PR #33518), checked on every run by `sglang_identity_problems`:
accept length = completion_tokens / spec_verify_ct; Σ spec_correct_drafts_histogram =
spec_verify_ct; Σ i·h[i] = spec_num_correct_drafts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def tau(decode_tokens: int, verify_forwards: int) -> float:
    """Decode tokens per verify forward (prefill token excluded, bonus included)."""
    return decode_tokens / verify_forwards if verify_forwards else 0.0


def tau_sglang(completion_tokens: int, verify_ct: int) -> float:
    """SGLang's `spec_accept_length`: completion tokens (prefill's counted) / verify count."""
    return completion_tokens / verify_ct if verify_ct else 0.0


def pooled_tau(accepted: Sequence[Sequence[int]]) -> float:
    """Pooled τ over requests, each a list of per-cycle emitted counts (bonus included)."""
    return tau(sum(sum(a) for a in accepted), sum(len(a) for a in accepted))


def pooled_tau_sglang(completion_tokens: Sequence[int], verify_cts: Sequence[int]) -> float:
    """Pooled SGLang accept length: Σ completion tokens / Σ verify counts."""
    return tau_sglang(sum(completion_tokens), sum(verify_cts))


def bootstrap_pooled_tau(tokens: Any, verifies: Any, n_boot: int, seed: int) -> Any:
    """Pooled τ per bootstrap resample of requests, paired across rows.

    tokens / verifies: arrays [W, P] (W settings, e.g. wirings, x P requests) of decode tokens
    and verify forwards; returns [W, n_boot]. Every row uses the same resampled requests, so
    differences between rows are paired."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens, verifies = np.asarray(tokens, dtype=float), np.asarray(verifies, dtype=float)
    idx = rng.integers(0, tokens.shape[1], size=(n_boot, tokens.shape[1]))
    return tokens[:, idx].sum(-1) / np.maximum(verifies[:, idx].sum(-1), 1)


def mean_request_tau(accepted: Sequence[Sequence[int]]) -> float:
    """Mean of per-request τ (NOT the pooled τ; requests with no cycle are left out)."""
    taus = [tau(sum(a), len(a)) for a in accepted if len(a)]
    return sum(taus) / len(taus) if taus else 0.0


def acceptance_counts(
    accepted: Sequence[Sequence[int]], num_steps: int, drop_last: bool = True
) -> tuple[list[int], list[int]]:
    """(reached_i, accepted_i) per draft position i from per-cycle emitted counts.

    A cycle that emitted a tokens accepted a-1 draft tokens. Each request's last cycle is left
    out by default: it may be cut at eos / max_new_tokens (censored)."""
    reached, acc = [0] * num_steps, [0] * num_steps
    for req in accepted:
        for a in req[:-1] if drop_last else req:
            m = min(a - 1, num_steps)
            for i in range(min(m + 1, num_steps)):
                reached[i] += 1
                acc[i] += i < m
    return reached, acc


def conditional_acceptance(reached: Sequence[float], acc: Sequence[float]) -> list[float]:
    """a_i = accepted_i / reached_i; 0 where position i was never reached."""
    return [a / n if n else 0.0 for a, n in zip(acc, reached, strict=True)]


def per_position_acceptance(accepted: Sequence[Sequence[int]], num_steps: int) -> list[float]:
    """a_i = P(draft token i accepted | tokens < i accepted), from per-cycle counts."""
    return conditional_acceptance(*acceptance_counts(accepted, num_steps))


def acceptance_from_histogram(hist: Sequence[int]) -> list[float]:
    """Per-position acceptance from SGLang's `spec_correct_drafts_histogram`.

    h[i] = number of verify cycles that accepted exactly i draft tokens. Position i was
    reached by cycles with ≥ i accepted and accepted by those with ≥ i+1."""
    n = len(hist) - 1
    at_least = [sum(hist[i:]) for i in range(len(hist))]
    return [at_least[i + 1] / at_least[i] if at_least[i] else 0.0 for i in range(n)]


def simulated_tau_curve(a: Sequence[float]) -> list[float]:
    """Simulated τ of a chain cut after each position k: 1 + Σ_{k'≤k} Π_{j≤k'} a_j."""
    out, t, prod = [], 1.0, 1.0
    for ai in a:
        prod *= ai
        t += prod
        out.append(t)
    return out


def simulated_tau(a: Sequence[float]) -> float:
    """1 + Σ_k Π_{j≤k} a_j: expected tokens per verify forward of a chain (bonus included)."""
    curve = simulated_tau_curve(a)
    return curve[-1] if curve else 1.0


def _depth_accept(a: Sequence[float], i: int, m: int, gamma: float) -> float:
    """P(one of m candidates at depth i is the target's token): 1 - (1 - a_i)^(1 + gamma(m-1))."""
    ai = min(max(float(a[min(i, len(a) - 1)]), 0.0), 1.0)
    return 1.0 - (1.0 - ai) ** (1.0 + gamma * (m - 1))


def _widths_tau(a: Sequence[float], widths: Sequence[int], gamma: float) -> float:
    return simulated_tau([_depth_accept(a, i, m, gamma) for i, m in enumerate(widths)])


def tree_depth_widths(
    num_steps: int, topk: int, num_draft_tokens: int, a: Sequence[float] = (), gamma: float = 1.0
) -> list[int]:
    """Approximate candidates per depth (under the right parent) of an EAGLE tree.

    EAGLE keeps the `num_draft_tokens - 1` best-scoring nodes; here each node goes where it
    adds the most expected accepted tokens: one level deeper (up to `num_steps`) or one more
    sibling at a depth (up to `topk`), greedily, ties going deeper. A chain (topk 1) is
    `num_steps` deep with width 1."""
    widths: list[int] = []
    for _ in range(max(0, num_draft_tokens - 1)):
        options = []
        if len(widths) < num_steps:
            options.append(widths + [1])
        for i, m in enumerate(widths):
            if m < topk:
                options.append(widths[:i] + [m + 1] + widths[i + 1 :])
        if not options:
            break
        # max keeps the first of equals: deeper wins ties; without a_i, main line first
        widths = max(options, key=lambda w: _widths_tau(a, w, gamma)) if a else options[0]
    return widths


def simulated_tree_tau(
    a: Sequence[float], num_steps: int, topk: int, num_draft_tokens: int, gamma: float = 1.0
) -> float:
    """Approximate τ of a top-k tree from chain per-position acceptance a_i (bonus included).

    Depth i holds m_i candidates (`tree_depth_widths`, the nodes placed where they pay most);
    it is accepted with probability 1 - (1 - a_i)^(1 + gamma (m_i - 1)). gamma = 1 treats
    siblings as independent tries (an upper bound: siblings are the draft's 2nd, 3rd...
    guesses, worse than the first); gamma < 1 discounts them and is fitted on measured tree
    configs. A chain gives `simulated_tau(a[:num_steps])` exactly. Positions past len(a)
    are taken as a[-1]."""
    if not a:
        return 1.0
    return _widths_tau(a, tree_depth_widths(num_steps, topk, num_draft_tokens, a, gamma), gamma)


def simulated_acc_len(a: Sequence[float]) -> float:
    """SpecForge's `simulated_acc_len`: Σ_k Π_{j≤k} a_j (no bonus token)."""
    return simulated_tau(a) - 1.0


def speedup(tok_s_spec: float, tok_s_plain: float) -> float:
    """Tokens/s with speculation ÷ tokens/s without (same model, prompts, machine, one run).

    Reported as measured, below 1 included: never clamped."""
    if tok_s_plain <= 0:
        raise ValueError("speedup needs a positive plain-decoding throughput")
    return tok_s_spec / tok_s_plain


def histogram_from_accepted(accepted: Sequence[int], num_draft: int) -> list[int]:
    """SGLang-style histogram of accepted draft tokens per cycle (emitted count - 1)."""
    h = [0] * (num_draft + 1)
    for a in accepted:
        h[min(max(a - 1, 0), num_draft)] += 1
    return h


def sglang_spec_meta(completion_tokens: int, accepted: Sequence[int], num_steps: int) -> dict:
    """SGLang's per-request spec `meta_info` fields from per-cycle emitted counts (bonus in).

    The engine and the local server report requests through this, so they compare 1:1 with a
    real SGLang server's `/generate` answers."""
    vct = len(accepted)
    hist = histogram_from_accepted(accepted, num_steps)
    correct = sum(i * h for i, h in enumerate(hist))
    proposed = vct * num_steps
    return {
        "spec_verify_ct": vct,
        "spec_accept_length": tau_sglang(completion_tokens, vct),
        "spec_accept_rate": correct / proposed if proposed else 0.0,
        "spec_num_correct_drafts": correct,
        "spec_num_proposed_drafts": proposed,
        "spec_correct_drafts_histogram": hist,
    }


def sglang_identity_problems(meta: Mapping[str, Any], tol: float = 1e-3) -> list[str]:
    """Check one request's `meta_info` against SGLang's identities; [] when they hold.

    Fields absent (plain serving) are not checked."""
    out: list[str] = []
    comp, vct = meta.get("completion_tokens"), meta.get("spec_verify_ct")
    if comp is None or not vct:
        return out
    length = meta.get("spec_accept_length")
    if length is not None and abs(length - comp / vct) > tol:
        out.append(
            f"spec_accept_length {length} != completion_tokens/spec_verify_ct = {comp}/{vct}"
        )
    hist = meta.get("spec_correct_drafts_histogram")
    if hist is not None:
        if sum(hist) != vct:
            out.append(f"sum(spec_correct_drafts_histogram) = {sum(hist)} != spec_verify_ct {vct}")
        correct = meta.get("spec_num_correct_drafts")
        weighted = sum(i * h for i, h in enumerate(hist))
        if correct is not None and weighted != correct:
            out.append(f"sum(i*h[i]) = {weighted} != spec_num_correct_drafts {correct}")
    return out
