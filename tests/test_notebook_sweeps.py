"""Notebooks 05 (step sweep) and 06 (all-reduce, TP scaling) run under Papermill on a tiny
grid: a tiny target with a random draft exported the SGLang way, and real torchrun/gloo."""

from __future__ import annotations

import json
from pathlib import Path

import papermill as pm
import torch

from workbench.draft.export import export_sglang
from workbench.draft.model import DraftConfig, Eagle3Draft, init_from_target
from workbench.layers import LayerIds

NB = Path(__file__).parent.parent / "notebooks"
PLOTLY = "application/vnd.plotly.v1+json"


def _run(nb: str, tmp_path: Path, monkeypatch, parameters: dict) -> tuple[list[str], dict]:
    monkeypatch.setenv("WORKBENCH_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("WORKBENCH_NOTEBOOK", nb[:2])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    executed = tmp_path / f"{nb[:2]}.ipynb"
    pm.execute_notebook(str(NB / nb), str(executed), kernel_name="python3", progress_bar=False,
                        cwd=str(tmp_path), parameters=parameters)  # fmt: skip
    cells = json.loads(executed.read_text())["cells"]
    outs = [o for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])]
    titles = [
        o["data"][PLOTLY]["layout"]["title"]["text"] for o in outs if PLOTLY in o.get("data", {})
    ]
    return titles, json.loads((tmp_path / "figures.json").read_text())[nb[:2]]


def test_notebook_05_sweeps_models_and_records(tiny_target, tiny_target_dir, tmp_path, monkeypatch):
    cfg = DraftConfig.from_target(tiny_target.config, LayerIds((1, 3, 4)), 128)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    draft.set_vocab(torch.sort(torch.randperm(cfg.vocab_size)[:128]).values)
    draft = init_from_target(draft, tiny_target.model)
    export = export_sglang(draft, tmp_path / "draft")
    sweep = tmp_path / "sweep"
    params = {"target": str(tiny_target_dir), "draft": str(export), "num_steps": [1, 2],
              "eagle_topk": [1, 2], "num_draft_tokens": [0], "n_prompts": 2,
              "max_new_tokens": 8, "calibration": 2, "out_dir": str(sweep)}  # fmt: skip
    titles, rec = _run("05_step_sweep.ipynb", tmp_path, monkeypatch, params)
    assert len(titles) == 4, titles
    assert "Measured tok/s by steps and topk (batch 1" in titles[0]
    assert "Accept length vs steps" in titles[1] and "Predicted vs measured" in titles[2]
    assert "Speedup over plain decoding" in titles[3]
    # plain + 1/1/2 + 2/1/3 + 1/2/2 + 2/2/3
    assert rec["step_sweep_configs"] == 5 and rec["step_sweep_failed"] == 0
    assert 0.0 <= rec["step_best_gap"] < 1.0 and -1.0 <= rec["step_rank_corr"] <= 1.0
    rows = (sweep / "results.jsonl").read_text().splitlines()
    assert len(rows) == 6  # + the baseline measured again at the end (drift check)
    assert "step_drift" in rec
    # a rerun resumes: nothing is measured again, the results file is unchanged
    _run("05_step_sweep.ipynb", tmp_path, monkeypatch, params)
    assert (sweep / "results.jsonl").read_text().splitlines() == rows


def test_notebook_06_allreduce_and_tp_scaling(tiny_target_dir, tmp_path, monkeypatch):
    params = {"batches": [1], "tokens": [1, 8], "iters": 3,
              "settings": {"default": {}, "ring": {"NCCL_ALGO": "Ring"}},
              "out_dir": str(tmp_path / "ar"), "compute_target": str(tiny_target_dir)}  # fmt: skip
    titles, rec = _run("06_nccl_sweep.ipynb", tmp_path, monkeypatch, params)
    assert titles == [
        "All-reduce latency and bus bandwidth vs message size",
        "TP-scaling prediction of the verify step",
    ]
    assert rec["allreduce_backend"] == "gloo" and rec["allreduce_world"] == 2
    assert rec["allreduce_settings"] == 2 and rec["allreduce_verify_us"] > 0
    assert any(k.startswith("crossover_tp[") and "sglang-custom-ar" in k for k in rec)
