"""Is the served layer the captured one? Hidden-state norm checks, at any draft quality.

- `stored_norm_check`: the target rerun on a few of the capture's own sequences; per-token norms at
  the served layers (and their neighbours) against the states the capture stored for those very
  tokens. The captured layer matches to storage rounding, a neighbour by several percent: it
  names the layer the capture holds, slot by slot.
- `norm_check`: the fallback when only a manifest is at hand (no shards): live medians over other
  prompts against the manifest's norm statistics; coarse in deep layers, whose neighbours differ
  by about as much as two prompt sets do.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.errors import WorkbenchError
from workbench.findings import ERROR, WARNING, Finding
from workbench.layers import CONVENTIONS, LayerConventionError, LayerIds


def open_capture(capture: Any) -> Any:
    """A CaptureReader for a capture directory or reader (its shards verified); None for a bare
    manifest (a dict or a manifest file), whose shards are not here."""
    if hasattr(capture, "manifest") and hasattr(capture, "__getitem__"):
        return capture
    if isinstance(capture, dict) or not Path(capture).is_dir():
        return None
    from workbench.capture import CaptureReader

    return CaptureReader(capture)


def read_manifest(capture: Any) -> dict:
    """A capture manifest from a dict, a CaptureReader, or a capture directory / manifest path."""
    if isinstance(capture, dict):
        return capture
    if hasattr(capture, "manifest"):
        return capture.manifest
    p = Path(capture)
    f = p / "manifest.json" if p.is_dir() else p
    if not f.is_file():
        raise WorkbenchError(f"{f}: no capture manifest; give the capture directory of notebook 01")
    return json.loads(f.read_text())


@dataclass
class NormRow:
    slot: int
    capture_id: int  # canonical id the capture recorded
    live_id: int  # canonical id served
    cap_p05: float
    cap_p50: float
    cap_p95: float
    live_p50: float
    ratio: float  # live median / capture median
    nearest_id: int  # live layer whose median is closest to the capture's (log scale)
    flag: str = ""


@torch.no_grad()
def live_norms(
    llm: Any, sequences: Sequence[Sequence[int]], layers: Sequence[int]
) -> dict[int, np.ndarray]:
    """Per-token L2 norms of the residual stream at canonical `layers` over whole sequences."""
    out: dict[int, list] = {i: [] for i in layers}
    for s in sequences:
        res = llm(torch.tensor([list(s)]), hidden_layers=list(layers), logits="none")
        for i in layers:
            out[i].append(res.hidden[i][0].float().norm(dim=-1).numpy())
    return {i: np.concatenate(v) if v else np.zeros(0) for i, v in out.items()}


def norm_check(
    llm: Any,
    sequences: Sequence[Sequence[int]],
    manifest: dict,
    layer_ids: LayerIds | None = None,
    *,
    ratio: float = 1.15,
) -> tuple[list[NormRow], list[Finding]]:
    """Compare live hidden-state norms at the served ids with the capture manifest's, slot by slot.

    Works at any draft quality. Flags a slot when the live median falls outside the capture's
    p05..p95, or differs from the capture's median by more than `ratio`, or when a neighbouring
    live layer (id ± 1, or the embedding) matches the capture's median better: the capture then
    recorded a different layer than the one served (off-by-one / convention mismatch). The prompt
    sets differ (capture: training conversations; live: these sequences), so medians agree only
    to within several percent on a correct wiring.
    """
    if layer_ids is not None and not isinstance(layer_ids, LayerIds):
        raise LayerConventionError(
            f"norm_check takes the served ids as LayerIds (ids + convention), got a bare "
            f"{type(layer_ids).__name__} {list(layer_ids)!r}; wrap them, e.g. "
            f"LayerIds(ids, convention) with convention one of {', '.join(CONVENTIONS)}"
        )
    cap = LayerIds.from_dict(manifest["layer_ids"]).canonical
    served = cap if layer_ids is None else layer_ids.canonical
    n = llm.n_layers
    cands = sorted({j for i in served for j in (i - 1, i, i + 1) if -1 <= j < n})
    norms = live_norms(llm, sequences, cands)
    med = {j: float(np.median(v)) for j, v in norms.items() if v.size}
    stats = {int(v["slot"]): v for v in manifest["norm_stats"]["layers"].values()}
    rows, finds = [], []
    if len(served) != len(cap):
        finds.append(
            Finding(ERROR, "number of aux layers (capture vs served)", len(cap), len(served))
        )
    for j, (cid, lid) in enumerate(zip(cap, served, strict=False)):
        st = stats.get(j)
        if not st or not st.get("count") or lid not in med:
            continue
        p50 = float(st["p50"])
        live = med[lid]
        r = live / p50 if p50 else math.inf
        near = min(
            (k for k in cands if abs(k - lid) <= 1), key=lambda k: abs(math.log(med[k] / p50))
        )
        flags = []
        if not float(st["p05"]) <= live <= float(st["p95"]):
            flags.append("live median outside the capture's p05..p95")
        if max(r, 1 / r) > ratio:
            flags.append(f"median ratio {r:.2f} beyond {ratio}")
        better = abs(math.log(med[near] / p50)) < 0.5 * abs(math.log(r))
        if near != lid and better:
            flags.append(f"capture slot {j} matches live layer {near} better than served {lid}")
        rows.append(NormRow(j, cid, lid, float(st["p05"]), p50, float(st["p95"]), live, r, near,
                            "; ".join(flags)))  # fmt: skip
        if flags:
            sev = ERROR if (near != lid and better) or len(flags) > 1 else WARNING
            finds.append(Finding(sev, f"hidden-state norms, aux slot {j} (capture layer {cid}, served layer {lid})",
                                 f"median ≈ {p50:.3g} (capture p05..p95 {st['p05']:.3g}..{st['p95']:.3g})",
                                 f"live median {live:.3g}", "; ".join(flags) +
                                 ": wrong layer or layer-id convention between capture and serving"))  # fmt: skip
    return rows, finds


def stored_norm_check(
    llm: Any,
    reader: Any,
    layer_ids: LayerIds | None = None,
    *,
    n_samples: int = 8,
    max_tokens: int = 512,
    tol: float = 0.02,
) -> tuple[list[NormRow], list[Finding]]:
    """`norm_check` on the capture's own tokens: decisive where the manifest medians are not.

    The live target runs on `n_samples` of the capture's sequences (evenly spaced, the first
    `max_tokens` tokens), and each slot's per-token norms are compared with the states the capture
    stored for those very tokens: at the layer the capture recorded they agree to storage
    rounding (a bf16 capture: ~0.1%), at a neighbour they differ by that layer's update (several
    %). Comparing medians over different prompt sets cannot tell neighbours apart in deep layers,
    where they differ by about as much as the prompt sets do. `ratio` in a row is the median
    per-token live / stored norm at the served layer; `nearest_id` the candidate whose per-token
    norms match best (median |log ratio|). A different target or compute dtype shows as no
    candidate within `tol`.
    """
    if layer_ids is not None and not isinstance(layer_ids, LayerIds):
        raise LayerConventionError(
            f"stored_norm_check takes the served ids as LayerIds (ids + convention), got "
            f"{type(layer_ids).__name__} {list(layer_ids)!r}"
        )
    man = reader.manifest
    cap = LayerIds.from_dict(man["layer_ids"]).canonical
    served = cap if layer_ids is None else layer_ids.canonical
    n, k, H = llm.n_layers, len(cap), int(man["hidden_size"])
    cands = sorted({j for i in served for j in (i - 1, i, i + 1) if -1 <= j < n})
    pick = np.unique(
        np.linspace(0, len(reader) - 1, min(n_samples, len(reader))).round().astype(int)
    )
    logr: dict[tuple[int, int], list[np.ndarray]] = {}
    live_norm: dict[int, list[np.ndarray]] = {}
    with torch.no_grad():
        for i in pick.tolist():
            s = reader[i]
            ids = s["input_ids"][:max_tokens].long()
            stored = s["aux_hidden"][: len(ids)].float().reshape(len(ids), k, H).norm(dim=-1)
            res = llm(ids[None], hidden_layers=cands, logits="none")
            for c in cands:
                live = res.hidden[c][0].float().norm(dim=-1)
                live_norm.setdefault(c, []).append(live.numpy())
                for j in range(k):
                    logr.setdefault((j, c), []).append(torch.log(live / stored[:, j]).numpy())
    dist = {key: float(np.median(np.abs(np.concatenate(v)))) for key, v in logr.items()}
    stats = {int(v["slot"]): v for v in man.get("norm_stats", {}).get("layers", {}).values()}
    rows, finds = [], []
    if len(served) != len(cap):
        finds.append(
            Finding(ERROR, "number of aux layers (capture vs served)", len(cap), len(served))
        )
    for j, (cid, lid) in enumerate(zip(cap, served, strict=False)):
        near = min((c for c in cands if abs(c - lid) <= 1), key=lambda c: dist[(j, c)])
        st = stats.get(j, {})
        r = float(np.exp(np.median(np.concatenate(logr[(j, lid)]))))
        flags = []
        if near != lid and dist[(j, near)] < 0.5 * dist[(j, lid)]:
            flags.append(f"capture slot {j} holds live layer {near}'s states, not served {lid}'s "
                         f"(per-token norm gap {dist[(j, near)]:.1%} vs {dist[(j, lid)]:.1%})")  # fmt: skip
        if dist[(j, near)] > tol:
            flags.append(f"no neighbouring live layer reproduces the stored states (closest "
                         f"{dist[(j, near)]:.1%} off): another target, dtype or convention")  # fmt: skip
        rows.append(NormRow(j, cid, lid, float(st.get("p05", math.nan)), float(st.get("p50", math.nan)),
                            float(st.get("p95", math.nan)), float(np.median(np.concatenate(live_norm[lid]))),
                            r, near, "; ".join(flags)))  # fmt: skip
        if flags:
            finds.append(Finding(ERROR, f"hidden-state norms on the capture's tokens, aux slot {j} (capture layer {cid}, served layer {lid})",
                                 "live states at the served layer equal the stored ones",
                                 f"per-token norm ratio {r:.3f}", "; ".join(flags) +
                                 ": wrong layer or layer-id convention between capture and serving"))  # fmt: skip
    return rows, finds
