"""Notebook 04 runs under Papermill on the local backend: a tiny target and an exported draft
served over real HTTP on loopback, with and without speculation; `workbench serve --trace-dir`
writes the trace an attached notebook reads. Notebook 04 attached to a real SGLang server:
test_serving_sglang.py (that module's server)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import papermill as pm
import torch
from test_serving_local import _group_gone

from workbench.draft.export import export_sglang
from workbench.draft.model import DraftConfig, Eagle3Draft, init_from_target
from workbench.layers import LayerIds

NB = Path(__file__).parent.parent / "notebooks" / "04_live_serving.ipynb"
PLOTLY = "application/vnd.plotly.v1+json"


def _tiny_export(tiny_target, out: Path) -> Path:
    cfg = DraftConfig.from_target(tiny_target.model.config, LayerIds((1, 3, 5)), 512)
    torch.manual_seed(0)
    d = Eagle3Draft(cfg)
    d.set_vocab(torch.sort(torch.randperm(cfg.vocab_size)[:512]).values)
    return export_sglang(init_from_target(d, tiny_target.model).eval(), out)


def test_notebook_04_serves_loads_and_records(tiny_target, tiny_target_dir, tmp_path, monkeypatch):
    export = _tiny_export(tiny_target, tmp_path / "draft")
    monkeypatch.setenv("WORKBENCH_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("WORKBENCH_NOTEBOOK", "04")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    executed = tmp_path / "04.ipynb"
    pm.execute_notebook(
        str(NB), str(executed), kernel_name="python3", progress_bar=False, cwd=str(tmp_path),
        parameters={"target": str(tiny_target_dir), "draft": str(export), "n_prompts": 3,
                    "max_new_tokens": 12, "concurrency": 1, "num_steps": 3, "eagle_topk": 1,
                    "num_draft_tokens": 4, "spec_config": "2/1/3"},  # spec_config wins
    )  # fmt: skip
    nb = json.loads(executed.read_text())
    outs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    titles = [
        o["data"][PLOTLY]["layout"]["title"]["text"] for o in outs if PLOTLY in o.get("data", {})
    ]
    assert len(titles) == 6, titles
    assert "Accepted draft tokens per verify" in titles[0]
    assert "Per-position acceptance" in titles[1]
    assert "with and without speculation" in titles[2] and "TTFT" in titles[3]
    assert "Time per decode cycle" in titles[4] and "Accept length over time" in titles[5]
    text = "".join("".join(o.get("text", "")) for o in outs)
    assert "identical outputs 3/3" in text  # greedy fp32 speculation is exact through the server
    assert "servers loaded paired" in text  # one request at a time: alternating between both
    rec = json.loads((tmp_path / "figures.json").read_text())["04"]
    assert rec["serve_status"] == "complete" and rec["serve_identities_ok"] is True
    assert rec["serve_tau_sglang"] >= 1.0 and rec["serve_tok_s"] > 0 and rec["serve_speedup"] > 0
    assert rec["serve_config"] == "2/1/3"
    cycles = check_anatomy(tmp_path, rec, tmp_path / "trace-eagle3")  # the local engine's trace
    assert all(c["hidden_in_dims"] == [3 * 64, 64] for c in cycles)  # k*H, then H: 2 steps served
    for name in ("eagle3", "plain"):
        saved = json.loads((tmp_path / f"load-{name}.json").read_text())
        assert saved["status"] == "complete" and len(saved["requests"]) == 3


def check_anatomy(run_dir: Path, rec: dict, trace_dir: Path) -> list[dict]:
    """The notebook's cycle anatomy agrees with the trace and the server's own counters: one
    trace line per verify cycle of the load's requests, each request in as many cycles as its
    spec_verify_ct (an attached server's trace also holds others' requests: left out)."""
    served = json.loads((run_dir / "load-eagle3.json").read_text())["requests"]
    mine = {r["meta"]["id"] for r in served}
    lines = [json.loads(x) for x in (trace_dir / "trace-rank0.jsonl").open()]
    cycles = [c for c in lines if mine.intersection(c["request_ids"])]
    assert rec["serve_cycles"] == len(cycles) >= 3
    per_req = [sum(r in c["request_ids"] for c in cycles) for r in mine]
    assert sorted(per_req) == sorted(r["meta"]["spec_verify_ct"] for r in served)
    shares = [rec[f"serve_{k}_share"] for k in ("draft", "verify", "extend")]
    assert all(0 < x < 1 for x in shares) and sum(shares) <= 1 + 1e-9
    return cycles


def test_cli_serve_traces_into_a_folder_a_load_reads_back(tiny_target, tiny_target_dir, tmp_path):
    """`workbench serve --trace-dir` (the attach workflow of notebook 04's `trace_dir`): a load's
    own cycles are read back by request id; the server's other traffic is left out."""
    from workbench.serving import client as lc
    from workbench.serving import plugin, process

    export = _tiny_export(tiny_target, tmp_path / "draft")
    port, trace = process.free_port(), tmp_path / "trace"
    argv = [sys.executable, "-c", "from workbench.cli import app; app()", "serve", "--target",
            str(tiny_target_dir), "--draft", str(export), "--num-steps", "2", "--eagle-topk", "1",
            "--num-draft-tokens", "3", "--port", str(port), "--trace-dir", str(trace),
            "--trace-hidden", "--log", str(tmp_path / "local.log")]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    reqs = [lc.LoadRequest(f"r{i}", input_ids=[1, 40 + i, 90, 7 * i + 3]) for i in range(3)]
    with process.start(argv, tmp_path / "cli.log", url, deadline_s=120, env=env) as server:
        cfg = lc.LoadConfig(url, max_new_tokens=10, ignore_eos=True)
        other = lc.run_load(cfg, reqs[:1], tmp_path / "other.json")  # someone else's traffic
        run = lc.run_load(cfg, reqs[1:], tmp_path / "mine.json")
    assert _group_gone(server.pgid, within_s=10)
    assert run.status == "complete" and other.status == "complete"
    rids = [r.meta["id"] for r in run.requests]
    mine = plugin.read_trace_dir(trace, request_ids=rids)
    every = plugin.read_trace_dir(trace)
    assert len(mine) == sum(r.meta["spec_verify_ct"] for r in run.requests)
    assert len(every) == len(mine) + other.requests[0].meta["spec_verify_ct"]
    assert all(set(c.request_ids) <= set(rids) for c in mine)  # batch 1: no shared cycles
    assert all(c.hidden_in_dims == [3 * 64, 64] and len(c.aux_norms) == 3 for c in mine)


def test_notebook_04_declares_the_pipeline_parameters():
    from workbench.pipeline import stages
    from workbench.report import notebook_parameters

    declared = notebook_parameters(NB)
    stage = next(s for s in stages("quick") if s.name == "serve")
    assert set(stage.parameters) <= set(declared)
    assert {"backend", "url", "plain_url", "target", "draft", "tp_size", "num_steps", "eagle_topk",
            "num_draft_tokens", "prompt_set", "n_prompts", "concurrency"} <= set(declared)  # fmt: skip
