"""Notebook 01 runs under Papermill with parameters (tiny target, a handful of prompts)."""

import json
from pathlib import Path

import papermill as pm

NB = Path(__file__).parent.parent / "notebooks" / "01_capture_hidden_states.ipynb"


def test_notebook_01_runs_under_papermill(tiny_target_dir, tmp_path):
    out = tmp_path / "cap"
    executed = tmp_path / "01.ipynb"
    pm.execute_notebook(
        str(NB),
        str(executed),
        kernel_name="python3",
        progress_bar=False,
        cwd=str(tmp_path),
        parameters={
            "target": str(tiny_target_dir),
            "prompt_set": "train",
            "n_samples": 3,
            "max_new_tokens": 4,
            "max_length": 64,
            "out_dir": str(out),
            "regen_dtype": "float32",
            "layers": "1,3,4",
        },
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_samples"] == 3 and manifest["layer_ids"]["ids"] == [1, 3, 4]
    nb = json.loads(executed.read_text())
    figures = [
        o
        for c in nb["cells"]
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
        if "application/vnd.plotly.v1+json" in o.get("data", {})
    ]
    assert len(figures) == 3
    titles = [
        f["data"]["application/vnd.plotly.v1+json"]["layout"]["title"]["text"] for f in figures
    ]
    assert (
        "norm distribution" in titles[0]
        and "Sequence lengths" in titles[1]
        and "Bytes per token" in titles[2]
    )
