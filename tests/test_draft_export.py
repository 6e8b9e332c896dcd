"""Draft export/import: SGLang and speculators layouts, round trips, the silent-failure guards.

The expected key sets and config fields are written out here from sglang.md / eagle3.md, not
taken from the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workbench.draft.errors import DraftImportError, ExportError
from workbench.draft.export import export_sglang, export_speculators
from workbench.draft.load import load_draft
from workbench.draft.model import DraftConfig, Eagle3Draft
from workbench.layers import LayerIds

H, HT, V, DV = 32, 48, 300, 40
MIDLAYER = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
]
SGLANG_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"midlayer.{k}" for k in MIDLAYER
}
SPECULATORS_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"layers.0.{k}" for k in MIDLAYER
}


def make_draft(seed: int = 0, ids=(1, 3, 4), max_pos: int = 512) -> Eagle3Draft:
    """A tiny draft with every weight random (norms too) and a real vocab map."""
    cfg = DraftConfig(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=V,
        draft_vocab_size=DV,
        target_hidden_size=HT,
        layer_ids=LayerIds(ids),
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        max_position_embeddings=max_pos,
    )
    g = torch.Generator().manual_seed(seed)
    d = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
        d.embed_tokens.copy_(torch.randn(V, H, generator=g))
    d.set_vocab(torch.sort(torch.randperm(V, generator=g)[:DV]).values)
    return d


@torch.no_grad()
def two_steps(d: Eagle3Draft) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a first step (3*HT aux input, fc applies) and a second (own hidden)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 6), generator=g)
    aux = torch.randn(2, 6, 3 * HT, generator=g)
    pos = torch.arange(6)
    l0, h = d(ids, aux, pos)
    l1, _ = d(ids.roll(1, 1), h, pos + 1)
    return l0, l1


def test_sglang_layout_matches_reference(tmp_path):
    d = make_draft()
    out = export_sglang(d, tmp_path / "sg", {"capture_hash": "c0ffee", "target_fingerprint": "f1"})
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "workbench.json",
    ]
    w = load_file(str(out / "model.safetensors"))
    assert set(w) == SGLANG_KEYS
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert w["lm_head.weight"].shape == (DV, H) and w["fc.weight"].shape == (H, 3 * HT)
    assert w["midlayer.self_attn.q_proj.weight"].shape == (32, 2 * H)
    assert w["t2d"].shape == (V,) and int(w["t2d"].sum()) == DV
    assert torch.equal(w["d2t"] + torch.arange(DV), d.draft_ids)
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]
    assert c["num_hidden_layers"] == 1 and c["tie_word_embeddings"] is False
    assert c["vocab_size"] == V and c["draft_vocab_size"] == DV and c["target_hidden_size"] == HT
    assert c["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4],  # SGLang's meaning is output_of_layer
        "use_aux_hidden_state": True,
    }
    for k, v in dict(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        rope_scaling=None,
        max_position_embeddings=512,
        hidden_act="silu",
        torch_dtype="float32",
    ).items():
        assert c[k] == v, k
    wb = json.loads((out / "workbench.json").read_text())
    assert wb["layer_ids"] == {"ids": [1, 3, 4], "convention": "output_of_layer"}
    assert wb["capture_hash"] == "c0ffee" and wb["target_fingerprint"] == "f1"


def test_speculators_layout_and_layer_ids(tmp_path):
    d = make_draft()
    out = export_speculators(d, tmp_path / "spec", "meta-llama/Llama-3.1-8B-Instruct", 5)
    w = load_file(str(out / "model.safetensors"))
    assert set(w) == SPECULATORS_KEYS
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["Eagle3Speculator"] and c["speculators_model_type"] == "eagle3"
    # output_of_layer [1, 3, 4] is vLLM's input_of_layer [2, 4, 5]
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert c["norm_before_residual"] is False and c["draft_vocab_size"] == DV
    sc = c["speculators_config"]
    assert sc["algorithm"] == "eagle3"
    assert sc["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 5}
    assert sc["verifier"]["name_or_path"] == "meta-llama/Llama-3.1-8B-Instruct"
    tl = c["transformer_layer_config"]
    assert tl["num_hidden_layers"] == 1 and tl["vocab_size"] == V and tl["hidden_size"] == H


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_round_trip_gives_identical_logits(tmp_path, fmt):
    d = make_draft()
    if fmt == "sglang":
        out = export_sglang(d, tmp_path / fmt, {})
    else:
        out = export_speculators(d, tmp_path / fmt, "some/verifier")
    imp = load_draft(out)
    assert imp.warnings == [] and imp.source == fmt
    assert imp.layer_ids == LayerIds((1, 3, 4), "output_of_layer")
    assert imp.draft.config == d.config
    imp.draft.embed_tokens.copy_(d.embed_tokens)  # never exported: comes from the target
    for a, b in zip(two_steps(d), two_steps(imp.draft), strict=True):
        assert torch.equal(a, b)


def test_bf16_export_casts_weights_only(tmp_path):
    out = export_sglang(make_draft(), tmp_path / "bf", {}, dtype="bfloat16")
    w = load_file(str(out / "model.safetensors"))
    assert w["fc.weight"].dtype == torch.bfloat16 and w["d2t"].dtype == torch.int64
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_unknown_or_missing_key_is_refused_on_export(tmp_path, monkeypatch):
    d = make_draft()
    d.register_buffer("midlayer_extra", torch.zeros(3))  # SGLang would skip it silently
    with pytest.raises(ExportError, match="unknown keys.*midlayer_extra"):
        export_sglang(d, tmp_path / "a", {})
    d = make_draft()
    full = d.state_dict

    def without_hidden_norm(*a, **k):
        return {k_: v for k_, v in full(*a, **k).items() if k_ != "midlayer.hidden_norm.weight"}

    monkeypatch.setattr(d, "state_dict", without_hidden_norm)
    with pytest.raises(ExportError, match="missing keys.*hidden_norm"):
        export_speculators(d, tmp_path / "b", "v")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("bad", ["zeros", "arange"])
def test_degenerate_d2t_refused_on_export_and_flagged_on_import(tmp_path, bad):
    d = make_draft()
    good = export_sglang(d, tmp_path / "good", {})
    d.d2t.copy_(torch.zeros(DV) if bad == "zeros" else torch.arange(DV))
    with pytest.raises(ExportError, match="all zeros" if bad == "zeros" else "arange"):
        export_sglang(d, tmp_path / "x", {})
    # a checkpoint from elsewhere with the same bug (t2d left consistent with the good map)
    w = load_file(str(good / "model.safetensors"))
    w["d2t"] = d.d2t.clone()
    save_file(w, str(good / "model.safetensors"))
    imp = load_draft(good)
    assert any(("all zeros" if bad == "zeros" else "arange") in m for m in imp.warnings)
    with pytest.raises(DraftImportError, match="d2t"):
        load_draft(good, strict=True)


def specforge_dir(tmp_path: Path, d: Eagle3Draft, ids=(1, 3, 4), **edit) -> Path:
    """An SGLang-style checkpoint as SpecForge writes it: no workbench.json, embeddings kept."""
    src = export_sglang(d, tmp_path / "src", {})
    out = tmp_path / "specforge"
    out.mkdir()
    c = json.loads((src / "config.json").read_text())
    if ids is None:
        c.pop("eagle_config")
    else:
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(ids)
    c.update(edit.pop("config", {}))
    (out / "config.json").write_text(json.dumps(c))
    w = load_file(str(src / "model.safetensors"))
    w["embed_tokens.weight"] = d.embed_tokens.clone()
    for k in edit.pop("drop", ()):
        del w[k]
    w.update(edit.pop("add", {}))
    save_file(w, str(out / "model.safetensors"))
    return out


def test_export_refuses_short_context_and_foreign_dirs(tmp_path):
    d = make_draft(max_pos=512)
    with pytest.raises(ExportError, match="max_position_embeddings 512 < the target's 2048"):
        export_sglang(d, tmp_path / "x", {"target": {"max_position_embeddings": 2048}})
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ExportError, match="not a draft export written by workbench"):
        export_sglang(d, tmp_path / "notes", {})
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_export_is_atomic_and_replaces_an_old_export(tmp_path, monkeypatch):
    out = export_sglang(make_draft(seed=0), tmp_path / "e", {})
    before = load_file(str(out / "model.safetensors"))["fc.weight"]
    import safetensors.torch as st

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(st, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        export_sglang(make_draft(seed=1), out, {})
    monkeypatch.undo()
    assert torch.equal(load_file(str(out / "model.safetensors"))["fc.weight"], before)
    assert [p.name for p in tmp_path.iterdir()] == ["e"]  # no temp dirs left behind
    export_sglang(make_draft(seed=1), out, {})
    assert not torch.equal(load_file(str(out / "model.safetensors"))["fc.weight"], before)


def fake_run(tmp_path: Path, d: Eagle3Draft) -> Path:
    """A run dir in train.py's checkpoint layout (checkpoints/latest -> step-N/state.pt)."""
    ck = tmp_path / "run" / "checkpoints" / "step-00000007"
    ck.mkdir(parents=True)
    torch.save(
        {
            "draft": d.state_dict(),
            "draft_config": d.config.to_dict(),
            "config": {"target": "tiny", "capture": "/cap", "ttt_len": 3, "lr": 1e-3},
            "metrics": [{"event": "eval", "step": 7, "acc": [0.5], "a": [0.5], "tau": 1.5}],
            "capture_hash": "cafe",
            "target_fingerprint": "fp",
            "step": 7,
            "world_size": 1,
        },
        ck / "state.pt",
    )
    (ck.parent / "latest").write_text(ck.name + "\n")
    return tmp_path / "run"


def test_export_never_replaces_a_folder_it_did_not_write(tmp_path):
    """An HF model folder holds a config.json too: exporting onto it must not wipe it."""
    from typer.testing import CliRunner

    from workbench.cli import app

    model = tmp_path / "hf-model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ExportError, match="not a draft export written by workbench"):
        export_sglang(make_draft(), model, {})
    run = fake_run(tmp_path, make_draft())
    r = CliRunner().invoke(app, ["export", "--draft", str(run), "--out", str(model)])
    assert r.exit_code == 2 and "refusing to replace" in r.output, r.output
    assert sorted(p.name for p in model.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json"]  # fmt: skip
    assert (model / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf-model", "run"]  # no temp left
    # an empty folder, or one an export wrote, is fine (and is replaced whole)
    out = export_sglang(make_draft(), tmp_path / "e", {})
    assert (
        json.loads((out / "workbench.json").read_text())["written_by"] == "workbench.draft.export"
    )
    export_speculators(make_draft(seed=2), out, "v")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Eagle3Speculator"]


def test_exported_files_are_world_readable(tmp_path):
    out = export_sglang(make_draft(), tmp_path / "e", {})
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644, "workbench.json": 0o644}
    assert out.stat().st_mode & 0o777 == 0o755
