"""Plotly figure builders used by notebooks, plus the offline-embedding helpers the report
runner uses (plotly.js goes into each HTML report once; reports are opened offline)."""

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


def length_histogram(reader):
    """Sequence lengths of the captured conversations, with assistant-token share."""
    import plotly.graph_objects as go

    lengths = reader.lengths()
    fig = go.Figure(go.Histogram(x=lengths, nbinsx=40, name="conversation length"))
    m = reader.manifest
    share = m["num_loss_tokens"] / max(m["num_tokens"], 1)
    fig.update_layout(
        title=f"Sequence lengths ({len(lengths)} samples, {m['num_tokens']} tokens, "
        f"{share:.0%} assistant tokens under the loss mask)",
        xaxis_title="tokens per conversation",
        yaxis_title="samples",
        template="plotly_white",
        height=380,
    )
    return fig


def bytes_per_token(reader):
    """Where the disk bytes go, per token: aux states dominate."""
    import plotly.graph_objects as go

    from workbench.capture import summarize

    s = summarize(reader)
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
