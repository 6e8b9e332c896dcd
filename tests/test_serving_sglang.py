"""Real SGLang 0.5.23 on this CPU serving the embedded target with an exported EAGLE-3 draft
(one server start for the module): fp32 greedy tokens identical to the local engine's plain
and speculative decoding, per-request accept lengths equal to the engine's (chain 3/1/4),
SGLang's identities, /metrics, /server_info, /flush_cache; the spec → argv checked by
SGLang's own parser; drafts SGLang would serve wrong refused before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sglang_common import (
    CHAIN,
    MAX_NEW_TOKENS,
    STARTUP_DEADLINE_S,
    cpu_spec,
    engine_reference,
    export_repeat_draft,
    need_server_env,
)

from workbench import metrics
from workbench.serving import client, process, sglang


@pytest.fixture(scope="module")
def target():
    from workbench.target import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    return export_repeat_draft(target, tmp_path_factory.mktemp("sglang-draft") / "export")


@pytest.fixture(scope="module")
def started(target, draft_dir, tmp_path_factory):
    """The server, and the local engine's reference computed while it starts."""
    need_server_env()
    log = tmp_path_factory.mktemp("sglang-eagle") / "server.log"
    srv = sglang.launch(cpu_spec(target.path, draft_dir), log, wait=False)
    try:
        ref = engine_reference(target, draft_dir)
        process.wait_healthy(srv, STARTUP_DEADLINE_S)
        print(f"SGLang EAGLE-3 server healthy after {srv.start_s:.1f} s")
        yield srv, ref
    finally:
        srv.stop()
    assert not process.group_members(srv.pgid)


@pytest.fixture(scope="module")
def server(started):
    return started[0]


@pytest.fixture(scope="module")
def reference(started):
    return started[1]


@pytest.fixture(scope="module")
def answers(server, reference):
    return [
        sglang.generate(server.url, p, MAX_NEW_TOKENS, temperature=0.0) for p in reference.prompts
    ]


@pytest.mark.slow
def test_eagle3_tokens_equal_plain_and_speculative_local_engine(answers, reference):
    for ans, plain, spec in zip(answers, reference.plain, reference.spec, strict=True):
        assert spec == plain  # the engine itself is lossless
        assert ans["output_ids"] == plain


@pytest.mark.slow
def test_per_request_accept_lengths_equal_the_local_engine(answers, reference):
    taus = []
    for ans, want in zip(answers, reference.meta, strict=True):
        m = ans["meta_info"]
        assert metrics.sglang_identity_problems(m) == []
        assert m["completion_tokens"] == want["completion_tokens"]
        assert m["spec_verify_ct"] == want["spec_verify_ct"]
        assert m["spec_accept_length"] == pytest.approx(
            metrics.tau_sglang(want["completion_tokens"], want["spec_verify_ct"])
        )
        # SGLang's histogram stops at the longest accepted run; the engine's has num_steps + 1
        assert _trim(m["spec_correct_drafts_histogram"]) == _trim(
            want["spec_correct_drafts_histogram"]
        )
        taus.append(m["spec_accept_length"])
    assert max(taus) > 1.5 > min(taus)  # the comparison is not a trivial all-1.0 one
    print("per-prompt accept length (SGLang = local engine):", [round(t, 3) for t in taus])
    toks = sum(a["meta_info"]["completion_tokens"] for a in answers)
    secs = sum(a["meta_info"]["e2e_latency"] for a in answers)
    print(f"SGLang EAGLE-3 chain 3/1/4 on CPU: {toks / secs:.2f} tok/s (batch 1, e2e)")


def _trim(hist: list[int]) -> list[int]:
    out = list(hist)
    while out and out[-1] == 0:
        out.pop()
    return out


@pytest.mark.slow
def test_metrics_server_info_and_flush_cache(server, answers):
    m = client.get_metrics(server.url)
    verify = sum(a["meta_info"]["spec_verify_ct"] for a in answers)
    assert m["sglang:spec_verify_calls_total"] == verify
    # last-value gauges, set at SGLang's decode log points (every 40 batches): present only
    assert "sglang:spec_accept_length" in m and "sglang:spec_num_steps" in m
    info = client.get_server_info(server.url)
    assert info["speculative_algorithm"] == "EAGLE3"
    assert info["speculative_num_draft_tokens"] == CHAIN[2]
    client.flush_cache(server.url)
    assert process.is_healthy(server.url)


@pytest.mark.slow
def test_sglang_parser_accepts_a_tp8_command_and_names_its_rejections(tmp_path):
    need_server_env()
    tp8 = sglang.ServeSpec(
        target="/models/Llama-3.1-70B-Instruct",
        draft="/drafts/eagle3",
        speculative_num_steps=5,
        speculative_eagle_topk=4,
        speculative_num_draft_tokens=8,
        tp_size=8,
        dtype="bfloat16",
        mem_fraction_static=0.8,
        extra_args=["--cuda-graph-max-bs-decode", "32"],
        env={"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL128"},
    )
    sglang.check_rules(tp8)
    bad = sglang.sglang_args(tp8) + ["--cuda-graph-max-bs", "32"]
    ok, rejected = sglang.parse_argvs_with_sglang([sglang.sglang_args(tp8), bad])
    assert ok["ok"] and ok["version"] == sglang.SGLANG_VERSION
    args = ok["args"]
    assert (args["tp_size"], args["speculative_num_steps"], args["speculative_eagle_topk"]) == (
        8,
        5,
        4,
    )
    assert args["speculative_num_draft_tokens"] == 8 and args["mem_fraction_static"] == 0.8
    assert not rejected["ok"] and "--cuda-graph-max-bs" in rejected["error"]
    line = sglang.shell_line(tp8, python="python")
    assert line.startswith("NCCL_ALGO=Ring NCCL_PROTO=LL128 python -m sglang.launch_server ")
    # the same flag in a spec is refused by the rules, naming SGLang's rule
    with pytest.raises(sglang.ServeSpecError, match="cuda-graph-max-bs-decode"):
        sglang.check_rules(sglang.ServeSpec(target="/m", extra_args=["--cuda-graph-max-bs", "8"]))


@pytest.mark.parametrize(
    "kw, rule",
    [
        ({"speculative_num_steps": 3}, "all three"),
        (
            {
                "speculative_num_steps": 3,
                "speculative_eagle_topk": 1,
                "speculative_num_draft_tokens": 6,
            },
            "num_steps \\+ 1",
        ),  # fmt: skip
        (
            {
                "speculative_num_steps": 2,
                "speculative_eagle_topk": 2,
                "speculative_num_draft_tokens": 8,
            },
            "topk \\+ \\(num_steps - 1\\)",
        ),  # fmt: skip
        ({"tp_size": 0}, "tp_size"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
    ],
)
def test_rules_name_sglangs_rule(kw, rule):
    with pytest.raises(sglang.ServeSpecError, match=rule):
        sglang.check_rules(sglang.ServeSpec(target="/m", draft="/d", **kw))


def test_cpu_command_and_environment(tmp_path):
    spec = cpu_spec(tmp_path / "t", tmp_path / "d")
    cmd = sglang.command(spec, python="py")
    assert cmd[:3] == ["py", "-m", "sglang_cpu_launch"]
    for flag in ("--device", "--disable-cuda-graph", "--skip-server-warmup", "--enable-metrics"):
        assert flag in cmd
    assert cmd[cmd.index("--attention-backend") + 1] == "intel_amx"
    plain = sglang.command(cpu_spec(tmp_path / "t"), python="py")
    assert plain[plain.index("--attention-backend") + 1] == "torch_native"
    env = sglang.server_env(spec, base={"PYTHONPATH": "/x"})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"].split(":") == [str(sglang.CPU_SUPPORT), "/x"]
    assert env["OMP_NUM_THREADS"] == "1"  # the spec's own variables
    tp2 = sglang.server_env(sglang.ServeSpec(target="/m", device="cpu", tp_size=2), base={})
    assert len(tp2["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 2  # one core group per rank
    assert not Path(tp2["SGLANG_NCCL_SO_PATH"]).exists()  # no PyNccl on the cpu device
    gpu = sglang.server_env(sglang.ServeSpec(target="/m", tp_size=8), base={})
    assert "SGLANG_USE_CPU_ENGINE" not in gpu and "SGLANG_NCCL_SO_PATH" not in gpu


def _copy_draft(src, dst, edit_config=None, edit_weights=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    w = load_file(str(src / "model.safetensors"))
    if edit_config:
        edit_config(cfg)
    if edit_weights:
        edit_weights(w)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(dst / "model.safetensors"))
    return dst


@pytest.mark.slow
def test_a_draft_with_a_wrong_key_or_hidden_size_is_refused_before_launch(
    target, draft_dir, tmp_path
):
    """SGLang skips unknown weight names silently (a random weight served), so the launcher
    checks the draft first and names the problem; nothing is started."""
    need_server_env()
    wrong_key = _copy_draft(
        draft_dir, tmp_path / "wrong-key",
        edit_weights=lambda w: w.__setitem__("fc.weights", w.pop("fc.weight")),
    )  # fmt: skip
    with pytest.raises(sglang.ServeSpecError, match="fc.weight"):
        sglang.launch(cpu_spec(target.path, wrong_key), tmp_path / "k.log")
    assert not (tmp_path / "k.log").exists()

    def shrink(w):
        for k, v in list(w.items()):
            if k.startswith("midlayer.") and v.dim() == 1:
                w[k] = torch.ones(512)

    wrong_h = _copy_draft(draft_dir, tmp_path / "wrong-h", edit_weights=shrink)
    with pytest.raises(sglang.ServeSpecError, match="shape \\(512,\\)"):
        sglang.launch(cpu_spec(target.path, wrong_h), tmp_path / "h.log")
