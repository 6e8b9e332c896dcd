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
