"""Notebook 04 runs under Papermill on the local backend: a tiny target and an exported draft
served over real HTTP on loopback, with and without speculation."""

from __future__ import annotations

import json
from pathlib import Path

import papermill as pm
import pytest
import torch

from workbench.draft.export import export_sglang
from workbench.draft.model import DraftConfig, Eagle3Draft, init_from_target
from workbench.layers import LayerIds

NB = Path(__file__).parent.parent / "notebooks" / "04_live_serving.ipynb"
PLOTLY = "application/vnd.plotly.v1+json"


def test_notebook_04_serves_loads_and_records(tiny_target, tiny_target_dir, tmp_path, monkeypatch):
    cfg = DraftConfig.from_target(tiny_target.model.config, LayerIds((1, 3, 5)), 512)
    torch.manual_seed(0)
    d = Eagle3Draft(cfg)
    d.set_vocab(torch.sort(torch.randperm(cfg.vocab_size)[:512]).values)
    export = export_sglang(init_from_target(d, tiny_target.model).eval(), tmp_path / "draft")
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
    cycles = _check_anatomy(tmp_path, rec)  # the local engine's trace
    assert all(c["hidden_in_dims"] == [3 * 64, 64] for c in cycles)  # k*H, then H: 2 steps served
    for name in ("eagle3", "plain"):
        saved = json.loads((tmp_path / f"load-{name}.json").read_text())
        assert saved["status"] == "complete" and len(saved["requests"]) == 3


def _check_anatomy(run_dir: Path, rec: dict) -> list[dict]:
    """The notebook's cycle anatomy agrees with the trace and the server's own counters: one
    trace line per verify cycle, each request in as many cycles as its spec_verify_ct."""
    cycles = [json.loads(x) for x in (run_dir / "trace-eagle3" / "trace-rank0.jsonl").open()]
    assert rec["serve_cycles"] == len(cycles) >= 3
    rids = {x for c in cycles for x in c["request_ids"]}
    per_req = [sum(r in c["request_ids"] for c in cycles) for r in rids]
    served = json.loads((run_dir / "load-eagle3.json").read_text())["requests"]
    assert sorted(per_req) == sorted(r["meta"]["spec_verify_ct"] for r in served)
    shares = [rec[f"serve_{k}_share"] for k in ("draft", "verify", "extend")]
    assert all(0 < x < 1 for x in shares) and sum(shares) <= 1 + 1e-9
    return cycles


@pytest.mark.slow
def test_notebook_04_cycle_anatomy_on_real_sglang(tmp_path, monkeypatch):
    """Backend sglang: the plugin's trace feeds the same anatomy; the live wiring check passes
    the correctly wired draft against a capture of the same target."""
    from sglang_common import export_repeat_draft, need_server_env

    from workbench.capture import CaptureConfig, capture
    from workbench.layers import default_layer_ids
    from workbench.target import load_target

    need_server_env()
    t = load_target("smollm2-135m")
    draft = export_repeat_draft(t, tmp_path / "draft")
    convs = [[{"role": "user", "content": f"Tell me about the number {i}."},
              {"role": "assistant", "content": f"{i} comes after {i - 1}. " * 4}] for i in range(6)]  # fmt: skip
    cfg = CaptureConfig(default_layer_ids(t.num_layers), dtype="float32")
    capture(t, convs, tmp_path / "cap", cfg, progress=False)
    for k, v in {"WORKBENCH_RUN_DIR": str(tmp_path), "WORKBENCH_NOTEBOOK": "04",
                 "OMP_NUM_THREADS": "1"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    pm.execute_notebook(
        str(NB), str(tmp_path / "04.ipynb"), kernel_name="python3", progress_bar=False,
        cwd=str(tmp_path),
        parameters={"backend": "sglang", "target": str(t.path), "draft": str(draft),
                    "n_prompts": 3, "max_new_tokens": 16, "concurrency": 2, "num_steps": 3,
                    "eagle_topk": 1, "num_draft_tokens": 4, "compare_plain": False,
                    "capture_dir": str(tmp_path / "cap")},
    )  # fmt: skip
    rec = json.loads((tmp_path / "figures.json").read_text())["04"]
    print({k: v for k, v in rec.items() if k.startswith("serve_")})
    cycles = _check_anatomy(tmp_path, rec)
    H = t.hidden_size
    assert all(c["hidden_in_dims"] == [3 * H, H, H] for c in cycles)
    assert rec["serve_live_wiring_ok"] is True


def test_notebook_04_declares_the_pipeline_parameters():
    from workbench.pipeline import stages
    from workbench.report import notebook_parameters

    declared = notebook_parameters(NB)
    stage = next(s for s in stages("quick") if s.name == "serve")
    assert set(stage.parameters) <= set(declared)
    assert {"backend", "url", "plain_url", "target", "draft", "tp_size", "num_steps", "eagle_topk",
            "num_draft_tokens", "prompt_set", "n_prompts", "concurrency"} <= set(declared)  # fmt: skip
