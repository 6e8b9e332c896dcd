"""Real SGLang 0.5.23 on this CPU serving the embedded target with an exported EAGLE-3 draft
and the workbench_trace plugin on (one server start for the module): fp32 greedy tokens
identical to the local engine's plain and speculative decoding, per-request accept lengths
equal to the engine's (chain 3/1/4), SGLang's identities, /metrics, /server_info,
/flush_cache; the plugin's trace: one line per decode cycle, as many as SGLang's
`spec_verify_calls_total`, per-request accepted counts that add up to each request's
meta_info, the local engine's schema (one reader), and the live wiring check passing the
correct export. Without a server: the spec → argv checked by SGLang's own parser; drafts
SGLang would serve wrong refused before launch."""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sglang_common import (
    CHAIN,
    GENERIC,
    MAX_NEW_TOKENS,
    STARTUP_DEADLINE_S,
    TRACE_NEW_TOKENS,
    cpu_spec,
    engine_reference,
    export_repeat_draft,
    need_server_env,
    norm_manifest,
)

from workbench import metrics
from workbench.engine.trace import CycleRecord, read_trace
from workbench.serving import client, plugin, process, sglang
from workbench.serving.wiring_live import live_wiring_check, served_layer_ids


@pytest.fixture(scope="module")
def target():
    from workbench.target import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    return export_repeat_draft(target, tmp_path_factory.mktemp("sglang-draft") / "export")


@pytest.fixture(scope="module")
def started(target, draft_dir, tmp_path_factory):
    """The server with the trace plugin on (per-aux-layer norms), and what is computed while it
    starts: the local engine's reference and the norm manifest of the draft's layers."""
    need_server_env()
    d = tmp_path_factory.mktemp("sglang-eagle")
    spec = cpu_spec(target.path, draft_dir)
    spec.trace_dir, spec.trace_hidden = str(d / "trace"), True
    srv = sglang.launch(spec, d / "server.log", wait=False)
    try:
        ref = engine_reference(target, draft_dir)
        manifest = norm_manifest(target, draft_dir, d / "cap")
        process.wait_healthy(srv, STARTUP_DEADLINE_S)
        print(f"SGLang EAGLE-3 server with the trace plugin healthy after {srv.start_s:.1f} s")
        yield srv, ref, spec, manifest, d / "cap"
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


@pytest.fixture(scope="module")
def traced(started, answers, target):
    """After `answers` (the repetitive prompts): generic prompts one at a time, then two at once
    (batch 2), with the metrics and the trace's length read between the two phases."""
    srv, _, spec, manifest, _ = started
    tok = target.tokenizer
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in GENERIC]
    t0 = time.perf_counter()
    seq = [sglang.generate(srv.url, p, TRACE_NEW_TOKENS) for p in ids]
    secs = time.perf_counter() - t0
    m_seq = client.get_metrics(srv.url)
    n_seq = len(plugin.read_trace_dir(spec.trace_dir))
    with ThreadPoolExecutor(2) as ex:
        par = list(ex.map(lambda p: sglang.generate(srv.url, p, TRACE_NEW_TOKENS), ids[:2]))
    m_all = client.get_metrics(srv.url)
    toks = sum(a["meta_info"]["completion_tokens"] for a in seq)
    print(f"RESULT sglang_trace_plugin_on tok_per_s={toks / secs:.2f} (sequential, CPU)")
    recs = plugin.read_trace_dir(spec.trace_dir)  # read once: every request has been answered
    return dict(spec=spec, manifest=manifest, recs=recs, seq=answers + seq, par=par,
                m_seq=m_seq, n_seq=n_seq, m_all=m_all)  # fmt: skip


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


def _verify_calls(answers: list[dict]) -> int:
    return sum(a["meta_info"]["spec_verify_ct"] for a in answers)


def _by_request(recs: list[CycleRecord]) -> dict[str, list[tuple[int, int]]]:
    out = defaultdict(list)  # rid -> [(emitted, verified)] per cycle
    for r in recs:
        verified = r.extra.get("verified", r.accepted)
        for rid, a, v in zip(r.request_ids, r.accepted, verified, strict=True):
            out[rid].append((a, v))
    return out


@pytest.mark.slow
def test_one_trace_line_per_verify_call(traced):
    seq_verify = _verify_calls(traced["seq"])
    assert traced["n_seq"] == traced["m_seq"]["sglang:spec_verify_calls_total"] == seq_verify
    recs = traced["recs"]
    rows = sum(r.batch_size for r in recs)
    assert rows == traced["m_all"]["sglang:spec_verify_calls_total"]
    assert max(r.batch_size for r in recs) == 2  # the concurrent pair shared cycles
    assert [r.cycle for r in recs] == list(range(len(recs)))


@pytest.mark.slow
def test_per_request_accepted_counts_agree_with_meta_info(traced):
    per = _by_request(traced["recs"])
    answers = traced["seq"] + traced["par"]
    assert len(per) == len(answers)
    for ans in answers:
        m = ans["meta_info"]
        cyc = per[m["id"]]
        assert len(cyc) == m["spec_verify_ct"]
        assert 1 + sum(a for a, _ in cyc) == m["completion_tokens"] == len(ans["output_ids"])
        hist = [0] * (CHAIN[0] + 1)
        for _, v in cyc:
            hist[v - 1] += 1  # accepted counts the bonus; the histogram counts correct drafts
        want = m["spec_correct_drafts_histogram"]  # SGLang drops trailing zeros
        assert hist[: len(want)] == want and not any(hist[len(want) :])
    taus = [a["meta_info"]["spec_accept_length"] for a in answers]
    assert max(taus) > 1.5 > min(taus)  # varied acceptance, not an all-1.0 comparison


@pytest.mark.slow
def test_trace_is_the_engine_schema_read_by_read_trace(traced, target):
    files = plugin.trace_files(traced["spec"].trace_dir)
    assert [f.name for f in files] == ["trace-rank0.jsonl"]
    recs = read_trace(files[0])
    H = target.model.config.hidden_size
    assert len({r.run_id for r in recs}) == 1 and {r.rank for r in recs} == {0}
    for r in recs:
        assert (r.num_steps, r.topk, r.num_draft_tokens) == CHAIN
        assert len(r.accepted) == len(r.request_ids) == r.batch_size
        assert all(1 <= a <= CHAIN[2] for a in r.accepted)
        assert r.hidden_in_dims == [3 * H, H, H]
        assert len(r.aux_norms) == 3 and all(x > 0 for x in r.aux_norms)
        assert min(r.draft_ms, r.verify_ms, r.extend_ms) > 0
        assert r.total_ms >= r.draft_ms + r.verify_ms + r.extend_ms
        assert r.extra["clock"] == "wall"
    share = sum(r.verify_ms for r in recs) / sum(r.total_ms for r in recs)
    print(f"verify share of the cycle on CPU: {share:.2f}")


@pytest.mark.slow
def test_live_wiring_check_passes_the_correct_export(traced, draft_dir):
    recs = traced["recs"]
    res = live_wiring_check(recs, traced["manifest"], served_layer_ids(draft_dir))
    for row in res.rows:
        print(row)
    print(res.result_line())
    assert res.ok, res.problems
    assert all(
        r.looks_like is not None and abs(r.looks_like - r.captured_layer) < 1 for r in res.rows
    )


@pytest.mark.slow
def test_metrics_server_info_and_flush_cache(server, traced):
    m = client.get_metrics(server.url)
    assert m["sglang:spec_verify_calls_total"] == _verify_calls(traced["seq"] + traced["par"])
    # last-value gauges, set at SGLang's decode log points (every 40 batches): present only
    assert "sglang:spec_accept_length" in m and "sglang:spec_num_steps" in m
    info = client.get_server_info(server.url)
    assert info["speculative_algorithm"] == "EAGLE3"
    assert info["speculative_num_draft_tokens"] == CHAIN[2]
    client.flush_cache(server.url)
    assert process.is_healthy(server.url)


@pytest.mark.slow
def test_notebook_04_attached_reads_its_own_cycles_from_the_servers_trace(
    started, traced, target, draft_dir, tmp_path, monkeypatch
):
    """Notebook 04 attached by URL to this server (one you already run), with its trace folder:
    the anatomy and the live wiring check come from this load's cycles only. It runs after the
    tests that count every request this server served (`traced`, the /metrics test above)."""
    import papermill as pm
    from test_notebook_serve import NB, check_anatomy

    srv, _, spec, _, cap = started
    before = len(traced["recs"])
    for k, v in {"WORKBENCH_RUN_DIR": str(tmp_path), "WORKBENCH_NOTEBOOK": "04",
                 "OMP_NUM_THREADS": "1"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    pm.execute_notebook(
        str(NB), str(tmp_path / "04.ipynb"), kernel_name="python3", progress_bar=False,
        cwd=str(tmp_path),
        parameters={"backend": "sglang", "url": srv.url, "trace_dir": spec.trace_dir,
                    "target": str(target.path), "draft": str(draft_dir), "n_prompts": 3,
                    "max_new_tokens": 16, "concurrency": 2, "spec_config": "3/1/4",
                    "capture_dir": str(cap)},
    )  # fmt: skip
    rec = json.loads((tmp_path / "figures.json").read_text())["04"]
    print({k: v for k, v in rec.items() if k.startswith("serve_")})
    assert rec["serve_status"] == "complete" and rec["serve_identities_ok"] is True
    assert rec["serve_tok_s_plain"] is None  # attached without plain_url: no plain server
    cycles = check_anatomy(tmp_path, rec, Path(spec.trace_dir))
    assert len(plugin.read_trace_dir(spec.trace_dir)) == before + len(cycles)  # others left out
    H = target.hidden_size
    assert all(c["hidden_in_dims"] == [3 * H, H, H] for c in cycles)
    assert rec["serve_live_wiring_ok"] is True


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


def test_a_launch_from_a_notebook_serves_the_spec_these_tests_start(tmp_path):
    """`session.open_server` (notebook 04 and the sweeps launching SGLang) builds its spec from
    a LocalConfig: the spec this module's server runs, but for the test's one-thread setting."""
    from workbench.serving.local import LocalConfig
    from workbench.serving.session import sglang_spec

    t, d = tmp_path / "t", tmp_path / "d"
    cfg = LocalConfig(model_path=str(t), draft=str(d), num_steps=CHAIN[0], eagle_topk=CHAIN[1],
                      num_draft_tokens=CHAIN[2], dtype="float32")  # fmt: skip
    assert sglang_spec(cfg, device="cpu") == dataclasses.replace(cpu_spec(t, d), env={})
    plain = sglang_spec(LocalConfig(model_path=str(t), dtype="float32"), device="cpu")
    want = dataclasses.replace(cpu_spec(t), env={})  # its algorithm unset: no draft to run
    assert sglang.command(plain, python="py") == sglang.command(want, python="py")


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
