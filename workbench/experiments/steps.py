"""Step-count cost model: predict tok/s of every (steps, topk, draft tokens, batch) config
from a few measured ones, name the predicted best, and score the prediction.

    tok/s(config) = accepted tokens per cycle / (draft + verify + extend + other) time

(SGLang's `bench_speculative.py` reports the same `speed = acc_length / step_time`.)

- Accepted tokens per cycle: a chain of `s` steps gets `metrics.simulated_tau(a[:s])` from
  the per-position acceptance a_i measured on the deepest calibration chain (or given, e.g.
  from notebook 03's offline inspection). A top-k tree gets `metrics.simulated_tree_tau`:
  its spare nodes widen the shallowest depths and a depth with m candidates is accepted with
  1 - (1 - a_i)^(1 + gamma (m - 1)); gamma is fitted on measured tree configs when the
  calibration holds one, else 1 (independent siblings, an optimistic bound).
- Times, least squares over the calibration configs' per-cycle means:
  draft = d0 + d1 (s - 1) + d2 (s - 1) k b (one draft forward per step past the first, each
  over k beams of b requests); verify = v0 + v1 n b (tokens verified); extend = e0 + e1 tau b
  (the draft re-reads the accepted tokens); other = the mean per-cycle time outside the
  three (Python, sampling), a constant.
- The no-speculation baseline is always measured (it is the reference) and is predicted as
  its measured step time.

Scores: predicted vs measured tok/s per config, `best_gap = 1 - measured(predicted best) /
measured best`, and Spearman's rank correlation of predicted vs measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from workbench import metrics
from workbench.errors import WorkbenchError
from workbench.experiments.sweep import config_key, label


class ModelError(WorkbenchError):
    """The cost model cannot be fitted from what was measured."""


def is_spec(config: dict[str, Any]) -> bool:
    return bool(config.get("spec", True)) and "num_steps" in config


def is_repeat(config: dict[str, Any]) -> bool:
    """A baseline measured again at the end of the sweep (the drift check), not a config."""
    return bool(config.get("repeat"))


def short(config: dict[str, Any]) -> str:
    """`s/k/n` for RESULT lines (`plain` for the baseline), batch left out when 1."""
    b = int(config.get("batch_size", 1))
    base = (
        f"{config['num_steps']}/{config['eagle_topk']}/{config['num_draft_tokens']}"
        if is_spec(config)
        else "plain"
    )
    return base if b == 1 else f"{base}@{b}"


def pick_calibration(configs: Sequence[dict[str, Any]], n: int = 3) -> list[dict[str, Any]]:
    """The configs to measure first: every baseline, the deepest and shallowest chain, the
    widest tree, then others spread evenly until `n` speculative ones are picked."""
    spec = [c for c in configs if is_spec(c)]
    out = [c for c in configs if not is_spec(c)]
    chains = sorted((c for c in spec if c["eagle_topk"] == 1), key=lambda c: c["num_steps"])
    trees = sorted((c for c in spec if c["eagle_topk"] > 1),
                   key=lambda c: (c["num_draft_tokens"] * c["eagle_topk"], c["num_steps"]))  # fmt: skip
    chosen: list[dict[str, Any]] = []
    for c in [*chains[-1:], *chains[:1], *trees[-1:]]:
        if c not in chosen:
            chosen.append(c)
    rest = [c for c in spec if c not in chosen]
    while len(chosen) < n and rest:
        chosen.append(rest.pop(len(rest) // 2))
    return out + chosen[: max(n, 1)]


@dataclass
class CostModel:
    acceptance: list[float]  # chain per-position acceptance a_i
    acceptance_source: str
    gamma: float
    gamma_source: str
    draft_coef: list[float]  # d0, d1 per step, d2 per step x beam x request
    verify_coef: list[float]  # v0, v1 per verified token
    extend_coef: list[float]  # e0, e1 per accepted token
    other_ms: float
    baseline_ms: dict[int, float] = field(default_factory=dict)  # batch -> measured step ms
    fit_keys: list[str] = field(default_factory=list)

    def tau(self, c: dict[str, Any]) -> float:
        if not is_spec(c):
            return 1.0
        s, k, n = c["num_steps"], c["eagle_topk"], c["num_draft_tokens"]
        return metrics.simulated_tree_tau(self.acceptance, s, k, n, self.gamma)

    def times(self, c: dict[str, Any]) -> dict[str, float]:
        b = int(c.get("batch_size", 1))
        if not is_spec(c):
            if b not in self.baseline_ms:
                raise ModelError(f"no measured baseline at batch {b}: the sweep must run it")
            return {"cycle_ms": self.baseline_ms[b]}
        s, k, n = c["num_steps"], c["eagle_topk"], c["num_draft_tokens"]
        t = {
            "draft_ms": float(np.dot(self.draft_coef, _draft_x(s, k, b))),
            "verify_ms": float(np.dot(self.verify_coef, _verify_x(n, b))),
            "extend_ms": float(np.dot(self.extend_coef, _extend_x(self.tau(c), b))),
            "other_ms": self.other_ms,
        }
        t["cycle_ms"] = sum(t.values())
        return t

    def tok_s(self, c: dict[str, Any]) -> float:
        """Predicted decode tokens/s of the whole batch (tau x batch per cycle)."""
        b = int(c.get("batch_size", 1))
        return 1e3 * self.tau(c) * b / self.times(c)["cycle_ms"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _draft_x(s: int, k: int, b: int) -> list[float]:
    return [1.0, s - 1.0, (s - 1.0) * k * b]


def _verify_x(n: int, b: int) -> list[float]:
    return [1.0, float(n * b)]


def _extend_x(tau: float, b: int) -> list[float]:
    return [1.0, tau * b]


def _lstsq(x: list[list[float]], y: list[float]) -> list[float]:
    sol, *_ = np.linalg.lstsq(np.asarray(x, float), np.asarray(y, float), rcond=None)
    return [float(v) for v in sol]


def fit_cost_model(
    rows: Sequence[dict[str, Any]],
    fit_keys: Sequence[str] | None = None,
    acceptance: Sequence[float] | None = None,
) -> CostModel:
    """Fit on the ok rows whose key is in `fit_keys` (default: all ok rows).

    `acceptance`: chain per-position acceptance from elsewhere (offline inspection); by
    default it is read from the deepest measured chain among the fit rows."""
    ok = [r for r in rows if r["status"] == "ok" and not is_repeat(r["config"])]
    fit = [r for r in ok if fit_keys is None or r["key"] in set(fit_keys)]
    spec = [r for r in fit if is_spec(r["config"])]
    if not spec:
        raise ModelError(
            "the cost model needs at least one measured speculative config among the fit rows"
        )
    untimed = [label(r["config"]) for r in spec
               if any(r["result"].get(k) is None for k in ("draft_ms", "verify_ms", "extend_ms"))]  # fmt: skip
    if untimed:
        raise ModelError(
            f"no per-cycle draft/verify/extend times for {untimed}: the cost model needs a trace "
            "(the local engine, in process or served, writes one)"
        )
    base = {int(r["config"].get("batch_size", 1)): r["result"]["cycle_ms"]
            for r in fit if not is_spec(r["config"])}  # fmt: skip
    if acceptance is None:
        chains = [r for r in spec if r["config"]["eagle_topk"] == 1]
        if not chains:
            raise ModelError(
                "no measured chain (topk 1) to read per-position acceptance from: add one to "
                "the calibration configs or pass acceptance="
            )
        deep = max(chains, key=lambda r: r["config"]["num_steps"])
        acc, src = list(deep["result"]["acceptance"]), f"measured on {label(deep['config'])}"
    else:
        acc, src = [float(a) for a in acceptance], "given"
    trees = [r for r in spec if r["config"]["eagle_topk"] > 1]
    gamma, gsrc = 1.0, "default (independent siblings, optimistic)"
    if trees:
        grid = [g / 20 for g in range(21)]

        def err(g: float) -> float:
            return sum(
                (metrics.simulated_tree_tau(acc, r["config"]["num_steps"], r["config"]["eagle_topk"],
                                            r["config"]["num_draft_tokens"], g) - r["result"]["tau"]) ** 2
                for r in trees
            )  # fmt: skip

        gamma = min(grid, key=err)
        gsrc = f"fitted on {len(trees)} tree config(s)"

    def bs(r):
        return int(r["config"].get("batch_size", 1))

    def cfg(r, name):
        return r["config"][name]

    res = [r["result"] for r in spec]
    draft = _lstsq([_draft_x(cfg(r, "num_steps"), cfg(r, "eagle_topk"), bs(r)) for r in spec],
                   [x["draft_ms"] for x in res])  # fmt: skip
    verify = _lstsq([_verify_x(cfg(r, "num_draft_tokens"), bs(r)) for r in spec],
                    [x["verify_ms"] for x in res])  # fmt: skip
    extend = _lstsq([_extend_x(x["tau"], bs(r)) for r, x in zip(spec, res, strict=True)],
                    [x["extend_ms"] for x in res])  # fmt: skip
    other = float(np.mean([x["cycle_ms"] - x["traced_ms"] for x in res]))
    return CostModel(acc, src, gamma, gsrc, draft, verify, extend, other, base,
                     [r["key"] for r in fit])  # fmt: skip


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); nan when either is constant."""

    def ranks(v: Sequence[float]) -> np.ndarray:
        v = np.asarray(v, float)
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            r[order[i : j + 1]] = (i + j) / 2
            i = j + 1
        return r

    if len(x) != len(y):
        raise ValueError("spearman needs two sequences of the same length")
    rx, ry = ranks(x), ranks(y)
    if len(x) < 2 or rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def evaluate(rows: Sequence[dict[str, Any]], model: CostModel) -> dict[str, Any]:
    """Predicted vs measured for every ok row; the predicted and measured best; the scores;
    `drift`: the baseline's tok/s measured again at the end over the first measurement, - 1
    (per batch size): the machine's own change during the sweep, which the errors include."""
    ok = [r for r in rows if r["status"] == "ok" and not is_repeat(r["config"])]
    again = {int(r["config"].get("batch_size", 1)): r["result"]["tok_s"]
             for r in rows if r["status"] == "ok" and is_repeat(r["config"])}  # fmt: skip
    if not ok:
        raise ModelError("no successful config to compare against")
    fit = set(model.fit_keys)
    base = {int(r["config"].get("batch_size", 1)): r["result"]["tok_s"]
            for r in ok if not is_spec(r["config"])}  # fmt: skip
    table = []
    for r in ok:
        c, m = r["config"], r["result"]
        pred = model.tok_s(c)
        b = int(c.get("batch_size", 1))
        table.append({
            "config": short(c), "key": r["key"], "fit": r["key"] in fit,
            "num_steps": c.get("num_steps", 0), "eagle_topk": c.get("eagle_topk", 0),
            "num_draft_tokens": c.get("num_draft_tokens", 1), "batch_size": b,
            "measured_tok_s": m["tok_s"], "predicted_tok_s": pred,
            "error": pred / m["tok_s"] - 1.0,
            "measured_tau": m["tau"], "predicted_tau": model.tau(c),
            "speedup": metrics.speedup(m["tok_s"], base[b]) if b in base else None,
            "draft_ms": m.get("draft_ms"), "verify_ms": m.get("verify_ms"),
            "extend_ms": m.get("extend_ms"), "cycle_ms": m.get("cycle_ms"),
            **{f"predicted_{k}": v for k, v in model.times(c).items()},
        })  # fmt: skip
    best = max(table, key=lambda t: t["measured_tok_s"])
    pick = max(table, key=lambda t: t["predicted_tok_s"])
    held = [t for t in table if not t["fit"]]
    out = {
        "table": table,
        "best": best["config"],
        "predicted": pick["config"],
        "best_gap": 1.0 - pick["measured_tok_s"] / best["measured_tok_s"],
        "rank_corr": spearman(
            [t["predicted_tok_s"] for t in table], [t["measured_tok_s"] for t in table]
        ),  # fmt: skip
        "mean_abs_error": float(np.mean([abs(t["error"]) for t in table])),
        "held_out_mean_abs_error": float(np.mean([abs(t["error"]) for t in held]))
        if held
        else None,
        "model": model.to_dict(),
        "drift": {b: again[b] / base[b] - 1.0 for b in again if b in base},
    }
    out["adaptive"] = compare_adaptive(out, model)
    return out


ADAPTIVE_TIERS = (1, 3, 7)


def adaptive_steady_state(
    tau_at: dict[int, float], tiers: Sequence[int] = ADAPTIVE_TIERS, max_iter: int = 20
) -> tuple[int, list[int]]:
    """Where SGLang's `--speculative-adaptive` rule settles, emulated from its description
    (PRs #21599, #24055; not SGLang's code): the next steps are round(EMA accept length) + 1,
    snapped to the smallest pre-captured tier >= that (the largest tier if none). With a
    fixed accept length per tier (the EMA's limit) and starting from the largest tier, it
    returns the tier it settles on (or the last of an oscillation) and the path."""
    tiers = sorted(tiers)

    def snap(x: int) -> int:
        return next((t for t in tiers if t >= x), tiers[-1])

    path = [tiers[-1]]
    for _ in range(max_iter):
        nxt = snap(round(tau_at[path[-1]]) + 1)
        if nxt in path:
            path.append(nxt)
            break
        path.append(nxt)
    return path[-1], path


def compare_adaptive(
    report: dict[str, Any], model: CostModel, tiers: Sequence[int] = ADAPTIVE_TIERS
) -> dict[str, Any]:
    """The adaptive rule's steady-state tier (chain, batch 1) vs the cost model's pick.

    Each tier's tau and tok/s are measured when the sweep ran that chain, else the model's
    (labelled `source`)."""
    table = {t["config"]: t for t in report["table"]}
    tiers_out = {}
    for s in tiers:
        cfg = {"spec": True, "num_steps": s, "eagle_topk": 1, "num_draft_tokens": s + 1}
        row = table.get(short(cfg))
        if row is not None:
            tiers_out[s] = {"tau": row["measured_tau"], "tok_s": row["measured_tok_s"],
                            "source": "measured"}  # fmt: skip
        else:
            src = "predicted" + (" (a_i past the measured depth = the last one)"
                                 if s > len(model.acceptance) else "")  # fmt: skip
            tiers_out[s] = {"tau": model.tau(cfg), "tok_s": model.tok_s(cfg), "source": src}
    tier, path = adaptive_steady_state({s: v["tau"] for s, v in tiers_out.items()}, tiers)
    pick = table[report["predicted"]]
    a = tiers_out[tier]
    return {
        "tiers": tiers_out,
        "adaptive_config": f"{tier}/1/{tier + 1}",
        "adaptive_path": path,
        "adaptive_tok_s": a["tok_s"],
        "adaptive_source": a["source"],
        "model_config": report["predicted"],
        "model_tok_s": pick["measured_tok_s"],
        "winner": "cost model" if pick["measured_tok_s"] > a["tok_s"] else "adaptive rule",
    }


def result_line(report: dict[str, Any]) -> str:
    drift = max(report["drift"].values(), key=abs) if report.get("drift") else None
    return (
        f"RESULT configs={len(report['table'])} best={report['best']} "
        f"predicted={report['predicted']} best_gap={report['best_gap']:.3f} "
        f"rank_corr={report['rank_corr']:.3f} mean_abs_error={report['mean_abs_error']:.3f}"
        + (f" drift={drift:+.3f}" if drift is not None else "")
    )


def drift_warning(report: dict[str, Any], limit: float = 0.05) -> str | None:
    """A warning when the machine's speed changed by more than `limit` during the sweep."""
    worst = max(report.get("drift", {}).values(), key=abs, default=0.0)
    if abs(worst) <= limit:
        return None
    return (
        f"warning: plain decoding measured {worst:+.1%} at the end vs the start of the sweep: "
        "the machine's speed changed (other load?), so measured tok/s of later configs, and "
        "the model's errors, include that drift; rerun on a quiet machine"
    )


def adaptive_line(report: dict[str, Any]) -> str:
    a = report["adaptive"]
    return (
        f"adaptive rule (emulated, tiers {list(a['tiers'])}): settles on {a['adaptive_config']} "
        f"(path {a['adaptive_path']}), {a['adaptive_tok_s']:.2f} tok/s ({a['adaptive_source']}); "
        f"cost model's pick {a['model_config']}: {a['model_tok_s']:.2f} tok/s measured; "
        f"winner: {a['winner']}"
    )


def format_table(report: dict[str, Any]) -> str:
    head = f"{'config':<10}{'fit':>4}{'tau':>7}{'tau^':>7}{'tok/s':>9}{'tok/s^':>9}{'err':>8}{'speedup':>9}"
    lines = [head]
    for t in report["table"]:
        sp = f"{t['speedup']:.2f}" if t["speedup"] is not None else "-"
        lines.append(
            f"{t['config']:<10}{'*' if t['fit'] else '':>4}{t['measured_tau']:7.2f}"
            f"{t['predicted_tau']:7.2f}{t['measured_tok_s']:9.2f}{t['predicted_tok_s']:9.2f}"
            f"{t['error']:+8.1%}{sp:>9}"
        )
    return "\n".join(lines)


def step_sweep(
    backend,
    configs: Sequence[dict[str, Any]],
    out_dir,
    *,
    calibration: int = 3,
    progress: bool = True,
    acceptance: Sequence[float] | None = None,
    workload: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Measure the calibration configs first, then the rest, then the baseline again (the
    drift check), in one resumable sweep folder; fit on the calibration, predict every config. Returns (rows, report or None when no
    speculative config succeeded)."""
    from workbench.experiments.sweep import run_sweep

    calib = pick_calibration(configs, calibration)
    again = [{**c, "repeat": "end"} for c in configs if not is_spec(c)]  # the drift check
    ordered = calib + [c for c in configs if c not in calib] + again
    rows = run_sweep(ordered, backend, out_dir, progress=progress, desc="step sweep",
                     workload=workload)  # fmt: skip
    ok_keys = {r["key"] for r in rows if r["status"] == "ok"}
    fit_keys = [config_key(c) for c in calib if config_key(c) in ok_keys]
    if not any(is_spec(r["config"]) and r["key"] in fit_keys for r in rows):
        return rows, None
    model = fit_cost_model(rows, fit_keys, acceptance)
    return rows, evaluate(rows, model)


def run_step_sweep(
    out_dir=None,
    *,
    backend: str = "engine",
    target: str = "smollm2-135m",
    draft: str | None = None,
    num_steps: Sequence[int] = (1, 2, 3, 4, 5),
    eagle_topk: Sequence[int] = (1,),
    num_draft_tokens: Sequence[int | None] = (None,),
    batch_size: Sequence[int] = (1,),
    n_prompts: int = 4,
    max_new_tokens: int = 48,
    dtype: str = "float32",
    calibration: int = 3,
    tp_size: int = 1,
    progress: bool = True,
) -> dict[str, Any]:
    """A step sweep over MT-bench first turns, resumable in `out_dir` (default
    `$WORKBENCH_HOME/sweeps/steps-<workload hash>`, so the same workload resumes), with the
    cost model fitted on `calibration` configs.

    backend: `engine` (the embedded engine in this process, batch 1), `local` (the local
    server over HTTP, batch = concurrency) or `sglang` (a launch per config; no trace, so no
    cost model unless SGLang's plugin writes one). Returns `rows`, `report` (None when the
    model could not be fitted, `model_error` says why), `rejected` (configs SGLang refuses),
    `out_dir`."""
    from pathlib import Path

    from workbench.experiments.sweep import step_grid

    if backend not in ("engine", "local", "sglang"):
        raise ModelError(f"backend must be engine, local or sglang, got {backend!r}")
    configs, rejected = step_grid(num_steps, eagle_topk, num_draft_tokens, batch_size)
    workload = {"backend": backend, "target": target, "draft": str(draft), "n_prompts": n_prompts,
                "max_new_tokens": max_new_tokens, "dtype": dtype, "prompts": "mtbench turn 1",
                "tp_size": tp_size}  # fmt: skip
    if out_dir is None:
        from workbench.target import workbench_home

        out_dir = workbench_home() / "sweeps" / f"steps-{config_key(workload)}"
    out = Path(out_dir)
    if backend == "engine":
        from workbench.experiments.local import load_local

        run = load_local(target, draft, n_prompts=n_prompts, max_new_tokens=max_new_tokens,
                         dtype=dtype, trace_dir=out / "traces")  # fmt: skip
    else:
        from workbench.experiments.served import ServedBackend

        if draft is None:
            raise ModelError("a served step sweep needs a draft")
        run = ServedBackend(backend, target, str(draft), out, n_prompts=n_prompts,
                            max_new_tokens=max_new_tokens, dtype=dtype, tp_size=tp_size)  # fmt: skip
    model_error = None
    try:
        rows, report = step_sweep(run, configs, out, calibration=calibration, progress=progress,
                                  workload=workload)  # fmt: skip
        if report is None:
            model_error = "no speculative calibration config succeeded"
    except ModelError as e:
        from workbench.experiments.sweep import RESULTS, latest_rows, read_results

        done = latest_rows(read_results(out / RESULTS))
        rows = [done[k] for k in map(config_key, configs) if k in done]
        report, model_error = None, str(e)
    return {"rows": rows, "report": report, "model_error": model_error, "rejected": rejected,
            "out_dir": str(out)}  # fmt: skip
