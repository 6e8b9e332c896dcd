"""Report runner: real papermill runs of tiny notebooks (seconds each), HTML offline embedding,
failure path, parameter validation, recorded figures, stage cache, index, browser, quiet
progress, and errors that name the file."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from workbench import report as R
from workbench.report.figures import RUN_DIR_ENV
from workbench.report.runner import input_artifacts
from workbench.report.stages import resolve_references

NB = Path(__file__).parent / "notebooks"
PLOT, FAIL, STAGE = NB / "tiny_plot.ipynb", NB / "tiny_fail.ipynb", NB / "tiny_stage.ipynb"
PROGRESS = NB / "tiny_progress.ipynb"


@pytest.fixture(scope="module", autouse=True)
def _venv_kernel():
    """The notebooks name kernel `python3`; it must start this interpreter (the venv's), where
    workbench is importable. jupyter_client maps a spec's `python` argv to sys.executable."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    exe = spec.argv[0]
    assert exe in ("python", "python3") or Path(exe).resolve() == Path(sys.executable).resolve(), (
        spec.argv
    )


@pytest.fixture(scope="module")
def plot_run(tmp_path_factory):
    rd = tmp_path_factory.mktemp("reports")
    return R.run_notebook(PLOT, {"n_points": 7, "greeting": "bonjour", "seed": 11}, rd), rd


def _plotlyjs_head() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()[:400]


def test_success_run_writes_ipynb_html_manifest(plot_run):
    r, rd = plot_run
    assert r.status == "ok" and r.ipynb.is_file() and r.html.is_file()
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", r.run_id)
    assert r.run_dir == rd / r.run_id
    nb = json.loads(r.ipynb.read_text())
    text = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    assert "GREETING=bonjour N=7" in text  # injected parameters took effect
    assert "GREETING=bonjour N=7" in r.html.read_text()
    m = json.loads(r.manifest.read_text())
    assert m["status"] == "ok" and m["run_id"] == r.run_id
    (e,) = m["notebooks"]
    assert e["parameters"] == {"n_points": 7, "greeting": "bonjour", "seed": 11}
    assert e["seeds"] == {"seed": 11} and e["duration_s"] > 0 and e["status"] == "ok"
    assert len(e["source_sha256"]) == 64
    for k in ("git", "packages", "host", "accelerator"):
        assert k in m
    assert {"torch", "transformers", "papermill", "plotly", "workbench"} <= set(m["packages"])
    assert m["host"]["cpu_count"] >= 1 and "dirty" in m["git"]


def test_html_is_offline_with_plotlyjs_once(plot_run):
    r, _ = plot_run
    html = r.html.read_text()
    assert html.count(_plotlyjs_head()) == 1  # the bundle, inlined once
    assert not re.search(r"<script[^>]+src=", html)  # no CDN / external scripts at all
    assert "cdn.plot.ly/plotly" not in html
    assert html.count('class="plotly-graph-div"') == 2  # both figures, as live plotly divs
    assert "Plotly.newPlot" in html


def test_recorded_figures_land_in_manifest_and_index(plot_run):
    r, rd = plot_run
    assert r.figures == {"tau": pytest.approx(1.7), "greeting": "bonjour"}
    m = json.loads(r.manifest.read_text())
    assert m["figures"]["tau"] == pytest.approx(1.7)
    index = (rd / "index.html").read_text()
    assert r.run_id in index and f"{r.run_id}/tiny_plot.html" in index
    assert "<th>tau</th>" in index and "1.7" in index


def test_record_outside_runner_is_local(monkeypatch):
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    assert R.record("x", 3) == 3 and R.RECORDED["x"] == 3


def test_unknown_parameter_refused_before_execution(tmp_path):
    with pytest.raises(R.UnknownParameters) as ei:
        R.run_notebook(PLOT, {"n_point": 3}, tmp_path)
    msg = str(ei.value)
    assert "n_point" in msg and "greeting" in msg and "n_points" in msg
    assert list(tmp_path.iterdir()) == []  # no run directory


def test_failing_notebook_keeps_ipynb_html_and_names_cell(tmp_path):
    with pytest.raises(R.NotebookFailed) as ei:
        R.run_notebook(FAIL, {"divisor": 0}, tmp_path)
    e = ei.value
    msg = str(e)
    assert "tiny_fail.ipynb" in msg and "cell 2" in msg and "1 / divisor" in msg
    assert "ZeroDivisionError" in msg and "division by zero" in msg
    assert e.ipynb.is_file() and e.html is not None and e.html.is_file()
    html = re.sub(r"<[^>]+>", "", e.html.read_text())  # highlighting splits code into spans
    assert "ZeroDivisionError" in html and "Traceback" in html and "1 / divisor" in html
    m = json.loads((e.run_dir / R.MANIFEST).read_text())
    assert m["status"] == "failed" and "ZeroDivisionError" in m["notebooks"][0]["error"]
    assert "failed" in (tmp_path / "index.html").read_text()


def test_cli_run_and_failure_exit_code(tmp_path):
    from typer.testing import CliRunner

    from workbench.cli import app

    runner = CliRunner()
    ok = runner.invoke(app, ["run", str(STAGE), "-p", "value", "41", "-p", "upstream", "1",
                             "--reports-dir", str(tmp_path)])  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert "result=42" in ok.output
    (pf := tmp_path / "p.yaml").write_text("divisor: 0\n")
    bad = runner.invoke(app, ["run", str(FAIL), "-f", str(pf), "--reports-dir", str(tmp_path)])
    assert bad.exit_code != 0 and "tiny_fail.ipynb failed in cell 2" in bad.output
    unk = runner.invoke(app, ["run", str(FAIL), "-p", "nope", "1", "--reports-dir", str(tmp_path)])
    assert unk.exit_code != 0 and "divisor" in unk.output


def test_parse_value_like_papermill():
    assert R.parse_value("3") == 3 and R.parse_value("1e-3") == 0.001
    assert R.parse_value("true") is True and R.parse_value("null") is None
    assert R.parse_value("hello world") == "hello world" and R.parse_value("[1, 2]") == [1, 2]


def test_pipeline_passes_outputs_skips_and_forces(tmp_path):
    rd, art = tmp_path / "reports", tmp_path / "art"
    stages = [
        R.Stage(STAGE, {"value": 2, "out_dir": str(art / "a")}, name="first", outputs=("out_dir",)),
        R.Stage(
            STAGE,
            {
                "value": 10,
                "upstream": "${first.result}",
                "in_dir": "${first.out_dir}",
                "out_dir": str(art / "b"),
            },
            name="second",
            outputs=("out_dir",),
        ),  # fmt: skip
    ]
    logs: list[str] = []
    res = R.run_stages(stages, rd, log=logs.append)
    assert [r.status for r in res] == ["ok", "ok"] and res[0].run_id == res[1].run_id
    assert res[1].figures["result"] == 12  # 10 + first's recorded result
    assert json.loads((art / "b" / "manifest.json").read_text()) == {"result": 12}
    m = json.loads((res[0].run_dir / R.MANIFEST).read_text())
    assert [e["stage"] for e in m["notebooks"]] == ["first", "second"]
    assert "in_dir" in m["notebooks"][1]["inputs"] and "out_dir" not in m["notebooks"][1]["inputs"]
    assert (rd / R.STAGE_CACHE).is_file()

    logs.clear()
    again = R.run_stages(stages, rd, log=logs.append)
    assert [r.status for r in again] == ["skipped", "skipped"]
    assert sum("skipped" in s for s in logs) == 2 and again[1].figures["result"] == 12
    m = json.loads((again[0].run_dir / R.MANIFEST).read_text())
    assert [e["reused_from"] for e in m["notebooks"]] == [res[0].run_id] * 2

    forced = R.run_stages(stages, rd, force=True, log=logs.append)
    assert [r.status for r in forced] == ["ok", "ok"]

    # a changed input artifact (second stage reads first's out_dir manifest) reruns only stage 2
    (art / "a" / "manifest.json").write_text('{"result": "edited"}')
    part = R.run_stages(stages, rd, log=logs.append)
    assert [r.status for r in part] == ["skipped", "ok"]
    assert len(R.list_runs(rd)) == 4


def test_unresolved_reference_names_stage():
    with pytest.raises(R.ReportError, match="no earlier stage named 'zzz'"):
        resolve_references({"a": "${zzz.x}"}, {})
    got = resolve_references(
        {"a": "${s.x}", "b": "p-${s.x}"}, {"s": {"figures": {"x": 1}, "parameters": {}}}
    )
    assert got == {"a": 1, "b": "p-1"}


def test_index_and_compare(tmp_path):
    a = R.run_notebook(STAGE, {"value": 1}, tmp_path)
    b = R.run_notebook(STAGE, {"value": 5}, tmp_path)
    index = (tmp_path / "index.html").read_text()
    assert a.run_id in index and b.run_id in index
    page = R.compare_runs(a.run_id, b.run_id, tmp_path)
    assert page.name == f"compare-{a.run_id}-vs-{b.run_id}.html"
    text = page.read_text()
    diffs = re.findall(r"<tr class=diff><th>([^<]*)</th>", text)
    assert "tiny_stage: param value" in diffs and "tiny_stage: figure result" in diffs
    assert "package torch" not in diffs
    assert page.name in (tmp_path / "index.html").read_text()
    with pytest.raises(R.ReportError, match="no run"):
        R.compare_runs(a.run_id, "nope", tmp_path)


def test_input_artifacts_hash_files_and_manifest_dirs(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"abc")
    (d := tmp_path / "cap").mkdir()
    (d / "manifest.json").write_text("{}")
    got = input_artifacts({"f": str(tmp_path / "f.bin"), "d": str(d), "x": "not-a-path", "n": 3})
    assert set(got) == {"f", "d"} and got["d"]["kind"] == "dir-manifest"
    assert got["f"]["sha256"].startswith("ba7816bf")


@pytest.mark.skipif(
    R.find_chromium() is None, reason="chromium not installed (apt-get install -y chromium)"
)
def test_html_renders_in_headless_chromium(plot_run, tmp_path):
    r, _ = plot_run
    shot = tmp_path / "tiny_plot.png"
    got = R.check_html_in_browser(r.html, screenshot=shot)
    assert got["plots"] == 2 and got["rendered_plots"] == 2 and got["main_svgs"] >= 2, got
    assert got["js_errors"] == [] and got["console_errors"] == [] and got["log_uncaught"] == [], got
    assert shot.is_file() and shot.stat().st_size > 10_000 and got["ok"], got


@pytest.mark.skipif(
    R.find_chromium() is None, reason="chromium not installed (apt-get install -y chromium)"
)
def test_browser_check_catches_js_errors(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><html><head></head><body><script>console.error('c');"
                    "throw new Error('boom')</script></body></html>")  # fmt: skip
    got = R.check_html_in_browser(page, min_plots=0)
    assert (
        not got["ok"]
        and any("boom" in e for e in got["js_errors"])
        and got["console_errors"] == ["c"]
    )


def test_export_strips_cdn_from_notebook_renderer_output(tmp_path):
    """Figures shown with a `notebook_connected`-style renderer (CDN script + div) still work
    offline: the CDN tags go, plotly.js is inlined once."""
    import nbformat
    import plotly.graph_objects as go
    import plotly.io as pio
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    fig_html = pio.to_html(go.Figure(go.Bar(y=[1, 2])), include_plotlyjs="cdn", full_html=False)
    assert "cdn.plot.ly" in fig_html
    cell = new_code_cell(
        "fig.show()", outputs=[new_output("display_data", {"text/html": fig_html})]
    )
    nbformat.write(new_notebook(cells=[cell]), ip := tmp_path / "x.ipynb")
    html = R.export_html(ip, tmp_path / "x.html").read_text()
    assert not re.search(r"<script[^>]+src=", html) and html.count(_plotlyjs_head()) == 1
    assert html.count('class="plotly-graph-div"') == 1


@pytest.mark.parametrize("fd_capture", [True, False])
def test_progress_bar_goes_to_terminal_and_one_line_to_report(
    tmp_path, capfd, monkeypatch, fd_capture
):
    """ipykernel pipes the kernel's fd 2 into the notebook (except under pytest, which it
    detects by PYTEST_CURRENT_TEST); either way the bar must reach the terminal (the kernel's
    original stderr, here pytest's) and leave only a summary line in the report."""
    if fd_capture:
        monkeypatch.delenv("PYTEST_CURRENT_TEST")
    r = R.run_notebook(PROGRESS, {"n": 40}, tmp_path)
    nb = json.loads(r.ipynb.read_text())
    outs = [o for c in nb["cells"] for o in c.get("outputs", [])]
    text = "".join("".join(o.get("text", "")) for o in outs)
    assert re.fullmatch(r"work: 40/40 step in \d+\.\ds\n", text), text
    assert "%|" not in r.html.read_text()
    assert "work: 100%|" in capfd.readouterr().err  # the terminal got the bar


def test_cli_wrong_parameter_type_is_one_line_naming_it(tmp_path):
    from typer.testing import CliRunner

    from workbench.cli import app

    nb03 = Path(__file__).parents[1] / "notebooks" / "03_inspect_draft.ipynb"
    res = CliRunner().invoke(
        app, ["run", str(nb03), "-p", "n_prompts", "abc", "--reports-dir", str(tmp_path)]
    )
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "n_prompts" in lines[0] and "'abc'" in lines[0], res.output
    assert list(tmp_path.iterdir()) == []  # refused before anything ran


def test_parameter_types_follow_notebook_defaults():
    from workbench.report.params import ParameterError, validate_parameters

    validate_parameters(PLOT, {"n_points": 3, "greeting": "hi", "seed": None})
    for bad in ({"n_points": "3x"}, {"n_points": 2.5}, {"n_points": True}):
        with pytest.raises(ParameterError, match="n_points must be an integer"):
            validate_parameters(PLOT, bad)


def test_corrupt_manifest_is_an_error_naming_it_not_replaced(tmp_path):
    run = tmp_path / "20260101-000000-abcd"
    run.mkdir()
    (run / R.MANIFEST).write_text("{not json")
    with pytest.raises(R.ReportError, match=re.escape(str(run / R.MANIFEST))):
        R.run_notebook(STAGE, {"value": 1}, tmp_path, run_id=run.name)
    assert (run / R.MANIFEST).read_text() == "{not json"  # left for the user to look at
    with pytest.raises(R.ReportError, match="not valid JSON"):
        R.write_index(tmp_path)


def test_corrupt_stage_cache_is_an_error_naming_it(tmp_path):
    (tmp_path / R.STAGE_CACHE).write_text("[")
    with pytest.raises(R.ReportError, match=re.escape(str(tmp_path / R.STAGE_CACHE))):
        R.run_stages([R.Stage(STAGE, {"value": 1})], tmp_path, log=lambda s: None)


def test_unreadable_input_names_parameter_and_file(tmp_path, monkeypatch):
    from workbench.report import runner

    (f := tmp_path / "in.bin").write_bytes(b"x")

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(runner, "artifact_hash", denied)
    with pytest.raises(R.ReportError, match=f"input in_dir={re.escape(str(f))}.*Permission denied"):
        input_artifacts({"in_dir": str(f)})


def test_project_notebooks_parse_without_papermill_warnings(caplog):
    """Papermill warns (three times per run) about a parameters line it cannot parse, e.g. an
    `=` inside a comment; such a parameter also cannot be validated."""
    import logging

    caplog.set_level(logging.WARNING, logger="papermill")
    for nb in sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb")):
        assert R.notebook_parameters(nb), nb
    assert [r.getMessage() for r in caplog.records] == []


def test_an_edited_key_extra_reruns_the_stage(tmp_path):
    """The pipeline's train stage names a preset; the preset's values are in its skip key, so
    editing the preset retrains instead of reusing the old draft."""
    rd = tmp_path / "reports"
    stage = R.Stage(STAGE, {"value": 1}, name="s", key_extra={"preset": {"epochs": 7}})
    assert [r.status for r in R.run_stages([stage], rd, log=lambda s: None)] == ["ok"]
    assert [r.status for r in R.run_stages([stage], rd, log=lambda s: None)] == ["skipped"]
    stage.key_extra = {"preset": {"epochs": 12}}
    assert [r.status for r in R.run_stages([stage], rd, log=lambda s: None)] == ["ok"]


def test_a_skip_says_when_other_workbench_code_made_the_result(tmp_path, monkeypatch):
    """Code is not in the skip key (an edit would redo hours of capture), so a reused result
    made by other code is named as such in the log and the manifest."""
    import workbench.report.stages as S

    rd = tmp_path / "reports"
    stage = R.Stage(STAGE, {"value": 1}, name="s")
    logs: list[str] = []
    R.run_stages([stage], rd, log=logs.append)
    logs.clear()
    same = R.run_stages([stage], rd, log=logs.append)
    assert same[0].status == "skipped" and not any("other workbench code" in s for s in logs)
    m = json.loads((same[0].run_dir / R.MANIFEST).read_text())
    assert m["notebooks"][0]["code_changed"] is False

    monkeypatch.setattr(S, "code_hash", lambda: "f" * 64)
    logs.clear()
    other = R.run_stages([stage], rd, log=logs.append)
    assert other[0].status == "skipped"
    assert any("other workbench code" in s and "now ffffffffffff" in s for s in logs), logs
    m = json.loads((other[0].run_dir / R.MANIFEST).read_text())
    assert m["notebooks"][0]["code_changed"] is True


def test_code_hash_follows_the_package_files_not_the_bytecode(tmp_path):
    from workbench.provenance import code_hash

    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    first = code_hash(tmp_path)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0" * 8)
    assert code_hash(tmp_path) == first
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert code_hash(tmp_path) != first
    assert len(code_hash()) == 64  # the installed package itself


def test_a_rerun_from_other_inputs_moves_the_old_outputs_aside_and_a_killed_one_resumes(
    tmp_path, monkeypatch
):
    """A stage whose inputs changed reruns into the same paths, where a capture or training
    folder would refuse other arguments: the last finished run's outputs are renamed
    `.before-<run id>` (nothing deleted); a forced rerun of the same inputs keeps them; the
    outputs of a killed run of the new inputs stay in place for it to resume; and a cached
    run is not reused once another run has written its output folder."""
    import workbench.report.stages as S

    # every run "finishes" in the same second (fast runs do): the order must not rest on time
    monkeypatch.setattr(S, "now", lambda: "2026-12-02T05:00:00+00:00")
    rd, out = tmp_path / "reports", tmp_path / "art" / "a"
    logs: list[str] = []

    def stage(value: int) -> R.Stage:
        return R.Stage(STAGE, {"value": value, "out_dir": str(out)}, name="s", outputs=("out_dir",))

    R.run_stages([stage(1)], rd, log=logs.append)
    R.run_stages([stage(1)], rd, force=True, log=logs.append)  # same inputs: nothing moved
    assert not list(out.parent.glob("a.before-*"))
    second = R.run_stages([stage(2)], rd, log=logs.append)
    aside = out.parent / f"a.before-{second[0].run_id}"
    assert json.loads((aside / "manifest.json").read_text()) == {"result": 1}
    assert json.loads((out / "manifest.json").read_text()) == {"result": 2}
    assert any("made from other inputs: moved aside" in s for s in logs), logs

    real = S.run_notebook

    def killed(*a, **kw):
        out.mkdir(parents=True)
        (out / "partial").write_text("half a capture")
        raise KeyboardInterrupt

    monkeypatch.setattr(S, "run_notebook", killed)
    with pytest.raises(KeyboardInterrupt):
        R.run_stages([stage(3)], rd, log=logs.append)  # moves result 2 aside, then dies
    monkeypatch.setattr(S, "run_notebook", real)
    R.run_stages([stage(3)], rd, log=logs.append)  # the rerun resumes in place
    assert (out / "partial").is_file() and len(list(out.parent.glob("a.before-*"))) == 2
    # back to value 1: its cached run is not what the folder holds now, so it reruns
    back = R.run_stages([stage(1)], rd, log=logs.append)
    assert back[0].status == "ok" and len(list(out.parent.glob("a.before-*"))) == 3
    assert json.loads((out / "manifest.json").read_text()) == {"result": 1}
    assert R.run_stages([stage(1)], rd, log=logs.append)[0].status == "skipped"
