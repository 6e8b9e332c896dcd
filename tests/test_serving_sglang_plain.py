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
    server_env_threads,
)

from workbench.serving import process, sglang


@pytest.fixture(scope="module")
def target():
    from workbench.target import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def server(target, tmp_path_factory):
    need_server_env()
    server_env_threads()
    log = tmp_path_factory.mktemp("sglang-plain") / "server.log"
    srv = sglang.launch(cpu_spec(target.path), log, deadline_s=STARTUP_DEADLINE_S)
    print(f"SGLang plain server healthy after {srv.start_s:.1f} s")
    yield srv
    srv.stop()
    assert not process.group_members(srv.pgid)


def test_plain_serving_tokens_equal_the_local_engine(server, target):
    ref = engine_reference(target, None)
    for prompt, want in zip(ref.prompts, ref.plain, strict=True):
        ans = sglang.generate(server.url, prompt, MAX_NEW_TOKENS, temperature=0.0)
        assert ans["output_ids"] == want
        m = ans["meta_info"]
        assert m["completion_tokens"] == len(want)
        assert "spec_verify_ct" not in m or not m["spec_verify_ct"]
    got = sglang.read_metrics(server.url)
    assert got["sglang:generation_tokens_total"] == sum(len(t) for t in ref.plain)
    assert got.get("sglang:spec_verify_calls_total", 0.0) == 0.0
