"""The teacher-forced wiring audit: which target layers does this draft actually read?

Why: a draft trained on aux layers [1, 14, 26] but served [2, 15, 27] (the field report's
off-by-one) loses acceptance, yet the engine-based τ audit cannot resolve it for a weak draft
(τ is a coarse count over a few dozen prompts). Here every position of held-out text is a
measurement: ONE target forward per sequence records every layer any candidate wiring needs;
the draft's first step then runs on each wiring's aux states (teacher-forced, the same input
tokens), giving per position the draft's log-probability of the target's next (greedy) token
and whether its argmax is that token (step-0 acceptance). Wirings are paired position by
position and the CI of the difference to the configured wiring comes from a bootstrap over
sequences (positions within one sequence are not independent).

Verdicts: `configured_wins` (every alternative's CI lies below 0), `shifted_wins` (some
alternative's CI lies above 0: the draft was trained on other layers than configured),
`inconclusive` (otherwise, fewer than `min_sequences` sequences, or a draft whose step-0
acceptance is below `min_accept` under every wiring: an untrained draft's log-probs differ
between wirings too, by accident). The decision uses the log-probability (continuous, far
more sensitive than acceptance); acceptance is reported too. Sequences: the capture's
held-out split (what the draft never trained on) and the target's greedy continuations of
eval prompts, every position scored.
`decisiveness` says what a verdict needed (positions, CI width, margin).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.errors import WorkbenchError
from workbench.layers import CANONICAL, LayerConventionError, LayerIds, validate
from workbench.llama import Llama

CONFIGURED_WINS, SHIFTED_WINS, INCONCLUSIVE = "configured_wins", "shifted_wins", "inconclusive"


# Held-out tokens scored by default. 6,000 left the full demo draft undecided against shift+1
# (6,929 positions with the continuations; `decisiveness` asked for ~8,600); 12,000 decided it
# (12,813 positions, 65 s on one busy core). Smaller held-out splits (quick: ~5K) are unaffected.
HELDOUT_TOKENS = 12000


@dataclass
class TFSequence:
    """Token ids and which draft positions are scored: position t (the draft reads token t+1
    and the aux states of t) predicts the target's greedy token after t+1; it is scored when
    token t+2 is text the draft was trained to predict (see `response_scored`)."""

    ids: list[int]
    scored: list[bool]  # len(ids): scored[t] for the draft position t
    source: str = ""  # "held-out <capture sample>" | "continuation <prompt id>"


def response_scored(loss_mask: Sequence[bool | int], all_tokens: bool = False) -> list[bool]:
    """scored[t] = loss_mask[t + 2] (the training loss mask of step 0); `all_tokens` scores
    every position with a token at t + 2."""
    m = [bool(x) or all_tokens for x in loss_mask]
    return [m[t + 2] if t + 2 < len(m) else False for t in range(len(m))]


def wiring_candidates(
    layer_ids: LayerIds, num_layers: int, shifts: Sequence[int] = (-1, 1), embedding: bool = True
) -> dict[str, LayerIds]:
    """configured, every id shifted by each of `shifts`, and the embedding output (-1) in place
    of the first id; out-of-range or duplicate wirings are left out. Names have no spaces (they
    go into the RESULT line)."""
    base = layer_ids.to(CANONICAL)
    cand = {"configured": base} | {f"shift{d:+d}": base.shifted(d) for d in shifts}
    if embedding:
        cand["embedding_first"] = LayerIds((-1, *base.ids[1:]), CANONICAL)
    out: dict[str, LayerIds] = {}
    for name, ids in cand.items():
        try:
            validate(ids, num_layers)
        except LayerConventionError:
            continue
        if ids.ids not in [w.ids for w in out.values()]:
            out[name] = ids
    return out


# ---------------------------------------------------------------- measuring


@dataclass
class SequenceScores:
    """Per scored position: draft log-prob of the target token per wiring (NaN where the token
    is outside the draft vocab) and step-0 acceptance per wiring."""

    logp: np.ndarray  # [W, n]
    accept: np.ndarray  # [W, n] bool
    in_vocab: np.ndarray  # [n] bool


@torch.no_grad()
def target_argmax(llm: Llama, final_hidden: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Greedy next token of every row of final_hidden [T, H] (logits a chunk at a time)."""
    out = []
    for a in range(0, final_hidden.shape[0], chunk):
        out.append(llm.logits_of(final_hidden[a : a + chunk]).argmax(-1))
    return torch.cat(out)


@torch.no_grad()
def score_sequence(
    llm: Llama, draft: Any, seq: TFSequence, wirings: dict[str, LayerIds]
) -> SequenceScores:
    """One target forward recording every needed layer; one draft step per wiring."""
    T = len(seq.ids)
    t_idx = torch.tensor([t for t in range(T - 2) if seq.scored[t]], dtype=torch.long)
    W = len(wirings)
    if len(t_idx) == 0:
        return SequenceScores(np.zeros((W, 0)), np.zeros((W, 0), bool), np.zeros(0, bool))
    need = sorted({i for w in wirings.values() for i in w.canonical})
    ids = torch.tensor([seq.ids], device=llm.device)
    res = llm(ids, None, hidden_layers=need, logits="none")
    targ = target_argmax(llm, res.final_hidden[0, t_idx + 1])  # greedy token after t+1
    V = int(draft.t2d.numel())
    lut = torch.full((V,), -1, dtype=torch.long)
    lut[draft.draft_ids.cpu()] = torch.arange(draft.draft_ids.numel())
    didx = lut[targ.cpu()]
    inv = didx >= 0
    pos = torch.arange(T - 1, device=llm.device)[None]
    dt = next(draft.parameters()).dtype
    logp, acc = [], []
    for w in wirings.values():
        aux = torch.cat([res.hidden[i][:, : T - 1] for i in w.canonical], dim=-1).to(dt)
        _, h = draft(ids[:, 1:], aux, pos, logits=False)  # the head only where scored
        lp = torch.log_softmax(draft.lm_head(draft.norm(h[0, t_idx])).float(), -1).cpu()
        got = lp.gather(1, didx.clamp(min=0)[:, None])[:, 0]
        logp.append(torch.where(inv, got, torch.full_like(got, math.nan)).numpy())
        acc.append((draft.draft_ids.cpu()[lp.argmax(-1)] == targ.cpu()).numpy())
    return SequenceScores(np.stack(logp), np.stack(acc), inv.numpy())


# ---------------------------------------------------------------- statistics


def paired_bootstrap(
    num: np.ndarray, den: np.ndarray, n_boot: int, ci: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ratio-of-sums difference of each wiring to wiring 0 with a percentile CI.

    num [W, S]: per-sequence sums of the statistic, den [S]: per-sequence counts. Resamples
    sequences (the same ones for every wiring: paired). Returns (delta, lo, hi), each [W].
    """
    d = num - num[0]
    delta = d.sum(1) / max(den.sum(), 1)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, num.shape[1], size=(n_boot, num.shape[1]))
    boot = d[:, idx].sum(-1) / np.maximum(den[idx].sum(-1), 1)  # [W, n_boot]
    q = ((1 - ci) / 2 * 100, (1 + ci) / 2 * 100)
    lo, hi = np.percentile(boot, q, axis=1)
    return delta, lo, hi


@dataclass
class WiringScore:
    name: str
    layer_ids: list[int]  # canonical (output_of_layer)
    logp: float  # mean draft log-prob of the target token (in-vocab positions)
    accept: float  # step-0 acceptance (all scored positions)
    delta: float = 0.0  # logp - configured logp
    delta_lo: float = 0.0
    delta_hi: float = 0.0
    accept_delta: float = 0.0
    accept_lo: float = 0.0
    accept_hi: float = 0.0


@dataclass
class TeacherForcedAudit:
    rows: list[WiringScore]  # configured first
    verdict: str  # configured_wins | shifted_wins | inconclusive
    best: str  # the winning wiring; for inconclusive the one with the highest mean log-prob
    sequences: int
    positions: int  # scored positions (acceptance); in_vocab of them carry a log-prob
    in_vocab: int
    ci: float
    seconds: float
    reason: str = ""
    sources: dict[str, int] = field(default_factory=dict)  # sequences per source kind
    norms: list[Any] = field(default_factory=list)  # norms.NormRow per slot (audit_draft_dir)

    @property
    def best_alternative(self) -> WiringScore | None:
        return max(self.rows[1:], key=lambda r: r.delta, default=None)

    def table(self) -> list[dict]:
        return [asdict(r) for r in self.rows]

    def format(self) -> str:
        lines = [
            f"teacher-forced wiring audit: {self.sequences} sequences "
            f"({', '.join(f'{n} {k}' for k, n in self.sources.items())}), {self.positions} "
            f"scored positions ({self.in_vocab} in the draft vocab), {self.seconds:.1f} s; "
            f"{self.ci:.0%} paired bootstrap CIs over sequences",
            f"{'wiring':<16}{'layers':<16}{'logp':>8}{'Δlogp [CI]':>26}{'acc':>7}{'Δacc [CI]':>26}",
        ]
        for r in self.rows:
            dl = f"{r.delta:+.3f} [{r.delta_lo:+.3f}, {r.delta_hi:+.3f}]"
            da = f"{r.accept_delta:+.3f} [{r.accept_lo:+.3f}, {r.accept_hi:+.3f}]"
            if r.name == "configured":
                dl = da = "-"
            lines.append(f"{r.name:<16}{str(r.layer_ids):<16}{r.logp:8.3f}{dl:>26}"
                         f"{r.accept:7.3f}{da:>26}")  # fmt: skip
        for n in self.norms:
            lines.append(f"norms on the capture's tokens, slot {n.slot}: served layer {n.live_id}, "
                         f"live/stored {n.ratio:.3f}, closest layer {n.nearest_id}"
                         + (f" <- {n.flag}" if n.flag else " ok"))  # fmt: skip
        lines.append(f"verdict: {self.verdict} ({self.reason})")
        return "\n".join(lines)

    def result_line(self) -> str:
        """`RESULT verdict=... best=... delta_lo=... delta_hi=...`: the paired CI of the best
        alternative's log-prob minus the configured wiring's."""
        alt = self.best_alternative
        lo, hi = (alt.delta_lo, alt.delta_hi) if alt else (math.nan, math.nan)
        return (f"RESULT verdict={self.verdict} best={self.best} delta_lo={lo:.4f} "
                f"delta_hi={hi:.4f}")  # fmt: skip


def decide(rows: list[WiringScore], enough: bool, min_accept: float = 0.05) -> tuple[str, str, str]:
    """(verdict, best, reason) from the paired log-prob CIs.

    A draft that predicts nothing under any wiring (step-0 acceptance below `min_accept`,
    e.g. untrained) gets no verdict: its log-probs still differ between wirings, but only by
    how garbage features happen to land, not by what it learned."""
    alts = rows[1:]
    top = max(rows, key=lambda r: r.logp).name
    if not alts:
        return INCONCLUSIVE, top, "no alternative wiring fits this target"
    if not enough:
        return INCONCLUSIVE, top, "too few sequences for a bootstrap CI"
    if max(r.accept for r in rows) < min_accept:
        return (
            INCONCLUSIVE,
            top,
            (
                f"the draft is too weak to tell: step-0 acceptance below {min_accept} under every "
                "wiring (untrained, or trained for another target)"
            ),
        )
    winners = [r for r in alts if r.delta_lo > 0]
    if winners:
        w = max(winners, key=lambda r: r.delta)
        return (
            SHIFTED_WINS,
            w.name,
            (
                f"the draft predicts better from {w.name} {w.layer_ids} than from the configured "
                f"{rows[0].layer_ids}: it was trained on other layers than it is configured with"
            ),
        )
    if all(r.delta_hi < 0 for r in alts):
        return CONFIGURED_WINS, "configured", "every alternative's CI lies below the configured"
    close = [r.name for r in alts if r.delta_hi >= 0]
    return INCONCLUSIVE, top, f"CI includes 0 for {', '.join(close)}"


def teacher_forced_audit(
    llm: Llama,
    draft: Any,
    sequences: Sequence[TFSequence],
    *,
    layer_ids: LayerIds | None = None,
    shifts: Sequence[int] = (-1, 1),
    embedding: bool = True,
    n_boot: int = 2000,
    ci: float = 0.95,
    min_sequences: int = 8,
    min_accept: float = 0.05,
    seed: int = 0,
) -> TeacherForcedAudit:
    """Score every wiring on `sequences` and decide (see the module doc).

    `layer_ids` overrides the configured wiring (default: the draft's own config)."""
    t0 = time.perf_counter()
    conf = (layer_ids or draft.config.layer_ids).to(CANONICAL)
    ws = wiring_candidates(conf, llm.n_layers, shifts, embedding)
    if not bool(draft.embed_tokens.any()):  # exports carry no embeddings: the target's
        draft.embed_tokens.copy_(llm.embed.to(draft.embed_tokens))
    scores = [score_sequence(llm, draft, s, ws) for s in sequences]
    scores = [(s, sc) for s, sc in zip(sequences, scores, strict=True) if sc.accept.shape[1]]
    W, S = len(ws), len(scores)
    lp_sum = np.zeros((W, S))
    acc_sum = np.zeros((W, S))
    n_inv, n_all = np.zeros(S), np.zeros(S)
    for j, (_, sc) in enumerate(scores):
        lp_sum[:, j] = np.nansum(sc.logp, axis=1)
        acc_sum[:, j] = sc.accept.sum(1)
        n_inv[j], n_all[j] = sc.in_vocab.sum(), sc.accept.shape[1]
    d, lo, hi = paired_bootstrap(lp_sum, n_inv, n_boot, ci, seed)
    ad, alo, ahi = paired_bootstrap(acc_sum, n_all, n_boot, ci, seed + 1)
    rows = [
        WiringScore(name, list(ids.ids), float(lp_sum[k].sum() / max(n_inv.sum(), 1)),
                    float(acc_sum[k].sum() / max(n_all.sum(), 1)), float(d[k]), float(lo[k]),
                    float(hi[k]), float(ad[k]), float(alo[k]), float(ahi[k]))
        for k, (name, ids) in enumerate(ws.items())
    ]  # fmt: skip
    verdict, best, reason = decide(rows, S >= min_sequences, min_accept)
    sources: dict[str, int] = {}
    for s, _ in scores:
        kind = s.source.split(" ")[0] or "given"
        sources[kind] = sources.get(kind, 0) + 1
    return TeacherForcedAudit(rows, verdict, best, S, int(n_all.sum()), int(n_inv.sum()), ci,
                              time.perf_counter() - t0, reason, sources)  # fmt: skip


def decisiveness(audit: TeacherForcedAudit) -> dict[str, Any]:
    """What the audit needed to be decisive: the positions used, the CI width of the hardest
    alternative (the one whose |Δ| is smallest relative to its CI half-width), that ratio (> 1
    means its CI excludes 0) and roughly how many positions would make it > 1 (CI half-width
    shrinks as 1/sqrt(positions); the draft's quality sets |Δ|)."""
    alts = audit.rows[1:]
    if not alts:
        return {"positions": audit.positions, "sequences": audit.sequences, "decisive": False}

    def margin(r: WiringScore) -> float:
        half = (r.delta_hi - r.delta_lo) / 2
        centre = (r.delta_hi + r.delta_lo) / 2
        if half > 0:
            return abs(centre) / half
        return math.inf if centre else 0.0  # a zero-width CI: decided unless it sits on 0

    hard = min(alts, key=margin)
    m = margin(hard)
    need = audit.in_vocab / m**2 if 0 < m < math.inf else (math.inf if m == 0 else 0)
    return {
        "positions": audit.positions,
        "in_vocab_positions": audit.in_vocab,
        "sequences": audit.sequences,
        "hardest_alternative": hard.name,
        "delta": hard.delta,
        "ci_width": hard.delta_hi - hard.delta_lo,
        "margin": m,  # |Δ| / CI half-width; > 1: that comparison is decided
        "positions_needed": need,
        "decisive": audit.verdict != INCONCLUSIVE,
    }


# ---------------------------------------------------------------- sequences


def heldout_sequences(
    capture: Any,
    training: dict | None = None,
    *,
    max_tokens: int = HELDOUT_TOKENS,
    max_len: int = 1024,
    all_tokens: bool = True,
) -> list[TFSequence]:
    """The capture's held-out split as the training run drew it (its seed, val fraction and
    prompt groups; the defaults of `TrainConfig` where the provenance does not say), up to
    `max_tokens` tokens, each sample truncated to `max_len`. Scored: every position
    (`all_tokens`, the default), else the assistant tokens only. Every position is a fair
    paired measurement, also where the loss did not reach: all wirings see the same text, and
    positions where the wiring makes no difference add nothing to either side."""
    from workbench.capture import CaptureReader
    from workbench.draft.data import split_indices
    from workbench.draft.train import TrainConfig

    reader = capture if isinstance(capture, CaptureReader) else CaptureReader(capture, False)
    cfg, dflt = dict(training or {}), TrainConfig()
    _, val = split_indices(len(reader), float(cfg.get("val_fraction", dflt.val_fraction)),
                           int(cfg.get("val_max_samples", dflt.val_max_samples)),
                           int(cfg.get("seed", dflt.seed)), reader.manifest.get("groups"))  # fmt: skip
    out, total = [], 0
    for i in val:
        s = reader[i]
        ids = s["input_ids"][:max_len].tolist()
        mask = s["loss_mask"][:max_len].tolist()
        out.append(TFSequence(ids, response_scored(mask, all_tokens), f"held-out {i}"))
        total += len(ids)
        if total >= max_tokens:
            break
    return out


def continuation_sequences(
    llm: Llama,
    tokenizer: Any,
    prompts: Sequence[Any],
    max_new_tokens: int = 64,
    all_tokens: bool = True,
) -> list[TFSequence]:
    """The target's greedy continuation of each prompt's first turn (chat template); the
    continuation is scored, and with `all_tokens` (default) the prompt too."""
    from workbench.data import eos_ids, prompt_ids
    from workbench.generate import generate_batch

    heads = [prompt_ids(tokenizer, p.messages(1)) for p in prompts]
    outs = generate_batch(llm, heads, max_new_tokens, eos_ids(tokenizer), temperature=0.0,
                          batch_size=len(heads), dtype=llm.dtype, progress=False)  # fmt: skip
    seqs = []
    for p, h, o in zip(prompts, heads, outs, strict=True):
        mask = [False] * len(h) + [True] * len(o)
        scored = response_scored(mask, all_tokens)
        seqs.append(TFSequence(h + list(o), scored, f"continuation {p.id}"))
    return seqs


# ---------------------------------------------------------------- from a draft directory


class WiringAuditError(WorkbenchError):
    """The wiring audit cannot find what it needs (capture, target, sequences)."""


def find_capture(loaded: Any, capture: str | os.PathLike | None = None) -> Path:
    """The capture a loaded draft was trained on: `capture`, else its provenance's."""
    prov = loaded.provenance or {}
    cap = capture or prov.get("capture")
    if not cap or not Path(cap).is_dir():
        raise WiringAuditError(
            f"{loaded.path}: no capture to take held-out text from (provenance says "
            f"{prov.get('capture')!r}); pass --capture DIR (the capture the draft was trained on)"
        )
    return Path(cap)


def audit_sequences(
    llm: Llama,
    tokenizer: Any,
    loaded: Any,
    capture: str | os.PathLike | None = None,
    *,
    eval_prompts: int = 8,
    max_new_tokens: int = 48,
    max_tokens: int = HELDOUT_TOKENS,
    all_tokens: bool = True,
) -> list[TFSequence]:
    """The audit's text for a loaded draft (`draft.load.LoadedDraft`): its capture's held-out
    split as its training run drew it + greedy continuations of `eval_prompts` MT-bench first
    turns, every position scored (`all_tokens=False`: the responses only)."""
    from workbench.capture import CaptureReader

    reader = CaptureReader(find_capture(loaded, capture), verify=False)
    training = ((loaded.provenance or {}).get("training") or {}).get("config")
    seqs = heldout_sequences(reader, training, max_tokens=max_tokens, all_tokens=all_tokens)
    if eval_prompts:
        from workbench.data import load_mtbench

        prompts = load_mtbench()[:eval_prompts]
        seqs += continuation_sequences(llm, tokenizer, prompts, max_new_tokens, all_tokens)
    return seqs


def audit_draft_dir(
    draft_path: str | os.PathLike,
    capture: str | os.PathLike | None = None,
    target: str | None = None,
    *,
    eval_prompts: int = 8,
    max_new_tokens: int = 48,
    max_tokens: int = HELDOUT_TOKENS,
    threads: int | None = None,
    **kw: Any,
) -> TeacherForcedAudit:
    """`teacher_forced_audit` of a draft directory (run, checkpoint or export): the capture
    from its provenance (or `capture`), the target from the provenance / capture manifest (or
    `target`), the text from `audit_sequences`. The configured wiring is what a serving
    engine reads from the draft's config. `threads` (torch intra-op threads) defaults to 1
    when other processes already keep every core busy (load average >= cores): there a
    2-thread op waits for a scheduler slice at every step (measured 208 s vs 33 s)."""
    from workbench.capture import CaptureReader
    from workbench.draft.load import load_draft
    from workbench.target import load_target

    loaded = load_draft(draft_path)
    cap = find_capture(loaded, capture)
    reader = CaptureReader(cap, verify=False)
    prov = loaded.provenance or {}
    name = target or (prov.get("target") or {}).get("name") or reader.manifest["target"]["name"]
    tgt = load_target(name, dtype="float32")
    if tgt.fingerprint != reader.target_fingerprint:
        raise WiringAuditError(
            f"target {name!r} (fingerprint {tgt.fingerprint}) is not the target of capture {cap} "
            f"({reader.target_fingerprint}); pass --target with the captured target"
        )
    if threads is None and os.getloadavg()[0] >= (os.cpu_count() or 1):
        threads = 1
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads or old_threads)
    try:
        return _audit_loaded(tgt, loaded, cap, eval_prompts, max_new_tokens, max_tokens, kw)
    finally:
        torch.set_num_threads(old_threads)


def _audit_loaded(
    tgt: Any, loaded: Any, cap: Path, eval_prompts: int, max_new_tokens: int, max_tokens: int,
    kw: dict[str, Any],
) -> TeacherForcedAudit:  # fmt: skip
    from workbench.capture import CaptureReader
    from workbench.norms import stored_norm_check

    llm = Llama(tgt.model, torch.float32)
    seqs = audit_sequences(llm, tgt.tokenizer, loaded, cap, eval_prompts=eval_prompts,
                           max_new_tokens=max_new_tokens, max_tokens=max_tokens)  # fmt: skip
    draft = loaded.draft.float().eval()
    tf = teacher_forced_audit(llm, draft, seqs, layer_ids=loaded.layer_ids, **kw)
    # the cross-check that does not depend on draft quality (decisive where τ and log-probs are not)
    tf.norms = stored_norm_check(llm, CaptureReader(cap, verify=False), loaded.layer_ids)[0]
    return tf
