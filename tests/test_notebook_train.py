"""Notebook 02 runs under Papermill: a tiny capture, a handful of steps, figures, an SGLang export."""

from __future__ import annotations

import json
from pathlib import Path

import papermill as pm

from workbench.capture import CaptureConfig, capture
from workbench.layers import LayerIds

NB = Path(__file__).parent.parent / "notebooks" / "02_train_draft.ipynb"
PLOTLY = "application/vnd.plotly.v1+json"


def _convs(n: int = 12) -> list[list[dict]]:
    return [
        [
            {"role": "user", "content": f"Question {i}: " + "why? " * (i % 4 + 1)},
            {"role": "assistant", "content": "Because " + "it is so. " * (i % 5 + 2)},
        ]
        for i in range(n)
    ]


def test_notebook_02_trains_plots_and_exports(tiny_target, tiny_target_dir, tmp_path, monkeypatch):
    cap = tmp_path / "cap"
    capture(tiny_target, _convs(), cap, CaptureConfig(LayerIds((1, 3, 4)), dtype="float32",
                                                      max_length=64), progress=False)  # fmt: skip
    monkeypatch.setenv("WORKBENCH_RUN_DIR", str(tmp_path))  # record() writes figures.json here
    monkeypatch.setenv("WORKBENCH_NOTEBOOK", "02")
    run, export = tmp_path / "run", tmp_path / "export"
    executed = tmp_path / "02.ipynb"
    pm.execute_notebook(
        str(NB), str(executed), kernel_name="python3", progress_bar=False, cwd=str(tmp_path),
        parameters={"capture_dir": str(cap), "target": str(tiny_target_dir), "profile": "quick",
                    "draft_vocab_size": 256, "ttt_length": 3, "steps": 6, "batch_size": 2,
                    "eval_every": 3, "lr": 1e-3, "out_dir": str(run), "export_dir": str(export)},
    )  # fmt: skip
    nb = json.loads(executed.read_text())
    figs = [o["data"][PLOTLY] for c in nb["cells"] if c["cell_type"] == "code"
            for o in c.get("outputs", []) if PLOTLY in o.get("data", {})]  # fmt: skip
    titles = [f["layout"]["title"]["text"] for f in figs]
    assert len(figs) == 3, titles
    assert "coverage" in titles[0] and "per-position accuracy" in titles[1] and "tau" in titles[2]
    names = {t["name"] for t in figs[1]["data"]}
    assert {"loss", "held-out acc_0", "held-out acc_2", "train acc_0"} <= names
    assert {"config.json", "model.safetensors", "workbench.json"} <= {
        p.name for p in export.iterdir()
    }
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 256
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    rec = json.loads((tmp_path / "figures.json").read_text())["02"]
    assert {"step0_acc", "sim_tau", "draft_dir", "export_dir", "train_tok_s"} <= set(rec)
    assert 0.0 <= rec["step0_acc"] <= 1.0 and rec["sim_tau"] >= 1.0
    assert rec["export_dir"] == str(export) and rec["draft_dir"] == str(run)
    wb = json.loads((export / "workbench.json").read_text())
    assert wb["target_fingerprint"] == tiny_target.fingerprint and wb["training"]["step"] == 6
