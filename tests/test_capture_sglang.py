"""`capture --backend sglang`: aux hidden states from real SGLang 0.5.23 on this CPU (one
capture-only server for the module) equal the HF backend's at every position (fp32), into the
same shards and manifest; plus the id translation (SGLang's +1) without a server."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sglang_common import STARTUP_DEADLINE_S, need_server_env

from workbench.capture import CaptureConfig, CaptureReader, capture
from workbench.layers import INPUT_OF_LAYER, LayerConventionError, LayerIds, sglang_return_aux_ids
from workbench.serving import capture_sglang, process, sglang

CONVS = [
    [{"role": "user", "content": "Name three colours."},
     {"role": "assistant", "content": "Red, green and blue."}],
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}],
    [{"role": "user", "content": "Say hello in French."},
     {"role": "assistant", "content": "Bonjour ! Comment allez-vous aujourd'hui ?"}],
]  # fmt: skip
ATOL = 1e-3  # fp32: SGLang's torch_native attention and fused RMSNorm vs HF's eager path
# fp32 rounding scales with magnitude: attention-sink rows reach |x| ~ 2.7e3 (one ulp 2.4e-4), so
# equality is judged per row relative to its largest |value| (an Intel Xeon gave 3.9e-3 absolute,
# 1.5e-6 relative; the AMD CPU of earlier runs stayed under 1e-3 absolute)
RTOL = 1e-5


def test_sglang_ids_are_output_of_layer_and_refuse_what_it_cannot_capture():
    assert sglang_return_aux_ids(LayerIds((1, 14, 26)), 30) == [1, 14, 26]
    assert sglang_return_aux_ids(LayerIds((2, 15, 27), INPUT_OF_LAYER), 30) == [1, 14, 26]
    for ids in ((-1, 14, 26), (1, 14, 29)):  # embeddings; last layer (nothing captures it)
        with pytest.raises(LayerConventionError, match="out of its reach"):
            sglang_return_aux_ids(LayerIds(ids), 30)
    spec = capture_sglang.capture_spec("T", LayerIds((2, 15, 27), INPUT_OF_LAYER), 30)
    a = sglang.sglang_args(spec)
    i = a.index("--return-aux-hidden-state-layer-ids")
    assert a[i + 1 : i + 4] == ["1", "14", "26"] and "--disable-radix-cache" in a
    assert (
        "--speculative-draft-model-path" not in a
        and a[a.index("--speculative-algorithm") + 1] == "EAGLE3"
    )


@pytest.fixture(scope="module")
def target():
    from workbench.target import load_target

    return load_target("smollm2-135m")


@pytest.mark.slow
def test_sglang_capture_equals_the_hf_backend(target, tmp_path):
    need_server_env()
    from workbench.layers import default_layer_ids

    ids = default_layer_ids(target.num_layers)
    spec = capture_sglang.capture_spec(str(target.path), ids, target.num_layers, dtype="float32",
                                       device="cpu")  # fmt: skip
    spec = dataclasses.replace(spec, env={"OMP_NUM_THREADS": "1"})
    server = sglang.launch(spec, tmp_path / "server.log", wait=False, check_draft=False)
    cfg = CaptureConfig(ids, dtype="float32", samples_per_shard=2)
    try:
        hf = capture(target, CONVS, tmp_path / "hf", cfg, progress=False)  # while SGLang starts
        cli_hf = _cli_capture(tmp_path, target.path, ["--backend", "hf"])
        process.wait_healthy(server, STARTUP_DEADLINE_S)
        rec = capture_sglang.recorder(server.url)
        sg = capture(target, CONVS, tmp_path / "sg", cfg, progress=False, recorder=rec)
        cli = _cli_capture(
            tmp_path, target.path, ["--backend", "sglang", "--sglang-url", server.url]
        )
    finally:
        server.stop()
    assert not process.group_members(server.pgid)
    assert (hf["capture_backend"], sg["capture_backend"]) == ("hf", "sglang")
    for k in ("layer_ids", "num_samples", "num_tokens", "num_loss_tokens", "hidden_size"):
        assert sg[k] == hf[k], k
    a, b = CaptureReader(tmp_path / "hf"), CaptureReader(tmp_path / "sg")
    worst, rel = 0.0, 0.0
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["last_hidden"], y["last_hidden"])  # both from the local target
        assert x["aux_hidden"].shape == y["aux_hidden"].shape
        d = (x["aux_hidden"] - y["aux_hidden"]).abs()
        worst = max(worst, float(d.max()))
        rel = max(rel, float((d.max(-1).values / x["aux_hidden"].abs().max(-1).values).max()))
    print(f"RESULT sglang_capture max_abs_diff={worst:.3g} max_rel_diff={rel:.3g} "
          f"tokens={hf['num_tokens']} layers={list(ids.ids)}")  # fmt: skip
    assert rel < RTOL
    # a shift by one layer is orders of magnitude further apart than the tolerance
    H = target.hidden_size
    x = next(iter(a))["aux_hidden"]
    assert float((x[:, H : 2 * H] - x[:, :H]).abs().max()) > 100 * ATOL
    for j in range(len(ids.ids)):
        p, q = (m["norm_stats"]["layers"][str(ids.ids[j])]["p50"] for m in (hf, sg))
        assert q == pytest.approx(p, rel=1e-3)

    # the CLI wiring: `workbench capture --backend sglang --sglang-url` == `--backend hf`
    assert (cli_hf["capture_backend"], cli["capture_backend"]) == ("hf", "sglang")
    for x, y in zip(CaptureReader(cli_hf["dir"]), CaptureReader(cli["dir"]), strict=True):
        d = (x["aux_hidden"] - y["aux_hidden"]).abs().max(-1).values
        assert float((d / x["aux_hidden"].abs().max(-1).values).max()) < RTOL


def _cli_capture(tmp_path, target_dir, extra: list[str]) -> dict:
    import json

    from typer.testing import CliRunner

    from workbench.cli import app

    data = tmp_path / "prompts.jsonl"
    rows = [{"id": f"q{i}", "turns": [f"Say {i}."], "answers": [f"{i}, said."]} for i in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / f"cli-{extra[1]}"
    args = ["capture", "--target", str(target_dir), "--prompts", str(data), "--out", str(out),
            "--dtype", "float32", *extra]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads((out / "manifest.json").read_text()) | {"dir": out}
