"""Plotly figures of notebooks 05 (step sweep) and 06 (all-reduce, TP scaling).

Builders take the plain dicts `steps.evaluate` and `allreduce.run_benchmark` return."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go


def step_heatmaps(report: dict[str, Any]) -> list[go.Figure]:
    """One heatmap per batch size: measured tok/s over (steps, topk), the best draft-token
    count per cell (its s/k/n in the cell text); the baseline is named in the title."""
    figs = []
    table = report["table"]
    for b in sorted({t["batch_size"] for t in table}):
        rows = [t for t in table if t["batch_size"] == b]
        spec = [t for t in rows if t["num_steps"]]
        plain = next((t for t in rows if not t["num_steps"]), None)
        steps = sorted({t["num_steps"] for t in spec})
        topks = sorted({t["eagle_topk"] for t in spec})
        z = [[None] * len(steps) for _ in topks]
        text = [[""] * len(steps) for _ in topks]
        for t in spec:
            i, j = topks.index(t["eagle_topk"]), steps.index(t["num_steps"])
            if z[i][j] is None or t["measured_tok_s"] > z[i][j]:
                z[i][j] = t["measured_tok_s"]
                text[i][j] = f"{t['config']}<br>{t['measured_tok_s']:.1f}"
        base = f", plain decoding {plain['measured_tok_s']:.1f} tok/s" if plain else ""
        fig = go.Figure(go.Heatmap(z=z, x=[str(s) for s in steps], y=[str(k) for k in topks],
                                   text=text, texttemplate="%{text}", colorscale="Viridis",
                                   colorbar={"title": "tok/s"}))  # fmt: skip
        fig.update_layout(title=f"Measured tok/s by steps and topk (batch {b}{base})",
                          xaxis_title="speculative_num_steps",
                          yaxis_title="speculative_eagle_topk", height=360)  # fmt: skip
        figs.append(fig)
    return figs


def accept_vs_steps(report: dict[str, Any]) -> go.Figure:
    """Accept length (tau, bonus included) vs steps: measured markers, model lines, per topk."""
    fig = go.Figure()
    spec = [t for t in report["table"] if t["num_steps"]]
    for k in sorted({t["eagle_topk"] for t in spec}):
        rows = sorted((t for t in spec if t["eagle_topk"] == k),
                      key=lambda t: (t["num_steps"], t["num_draft_tokens"]))  # fmt: skip
        names = [t["config"] for t in rows]
        fig.add_scatter(x=[t["num_steps"] for t in rows], y=[t["measured_tau"] for t in rows],
                        mode="markers", name=f"measured, topk {k}", text=names)  # fmt: skip
        fig.add_scatter(x=[t["num_steps"] for t in rows], y=[t["predicted_tau"] for t in rows],
                        mode="lines", line={"dash": "dot"}, name=f"model, topk {k}", text=names)  # fmt: skip
    fig.update_layout(title="Accept length vs steps (measured and the cost model's)",
                      xaxis_title="speculative_num_steps", yaxis_title="tau (tokens per verify)",
                      height=380)  # fmt: skip
    return fig


def predicted_vs_measured(report: dict[str, Any]) -> go.Figure:
    """Predicted vs measured tok/s per config; the model's pick and the measured best marked."""
    t = report["table"]
    lo = min(min(x["measured_tok_s"], x["predicted_tok_s"]) for x in t)
    hi = max(max(x["measured_tok_s"], x["predicted_tok_s"]) for x in t)
    fig = go.Figure()
    fig.add_scatter(x=[lo, hi], y=[lo, hi], mode="lines", line={"color": "gray", "dash": "dash"},
                    name="predicted = measured")  # fmt: skip
    for fit, name in ((True, "calibration (fitted)"), (False, "predicted (held out)")):
        rows = [x for x in t if x["fit"] == fit]
        fig.add_scatter(x=[x["measured_tok_s"] for x in rows],
                        y=[x["predicted_tok_s"] for x in rows], mode="markers+text",
                        text=[x["config"] for x in rows], textposition="top center", name=name)  # fmt: skip
    for cfg, sym, name in ((report["best"], "star", "measured best"),
                           (report["predicted"], "x", "model's pick")):  # fmt: skip
        x = next(r for r in t if r["config"] == cfg)
        fig.add_scatter(x=[x["measured_tok_s"]], y=[x["predicted_tok_s"]], mode="markers",
                        marker={"symbol": sym, "size": 16}, name=f"{name}: {cfg}")  # fmt: skip
    fig.update_layout(
        title=f"Predicted vs measured tok/s (best_gap {report['best_gap']:.1%}, "
        f"Spearman {report['rank_corr']:.2f})",
        xaxis_title="measured tok/s",
        yaxis_title="predicted tok/s",
        height=420,
    )
    return fig


def speedup_bars(report: dict[str, Any]) -> go.Figure:
    """Measured speedup over plain decoding per config (below 1 shown as measured)."""
    t = [x for x in report["table"] if x["speedup"] is not None]
    fig = go.Figure(go.Bar(x=[x["config"] for x in t], y=[x["speedup"] for x in t],
                           text=[f"{x['speedup']:.2f}" for x in t], textposition="outside"))  # fmt: skip
    fig.add_hline(y=1.0, line_dash="dash", line_color="gray")
    fig.update_layout(title="Speedup over plain decoding (same prompts, one run)",
                      xaxis_title="config (steps/topk/draft tokens)", yaxis_title="speedup",
                      height=360)  # fmt: skip
    return fig


def allreduce_curves(
    settings: dict[str, Sequence[dict[str, Any]]], marks: dict[str, int]
) -> go.Figure:
    """Latency and bus bandwidth vs message size, one line per setting; vertical marks at
    the decode and verify sizes."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("latency (us)", "bus bandwidth (GB/s)"))
    for name, rows in settings.items():
        x = [r["bytes"] for r in rows]
        fig.add_scatter(x=x, y=[r["us"] for r in rows], mode="lines+markers", name=name,
                        legendgroup=name, row=1, col=1)  # fmt: skip
        fig.add_scatter(x=x, y=[r["busbw_GBps"] for r in rows], mode="lines+markers", name=name,
                        legendgroup=name, showlegend=False, row=1, col=2)  # fmt: skip
    for label, nbytes in marks.items():
        for col in (1, 2):
            fig.add_vline(x=nbytes, line_dash="dot", line_color="gray", row=1, col=col)
        fig.add_annotation(x=nbytes, y=1.02, yref="paper", xref="x", text=label,
                           showarrow=False, font={"size": 10})  # fmt: skip
    fig.update_xaxes(type="log", title_text="message bytes")
    fig.update_yaxes(type="log")
    fig.update_layout(title="All-reduce latency and bus bandwidth vs message size", height=400)
    return fig


def tp_scaling_fig(predictions: dict[str, Sequence[dict[str, Any]]]) -> go.Figure:
    """Predicted verify step time (compute and communication) vs TP size per latency source."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("verify step (ms)", "speedup vs TP=1"))
    for name, rows in predictions.items():
        tp = [r["tp"] for r in rows]
        fig.add_scatter(x=tp, y=[r["step_ms"] for r in rows], mode="lines+markers",
                        name=f"{name}: total", legendgroup=name, row=1, col=1)  # fmt: skip
        fig.add_scatter(x=tp, y=[r["comm_ms"] for r in rows], mode="lines", line={"dash": "dot"},
                        name=f"{name}: all-reduce", legendgroup=name, row=1, col=1)  # fmt: skip
        fig.add_scatter(x=tp, y=[r["speedup"] for r in rows], mode="lines+markers",
                        name=name, legendgroup=name, showlegend=False, row=1, col=2)  # fmt: skip
    fig.update_xaxes(type="log", tickvals=[1, 2, 4, 8], title_text="TP size")
    fig.update_layout(title="TP-scaling prediction of the verify step", height=420)
    return fig
