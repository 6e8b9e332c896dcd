"""The workbench_trace SGLang plugin on the real SGLang 0.5.23 on this CPU (one server start for
the module, EAGLE-3 chain 3/1/4, trace with per-aux-layer norms): one trace line per decode
cycle, as many as SGLang's `spec_verify_calls_total`; per-request accepted counts that add up
to each request's meta_info; the same schema the local engine writes (one reader); the live
wiring check passes the correct export. Without a server: the check flags a one-layer shift,
quirk warnings, the plugin's environment, its import hygiene and its loud failure on a missing
hook target."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sglang_common import (
    CHAIN,
    PROMPTS,
    STARTUP_DEADLINE_S,
    cpu_spec,
    export_repeat_draft,
    need_server_env,
    server_env_threads,
)

from workbench.engine.trace import CycleRecord, read_trace
from workbench.errors import WorkbenchError
from workbench.layers import LayerIds
from workbench.serving import client, plugin, process, sglang
from workbench.serving.wiring_live import (
    live_wiring_check,
    looks_like,
    quirk_warnings,
    served_layer_ids,
)

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "support" / "sglang_plugin"
GENERIC = [
    "Water boils at a lower temperature on a high mountain because",
    "The three primary colours of light are",
    "A good way to learn a new language is to",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def target():
    from workbench.target import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    return export_repeat_draft(target, tmp_path_factory.mktemp("plugin-draft") / "export")


@pytest.fixture(scope="module")
def manifest(target, draft_dir, tmp_path_factory):
    """A capture of the draft's layers on a few generic conversations (the norm statistics)."""
    from workbench.capture import CaptureConfig, capture

    topics = ["rivers", "bread", "chess", "rain", "trains", "music", "bees", "glass", "maps"]
    convs = [
        [
            {"role": "user", "content": f"Tell me something about {t}."},
            {
                "role": "assistant",
                "content": f"Here are a few facts about {t}. People have "
                f"studied {t} for a long time, and there is much to say about how {t} work.",
            },
        ]  # fmt: skip
        for t in topics
    ]
    cfg = CaptureConfig(served_layer_ids(draft_dir), dtype="float32", max_length=128)
    out = tmp_path_factory.mktemp("plugin-capture") / "cap"
    return capture(target, convs, out, cfg, progress=False)


@pytest.fixture(scope="module")
def served(target, draft_dir, tmp_path_factory):
    """The server with the plugin on; sequential requests, then two at once (batch 2)."""
    need_server_env()
    server_env_threads()
    d = tmp_path_factory.mktemp("plugin-serve")
    spec = cpu_spec(target.path, draft_dir)
    spec.trace_dir, spec.trace_hidden = str(d / "trace"), True
    srv = sglang.launch(spec, d / "server.log", deadline_s=STARTUP_DEADLINE_S)
    print(f"SGLang EAGLE-3 server with the trace plugin healthy after {srv.start_s:.1f} s")
    try:
        tok = target.tokenizer
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS + GENERIC]
        t0 = time.perf_counter()
        seq = [sglang.generate(srv.url, p, NEW_TOKENS) for p in ids]
        secs = time.perf_counter() - t0
        m_seq = client.get_metrics(srv.url)
        n_seq = len(plugin.read_trace_dir(spec.trace_dir))
        with ThreadPoolExecutor(2) as ex:
            par = list(ex.map(lambda p: sglang.generate(srv.url, p, NEW_TOKENS), ids[:2]))
        m_all = client.get_metrics(srv.url)
        toks = sum(a["meta_info"]["completion_tokens"] for a in seq)
        print(f"RESULT sglang_trace_plugin_on tok_per_s={toks / secs:.2f} (sequential, CPU)")
        yield dict(spec=spec, seq=seq, par=par, m_seq=m_seq, n_seq=n_seq, m_all=m_all)
    finally:
        srv.stop()
    assert not process.group_members(srv.pgid)


def _by_request(recs: list[CycleRecord]) -> dict[str, list[tuple[int, int]]]:
    out = defaultdict(list)  # rid -> [(emitted, verified)] per cycle
    for r in recs:
        verified = r.extra.get("verified", r.accepted)
        for rid, a, v in zip(r.request_ids, r.accepted, verified, strict=True):
            out[rid].append((a, v))
    return out


@pytest.mark.slow  # a real SGLang server on the real 135M target
def test_one_trace_line_per_verify_call(served):
    seq_verify = sum(a["meta_info"]["spec_verify_ct"] for a in served["seq"])
    assert served["n_seq"] == served["m_seq"]["sglang:spec_verify_calls_total"] == seq_verify
    recs = plugin.read_trace_dir(served["spec"].trace_dir)
    rows = sum(r.batch_size for r in recs)
    assert rows == served["m_all"]["sglang:spec_verify_calls_total"]
    assert max(r.batch_size for r in recs) == 2  # the concurrent pair shared cycles
    assert [r.cycle for r in recs] == list(range(len(recs)))


@pytest.mark.slow  # a real SGLang server on the real 135M target
def test_per_request_accepted_counts_agree_with_meta_info(served):
    per = _by_request(plugin.read_trace_dir(served["spec"].trace_dir))
    answers = served["seq"] + served["par"]
    assert len(per) == len(answers)
    for ans in answers:
        m = ans["meta_info"]
        cyc = per[m["id"]]
        assert len(cyc) == m["spec_verify_ct"]
        assert 1 + sum(a for a, _ in cyc) == m["completion_tokens"] == len(ans["output_ids"])
        hist = [0] * (CHAIN[0] + 1)
        for _, v in cyc:
            hist[v - 1] += 1  # accepted counts the bonus; the histogram counts correct drafts
        want = m["spec_correct_drafts_histogram"]  # SGLang drops trailing zeros
        assert hist[: len(want)] == want and not any(hist[len(want) :])
    taus = [a["meta_info"]["spec_accept_length"] for a in answers]
    assert max(taus) > 1.5 > min(taus)  # varied acceptance, not an all-1.0 comparison


@pytest.mark.slow  # a real SGLang server on the real 135M target
def test_trace_is_the_engine_schema_read_by_read_trace(served, target):
    files = plugin.trace_files(served["spec"].trace_dir)
    assert [f.name for f in files] == ["trace-rank0.jsonl"]
    recs = read_trace(files[0])
    H = target.model.config.hidden_size
    assert len({r.run_id for r in recs}) == 1 and {r.rank for r in recs} == {0}
    for r in recs:
        assert (r.num_steps, r.topk, r.num_draft_tokens) == CHAIN
        assert len(r.accepted) == len(r.request_ids) == r.batch_size
        assert all(1 <= a <= CHAIN[2] for a in r.accepted)
        assert r.hidden_in_dims == [3 * H, H, H]
        assert len(r.aux_norms) == 3 and all(x > 0 for x in r.aux_norms)
        assert min(r.draft_ms, r.verify_ms, r.extend_ms) > 0
        assert r.total_ms >= r.draft_ms + r.verify_ms + r.extend_ms
        assert r.extra["clock"] == "wall"
    share = sum(r.verify_ms for r in recs) / sum(r.total_ms for r in recs)
    print(f"verify share of the cycle on CPU: {share:.2f}")


@pytest.mark.slow  # a real SGLang server on the real 135M target
def test_live_wiring_check_passes_the_correct_export(served, manifest, draft_dir):
    recs = plugin.read_trace_dir(served["spec"].trace_dir)
    res = live_wiring_check(recs, manifest, served_layer_ids(draft_dir))
    for row in res.rows:
        print(row)
    print(res.result_line())
    assert res.ok, res.problems
    assert all(
        r.looks_like is not None and abs(r.looks_like - r.captured_layer) < 1 for r in res.rows
    )


@pytest.fixture(scope="module")
def shifted_trace(target, draft_dir, tmp_path_factory):
    """A second server: the same export with eagle_aux_hidden_state_layer_ids shifted by one in
    config.json (the field report's hand edit)."""
    need_server_env()
    server_env_threads()
    d = tmp_path_factory.mktemp("plugin-shifted")
    shifted = d / "export"
    shutil.copytree(draft_dir, shifted)
    cfg = json.loads((shifted / "config.json").read_text())
    ec = cfg["eagle_config"]
    ec["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ec["eagle_aux_hidden_state_layer_ids"]]
    (shifted / "config.json").write_text(json.dumps(cfg))
    spec = cpu_spec(target.path, shifted)
    spec.trace_dir, spec.trace_hidden = str(d / "trace"), True
    # the export's provenance (workbench.json) still names the trained ids: refused before launch
    with pytest.raises(sglang.ServeSpecError, match="off-by-one"):
        sglang.launch(spec, d / "refused.log")
    (shifted / "workbench.json").unlink()  # a draft from elsewhere: its config is all there is
    srv = sglang.launch(spec, d / "server.log", deadline_s=STARTUP_DEADLINE_S)
    try:
        tok = target.tokenizer
        for p in PROMPTS + GENERIC:
            sglang.generate(srv.url, tok(p, add_special_tokens=False)["input_ids"], NEW_TOKENS)
    finally:
        srv.stop()
    return plugin.read_trace_dir(spec.trace_dir), served_layer_ids(shifted)


@pytest.mark.slow  # a real SGLang server on the real 135M target
def test_live_wiring_check_flags_the_shifted_export(shifted_trace, manifest):
    recs, served = shifted_trace
    assert live_wiring_check(recs, manifest).problems  # the norms alone flag it
    res = live_wiring_check(recs, manifest, served)
    for row in res.rows:
        print(row)
    print(res.result_line(), *res.problems, sep="\n")
    assert any(r.flagged and r.looks_like > r.captured_layer for r in res.rows)
    assert res.problems[-1].startswith("the draft's config names layers [2, 15, 27]")


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
