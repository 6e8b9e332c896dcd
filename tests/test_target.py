import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from workbench.target import (
    EMBEDDED_NAME,
    TargetError,
    fingerprint_dir,
    load_target,
    resolve_target_dir,
)


def test_missing_path_names_the_path(tmp_path):
    with pytest.raises(TargetError, match=r"nope.*not found.*config.json.*gguf"):
        load_target(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(TargetError, match=rf"{tmp_path}.*no config.json"):
        load_target(tmp_path)


def test_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(TargetError, match="must be a .gguf"):
        load_target(f)


def _write_gguf(path, arch):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_of_encoder_architecture_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    f = tmp_path / "encoder.gguf"
    _write_gguf(f, "bert")
    with pytest.raises(TargetError, match=r"encoder.gguf.*'bert' is not a decoder-only"):
        load_target(f)
    g = tmp_path / "garbage.gguf"
    g.write_bytes(b"not a gguf at all")
    with pytest.raises(TargetError, match="garbage.gguf: not a readable GGUF"):
        load_target(g)


def test_tiny_target_loads_and_fingerprint_tracks_content(tiny_target_dir, tmp_path):
    t = load_target(tiny_target_dir)
    assert t.num_layers == 8 and t.hidden_size == 64 and t.vocab_size == 49152
    assert t.fingerprint == fingerprint_dir(tiny_target_dir)
    # A copy with one config field changed must fingerprint differently.
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_target_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    assert fingerprint_dir(other) == t.fingerprint  # same content, same fingerprint
    cfg["rms_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(cfg))
    assert fingerprint_dir(other) != t.fingerprint
    # and a changed chat template too
    shutil.copytree(tiny_target_dir, tmp_path / "third")
    (tmp_path / "third" / "chat_template.jinja").write_text("{{ messages }}")
    assert fingerprint_dir(tmp_path / "third") != t.fingerprint


@pytest.mark.slow
def test_embedded_default_second_load_is_fast(embedded_dir):
    """The first load converted the GGUF (fixture); a fresh process reloads the fp32 copy quickly."""
    weights = embedded_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    code = (
        "import time; t0=time.perf_counter(); from workbench.target import load_target; "
        "t=load_target('smollm2-135m'); print(t.load_seconds, t.num_layers, t.hidden_size, t.vocab_size, t.fingerprint)"
    )
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True
    )
    wall = time.perf_counter() - t0
    load_s, n, h, v, fp = out.stdout.split()
    assert (int(n), int(h), int(v)) == (30, 576, 49152)
    assert weights.stat().st_mtime_ns == mtime, "second load must not re-convert"
    assert float(load_s) < 5.0, f"load from converted copy took {load_s}s (expected about a second)"
    assert fp == fingerprint_dir(embedded_dir)
    assert resolve_target_dir(EMBEDDED_NAME)[1] == embedded_dir
    print(f"embedded reload: {float(load_s):.2f}s in-process, {wall:.1f}s with interpreter start")


def _cli(*args):
    from typer.testing import CliRunner

    from workbench.cli import app

    return CliRunner().invoke(app, list(args))


def _one_line_error(res, *fragments):
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    for f in fragments:
        assert f in res.stderr, res.stderr


def test_info_on_bad_targets_is_one_line(tmp_path):
    _one_line_error(_cli("info", "--target", str(tmp_path / "nope")), "not found")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    (empty / "model.safetensors").write_bytes(b"")
    _one_line_error(_cli("info", "--target", str(empty)), "no 'model_type' key")
    (empty / "config.json").write_text("{not json")
    _one_line_error(_cli("info", "--target", str(empty)), "unreadable config.json")
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (empty / "model.safetensors").write_bytes(b"garbage")
    _one_line_error(_cli("info", "--target", str(empty)), "cannot load as an HF causal LM")


def test_bad_dtype_and_missing_gpu_are_refused_before_loading(tiny_target_dir):
    import torch

    with pytest.raises(TargetError, match="unknown target dtype 'foo'"):
        load_target(tiny_target_dir, dtype="foo")
    with pytest.raises(TargetError, match="unknown device 'tpu'"):
        load_target(tiny_target_dir, device="tpu")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(TargetError, match="no CUDA GPU"):
        load_target(tiny_target_dir, device="cuda")
    res = _cli("capture", "--target", str(tiny_target_dir), "--out", "/nonexistent/x",
               "--device", "cuda")  # fmt: skip
    _one_line_error(res, "--device cuda: no CUDA GPU")


def test_fingerprint_cache_lives_under_workbench_home(tiny_target_dir, tmp_path, monkeypatch):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_target_dir, model)
    before = sorted(p.name for p in model.iterdir())
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    fp = fingerprint_dir(model)
    assert sorted(p.name for p in model.iterdir()) == before  # nothing written into the model
    cached = list((tmp_path / "home" / "fingerprints").glob("model-*.json"))
    assert len(cached) == 1 and fingerprint_dir(model) == fp
    model.chmod(0o555)  # a read-only model folder fingerprints all the same
    try:
        assert fingerprint_dir(model) == fp
    finally:
        model.chmod(0o755)


# ---------------------------------------------------------------- CLI: one catch, one line


def test_malformed_parameter_yaml_and_unclosed_serving_quote_are_one_line(tmp_path):
    from workbench.audit import parse_serving
    from workbench.errors import WorkbenchError

    bad = tmp_path / "p.yaml"
    bad.write_text("n_prompts: [1, 2\nmax_new_tokens: 5\n")
    nb = str(tmp_path / "x.ipynb")
    _one_line_error(_cli("run", nb, "-f", str(bad)), f"parameters file {bad}: malformed YAML")
    bad.write_text("- just\n- a list\n")
    _one_line_error(_cli("run", nb, "-f", str(bad)), "must hold a mapping", "got a list")
    _one_line_error(_cli("run", nb, "-f", str(tmp_path / "none.yaml")), "cannot read it")
    with pytest.raises(WorkbenchError, match="cannot split it .*closing quotation"):
        parse_serving('python -m sglang.launch_server --model-path "my model')


def test_cli_has_one_error_handler():
    """The repeated per-command exception tuples are gone: one WorkbenchError catch remains."""
    import re
    from pathlib import Path

    import workbench.cli

    src = Path(workbench.cli.__file__).read_text()
    assert src.count("except WorkbenchError") == 1
    assert not re.findall(r"except \([^)]*Error", src)


def test_native_bf16_reads_the_cpu_flags_and_auto_picks_the_fast_dtype(monkeypatch):
    from workbench import target as tg

    xeon = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
    zen4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16\n"
    spr = "processor\t: 0\nflags\t\t: avx512f amx_tile amx_bf16\n"
    assert not tg.native_bf16("cpu", xeon)
    assert tg.native_bf16("cpu", zen4) and tg.native_bf16("cpu", spr)
    assert tg.native_bf16("cuda:0", xeon)  # a GPU: bf16 is native
    assert tg.fast_dtype("float16") == "float16" and tg.fast_dtype("bfloat16") == "bfloat16"
    monkeypatch.setattr(tg, "native_bf16", lambda device="cpu", cpuinfo=None: False)
    assert tg.fast_dtype("auto") == "float32"
    monkeypatch.setattr(tg, "native_bf16", lambda device="cpu", cpuinfo=None: True)
    assert tg.fast_dtype("auto") == "bfloat16"


def test_regeneration_records_the_dtype_auto_resolved_to(tiny_target, tmp_path, monkeypatch):
    import json

    from workbench import target as tg
    from workbench.data import Prompt, RegenConfig, regenerate

    monkeypatch.setattr(tg, "native_bf16", lambda device="cpu", cpuinfo=None: False)
    prompts = [Prompt("p0", "test", ["Say 0."])]
    regenerate(tiny_target, prompts, tmp_path / "r", RegenConfig(max_new_tokens=3), progress=False)
    assert RegenConfig().dtype == "auto"
    assert json.loads((tmp_path / "r" / "regen-args.json").read_text())["dtype"] == "float32"
