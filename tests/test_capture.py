import json

import pytest
import torch

from workbench.capture import CaptureConfig, CaptureError, CaptureReader, capture
from workbench.layers import INPUT_OF_LAYER, LayerIds


def _convs(n=7):
    out = []
    for i in range(n):
        turns = [
            {"role": "user", "content": f"Question number {i}: " + "why? " * (i + 1)},
            {"role": "assistant", "content": "Because " + "it is so. " * (2 * i + 1)},
        ]
        if i % 3 == 0:
            turns += [
                {"role": "user", "content": "Shorter?"},
                {"role": "assistant", "content": "Yes."},
            ]
        out.append(turns)
    return out


def _cfg(**kw):
    base = dict(
        layer_ids=LayerIds((1, 3, 4)),
        dtype="float32",
        max_length=64,
        samples_per_shard=3,
        batch_tokens=128,
    )
    return CaptureConfig(**{**base, **kw})


def test_capture_matches_hf_hidden_states(tiny_target, tmp_path):
    m = capture(
        tiny_target, _convs(), tmp_path / "cap", _cfg(), prompt_set={"name": "t"}, progress=False
    )
    assert m["layer_ids"] == {"ids": [1, 3, 4], "convention": "output_of_layer"}
    assert m["num_samples"] == 7 and len(m["shards"]) == 3 and m["hidden_size"] == 64
    assert m["target"]["fingerprint"] == tiny_target.fingerprint and m["target"]["tokenizer_hash"]
    assert (
        set(m["norm_stats"]["layers"]) == {"1", "3", "4"} and m["norm_stats"]["last"]["layer"] == 7
    )
    assert all(len(s["sha256"]) == 64 for s in m["shards"])
    assert m["num_loss_tokens"] < m["num_tokens"]
    r = CaptureReader(tmp_path / "cap", verify=True)
    assert len(r) == 7 and r.layer_ids.ids == (1, 3, 4) and sum(r.lengths()) == m["num_tokens"]
    for i in (0, 4, 6):
        s = r[i]
        with torch.no_grad():
            hs = tiny_target.model(s["input_ids"][None], output_hidden_states=True).hidden_states
        H = 64
        for slot, layer in enumerate((1, 3, 4)):  # output_of_layer k == HF hidden_states[k + 1]
            torch.testing.assert_close(
                s["aux_hidden"][:, slot * H : (slot + 1) * H],
                hs[layer + 1][0],
                atol=1e-5,
                rtol=1e-5,
            )
        # last_hidden is the pre-norm residual after the last layer (HF's last entry is post-norm).
        norm = tiny_target.model.model.norm
        torch.testing.assert_close(norm(s["last_hidden"]), hs[-1][0], atol=1e-5, rtol=1e-5)
        assert s["loss_mask"].dtype == torch.bool and s["loss_mask"].any()


def test_ids_given_in_another_convention_are_stored_canonically(tiny_target, tmp_path):
    m = capture(
        tiny_target,
        _convs(2),
        tmp_path / "c",
        _cfg(layer_ids=LayerIds((2, 4, 5), INPUT_OF_LAYER)),
        progress=False,
    )
    assert m["layer_ids"] == {"ids": [1, 3, 4], "convention": "output_of_layer"}


def test_killed_capture_resumes_to_identical_result(tiny_target, tmp_path, monkeypatch):
    ref = capture(tiny_target, _convs(), tmp_path / "ref", _cfg(dtype="bfloat16"), progress=False)
    import workbench.capture as cap

    real = cap.write_shard
    calls = {"n": 0}

    def dies_on_second(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # as if killed mid-way
        return real(*a, **k)

    monkeypatch.setattr(cap, "write_shard", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        capture(tiny_target, _convs(), tmp_path / "run", _cfg(dtype="bfloat16"), progress=False)
    monkeypatch.setattr(cap, "write_shard", real)
    assert not (tmp_path / "run" / "manifest.json").exists()
    assert [p.name for p in (tmp_path / "run").glob("shard-*")] == ["shard-00000.safetensors"]
    with pytest.raises(CaptureError, match="did not finish: rerun the same command"):
        CaptureReader(tmp_path / "run")
    done = capture(tiny_target, _convs(), tmp_path / "run", _cfg(dtype="bfloat16"), progress=False)
    assert [s["sha256"] for s in done["shards"]] == [s["sha256"] for s in ref["shards"]]
    assert done["norm_stats"] == ref["norm_stats"]


def test_other_arguments_into_same_dir_are_refused(tiny_target, tmp_path):
    capture(tiny_target, _convs(2), tmp_path / "c", _cfg(), progress=False)
    with pytest.raises(
        CaptureError, match=r"different arguments:\n  layer_ids: was .*\[1, 3, 4\].*\[1, 2, 4\]"
    ):
        capture(
            tiny_target,
            _convs(2),
            tmp_path / "c",
            _cfg(layer_ids=LayerIds((1, 2, 4))),
            progress=False,
        )
    with pytest.raises(CaptureError, match="data_hash"):
        capture(tiny_target, _convs(3), tmp_path / "c", _cfg(), progress=False)


def test_corrupt_and_truncated_shards_name_the_file(tiny_target, tmp_path):
    capture(tiny_target, _convs(), tmp_path / "c", _cfg(), progress=False)
    shard = tmp_path / "c" / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # flip a bit inside the tensor data
    shard.write_bytes(bytes(data))
    CaptureReader(tmp_path / "c")  # opening without verification still works...
    with pytest.raises(CaptureError, match=r"shard-00001.safetensors: checksum mismatch"):
        CaptureReader(tmp_path / "c", verify=True)
    shard.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CaptureError, match=r"shard-00001.safetensors: corrupt or truncated"):
        CaptureReader(tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    manifest["layer_ids"].pop("convention")
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CaptureError, match="convention"):
        CaptureReader(tmp_path / "c")


@pytest.mark.slow
def test_embedded_target_capture_smoke(tmp_path):
    from workbench.layers import default_layer_ids
    from workbench.target import load_target

    t = load_target("smollm2-135m")
    convs = [
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "2+2 equals 4."},
        ]
    ]
    m = capture(
        t,
        convs,
        tmp_path / "c",
        CaptureConfig(default_layer_ids(30), dtype="float32"),
        progress=False,
    )
    assert m["layer_ids"]["ids"] == [1, 14, 26]
    s = CaptureReader(tmp_path / "c")[0]
    with torch.no_grad():
        hs = t.model(s["input_ids"][None], output_hidden_states=True).hidden_states
    for slot, layer in enumerate((1, 14, 26)):
        torch.testing.assert_close(
            s["aux_hidden"][:, slot * 576 : (slot + 1) * 576],
            hs[layer + 1][0],
            atol=1e-3,
            rtol=1e-4,
        )
