"""HTML pages: a notebook's self-contained report (plotly.js inlined once, no CDN: reports are
opened offline and mailed around), `reports/index.html` and the two-run comparison."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from workbench.fsutil import atomic_write_text
from workbench.report.errors import ReportError
from workbench.report.figures import KEY_FIGURES
from workbench.report.manifest import MANIFEST, list_runs, read_manifest

# CDN scripts in renderer output: <script src="https://..."> and <script type="module">import "https://..."
_EXTERNAL_SCRIPT = re.compile(
    r"<script[^>]*\ssrc=[\"']?(?:https?:)?//[^>]*>\s*</script>"
    r"|<script[^>]*>\s*import\s+[\"'](?:https?:)?//[^\"']*[\"'];?\s*</script>",
    re.I,
)
_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{% block html_head_js_requirejs %}{% endblock %}
{% block html_head_js_mathjax %}{% endblock %}
{% block html_head_js_mermaidjs %}{% endblock %}
{% block jupyter_widgets %}{% endblock %}
{% block html_head_css %}{{ resources.wb_head | default('') }}{% endblock %}
"""


def _text(value: str | list[str]) -> str:
    return "".join(value) if isinstance(value, list) else value


def _is_plotlyjs_bundle(output: dict) -> bool:
    """A `notebook` renderer output that injects plotly.js itself (we inline it once instead)."""
    text = _text(output.get("data", {}).get("text/html", ""))
    return "plotly.js v" in text and ("define('plotly'" in text or len(text) > 1_000_000)


def export_html(ipynb: str | Path, html_path: str | Path, banner: str = "") -> Path:
    """Self-contained HTML: lab template without require.js/MathJax/mermaid/widget CDN scripts,
    plotly outputs turned into divs, and plotly.js inlined once in <head> when any plot exists."""
    import nbformat
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    from workbench.plots import PLOTLY_MIMETYPE, figure_html, plotlyjs_script

    nb = nbformat.read(str(ipynb), as_version=4)
    n_plots = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.get("outputs", []):
            if _is_plotlyjs_bundle(out):
                continue
            data = out.get("data", {})
            if PLOTLY_MIMETYPE in data:
                data["text/html"] = figure_html(dict(data[PLOTLY_MIMETYPE]))
                for k in [k for k in data if k not in ("text/html", "text/plain")]:
                    del data[k]
                n_plots += 1
            elif "plotly" in (h := _text(data.get("text/html", ""))):
                # html from a `notebook*` renderer: keep the figure, drop its CDN scripts
                data["text/html"] = _EXTERNAL_SCRIPT.sub("", h)
                n_plots += h.count('class="plotly-graph-div"')
            kept.append(out)
        cell.outputs = kept
    exporter = HTMLExporter(extra_loaders=[DictLoader({"wb_offline.html.j2": _TEMPLATE})])
    exporter.template_file = "wb_offline.html.j2"
    resources = {"wb_head": plotlyjs_script() if n_plots else ""}
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    if banner:
        body = body.replace("<main>", f"<main>\n{banner}", 1)
    html_path = Path(html_path)
    atomic_write_text(html_path, body)
    return html_path


def banner(run_id: str, stem: str, status: str) -> str:
    """The line atop a notebook's HTML: back to the index, run id, notebook, status."""
    color = {"ok": "#1a7f37", "failed": "#cf222e"}.get(status, "#666")
    return (
        '<div style="font:13px sans-serif;padding:6px 12px;border-bottom:1px solid #ddd">'
        f'<a href="../index.html">&larr; all runs</a> &middot; run <b>{html.escape(run_id)}</b>'
        f' &middot; {html.escape(stem)} &middot; <span style="color:{color}">{status}</span></div>'
    )


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)
    return "" if v is None else str(v)


_CSS = """body{font:14px system-ui,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}.ok{color:#1a7f37}.failed{color:#cf222e}.skipped,.running{color:#9a6700}
.diff{background:#fff3b0}code{font-size:12px}small{color:#666}"""


def write_index(reports_dir: str | Path = "reports") -> Path:
    """`reports/index.html`: one row per run with notebooks (links), status and key figures."""
    reports_dir = Path(reports_dir)
    runs = list_runs(reports_dir)
    keys = [k for k in KEY_FIGURES if any(k in (m.get("figures") or {}) for m in runs)]
    e = html.escape
    rows = []
    for m in runs:
        rid = m["run_id"]
        links = []
        for nb in m.get("notebooks", []):
            href = f"{rid}/{nb.get('html', nb['notebook'] + '.html')}"
            extra = (
                f" <small>(from {e(nb['reused_from'])})</small>" if nb.get("reused_from") else ""
            )
            err = f' title="{e(nb["error"])}"' if nb.get("error") else ""
            links.append(
                f'<a href="{e(href)}"{err}>{e(nb["notebook"])}</a> '
                f'<span class="{e(nb["status"])}">{e(nb["status"])}</span>{extra}'
            )
        figs = m.get("figures") or {}
        others = ", ".join(f"{e(k)}={e(_fmt(v))}" for k, v in figs.items() if k not in keys)
        git = m.get("git") or {}
        sha = (git.get("sha") or "")[:8] + ("+dirty" if git.get("dirty") else "")
        rows.append(
            f"<tr><td><code>{e(rid)}</code><br><small>{e(m.get('created', ''))}</small></td>"
            f'<td class="{e(m.get("status", ""))}">{e(m.get("status", ""))}</td>'
            f"<td>{'<br>'.join(links)}</td>"
            + "".join(f"<td>{e(_fmt(figs.get(k)))}</td>" for k in keys)
            + f"<td><small>{others}</small></td><td><code>{e(sha)}</code></td>"
            f"<td>{_fmt(m.get('duration_s'))}</td></tr>"
        )
    compares = sorted(reports_dir.glob("compare-*.html"))
    comp = "".join(f'<li><a href="{e(p.name)}">{e(p.stem)}</a></li>' for p in compares)
    head = "".join(f"<th>{e(k)}</th>" for k in keys)
    page = f"""<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Workbench reports</title>
<style>{_CSS}</style></head><body><h1>Workbench reports</h1>
<p>{len(runs)} run(s). Compare two runs: <code>workbench compare RUN_A RUN_B</code>.</p>
<table><tr><th>run</th><th>status</th><th>notebooks</th>{head}<th>other figures</th><th>git</th><th>seconds</th></tr>
{"".join(rows)}</table>{"<h2>Comparisons</h2><ul>" + comp + "</ul>" if comp else ""}</body></html>
"""
    path = reports_dir / "index.html"
    reports_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, page)
    return path


def _flatten(m: dict[str, Any]) -> dict[str, Any]:
    """The comparable facts of a run: per-notebook parameters/status/duration, figures, env."""
    out: dict[str, Any] = {"status": m.get("status"), "created": m.get("created")}
    figs = m.get("figures") or {}
    out.update({f"key figure {k}": figs[k] for k in KEY_FIGURES if k in figs})
    for k, v in (m.get("git") or {}).items():
        out[f"git.{k}"] = v
    for nb in m.get("notebooks", []):
        s = nb["notebook"]
        out[f"{s}: status"] = nb.get("status")
        out[f"{s}: seconds"] = nb.get("duration_s")
        for k, v in (nb.get("parameters") or {}).items():
            out[f"{s}: param {k}"] = v
        for k, v in (nb.get("figures") or {}).items():
            out[f"{s}: figure {k}"] = v
    for k, v in (m.get("packages") or {}).items():
        out[f"package {k}"] = v
    for k in ("hostname", "cpu_count", "memory_bytes"):
        out[f"host {k}"] = (m.get("host") or {}).get(k)
    out["accelerator devices"] = (m.get("accelerator") or {}).get("devices")
    return out


def compare_runs(run_a: str, run_b: str, reports_dir: str | Path = "reports") -> Path:
    """`reports/compare-A-vs-B.html`: parameters and key figures in two columns, diffs marked."""
    reports_dir = Path(reports_dir)
    ms = []
    for rid in (run_a, run_b):
        m = read_manifest(reports_dir / rid / MANIFEST)
        if m is None:
            known = ", ".join(m["run_id"] for m in list_runs(reports_dir)[:10])
            raise ReportError(f"no run {rid!r} in {reports_dir} (recent runs: {known})")
        ms.append(m)
    fa, fb = _flatten(ms[0]), _flatten(ms[1])
    e = html.escape
    rows, n_diff = [], 0
    for k in list(dict.fromkeys([*fa, *fb])):
        a, b = fa.get(k), fb.get(k)
        diff = a != b and k != "created"
        n_diff += diff
        rows.append(
            f"<tr{' class=diff' if diff else ''}><th>{e(k)}</th>"
            f"<td>{e(_fmt(a))}</td><td>{e(_fmt(b))}</td></tr>"
        )
    page = f"""<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">
<title>{e(run_a)} vs {e(run_b)}</title><style>{_CSS}</style></head><body>
<p><a href="index.html">&larr; all runs</a></p><h1>{e(run_a)} vs {e(run_b)}</h1>
<p>{n_diff} differing value(s), highlighted.</p>
<table><tr><th></th><th><a href="{e(run_a)}/">{e(run_a)}</a></th><th><a href="{e(run_b)}/">{e(run_b)}</a></th></tr>
{"".join(rows)}</table></body></html>
"""
    path = reports_dir / f"compare-{run_a}-vs-{run_b}.html"
    atomic_write_text(path, page)
    write_index(reports_dir)
    return path
