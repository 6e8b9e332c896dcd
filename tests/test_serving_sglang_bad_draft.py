"""A draft whose weights do not fit its hidden size, handed to the real SGLang with the
launcher's own check off: SGLang fails while loading it, the launcher fails at once with
SGLang's reason from the log, and the server's process group is gone (one server start)."""

from __future__ import annotations

import json
import time

import pytest
from safetensors.torch import load_file, save_file
from sglang_common import STARTUP_DEADLINE_S, cpu_spec, export_repeat_draft, need_server_env

from workbench.serving import process, sglang

pytestmark = pytest.mark.slow  # the real 135M target and a real SGLang server


def test_wrong_hidden_size_fails_to_start_with_sglangs_reason(tmp_path):
    need_server_env()
    from workbench.target import load_target

    target = load_target("smollm2-135m")
    good = export_repeat_draft(target, tmp_path / "good")
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((good / "config.json").read_text())
    cfg["hidden_size"] = 512  # the weights stay 576 wide
    cfg["head_dim"] = 64
    (bad / "config.json").write_text(json.dumps(cfg))
    save_file(load_file(str(good / "model.safetensors")), str(bad / "model.safetensors"))
    spec = cpu_spec(target.path, bad)
    assert sglang.draft_problems(spec)  # the launcher's check would have refused it
    t0 = time.monotonic()
    with pytest.raises(process.ServerError) as e:
        sglang.launch(spec, tmp_path / "server.log", deadline_s=STARTUP_DEADLINE_S,
                      check_draft=False)  # fmt: skip
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "during start-up" in msg  # it died; the deadline was not what ended it
    assert "size" in msg.lower() and ("512" in msg or "576" in msg), msg[-2000:]
    print(f"SGLang refused the draft after {took:.1f} s; reason from its log:\n{msg[-600:]}")
