"""Notebook 03 runs under Papermill on a tiny target + a briefly trained tiny draft."""

from __future__ import annotations

import json
from pathlib import Path

import papermill as pm

from workbench.capture import CaptureConfig, capture
from workbench.draft.train import TrainConfig, train
from workbench.layers import LayerIds
from workbench.pipeline import stages

NB = Path(__file__).parent.parent / "notebooks" / "03_inspect_draft.ipynb"
PLOTLY = "application/vnd.plotly.v1+json"


def _convs(n: int = 8) -> list[list[dict]]:
    return [
        [
            {"role": "user", "content": f"Question {i}: " + "why? " * (i % 4 + 1)},
            {"role": "assistant", "content": "Because " + "it is so. " * (i % 5 + 2)},
        ]
        for i in range(n)
    ]


def test_notebook_03_inspects_audits_and_records(
    tiny_target, tiny_target_dir, tmp_path, monkeypatch
):
    cap, run = tmp_path / "cap", tmp_path / "run"
    capture(tiny_target, _convs(), cap, CaptureConfig(LayerIds((1, 3, 4)), dtype="float32",
                                                      max_length=64), progress=False)  # fmt: skip
    train(TrainConfig(capture=str(cap), out=str(run), draft_vocab_size=128, ttt_len=2, max_steps=4,
                      batch_size=2, eval_every=4, ckpt_every=4, progress=False, threads=1),
          target=tiny_target)  # fmt: skip
    monkeypatch.setenv("WORKBENCH_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("WORKBENCH_NOTEBOOK", "03")
    executed = tmp_path / "03.ipynb"
    pm.execute_notebook(
        str(NB), str(executed), kernel_name="python3", progress_bar=False, cwd=str(tmp_path),
        parameters={"target": str(tiny_target_dir), "draft": str(run), "capture_dir": str(cap),
                    "n_prompts": 3, "max_new_tokens": 10, "num_steps": 3, "eagle_topk": 1,
                    "num_draft_tokens": 4, "audit": True},
    )  # fmt: skip
    nb = json.loads(executed.read_text())
    outs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    titles = [
        o["data"][PLOTLY]["layout"]["title"]["text"] for o in outs if PLOTLY in o.get("data", {})
    ]
    assert len(titles) == 5, titles
    assert "Per-position acceptance" in titles[0] and "category" in titles[1]
    assert "Time per decode cycle" in titles[2] and "Layer-wiring audit" in titles[3]
    assert "Decode speed" in titles[4]
    assert any("background:#" in "".join(o.get("data", {}).get("text/html", "")) for o in outs)
    rec = json.loads((tmp_path / "figures.json").read_text())["03"]
    assert {
        "tau",
        "serve_sim_tau",
        "accept_pos0",
        "audit_verdict",
        "best_wiring",
        "tf_wiring_verdict",
        "best_speedup",
        "best_speedup_config",
        "served_config",
        "served_speedup",
    } <= set(rec)
    # recorded as measured: a positive ratio of one of the candidates, below 1 allowed
    assert rec["best_speedup"] > 0 and rec["best_speedup_config"] in (
        "1/1/2",
        "2/1/3",
        "3/1/4",
        "3/2/6",
    )
    if rec["served_config"] == "plain":
        assert rec["served_speedup"] is None
    else:
        assert rec["served_speedup"] <= rec["best_speedup"]
    assert rec["tau"] >= 1.0 and rec["audit_verdict"] in (
        "configured wins",
        "shifted wiring wins",
        "inconclusive",
    )
    assert rec["tf_wiring_verdict"] in ("configured_wins", "shifted_wins", "inconclusive")


def test_notebook_03_declares_the_pipeline_parameters():
    from workbench.report import notebook_parameters

    declared = notebook_parameters(NB)
    stage = next(s for s in stages("quick") if s.name == "inspect")
    assert set(stage.parameters) <= set(declared)
    assert {
        "prompt_set",
        "num_steps",
        "eagle_topk",
        "num_draft_tokens",
        "dtype",
        "audit",
        "seed",
    } <= set(declared)
