"""The workbench_trace SGLang plugin without a server: the live wiring check flags a one-layer
shift and names the layer, quirk warnings, the plugin's environment, its import hygiene and its
loud failure on a missing hook target. On the real SGLang: test_serving_sglang.py (the trace
of the correct export, plugin on) and test_sglang_shifted_export.py (the field report's bug)."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest
from sglang_common import need_server_env

from workbench.engine.trace import CycleRecord
from workbench.errors import WorkbenchError
from workbench.layers import LayerIds
from workbench.serving import plugin, sglang
from workbench.serving.wiring_live import live_wiring_check, looks_like, quirk_warnings

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "support" / "sglang_plugin"


# ---------------------------------------------------------------- without a server


def _manifest(ids=(1, 14, 26), p50=(70.0, 166.0, 510.0)):
    layers = {str(i): {"slot": j, "count": 100, "p05": m * 0.6, "p50": m, "p95": m * 1.5}
              for j, (i, m) in enumerate(zip(ids, p50, strict=True))}  # fmt: skip
    return {"layer_ids": {"ids": list(ids), "convention": "output_of_layer"},
            "norm_stats": {"layers": layers}}  # fmt: skip


def _recs(norms):
    return [CycleRecord("r", 0, i, ["a"], 1, 3, 1, 4, [2], 1.0, 1.0, 1.0, 3.0, aux_norms=list(n))
            for i, n in enumerate(norms)]  # fmt: skip


def test_live_wiring_check_flags_a_one_layer_shift_and_names_the_layer():
    # medians of SmolLM2-135M's residual norms at outputs of layers 2, 15, 27 (served one
    # layer deeper than the capture's 1, 14, 26), measured with workbench.norms.live_norms
    shifted = live_wiring_check(
        _recs([(80, 172, 602), (79, 173, 600), (81, 171, 604)]), _manifest()
    )
    assert not shifted.ok
    assert [r.flagged for r in shifted.rows] == [True, False, True]
    assert "served slot 2 (layer 26) looks like captured layer ~27.8 ± 1" in shifted.problems[1]
    assert round(shifted.rows[0].looks_like) == 3
    correct = live_wiring_check(_recs([(71, 160, 500), (69, 168, 515)]), _manifest())
    assert correct.ok and "ok=True" in correct.result_line()
    named = live_wiring_check(_recs([(71, 160, 500)]), _manifest(), LayerIds((2, 15, 27)))
    assert named.problems == ["the draft's config names layers [2, 15, 27] (output_of_layer); "
                              "the capture recorded [1, 14, 26]"]  # fmt: skip


def test_live_wiring_check_refuses_a_trace_without_norms():
    with pytest.raises(WorkbenchError, match="trace_hidden=True"):
        live_wiring_check(_recs([]), _manifest())
    res = live_wiring_check(_recs([(70, 166)]), _manifest())
    assert not res.ok and "reads 2 aux layers" in res.problems[0]


def test_looks_like_interpolates_and_extrapolates_in_log_norm():
    ids, med = (1, 14, 26), (70.0, 166.0, 510.0)
    assert looks_like(ids, med, 166.0, 14) == pytest.approx(14.0)
    assert 14 < looks_like(ids, med, 200.0, 14) < 26
    assert looks_like(ids, med, 1000.0, 26) > 26 and looks_like(ids, med, 50.0, 1) < 1
    assert looks_like((5,), (10.0,), 12.0, 5) is None


def _config(d: Path, **kw) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps(kw))
    return d


def test_quirk_warnings_before_launch(tmp_path):
    draft = _config(tmp_path / "d", eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 14, 25]})
    qwen = _config(tmp_path / "q", architectures=["Qwen2ForCausalLM"], num_hidden_layers=28)
    ds = _config(tmp_path / "ds", architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=61)
    llama = _config(tmp_path / "l", architectures=["LlamaForCausalLM"], num_hidden_layers=28)
    assert "ids always get +1" in quirk_warnings(qwen, draft)[0]
    assert "every aux layer one layer early" in str(quirk_warnings(ds, draft)[0])
    assert quirk_warnings(llama, draft) == [] and quirk_warnings(llama, None) == []


def test_trace_env_adds_the_plugin_to_sglangs_allow_list(tmp_path):
    env = plugin.trace_env(tmp_path / "t", hidden=True, allowed="other")
    assert env["SGLANG_PLUGINS"] == "other,workbench_trace"
    assert env["WORKBENCH_TRACE_DIR"] == str((tmp_path / "t").resolve())
    assert env["WORKBENCH_TRACE_HIDDEN"] == "1" and len(env["WORKBENCH_TRACE_RUN_ID"]) == 12
    spec = sglang.ServeSpec(target="/m", device="cpu", trace_dir=str(tmp_path / "t"))
    got = sglang.server_env(spec, base={})
    assert got["SGLANG_PLUGINS"] == "workbench_trace" and got["WORKBENCH_TRACE_HIDDEN"] == "0"
    assert "WORKBENCH_TRACE_DIR" not in sglang.server_env(sglang.ServeSpec(target="/m"), base={})
    with pytest.raises(WorkbenchError, match="no trace in"):
        plugin.read_trace_dir(tmp_path)


def test_read_trace_dir_keeps_the_cycles_of_the_requests_asked_for(tmp_path):
    """An attached server's trace holds every request it served: a load reads its own cycles
    (shared batches whole), and a trace without any of them is named, not read as empty."""
    from workbench.engine.trace import TraceWriter

    w = TraceWriter(tmp_path / "trace-rank0.jsonl")
    for i, rids in enumerate([["old"], ["old", "a"], ["a", "b"], ["b"], ["later"]]):
        w.write(CycleRecord("r", 0, i, rids, len(rids), 3, 1, 4, [1] * len(rids),
                            1.0, 2.0, 0.5, 4.0))  # fmt: skip
    assert len(plugin.read_trace_dir(tmp_path)) == 5
    assert [r.cycle for r in plugin.read_trace_dir(tmp_path, request_ids=["a", "b"])] == [1, 2, 3]
    with pytest.raises(WorkbenchError, match="none of the 1 requests"):
        plugin.read_trace_dir(tmp_path, request_ids={"elsewhere"})


def test_plugin_imports_nothing_from_the_workbench():
    """It runs in the server environment (another torch): only stdlib, torch and sglang."""
    allowed = {"__future__", "atexit", "json", "os", "pkgutil", "time", "uuid", "collections",
               "dataclasses", "pathlib", "typing", "multiprocessing", "setproctitle", "torch",
               "sglang", "workbench_sglang_plugin"}  # fmt: skip
    for f in (PLUGIN_SRC / "workbench_sglang_plugin").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for n in names:
                assert n.split(".")[0] in allowed, f"{f.name} imports {n}"


_PROBE = """
import os, sys
from sglang.srt.plugins.hook_registry import HookRegistry
import workbench_sglang_plugin as p
from workbench_sglang_plugin import hooks
os.environ.pop("WORKBENCH_TRACE_DIR", None)
p.register()
assert not HookRegistry._hooks, "hooks registered without WORKBENCH_TRACE_DIR"
hooks.check_targets(("sglang.srt.plugins.hook_registry.HookRegistry.apply_hooks",))
hooks.check_targets(("sglang.srt.plugins.hook_registry.HookRegistry.gone_in_this_version",))
"""


def test_plugin_is_inert_when_disabled_and_fails_loudly_on_a_missing_target():
    py = need_server_env()
    r = subprocess.run([str(py), "-c", _PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("workbench_trace plugin: SGLang 0.5.23 has no hook target "
                           "sglang.srt.plugins.hook_registry.HookRegistry.gone_in_this_version")  # fmt: skip
