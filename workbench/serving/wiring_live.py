"""Live wiring check: do the target layers SGLang feeds the draft match the ones it was trained on?

The field report's bug (aux layer ids one off between capture and serving) showed up only
as a lower accept length. Here it is caught while serving: the trace plugin (launched with
`ServeSpec(trace_hidden=True)`) records, per cycle, the mean L2 norm of each aux layer's
slice of the draft's 3H input; the capture manifest holds per-token norm statistics of the
layers the draft was trained on. Residual-stream norms grow with depth, so the captured
layers' medians give a norm -> layer curve (log-linear between captured layers, extended
past the ends with the nearest segment's slope): a served slot whose live median sits off
its captured layer's median by more than `tol` AND reads, on that curve, as another layer is
named: "served slot 2 (layer 27) looks like captured layer ~28 ± 1". Prompt sets differ
(capture: training conversations; live: whatever is served), so medians agree only to a few
percent on a correct wiring; the ± 1 says how finely three captured layers resolve depth.

Also: `quirk_warnings`, SGLang's per-architecture readings of the draft's layer ids
(sglang.md), said before launch.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from workbench.engine.trace import CycleRecord
from workbench.errors import WorkbenchError
from workbench.layers import CANONICAL, LayerIds

TOL = 1.08  # live/captured median ratio a correct wiring stays within (measured: see tests)


@dataclass
class SlotRow:
    slot: int
    captured_layer: int
    served_layer: int
    captured_p50: float
    live_median: float
    ratio: float
    looks_like: float | None  # the layer the live norm reads as on the captured curve
    flagged: bool


@dataclass
class LiveWiring:
    rows: list[SlotRow]
    cycles: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def result_line(self) -> str:
        worst = max(self.rows, key=lambda r: abs(math.log(r.ratio)), default=None)
        w = f" worst_slot={worst.slot} ratio={worst.ratio:.3f}" if worst else ""
        return f"RESULT live_wiring ok={self.ok} cycles={self.cycles}{w}"

    def table(self) -> list[dict]:
        return [r.__dict__ | {"looks_like": _fmt_layer(r.looks_like)} for r in self.rows]


def _fmt_layer(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f}"


def live_aux_norms(records: Sequence[CycleRecord]) -> list[list[float]]:
    """Per aux slot, the per-cycle mean norms the trace recorded (cycles without them skipped)."""
    rows = [r.aux_norms for r in records if r.aux_norms]
    if not rows:
        raise WorkbenchError(
            "the trace has no aux_norms: launch the server with ServeSpec(trace_hidden=True) "
            "(WORKBENCH_TRACE_HIDDEN=1) and serve at least one EAGLE-3 decode cycle"
        )
    k = len(rows[0])
    if any(len(r) != k for r in rows):
        raise WorkbenchError(f"trace aux_norms change width across cycles (first has {k})")
    return [[r[j] for r in rows] for j in range(k)]


def looks_like(
    ids: Sequence[int], medians: Sequence[float], value: float, near: int
) -> float | None:
    """The (fractional) layer whose median norm would be `value`, on the log-linear curve through
    the captured (id, median) points; among several readings the one nearest `near`."""
    pts = sorted((int(i), math.log(m)) for i, m in zip(ids, medians, strict=True) if m > 0)
    if len(pts) < 2 or value <= 0:
        return None
    v = math.log(value)
    cands = []
    for k, ((a, ya), (b, yb)) in enumerate(zip(pts, pts[1:], strict=False)):
        if yb == ya or b == a:
            continue
        x = a + (v - ya) * (b - a) / (yb - ya)
        inside = min(a, b) <= x <= max(a, b)
        before = k == 0 and x < a
        after = k == len(pts) - 2 and x > b
        if inside or before or after:
            cands.append(x)
    return min(cands, key=lambda x: abs(x - near)) if cands else None


def live_wiring_check(
    records: Sequence[CycleRecord],
    manifest: dict,
    served: LayerIds | None = None,
    *,
    tol: float = TOL,
) -> LiveWiring:
    """Compare the trace's per-aux-layer norms with the capture manifest's, slot by slot.

    `served`: the ids the draft's config names (default: the captured ones), used in messages;
    the verdict comes from the norms alone, since the bug being caught is a config that names
    the right ids and means others (or the reverse)."""
    cap = LayerIds.from_dict(manifest["layer_ids"]).canonical
    srv = cap if served is None else served.canonical
    stats = {int(v["slot"]): v for v in manifest["norm_stats"]["layers"].values()}
    missing = [j for j in range(len(cap)) if not (stats.get(j) or {}).get("count")]
    if missing:
        raise WorkbenchError(f"capture manifest has no norm statistics for aux slots {missing}")
    p50 = [float(stats[j]["p50"]) for j in range(len(cap))]
    live = live_aux_norms(records)
    out = LiveWiring([], cycles=len(live[0]))
    if len(live) != len(cap):
        out.problems.append(
            f"the served draft reads {len(live)} aux layers, the capture recorded {len(cap)}"
        )
        return out
    for j, (cid, sid) in enumerate(zip(cap, srv, strict=False)):
        m = statistics.median(live[j])
        r = m / p50[j]
        est = looks_like(cap, p50, m, cid)
        flagged = max(r, 1 / r) > tol and (est is None or round(est) != cid)
        out.rows.append(SlotRow(j, cid, sid, p50[j], m, r, est, flagged))
        if flagged:
            out.problems.append(
                f"served slot {j} (layer {sid}) looks like captured layer ~{_fmt_layer(est)} ± 1, "
                f"not {cid}: live median norm {m:.4g} vs the capture's {p50[j]:.4g} "
                f"(ratio {r:.3f}, tolerance {tol}); check eagle_aux_hidden_state_layer_ids and "
                f"the layer-id convention between capture and serving"
            )
    if served is not None and tuple(srv) != tuple(cap):
        out.problems.append(
            f"the draft's config names layers {list(srv)} ({CANONICAL}); the capture recorded "
            f"{list(cap)}"
        )
    return out


# ---------------------------------------------------------------- before launch


def served_layer_ids(draft_dir: str | os.PathLike) -> LayerIds | None:
    """The ids an exported draft's config.json names (SGLang reads them as output_of_layer)."""
    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else LayerIds(tuple(ids), CANONICAL)


def quirk_warnings(target: str | os.PathLike, draft: str | os.PathLike | None) -> list[str]:
    """SGLang's per-architecture readings of the draft's layer ids that differ from Llama's +1
    (deepseek_v2, gpt_oss, qwen2/qwen3: sglang.md), as one line each; [] when none apply or
    the configs are not local files."""
    from workbench.audit import architecture_quirks

    tcfg = Path(target) / "config.json"
    if draft is None or not tcfg.is_file() or not (Path(draft) / "config.json").is_file():
        return []
    t = json.loads(tcfg.read_text())
    ids = served_layer_ids(draft)
    arch = (t.get("architectures") or [None])[0]
    if ids is None or arch is None:
        return []
    return [
        f"SGLang layer-id quirk: {f}"
        for f in architecture_quirks(arch, ids, t.get("num_hidden_layers"))
    ]
