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
    assert (rec["stopped_early"], rec["steps_done"], rec["steps_planned"]) == (False, 6, 6)
    assert 0.0 <= rec["step0_acc"] <= 1.0 and rec["sim_tau"] >= 1.0
    assert rec["export_dir"] == str(export) and rec["draft_dir"] == str(run)
    wb = json.loads((export / "workbench.json").read_text())
    assert wb["target_fingerprint"] == tiny_target.fingerprint and wb["training"]["step"] == 6
    assert wb["layer_ids"] == {"ids": [1, 3, 4], "convention": "output_of_layer"}
    assert "layer_ids" not in wb["draft_config"]  # the ids are stored once
    assert (export / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_notebook_02_parameters_parse_without_warnings(caplog):
    """Papermill warns "Unable to parse line" for a comment holding '=' (and drops its help)."""
    with caplog.at_level("WARNING", logger="papermill"):
        params = pm.inspect_notebook(str(NB))
    assert not [r for r in caplog.records if "Unable to parse" in r.getMessage()]
    assert {"ttt_sample", "loss_on", "force", "time_budget_s"} <= set(params)
    assert "4096" in params["draft_vocab_size"]["help"]  # the quick preset's vocab


def test_notebook_02_flags_a_run_stopped_by_its_time_budget(
    tiny_target, tiny_target_dir, tmp_path, monkeypatch
):
    cap = tmp_path / "cap"
    capture(tiny_target, _convs(), cap, CaptureConfig(LayerIds((1, 3, 4)), dtype="float32",
                                                      max_length=64), progress=False)  # fmt: skip
    monkeypatch.setenv("WORKBENCH_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("WORKBENCH_NOTEBOOK", "02")
    executed = tmp_path / "02.ipynb"
    pm.execute_notebook(
        str(NB), str(executed), kernel_name="python3", progress_bar=False, cwd=str(tmp_path),
        parameters={"capture_dir": str(cap), "target": str(tiny_target_dir), "profile": "quick",
                    "draft_vocab_size": 256, "ttt_length": 2, "steps": 6, "batch_size": 2,
                    "eval_every": 3, "time_budget_s": 0.0, "out_dir": str(tmp_path / "run")},
    )  # fmt: skip
    rec = json.loads((tmp_path / "figures.json").read_text())["02"]
    assert (rec["stopped_early"], rec["steps_done"], rec["steps_planned"]) == (True, 1, 6)
    text = json.dumps(json.loads(executed.read_text())["cells"])
    assert "training STOPPED EARLY" in text
