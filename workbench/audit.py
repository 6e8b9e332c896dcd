"""Is the draft wired as it was trained? The τ wiring audit and the config audit.

Why: high training accuracy with low serving τ usually means a wiring mismatch (aux layer ids
off by one between capture, training and serving; a wrong algorithm flag; a bad vocab map).
- `wiring_audit`: the same draft served by the embedded engine with aux states from shifted
  layers; a shifted wiring accepting more (bootstrap CI) names an off-by-one.
- `config_audit`: every disagreement between a draft, its capture and a serving command line,
  plus SGLang's per-architecture quirks in reading layer ids.
The hidden-state norm checks live in norms.py, findings and their summary in findings.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workbench import metrics
from workbench.engine import SpecError, SpecParams
from workbench.errors import WorkbenchError
from workbench.findings import ERROR, INFO, WARNING, Finding
from workbench.inspect import EvalResult, evaluate_draft, prepare_prompts
from workbench.layers import (
    CANONICAL,
    INPUT_OF_LAYER,
    LayerConventionError,
    LayerIds,
    validate,
)
from workbench.norms import NormRow, norm_check, open_capture, read_manifest, stored_norm_check

# ---------------------------------------------------------------- wiring audit


@dataclass
class WiringRow:
    name: str
    layer_ids: LayerIds  # the aux layers served in this wiring
    tau: float
    lo: float
    hi: float
    mean_request_tau: float
    accept_pos0: float
    delta: float = 0.0  # tau - configured tau
    delta_lo: float = 0.0
    delta_hi: float = 0.0
    beats_configured: bool = False  # supported by the CI rule
    loses_to_configured: bool = False


@dataclass
class WiringAudit:
    rows: list[WiringRow]
    verdict: str  # configured wins | shifted wiring wins | inconclusive
    best: str  # name of the winning wiring, or "inconclusive"
    findings: list[Finding]
    norms: list[NormRow] = field(default_factory=list)
    ci: float = 0.9  # the level of each row's CI (Bonferroni-widened)
    results: dict[str, EvalResult] = field(default_factory=dict)

    def table(self) -> list[dict]:
        return [asdict(r) | {"layer_ids": str(r.layer_ids)} for r in self.rows]


def wirings(layer_ids: LayerIds, num_layers: int, shifts: Sequence[int] = (-1, 1),
            embedding: bool = True) -> dict[str, LayerIds]:  # fmt: skip
    """configured, each shift, and the embedding output (canonical -1) in place of the first id;
    invalid (out of range) or duplicate wirings are left out."""
    base = layer_ids.to(CANONICAL)
    cand = {"configured": base}
    cand |= {f"shift {d:+d}": base.shifted(d) for d in shifts}
    if embedding:
        cand["embedding first"] = LayerIds((-1, *base.ids[1:]), CANONICAL)
    out, seen = {}, set()
    for name, ids in cand.items():
        try:
            validate(ids, num_layers)
        except LayerConventionError:
            continue
        if ids.ids not in seen:
            seen.add(ids.ids)
            out[name] = ids
    return out


def wiring_audit(
    target: Any,
    draft: Any,
    prompts: Sequence[Any],
    params: SpecParams | None = None,
    max_new_tokens: int = 64,
    *,
    capture: Any = None,
    llm: Any = None,
    dtype: str = "float32",
    shifts: Sequence[int] = (-1, 1),
    embedding: bool = True,
    n_boot: int = 2000,
    ci: float = 0.9,
    rule: str = "paired",
    seed: int = 0,
    norm_ratio: float = 1.15,
    progress: bool = False,
    configured: EvalResult | None = None,
) -> WiringAudit:
    """Serve the same draft with aux states from other layers and see which wiring accepts most.

    A shifted wiring beating the configured one means the draft was trained on other layers than
    it is served with (the Kimi-K2.5 off-by-one). Each τ gets a bootstrap CI over prompts; a
    winner is named only when it is supported: `rule="paired"` (default) asks that the CI of the
    paired τ difference (same resampled prompts for both wirings) excludes 0, `rule="overlap"`
    that the two τ CIs do not overlap; otherwise the verdict is "inconclusive" (a weak draft
    cannot tell wirings apart; rely on the norm check, which needs a `capture` manifest).
    Each comparison's CI is Bonferroni-widened to `1 - (1 - ci) / m` for m alternatives, so
    the chance of naming a wiring that is no better stays below `(1 - ci) / 2` in all (at a
    plain 90% each, embedding-first once "won" by +0.014 τ over 16 prompts against a
    teacher-forced audit that found it worse over 5,866 positions).
    `configured` reuses an `evaluate_draft` result of the configured wiring on the same prompts.
    """
    from workbench.llama import Llama

    llm = llm or Llama(target.model, dtype)
    items = prepare_prompts(target, prompts)
    conf = draft.config.layer_ids
    ws = wirings(conf, llm.n_layers, shifts, embedding)
    results = {name: configured if name == "configured" and configured is not None else
               evaluate_draft(target, draft, items, params, max_new_tokens, llm=llm, layer_ids=ids,
                              progress=progress)
               for name, ids in ws.items()}  # fmt: skip
    names = list(results)
    tok = np.array([[r.decode_tokens for r in results[n].requests] for n in names], dtype=float)
    ver = np.array([[r.verify_forwards for r in results[n].requests] for n in names], dtype=float)
    boot = metrics.bootstrap_pooled_tau(tok, ver, n_boot, seed)
    m = max(len(names) - 1, 1)  # comparisons with the configured wiring
    level = 1 - (1 - ci) / m  # Bonferroni: the family of m comparisons keeps `ci`
    q = ((1 - level) / 2 * 100, (1 + level) / 2 * 100)
    lo, hi = np.percentile(boot, q, axis=1)
    dl, dh = np.percentile(boot - boot[0], q, axis=1)
    rows = []
    for k, n in enumerate(names):
        res = results[n]
        beats = (dl[k] > 0) if rule == "paired" else (lo[k] > hi[0])
        loses = (dh[k] < 0) if rule == "paired" else (hi[k] < lo[0])
        rows.append(WiringRow(n, ws[n], res.tau, float(lo[k]), float(hi[k]),
                              res.mean_request_tau, (res.accept_pos or [0.0])[0],
                              res.tau - results[names[0]].tau, float(dl[k]), float(dh[k]),
                              bool(k and beats), bool(k and loses)))  # fmt: skip
    finds: list[Finding] = []
    winners = [r for r in rows[1:] if r.beats_configured]
    pct = f"{level:.1%} CI ({ci:.0%} over {m} wirings)"
    if winners:
        best = max(winners, key=lambda r: r.tau)
        verdict, best_name = "shifted wiring wins", best.name
        finds.append(Finding(ERROR, f"wiring '{best.name}' {best.layer_ids} accepts more than the configured {rows[0].layer_ids}",
                             f"configured τ {rows[0].tau:.3f} [{rows[0].lo:.3f}, {rows[0].hi:.3f}]",
                             f"τ {best.tau:.3f} [{best.lo:.3f}, {best.hi:.3f}]; difference {pct} "
                             f"[{best.delta_lo:+.3f}, {best.delta_hi:+.3f}]",
                             "the draft was trained on other layers than it is served with: an "
                             "off-by-one between capture and serving ids or conventions"))  # fmt: skip
    elif len(rows) > 1 and all(r.loses_to_configured for r in rows[1:]):
        verdict, best_name = "configured wins", "configured"
        finds.append(Finding(INFO, "configured wiring accepts more than every shifted wiring",
                             got=f"τ {rows[0].tau:.3f} [{rows[0].lo:.3f}, {rows[0].hi:.3f}]"))  # fmt: skip
    else:
        verdict, best_name = "inconclusive", "inconclusive"
        finds.append(Finding(WARNING if len(rows) > 1 else INFO, "wiring audit inconclusive",
                             got=", ".join(f"{r.name} τ {r.tau:.3f} [{r.lo:.3f}, {r.hi:.3f}]" for r in rows),
                             why=f"the {pct}s do not separate the wirings (draft too weak or too few "
                                 "prompts); rely on the norm check"))  # fmt: skip
    norms: list[NormRow] = []
    if capture is not None:
        reader = open_capture(capture)
        if reader is not None:  # the capture's own tokens: decisive
            norms, nf = stored_norm_check(llm, reader, conf)
        else:  # a manifest alone: medians over these prompts
            seqs = [r.prompt + r.tokens for r in results[names[0]].requests]
            norms, nf = norm_check(llm, seqs, read_manifest(capture), conf, ratio=norm_ratio)
        finds += nf
    return WiringAudit(rows, verdict, best_name, finds, norms, level, results)


def reconcile(wa: WiringAudit, tf: Any) -> list[Finding]:
    """The τ audit's findings read against the teacher-forced audit (`wiring.TeacherForcedAudit`).

    Why: the τ audit bootstraps over a few prompts; the teacher-forced one scores thousands
    of positions. When the latter decides for the configured wiring, a τ audit naming another
    wiring is a disagreement to look at (a WARNING naming both figures), not evidence of an
    off-by-one (ERROR); when both name a shifted wiring, or the teacher-forced audit is not
    decisive, the τ audit's findings stand as they are.
    """
    if wa.verdict != "shifted wiring wins" or tf.verdict != "configured_wins":
        return list(wa.findings)
    out = []
    for f in wa.findings:
        if f.severity == ERROR and "accepts more than the configured" in f.what:
            f = Finding(WARNING, f.what, f.expected, f.got,
                        f"the teacher-forced audit disagrees, decisively: configured wins over "
                        f"{tf.positions} positions in {tf.sequences} sequences; a τ lead this "
                        "small over this few prompts is what prompt sampling gives. Trust the "
                        "teacher-forced verdict; more prompts would settle the τ audit")  # fmt: skip
        out.append(f)
    return out


# ---------------------------------------------------------------- config audit

# SGLang model quirks in mapping eagle_aux_hidden_state_layer_ids to captured layers (sglang.md)
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
_GPT_OSS = ("GptOssForCausalLM",)
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def architecture_quirks(
    arch: str | None, layer_ids: LayerIds, num_layers: int | None
) -> list[Finding]:
    """Warn where SGLang's model code reads the draft's layer ids (as written in its config,
    canonical) differently from Llama's +1."""
    if not arch:
        return []
    ids = list(layer_ids.canonical)
    if arch in _DEEPSEEK:
        shifted = ids[:1] != [1]
        return [Finding(WARNING, f"SGLang {arch} quirk: ids get +1 only when the first id is 1",
                        "first id 1 (then output_of_layer semantics)", ids,
                        "ids are read raw as input_of_layer: every aux layer one layer early"
                        if shifted else "ids follow the canonical meaning here; keep the first id at 1")]  # fmt: skip
    if arch in _GPT_OSS:
        raw = num_layers is not None and max(ids) == num_layers
        return [Finding(WARNING, f"SGLang {arch} quirk: ids are used raw when max(ids) == num_layers",
                        f"max id < {num_layers}", ids,
                        "ids read as input_of_layer: one layer off the canonical meaning"
                        if raw else "ids get +1 here (canonical); the quirk triggers only if max(ids) == N")]  # fmt: skip
    if arch in _QWEN:
        return [Finding(WARNING, f"SGLang {arch} quirk: ids always get +1",
                        got=ids, why="canonical output_of_layer semantics; a capture made elsewhere "
                        "with input_of_layer ids would be one layer off")]  # fmt: skip
    return []


def parse_serving(serving: Sequence[str] | str | dict) -> dict:
    """The speculation-relevant fields of an SGLang argv (list or string) or an engine config dict.

    Keys: model_path, draft_path, algorithm, num_steps, eagle_topk, num_draft_tokens,
    context_length, layer_ids (LayerIds or None), source."""
    if isinstance(serving, dict):
        d = dict(serving)
        ids = d.get("layer_ids")
        if ids is not None and not isinstance(ids, LayerIds):
            ids = LayerIds.from_dict(ids)
        return {"model_path": d.get("model_path") or d.get("target"), "draft_path": d.get("draft_path") or d.get("draft"),
                "algorithm": d.get("algorithm", "EAGLE3"), "num_steps": d.get("num_steps"),
                "eagle_topk": d.get("eagle_topk"), "num_draft_tokens": d.get("num_draft_tokens"),
                "context_length": d.get("context_length"), "layer_ids": ids, "source": "engine config"}  # fmt: skip
    try:
        argv = shlex.split(serving) if isinstance(serving, str) else list(serving)
    except ValueError as e:  # shlex: "No closing quotation"
        raise WorkbenchError(
            f"--serving {serving!r}: cannot split it ({e}); check its quotes"
        ) from e
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--model-path", "--speculative-draft-model-path", "--speculative-algorithm"):
        p.add_argument(flag)
    for flag in (
        "--speculative-num-steps",
        "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
        "--context-length",
    ):
        p.add_argument(flag, type=int)  # fmt: skip
    a, _ = p.parse_known_args(argv)
    return {"model_path": a.model_path, "draft_path": a.speculative_draft_model_path,
            "algorithm": a.speculative_algorithm, "num_steps": a.speculative_num_steps,
            "eagle_topk": a.speculative_eagle_topk, "num_draft_tokens": a.speculative_num_draft_tokens,
            "context_length": a.context_length, "layer_ids": None, "source": "SGLang argv"}  # fmt: skip


def _as_loaded(draft: Any) -> tuple[Any, LayerIds, Any]:
    """(Eagle3Draft, its canonical layer ids, the LoadedDraft or None for a bare draft)."""
    from workbench.draft.load import LoadedDraft, load_draft

    if isinstance(draft, (str, os.PathLike)):
        draft = load_draft(draft)
    if isinstance(draft, LoadedDraft):
        return draft.draft, draft.layer_ids.to(CANONICAL), draft
    return draft, draft.config.layer_ids.to(CANONICAL), None


def config_audit(
    draft: Any,
    capture_manifest: Any = None,
    serving: Sequence[str] | str | dict | None = None,
    *,
    target: Any = None,
) -> list[Finding]:
    """Every disagreement between a draft (a directory `draft.load.load_draft` reads, a
    `LoadedDraft`, or an `Eagle3Draft`), the capture it was trained on and a serving command
    line / engine config: layer ids and convention, target fingerprint, vocab (size, d2t), max
    positions, algorithm and step flags, plus SGLang architecture quirks. Errors will break
    acceptance; warnings might."""
    from workbench.draft.vocab import d2t_problems
    from workbench.engine import resolve_params

    d, ids, loaded = _as_loaded(draft)
    c = d.config
    prov = (loaded.provenance or {}) if loaded else {}
    dpath = str(loaded.path) if loaded else None
    trained_run = loaded is not None and loaded.source in ("run", "checkpoint")
    raw_cfg = loaded.config if loaded is not None and not trained_run else None  # config.json
    F = [Finding(WARNING, "draft import", got=w) for w in (loaded.warnings if loaded else [])]
    if trained_run:
        F.append(Finding(INFO, "draft is a training run, not an export",
                         why="serve `workbench export --draft ... --out DIR` output, which SGLang loads"))  # fmt: skip
    if raw_cfg is not None:
        eagle = raw_cfg.get("eagle_config") or {}
        if (
            not eagle.get("eagle_aux_hidden_state_layer_ids")
            and "speculators_config" not in raw_cfg
        ):
            F.append(Finding(ERROR, "config.json has no eagle_config.eagle_aux_hidden_state_layer_ids",
                             list(ids.ids), None, "SGLang then uses the architecture default layers"))  # fmt: skip
    for p in d2t_problems(d.d2t.cpu(), c.vocab_size):
        F.append(Finding(ERROR, "draft vocab map (d2t)", got=p))
    if c.draft_vocab_size > c.vocab_size:
        F.append(
            Finding(ERROR, "draft_vocab_size", f"<= vocab_size {c.vocab_size}", c.draft_vocab_size)
        )

    man = read_manifest(capture_manifest) if capture_manifest is not None else None
    arch, n_layers, tgt_fp, tgt_maxpos, tgt_vocab, tgt_hidden = None, None, None, None, None, None
    if target is not None:
        desc = target.describe()
        arch, n_layers, tgt_fp = desc["architecture"], desc["num_layers"], desc["fingerprint"]
        tgt_maxpos, tgt_vocab, tgt_hidden = (
            desc["max_position_embeddings"],
            desc["vocab_size"],
            desc["hidden_size"],
        )
    if man is not None:
        t = man.get("target", {})
        arch, n_layers = arch or t.get("architecture"), n_layers or t.get("num_layers")
        tgt_maxpos = tgt_maxpos or t.get("max_position_embeddings")
        tgt_vocab, tgt_hidden = (
            tgt_vocab or t.get("vocab_size"),
            tgt_hidden or man.get("hidden_size"),
        )
        try:
            cap = LayerIds.from_dict(man.get("layer_ids"))
        except LayerConventionError as e:
            F.append(
                Finding(
                    ERROR,
                    "capture layer ids have no convention",
                    got=man.get("layer_ids"),
                    why=str(e),
                )
            )
            cap = None
        if cap is not None:
            if cap.convention != CANONICAL:
                F.append(Finding(WARNING, "capture layer-id convention", CANONICAL, cap.convention,
                                 "compared after conversion"))  # fmt: skip
            if cap.canonical != ids.canonical:
                F.append(Finding(ERROR, "aux layer ids: draft vs capture", f"{list(cap.canonical)} ({CANONICAL})",
                                 f"{list(ids.ids)} ({CANONICAL}) = {list(ids.to(INPUT_OF_LAYER).ids)} ({INPUT_OF_LAYER})",
                                 "the draft is served with other layers than it was trained on"))  # fmt: skip
        cap_fp = t.get("fingerprint")
        if tgt_fp and cap_fp and cap_fp != tgt_fp:
            F.append(Finding(ERROR, "target fingerprint: capture vs target", tgt_fp, cap_fp))
        tgt_fp = tgt_fp or cap_fp
    if tgt_fp and prov.get("target_fingerprint") and prov["target_fingerprint"] != tgt_fp:
        F.append(Finding(ERROR, "target fingerprint: draft provenance vs capture/target", tgt_fp,
                         prov["target_fingerprint"], "the draft was trained against another target"))  # fmt: skip
    if tgt_vocab and c.vocab_size != int(tgt_vocab):
        F.append(Finding(ERROR, "vocab_size: draft vs target", tgt_vocab, c.vocab_size))
    if tgt_hidden and c.target_hidden_size != int(tgt_hidden):
        F.append(
            Finding(ERROR, "target_hidden_size: draft vs target", tgt_hidden, c.target_hidden_size)
        )
    if tgt_maxpos and c.max_position_embeddings < int(tgt_maxpos):
        F.append(Finding(WARNING, "max_position_embeddings: draft below the target's", f">= {tgt_maxpos}",
                         c.max_position_embeddings, "acceptance collapses on requests longer than the draft's limit"))  # fmt: skip
    if n_layers:
        try:
            validate(ids, int(n_layers))
        except LayerConventionError as e:
            F.append(
                Finding(
                    ERROR,
                    "aux layer ids out of range for the target",
                    got=list(ids.ids),
                    why=str(e),
                )
            )
    F += architecture_quirks(arch, ids, n_layers)

    if serving is not None:
        s = parse_serving(serving)
        alg = s["algorithm"]
        if alg is None:
            F.append(Finding(ERROR, f"{s['source']}: --speculative-algorithm missing", "EAGLE3", None,
                             "speculation is off"))  # fmt: skip
        elif str(alg).upper() != "EAGLE3":
            F.append(Finding(ERROR, f"{s['source']}: speculative algorithm", "EAGLE3", alg,
                             "EAGLE (EAGLE-2) skips fc and the aux states: τ ≈ 1" if str(alg).upper() == "EAGLE"
                             else "this draft is an EAGLE-3 head"))  # fmt: skip
        if s["source"] == "SGLang argv" and not s["draft_path"]:
            F.append(Finding(ERROR, "--speculative-draft-model-path missing", dpath, None))
        elif s["draft_path"] and dpath and Path(s["draft_path"]).resolve() != Path(dpath).resolve():
            F.append(Finding(WARNING, f"{s['source']}: draft path differs from the audited draft", dpath,
                             s["draft_path"]))  # fmt: skip
        steps = (s["num_steps"], s["eagle_topk"], s["num_draft_tokens"])
        try:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                resolve_params(*steps)
            F += [
                Finding(WARNING, f"{s['source']}: step flags", got=steps, why=str(x.message))
                for x in w
            ]
        except SpecError as e:
            F.append(Finding(ERROR, f"{s['source']}: step flags", got=steps, why=str(e)))
        if s["context_length"] and c.max_position_embeddings < int(s["context_length"]):
            F.append(Finding(ERROR, f"{s['source']}: context length beyond the draft's max_position_embeddings",
                             f"<= {c.max_position_embeddings}", s["context_length"],
                             "draft positions past its limit: acceptance collapses on long requests"))  # fmt: skip
        if s["layer_ids"] is not None and s["layer_ids"].canonical != ids.canonical:
            F.append(Finding(ERROR, f"{s['source']}: aux layer ids", f"{list(ids.ids)} ({CANONICAL})",
                             f"{list(s['layer_ids'].canonical)} ({CANONICAL})"))  # fmt: skip
        mp = s["model_path"]
        if mp and (Path(mp) / "config.json").is_file():
            a = (json.loads((Path(mp) / "config.json").read_text()).get("architectures") or [None])[
                0
            ]
            if a and a != arch:
                F += architecture_quirks(a, ids, n_layers)
    order = {ERROR: 0, WARNING: 1, INFO: 2}
    return sorted(F, key=lambda f: order.get(f.severity, 3))
