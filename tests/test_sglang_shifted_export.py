"""The field report's bug on the real SGLang 0.5.23 on this CPU (one server start for the
module): the correct export with eagle_aux_hidden_state_layer_ids shifted by one in its
config.json. The launcher refuses it while the export's provenance names other ids; served
anyway (the provenance gone), the trace plugin's per-aux-layer norms flag the shift against a
capture of the trained layers and name the layers the config serves."""

from __future__ import annotations

import json
import shutil

import pytest
from sglang_common import (
    GENERIC,
    STARTUP_DEADLINE_S,
    TRACE_NEW_TOKENS,
    cpu_spec,
    export_repeat_draft,
    need_server_env,
    norm_manifest,
)

from workbench.serving import plugin, process, sglang
from workbench.serving.wiring_live import live_wiring_check, served_layer_ids

pytestmark = pytest.mark.slow  # the real 135M target and a real SGLang server


@pytest.fixture(scope="module")
def target():
    from workbench.target import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    return export_repeat_draft(target, tmp_path_factory.mktemp("shift-draft") / "export")


@pytest.fixture(scope="module")
def shifted_trace(target, draft_dir, tmp_path_factory):
    """The server on the export whose config names every aux layer one deeper (a hand edit),
    and the manifest of the trained layers, captured while the server starts."""
    need_server_env()
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
    srv = sglang.launch(spec, d / "server.log", wait=False)
    try:
        manifest = norm_manifest(target, draft_dir, d / "cap")
        process.wait_healthy(srv, STARTUP_DEADLINE_S)
        tok = target.tokenizer
        for p in GENERIC:
            ids = tok(p, add_special_tokens=False)["input_ids"]
            sglang.generate(srv.url, ids, TRACE_NEW_TOKENS)
    finally:
        srv.stop()
    assert not process.group_members(srv.pgid)
    return plugin.read_trace_dir(spec.trace_dir), served_layer_ids(shifted), manifest


def test_live_wiring_check_flags_the_shifted_export(shifted_trace):
    recs, served, manifest = shifted_trace
    assert live_wiring_check(recs, manifest).problems  # the norms alone flag it
    res = live_wiring_check(recs, manifest, served)
    for row in res.rows:
        print(row)
    print(res.result_line(), *res.problems, sep="\n")
    assert any(r.flagged and r.looks_like > r.captured_layer for r in res.rows)
    assert res.problems[-1].startswith("the draft's config names layers [2, 15, 27]")
