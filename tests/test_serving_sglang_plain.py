"""Real SGLang 0.5.23 on this CPU serving the embedded target without speculation (one
server start for the module): fp32 greedy tokens identical to the local engine's plain
decoding (and so, with test_serving_sglang.py, to SGLang's EAGLE-3 serving)."""

from __future__ import annotations

import pytest
from sglang_common import (
    MAX_NEW_TOKENS,
    STARTUP_DEADLINE_S,
    cpu_spec,
    engine_reference,
    need_server_env,
)

from workbench.serving import client, process, sglang

pytestmark = pytest.mark.slow  # the real 135M target and a real SGLang server


@pytest.fixture(scope="module")
def target():
    from workbench.target import load_target

    return load_target("smollm2-135m")


def test_plain_serving_tokens_equal_the_local_engine(target, tmp_path):
    need_server_env()
    server = sglang.launch(cpu_spec(target.path), tmp_path / "server.log", wait=False)
    try:
        ref = engine_reference(target, None)  # computed while the server starts
        process.wait_healthy(server, STARTUP_DEADLINE_S)
        print(f"SGLang plain server healthy after {server.start_s:.1f} s")
        _check(server, ref)
    finally:
        server.stop()
    assert not process.group_members(server.pgid)


def _check(server, ref):
    for prompt, want in zip(ref.prompts, ref.plain, strict=True):
        ans = sglang.generate(server.url, prompt, MAX_NEW_TOKENS, temperature=0.0)
        assert ans["output_ids"] == want
        m = ans["meta_info"]
        assert m["completion_tokens"] == len(want)
        assert "spec_verify_ct" not in m or not m["spec_verify_ct"]
    toks, secs = 0, 0.0
    for prompt in ref.prompts:  # timing only, with every request's prefix now cached alike
        m = sglang.generate(server.url, prompt, MAX_NEW_TOKENS, temperature=0.0)["meta_info"]
        toks, secs = toks + m["completion_tokens"], secs + m["e2e_latency"]
    print(f"SGLang plain on CPU: {toks / secs:.2f} tok/s (batch 1, e2e)")
    got = client.get_metrics(server.url)
    assert got["sglang:generation_tokens_total"] == 2 * sum(len(t) for t in ref.plain)
    assert got.get("sglang:spec_verify_calls_total", 0.0) == 0.0
