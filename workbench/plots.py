"""Plotly figure builders used by notebooks, plus the offline-embedding helpers the report
runner uses (plotly.js goes into each HTML report once; reports are opened offline).

Plots take data (dicts, lists, result objects), never a pipeline module: callers compute
summaries (e.g. `capture.summarize`) and pass them in, so nothing here imports upward."""

from __future__ import annotations

import functools
from typing import Any

PLOTLY_MIMETYPE = "application/vnd.plotly.v1+json"


@functools.lru_cache(maxsize=1)
def plotlyjs_script() -> str:
    """The full plotly.js bundle as one inline <script> block (no CDN)."""
    from plotly.offline import get_plotlyjs

    return (
        '<script type="text/javascript">window.PlotlyConfig = {MathJaxConfig: "local"};</script>\n'
        f'<script type="text/javascript">{get_plotlyjs()}</script>\n'
    )


def figure_html(fig: dict[str, Any] | Any) -> str:
    """A div + Plotly.newPlot script for one figure; expects plotly.js already on the page."""
    import plotly.io as pio

    return pio.to_html(
        fig, include_plotlyjs=False, full_html=False, validate=False, default_width="100%"
    )


# ---------------------------------------------------------------- 01 capture


def norm_distributions(manifest: dict):
    """Per-layer token-norm histograms (log x) from a capture manifest."""
    import plotly.graph_objects as go

    ns = manifest["norm_stats"]
    edges = ns["bin_edges"]
    centers = [(a * b) ** 0.5 for a, b in zip(edges[:-1], edges[1:], strict=True)]
    fig = go.Figure()
    series = [(f"layer {lid} (aux {v['slot']})", v) for lid, v in ns["layers"].items()]
    series.append((f"final (layer {ns['last']['layer']}, pre-norm)", ns["last"]))
    for name, st in series:
        total = max(sum(st["hist"]), 1)
        fig.add_trace(
            go.Scatter(
                x=centers,
                y=[c / total for c in st["hist"]],
                mode="lines",
                name=name,
                line_shape="hvh",
            )
        )
    conv = manifest["layer_ids"]["convention"]
    fig.update_layout(
        title=f"Token L2-norm distribution per captured layer ({conv})",
        xaxis_title="per-token L2 norm",
        yaxis_title="share of tokens",
        xaxis_type="log",
        template="plotly_white",
        height=420,
    )
    return fig


def length_histogram(lengths: list[int], summary: dict):
    """Sequence lengths of the captured conversations, with assistant-token share.

    `lengths`: tokens per sample (`CaptureReader.lengths()`); `summary`: `capture.summarize`."""
    import plotly.graph_objects as go

    fig = go.Figure(go.Histogram(x=lengths, nbinsx=40, name="conversation length"))
    fig.update_layout(
        title=f"Sequence lengths ({len(lengths)} samples, {summary['tokens']} tokens, "
        f"{summary['assistant_share']:.0%} assistant tokens under the loss mask)",
        xaxis_title="tokens per conversation",
        yaxis_title="samples",
        template="plotly_white",
        height=380,
    )
    return fig


def bytes_per_token(s: dict):
    """Where the disk bytes go, per token: aux states dominate. `s`: `capture.summarize`."""
    import plotly.graph_objects as go

    parts = s["bytes_per_token_parts"]
    fig = go.Figure(
        go.Bar(
            x=list(parts),
            y=list(parts.values()),
            text=[f"{v} B" for v in parts.values()],
            textposition="outside",
        )
    )
    fig.add_hline(
        y=s["bytes_per_token"],
        line_dash="dash",
        annotation_text=f"measured on disk: {s['bytes_per_token']:.0f} B/token",
    )
    fig.update_layout(
        title=f"Bytes per token on disk ({s['dtype']}; {s['disk_bytes'] / 1e6:.1f} MB total)",
        yaxis_title="bytes per token",
        template="plotly_white",
        height=380,
    )
    return fig


# ---------------------------------------------------------------- 02 train draft


def _events(metrics: list[dict], kind: str) -> list[dict]:
    return [m for m in metrics if m.get("event") == kind]


def train_curves(metrics: list[dict]):
    """Loss, and accuracy per TTT position: held-out (solid) against training (dotted).

    A wide gap between the two at position 0 means the draft memorizes: more data helps more
    than more steps."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    tr, ev = _events(metrics, "train"), _events(metrics, "eval")
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("training loss (sum of 0.8^i x CE_i)", "accuracy per TTT position"),
    )
    fig.add_trace(
        go.Scatter(x=[m["step"] for m in tr], y=[m["loss"] for m in tr], name="loss",
                   mode="lines", line_color="#444"),
        row=1, col=1,
    )  # fmt: skip
    n = max([len(m["acc"]) for m in tr + ev] or [0])
    colors = qualitative.Plotly
    for i in range(n):
        c = colors[i % len(colors)]
        if ev:
            fig.add_trace(
                go.Scatter(x=[m["step"] for m in ev], y=[m["acc"][i] for m in ev],
                           name=f"held-out acc_{i}", legendgroup=f"p{i}", mode="lines+markers",
                           line_color=c),
                row=1, col=2,
            )  # fmt: skip
        fig.add_trace(
            go.Scatter(x=[m["step"] for m in tr], y=[m["acc"][i] for m in tr],
                       name=f"train acc_{i}", legendgroup=f"p{i}", mode="lines",
                       line=dict(color=c, dash="dot"), opacity=0.6, visible=True if i == 0 else "legendonly"),
            row=1, col=2,
        )  # fmt: skip
    last = ev[-1]["acc"][0] if ev else float("nan")
    fig.update_layout(
        title=f"Draft training: loss and per-position accuracy (held-out acc_0 {last:.3f})",
        template="plotly_white",
        height=420,
    )
    fig.update_xaxes(title_text="optimizer step")
    fig.update_yaxes(title_text="loss", row=1, col=1)
    fig.update_yaxes(title_text="top-1 agreement with the target", range=[0, 1], row=1, col=2)
    return fig


def tau_curve(metrics: list[dict], pays_off: float = 1.3):
    """Simulated accept length tau = 1 + sum_k prod_{j<=k} a_j on the held-out split."""
    import plotly.graph_objects as go

    ev = _events(metrics, "eval")
    steps = [m["step"] for m in ev]
    fig = go.Figure(
        go.Scatter(x=steps, y=[m["tau"] for m in ev], mode="lines+markers", name="simulated tau")
    )
    k = max([len(m.get("tau_k") or []) for m in ev] or [0])
    for j in range(k - 1):  # tau with fewer draft steps: where the extra steps stop paying
        fig.add_trace(
            go.Scatter(x=steps, y=[m["tau_k"][j] for m in ev], mode="lines", name=f"{j + 1} draft steps",
                       line=dict(dash="dot", width=1), opacity=0.6)
        )  # fmt: skip
    fig.add_hline(
        y=pays_off, line_dash="dash", line_color="red",
        annotation_text=f"~{pays_off}: below this speculation does not pay on CPU",
    )  # fmt: skip
    last = ev[-1]["tau"] if ev else float("nan")
    fig.update_layout(
        title=f"Simulated accept length tau on held-out data (chain, bonus included): {last:.2f}",
        xaxis_title="optimizer step",
        yaxis_title="tokens per target forward",
        template="plotly_white",
        height=400,
    )
    return fig


def vocab_coverage(curve: dict[int, float], chosen: int | None = None):
    """Share of assistant tokens inside a top-k draft vocab, against k (log x)."""
    import plotly.graph_objects as go

    ks = sorted(curve)
    fig = go.Figure(
        go.Scatter(x=ks, y=[curve[k] for k in ks], mode="lines+markers", name="coverage")
    )
    title = "Draft-vocab coverage of assistant tokens"
    if chosen:
        near = min(ks, key=lambda k: abs(k - chosen))
        fig.add_vline(x=chosen, line_dash="dash",
                      annotation_text=f"draft vocab {chosen}: {curve[near]:.1%}")  # fmt: skip
        title += f" (chosen {chosen}: {curve[near]:.1%})"
    fig.update_layout(
        title=title,
        xaxis_title="draft vocab size (most frequent target ids)",
        yaxis_title="share of assistant tokens covered",
        xaxis_type="log",
        yaxis_range=[0, 1.02],
        template="plotly_white",
        height=380,
    )
    return fig


# ---------------------------------------------------------------- 03 inspect draft


def acceptance_bars(result):
    """Per-position acceptance a_i (conditional on earlier positions accepted) with the measured
    pooled τ and the τ simulated from the a_i in the title."""
    import plotly.graph_objects as go

    a = result.accept_pos
    reached, _ = result.accept_counts
    fig = go.Figure(
        go.Bar(x=[f"pos {i}" for i in range(len(a))], y=a, text=[f"{v:.2f}" for v in a],
               textposition="outside", customdata=reached,
               hovertemplate="%{x}: %{y:.3f} (%{customdata} cycles reached it)<extra></extra>")
    )  # fmt: skip
    fig.update_layout(
        title=f"Per-position acceptance ({result.params}): pooled tau {result.tau:.2f}, "
        f"simulated tau {result.sim_tau:.2f}, mean of per-request tau {result.mean_request_tau:.2f}",
        xaxis_title="draft position i",
        yaxis_title="P(token i accepted | tokens < i accepted)",
        yaxis_range=[0, 1.1],
        template="plotly_white",
        height=400,
    )
    return fig


def category_bars(rows: list[dict]):
    """Pooled tau per prompt category (MT-bench has 8); bar text gives the request count."""
    import plotly.graph_objects as go

    fig = go.Figure(
        go.Bar(x=[r["category"] for r in rows], y=[r["tau"] for r in rows],
               text=[f"{r['tau']:.2f} (n={r['requests']})" for r in rows], textposition="outside")
    )  # fmt: skip
    fig.update_layout(
        title="Pooled accept length tau by prompt category",
        yaxis_title="tokens per verify forward (bonus included)",
        template="plotly_white",
        height=400,
    )
    return fig


def wiring_bars(audit):
    """Tau per aux-layer wiring with bootstrap CIs; the configured wiring is highlighted."""
    import plotly.graph_objects as go

    rows = audit.rows
    colors = ["#1f77b4" if i == 0 else ("#d62728" if r.beats_configured else "#aaaaaa")
              for i, r in enumerate(rows)]  # fmt: skip
    fig = go.Figure(
        go.Bar(
            x=[f"{r.name}<br>{list(r.layer_ids.ids)}" for r in rows],
            y=[r.tau for r in rows],
            marker_color=colors,
            error_y=dict(type="data", symmetric=False, array=[r.hi - r.tau for r in rows],
                         arrayminus=[r.tau - r.lo for r in rows]),
            text=[f"{r.tau:.3f}" for r in rows],
            textposition="inside",
        )
    )  # fmt: skip
    fig.update_layout(
        title=f"Layer-wiring audit: {audit.verdict} (bars: pooled tau, whiskers: {audit.ci:.0%} "
        "bootstrap CI over prompts)",
        yaxis_title="pooled tau",
        template="plotly_white",
        height=420,
    )
    return fig


def cycle_time_breakdown(breakdown: dict):
    """Mean ms per decode cycle, split into draft steps, draft extend, target verify, other."""
    import plotly.graph_objects as go

    parts = [("draft steps", "draft_ms"), ("draft extend", "extend_ms"), ("verify (target)", "verify_ms"),
             ("other", "other_ms")]  # fmt: skip
    fig = go.Figure()
    for name, key in parts:
        v = breakdown.get(key, 0.0)
        fig.add_trace(go.Bar(x=["per cycle"], y=[v], name=name, text=[f"{v:.1f} ms"],
                             textposition="inside"))  # fmt: skip
    share = breakdown.get("share", {}).get("verify", 0.0)
    fig.update_layout(
        barmode="stack",
        title=f"Time per decode cycle ({breakdown.get('cycles', 0)} cycles; verify {share:.0%})",
        yaxis_title="ms",
        template="plotly_white",
        height=420,
    )
    return fig


def accept_over_time(accepted: dict[str, list[tuple[int, int]]]):
    """Tokens each request emitted per verify cycle (bonus included), in cycle order."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for rid, rows in accepted.items():
        fig.add_trace(go.Scatter(x=list(range(len(rows))), y=[a for _, a in rows],
                                 mode="lines+markers", name=str(rid)[:12]))  # fmt: skip
    fig.update_layout(
        title=f"Accept length over time per request ({len(accepted)} requests)",
        xaxis_title="verify cycle of the request",
        yaxis_title="tokens emitted (bonus included)",
        template="plotly_white",
        height=420,
    )
    return fig


# ---------------------------------------------------------------- 03 speed


def speed_bars(rows: list[dict], chosen=None):
    """Tokens/s per method, the served setting (chosen on other prompts) highlighted, plain
    decoding as a dashed line."""
    import plotly.graph_objects as go

    labels = [r["method"] if r["config"] == "-" else f"EAGLE-3 {r['config']}" for r in rows]
    plain = next(r["tok_s"] for r in rows if r["method"].startswith("engine"))
    chosen_s = str(chosen) if chosen is not None else None
    colors = [
        "#2ca02c"
        if r["config"] == chosen_s
        else ("#d62728" if r["tok_s"] < plain and r["config"] != "-" else "#7f7f7f")
        for r in rows
    ]
    fig = go.Figure(
        go.Bar(
            x=labels,
            y=[r["tok_s"] for r in rows],
            marker_color=colors,
            text=[f"{r['tok_s']:.1f} tok/s<br>τ {r['tau']:.2f}" for r in rows],
            textposition="outside",
        )
    )
    fig.add_hline(y=plain, line_dash="dash", annotation_text="plain decoding")
    fig.update_layout(
        title="Decode speed, batch 1 (green: served setting, chosen on calibration prompts; "
        "red: slower than plain)",
        yaxis_title="tokens / s",
        template="plotly_white",
        height=420,
    )
    return fig


# ---------------------------------------------------------------- live serving (notebook 04)


def accept_histogram(hist: list[int], tau_sglang: float, tau: float):
    """Verify cycles by the number of draft tokens they accepted (SGLang's
    `spec_correct_drafts_histogram`, pooled over requests); a cycle emits that many + 1."""
    import plotly.graph_objects as go

    total = sum(hist) or 1
    fig = go.Figure(
        go.Bar(x=list(range(len(hist))), y=hist, text=[f"{h / total:.0%}" for h in hist],
               textposition="outside",
               hovertemplate="%{x} accepted: %{y} cycles<extra></extra>")
    )  # fmt: skip
    fig.update_layout(
        title=f"Accepted draft tokens per verify: pooled accept length {tau_sglang:.2f} "
        f"(SGLang's, prefill token counted), tau {tau:.2f} (decode tokens per verify)",
        xaxis_title="draft tokens accepted in a verify cycle",
        yaxis_title="verify cycles",
        template="plotly_white",
        height=400,
    )
    return fig


def histogram_acceptance_bars(a: list[float]):
    """Per-position acceptance a_i derived from the served histogram (conditional on the
    earlier positions accepted)."""
    import plotly.graph_objects as go

    fig = go.Figure(
        go.Bar(x=[f"pos {i}" for i in range(len(a))], y=a, text=[f"{v:.2f}" for v in a],
               textposition="outside")
    )  # fmt: skip
    fig.update_layout(
        title="Per-position acceptance while serving (from spec_correct_drafts_histogram)",
        xaxis_title="draft position i",
        yaxis_title="P(token i accepted | tokens < i accepted)",
        yaxis_range=[0, 1.1],
        template="plotly_white",
        height=400,
    )
    return fig


def serving_comparison(summaries: dict[str, dict]):
    """Output tokens/s and request latency p50/p90 per server (e.g. EAGLE-3 vs plain)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = list(summaries)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("output tokens / s", "latency (s)"))
    fig.add_trace(go.Bar(x=names, y=[summaries[n]["output_tok_s"] for n in names],
                         text=[f"{summaries[n]['output_tok_s']:.1f}" for n in names],
                         textposition="outside", showlegend=False), 1, 1)  # fmt: skip
    for q in ("p50", "p90"):
        fig.add_trace(go.Bar(x=names, y=[summaries[n][f"latency_s_{q}"] for n in names],
                             name=f"latency {q}"), 1, 2)  # fmt: skip
    fig.update_layout(title="Same server and prompts, with and without speculation",
                      template="plotly_white", height=420, barmode="group")  # fmt: skip
    return fig


def ttft_itl_boxes(samples: dict[str, dict[str, list[float]]]):
    """TTFT and inter-chunk latency (ms) per server; samples[name] = {"ttft": [...], "itl": [...]}."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("time to first token (ms)",
                                                        "inter-chunk latency (ms)"))  # fmt: skip
    for name, s in samples.items():
        fig.add_trace(go.Box(y=[v * 1e3 for v in s["ttft"]], name=name, showlegend=False), 1, 1)
        fig.add_trace(go.Box(y=[v * 1e3 for v in s["itl"]], name=name, showlegend=False), 1, 2)
    fig.update_layout(title="TTFT and ITL (a chunk is one verify's tokens with speculation)",
                      template="plotly_white", height=420)  # fmt: skip
    return fig
