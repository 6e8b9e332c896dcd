"""Open an HTML report in headless Chromium and say whether its plots rendered without
JavaScript errors. Used by the tests and by `workbench pipeline` after each stage."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

_PROBE = """<script>window.__wb={errors:[],console:[]};window.addEventListener('error',function(e){
__wb.errors.push(String(e.message||e.type)+' @'+(e.filename||'')+':'+(e.lineno||''))},true);
window.addEventListener('unhandledrejection',function(e){__wb.errors.push('unhandled rejection: '+e.reason)});
(function(){var ce=console.error;console.error=function(){__wb.console.push(Array.prototype.join.call(arguments,' '));
return ce.apply(console,arguments)}})();
document.addEventListener('DOMContentLoaded',function(){setTimeout(function(){var d=document.createElement('pre');
d.id='__wb_probe';d.textContent=JSON.stringify(__wb);document.body.appendChild(d)},1500)});</script>"""


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if p := shutil.which(name):
            return p
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None


def _chromium_argv(exe: str, profile: str) -> list[str]:
    return [
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}",
    ]  # fmt: skip


def check_html_in_browser(
    path: str | Path, screenshot: str | Path | None = None, timeout: float = 90.0,
    window: tuple[int, int] = (1280, 2400), min_plots: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """Open an HTML report in headless Chromium (a temp copy with a probe script that records
    uncaught errors and console.error calls into the DOM, read back with --dump-dom): count
    plotly plots and those rendered (`.js-plotly-plot` holding a `.main-svg`), collect errors,
    optionally save a screenshot. `ok` needs >= min_plots plots, all rendered, and no errors.
    Returns {ok, plots, rendered_plots, main_svgs, js_errors, console_errors, log_uncaught,
    screenshot, returncode}."""
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("chromium not found (Debian: apt-get install -y chromium)")
    src = Path(path).resolve()
    text = src.read_text(encoding="utf-8")
    probed = re.sub(r"<head>", "<head>" + _PROBE, text, count=1)
    with tempfile.TemporaryDirectory(prefix="wb-chromium-") as tmp:
        page = Path(tmp) / src.name  # same name; links elsewhere do not matter for the check
        page.write_text(probed, encoding="utf-8")
        budget = "--virtual-time-budget=10000"
        argv = _chromium_argv(exe, str(Path(tmp) / "profile"))
        r = subprocess.run(
            [*argv, "--enable-logging=stderr", "--v=0", budget, "--dump-dom", page.as_uri()],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        dom = r.stdout
        shot = None
        if screenshot is not None:
            shot = Path(screenshot).resolve()
            shot.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [*argv, budget, f"--window-size={window[0]},{window[1]}",
                 f"--screenshot={shot}", src.as_uri()],
                capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
    m = re.search(r'<pre id="__wb_probe">(.*?)</pre>', dom, re.S)
    probe = json.loads(html.unescape(m.group(1))) if m else {"errors": [], "console": []}
    js_errors = probe["errors"] + ([] if m else ["probe did not report (page never loaded?)"])
    uncaught = [ln for ln in r.stderr.splitlines() if "CONSOLE" in ln and "Uncaught" in ln]
    # Plot divs come from figure_html (class plotly-graph-div); plotly adds js-plotly-plot and a
    # <svg class="main-svg"> inside once it has drawn the figure.
    parts = re.split(r'<div[^>]*class="([^"]*\bplotly-graph-div\b[^"]*)"', dom)
    classes, bodies = parts[1::2], parts[2::2]
    rendered = sum(
        1
        for c, b in zip(classes, bodies, strict=True)
        if "js-plotly-plot" in c and 'class="main-svg"' in b
    )
    out = {
        "plots": len(classes),
        "rendered_plots": rendered,
        "main_svgs": dom.count('class="main-svg"'),
        "js_errors": js_errors,
        "console_errors": probe["console"],
        "log_uncaught": uncaught,
        "screenshot": str(shot) if shot and shot.exists() else None,
        "returncode": r.returncode,
    }
    out["ok"] = bool(
        r.returncode == 0 and out["plots"] >= min_plots and rendered == out["plots"]
        and not js_errors and not uncaught and not probe["console"]
        and (screenshot is None or out["screenshot"])
    )  # fmt: skip
    return out
