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
    CaptureReader(tmp_path / "c", verify=False)  # opening without verification still works...
    with pytest.raises(CaptureError, match=r"shard-00001.safetensors: checksum mismatch"):
        CaptureReader(tmp_path / "c")  # ...but verification is the default
    shard.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CaptureError, match=r"shard-00001.safetensors: corrupt or truncated"):
        CaptureReader(tmp_path / "c", verify=False)
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


def _flip_middle_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_mid_shard_is_caught_and_never_adopted_by_a_rerun(tiny_target, tmp_path):
    m = capture(tiny_target, _convs(), tmp_path / "c", _cfg(), progress=False)
    shard = tmp_path / "c" / "shard-00001.safetensors"
    _flip_middle_byte(shard)
    # training opens captures verified (the default): the bad shard is named
    with pytest.raises(CaptureError, match=r"shard-00001.safetensors: checksum mismatch"):
        CaptureReader(tmp_path / "c")
    # rerunning the same capture re-verifies the shards it finds; the manifest keeps the good hash
    with pytest.raises(
        CaptureError, match=r"shard-00001.safetensors: checksum mismatch.*recapture"
    ):
        capture(tiny_target, _convs(), tmp_path / "c", _cfg(), progress=False)
    after = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert [s["sha256"] for s in after["shards"]] == [s["sha256"] for s in m["shards"]]
    # deleting the bad shard and rerunning recaptures it byte-identically
    shard.unlink()
    again = capture(tiny_target, _convs(), tmp_path / "c", _cfg(), progress=False)
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in m["shards"]]
    CaptureReader(tmp_path / "c")


def test_killed_capture_does_not_resume_onto_a_corrupted_shard(tiny_target, tmp_path, monkeypatch):
    import workbench.capture as cap

    real = cap.write_shard
    calls = {"n": 0}

    def dies_on_second(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(cap, "write_shard", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        capture(tiny_target, _convs(), tmp_path / "run", _cfg(), progress=False)
    monkeypatch.setattr(cap, "write_shard", real)
    _flip_middle_byte(tmp_path / "run" / "shard-00000.safetensors")
    with pytest.raises(CaptureError, match=r"shard-00000.safetensors: checksum mismatch"):
        capture(tiny_target, _convs(), tmp_path / "run", _cfg(), progress=False)


def test_verify_command_names_the_bad_shard(tiny_target, tmp_path):
    from typer.testing import CliRunner

    from workbench.cli import app

    capture(tiny_target, _convs(), tmp_path / "c", _cfg(), progress=False)
    ok = CliRunner().invoke(app, ["verify", str(tmp_path / "c")])
    assert ok.exit_code == 0 and "3 shards" in ok.output and "intact" in ok.output
    _flip_middle_byte(tmp_path / "c" / "shard-00002.safetensors")
    bad = CliRunner().invoke(app, ["verify", str(tmp_path / "c")])
    assert bad.exit_code == 2
    assert bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1
    assert "shard-00002.safetensors: checksum mismatch" in bad.stderr


def test_manifest_layer_ids_that_disagree_with_the_shards_are_refused(tiny_target, tmp_path):
    capture(tiny_target, _convs(), tmp_path / "c", _cfg(), progress=False)
    mf = tmp_path / "c" / "manifest.json"
    manifest = json.loads(mf.read_text())
    manifest["layer_ids"]["ids"] = [2, 4, 5]  # same count, shifted: a silently mis-wired draft
    mf.write_text(json.dumps(manifest))
    with pytest.raises(
        CaptureError,
        match=r"shard-00000.safetensors: shard was captured at layers \[1, 3, 4\] but "
        r"manifest.json says \[2, 4, 5\]",
    ):
        CaptureReader(tmp_path / "c")
    manifest["layer_ids"]["ids"] = [1, 3]  # fewer ids than the shards hold
    mf.write_text(json.dumps(manifest))
    with pytest.raises(CaptureError, match=r"aux_hidden is 192 wide = 3 layers .* lists 2"):
        CaptureReader(tmp_path / "c")


def test_shards_without_recorded_ids_are_read_with_a_warning(tiny_target, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save

    m = capture(tiny_target, _convs(), tmp_path / "c", _cfg(), progress=False)
    for e in m["shards"]:  # rewrite as an older workbench did: norm stats only, no ids
        p = tmp_path / "c" / e["file"]
        with safe_open(str(p), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            stats = json.loads(f.metadata()["workbench"])["norm_stats"]
        data = save(tensors, metadata={"workbench_norm_stats": json.dumps(stats)})
        p.write_bytes(data)
        e["sha256"] = __import__("hashlib").sha256(data).hexdigest()
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(m))
    with pytest.warns(UserWarning, match=r"3 shard\(s\) .* record no layer ids.*Re-capture"):
        r = CaptureReader(tmp_path / "c")
    assert r.layer_ids.ids == (1, 3, 4) and len(r) == 7


def test_second_writer_gets_in_use_by_pid(tiny_target, tmp_path):
    import os

    from workbench.errors import InUseError
    from workbench.fsutil import locked_dir

    with locked_dir(tmp_path / "c", "capture folder"):
        with pytest.raises(InUseError, match=rf"in use by pid {os.getpid()}"):
            capture(tiny_target, _convs(2), tmp_path / "c", _cfg(), progress=False)
    assert not (tmp_path / "c" / "capture-args.json").exists()
    capture(tiny_target, _convs(2), tmp_path / "c", _cfg(), progress=False)  # free again


def test_bad_capture_arguments_are_refused_before_anything_is_written(tiny_target):
    with pytest.raises(CaptureError, match="unknown storage dtype 'foo'"):
        _cfg(dtype="foo")
    for name in ("max_length", "samples_per_shard", "batch_tokens"):
        with pytest.raises(CaptureError, match=rf"{name}=0: must be at least 1"):
            _cfg(**{name: 0})


def _answered_jsonl(path, n=3):
    rows = [{"id": f"q{i}", "turns": [f"Say {i}."], "answers": [f"{i}, said."]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _one_line_error(res, *fragments):
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    for f in fragments:
        assert f in res.stderr, res.stderr


def test_capture_cli_validates_arguments_before_writing(tiny_target_dir, tmp_path):
    from typer.testing import CliRunner

    from workbench.cli import app

    data = _answered_jsonl(tmp_path / "d.jsonl")
    out = tmp_path / "cap"
    base = ["capture", "--target", str(tiny_target_dir), "--prompts", str(data)]
    base += ["--out", str(out), "--layers", "1,3,4"]
    for extra, frag in (
        (["--dtype", "foo"], "unknown storage dtype 'foo'"),
        (["--max-length", "0"], "max_length=0"),
        (["--max-new-tokens", "0"], "max_new_tokens=0"),
        (["--n", "-2"], "--n -2"),
        (["--self-prompts", "-3"], "self_prompts=-3"),
        (["--target-dtype", "foo"], "unknown target dtype 'foo'"),
        (["--layers", "default", "--convention", "nope"], "unknown or missing layer-id"),
    ):
        _one_line_error(CliRunner().invoke(app, base + extra), frag)
        assert not out.exists(), extra
    res = CliRunner().invoke(app, base)  # the corrected rerun works
    assert res.exit_code == 0, res.output
    assert "captured 3 samples" in res.output
    CaptureReader(out)


def test_training_refuses_a_capture_with_a_flipped_byte(tiny_target, tiny_target_dir, tmp_path):
    from typer.testing import CliRunner

    from workbench.cli import app

    capture(tiny_target, _convs(), tmp_path / "c", _cfg(), progress=False)
    _flip_middle_byte(tmp_path / "c" / "shard-00001.safetensors")
    res = CliRunner().invoke(
        app,
        ["train", "--capture", str(tmp_path / "c"), "--out", str(tmp_path / "run"),
         "--target", str(tiny_target_dir), "--max-steps", "1"],
    )  # fmt: skip
    _one_line_error(res, "shard-00001.safetensors: checksum mismatch")
    assert not (tmp_path / "run").exists()
