"""The one draft loader: runs, checkpoints, our exports, SpecForge and speculators dirs; what
looks wrong in them; no pickle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_draft_export import fake_run, make_draft, specforge_dir, two_steps

from workbench.draft.errors import DraftImportError
from workbench.draft.export import export_sglang
from workbench.draft.load import load_draft
from workbench.layers import LayerConventionError


def test_import_specforge_checkpoint_with_embeddings(tmp_path):
    d = make_draft()
    imp = load_draft(specforge_dir(tmp_path, d))
    assert imp.warnings == [] and imp.provenance is None and imp.source == "specforge"
    assert imp.layer_ids.ids == (1, 3, 4) and imp.layer_ids.convention == "output_of_layer"
    assert torch.equal(imp.draft.embed_tokens, d.embed_tokens)
    for a, b in zip(two_steps(d), two_steps(imp.draft), strict=True):
        assert torch.equal(a, b)


def test_import_flags_unknown_missing_keys_missing_d2t_and_short_context(tmp_path):
    d = make_draft()
    path = specforge_dir(
        tmp_path,
        d,
        drop=("d2t", "midlayer.hidden_norm.weight"),
        add={"model.layers.0.mlp.up_proj.weight": torch.zeros(2)},
    )
    imp = load_draft(path, target_max_position_embeddings=8192)
    text = "\n".join(imp.warnings)
    assert "unknown keys ['model.layers.0.mlp.up_proj.weight']" in text
    assert "missing keys ['midlayer.hidden_norm.weight']" in text
    assert "d2t missing" in text
    assert "max_position_embeddings 512 < the target's 8192" in text
    with pytest.raises(DraftImportError):
        load_draft(path, target_max_position_embeddings=8192, strict=True)


def test_import_without_layer_ids_needs_ids_and_convention(tmp_path):
    path = specforge_dir(tmp_path, make_draft(), ids=None)
    with pytest.raises(LayerConventionError) as e:
        load_draft(path)
    for name in ("output_of_layer", "input_of_layer", "hf_hidden_states_index"):
        assert name in str(e.value)
    with pytest.raises(LayerConventionError, match="output_of_layer"):
        load_draft(path, layer_ids=[2, 4, 5])  # ids without their convention
    imp = load_draft(path, layer_ids="2,4,5", layer_convention="input_of_layer")
    assert imp.layer_ids.ids == (1, 3, 4)
    assert any("engine will use its architecture default" in w for w in imp.warnings)


def test_import_cross_checks_ids_against_training(tmp_path):
    out = export_sglang(make_draft(), tmp_path / "sg", {})
    c = json.loads((out / "config.json").read_text())
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]  # an off-by-one edit
    (out / "config.json").write_text(json.dumps(c))
    imp = load_draft(out)
    assert any("off-by-one" in w for w in imp.warnings)


def test_load_checkpoint_and_cli(tmp_path):
    from typer.testing import CliRunner

    from workbench.cli import app

    d = make_draft()
    run = fake_run(tmp_path, d)
    loaded = load_draft(run)
    draft, prov = loaded.draft, loaded.provenance
    assert loaded.source == "run" and loaded.layer_ids.ids == (1, 3, 4)
    assert load_draft(run / "checkpoints" / "step-00000007").source == "checkpoint"
    assert prov["capture_hash"] == "cafe" and prov["training"]["held_out"]["tau"] == 1.5
    assert torch.equal(draft.lm_head.weight, d.lm_head.weight)
    r = CliRunner().invoke(app, ["export", "--draft", str(run), "--out", str(tmp_path / "sg")])
    assert r.exit_code == 0, r.output
    wb = json.loads((tmp_path / "sg" / "workbench.json").read_text())
    assert wb["capture_hash"] == "cafe" and wb["training"]["step"] == 7
    r = CliRunner().invoke(app, ["export", "--draft", str(tmp_path / "sg"), "--format",
                                 "speculators", "--verifier", "org/m", "--out", str(tmp_path / "sp")])  # fmt: skip
    assert r.exit_code == 0, r.output
    c = json.loads((tmp_path / "sp" / "config.json").read_text())
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    r = CliRunner().invoke(app, ["import-draft", str(tmp_path / "sp")])
    assert r.exit_code == 0 and "0 warning(s)" in r.output and "[1, 3, 4]" in r.output
    r = CliRunner().invoke(app, ["export", "--draft", str(run), "--format", "speculators",
                                 "--out", str(tmp_path / "x")])  # fmt: skip
    assert r.exit_code != 0 and "--verifier" in r.output
    assert CliRunner().invoke(app, ["train"]).exit_code != 0  # passthrough: --capture required


class _RunsCode:
    """Unpickling this object creates a file: what a crafted checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_crafted_pickle_checkpoint_is_refused_and_runs_nothing(tmp_path):
    from typer.testing import CliRunner

    from workbench.cli import app
    from workbench.draft.errors import TrainError

    marker = tmp_path / "pwned"
    run = fake_run(tmp_path, make_draft())
    state = run / "checkpoints" / "step-00000007" / "state.pt"
    blob = torch.load(state, weights_only=True)
    blob["metrics"].append(_RunsCode(str(marker)))
    torch.save(blob, state)
    with pytest.raises(TrainError, match="refusing to load.*could run code"):
        load_draft(run)
    assert not marker.exists()
    r = CliRunner().invoke(app, ["export", "--draft", str(run), "--out", str(tmp_path / "e")])
    assert r.exit_code == 2 and "refusing to load" in r.output, r.output
    assert not marker.exists() and not (tmp_path / "e").exists()
    # an outside draft's pickled weights (pytorch_model.bin) get the same treatment
    out = specforge_dir(tmp_path, make_draft())
    (out / "model.safetensors").unlink()
    torch.save({"fc.weight": _RunsCode(str(marker))}, out / "pytorch_model.bin")
    with pytest.raises(DraftImportError, match="refusing to load"):
        load_draft(out)
    assert not marker.exists()


def test_not_a_draft_and_bad_config_are_one_line_errors(tmp_path):
    with pytest.raises(DraftImportError, match="not a draft"):
        load_draft(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DraftImportError, match="expected a JSON object"):
        load_draft(tmp_path)
