"""The local server (embedded engine behind SGLang's API on loopback) and the load client.

Real HTTP on 127.0.0.1: greedy fp32 output through the server is token-identical to the engine
called directly and to plain decoding; SGLang's meta_info identities hold; /metrics and
/server_info agree with the per-request figures; bad settings, a port in use and bad requests
are clear errors; the client keeps and marks partial results when the server dies mid-load.

An oracle draft (tests/test_engine.py: the real draft, whose logits are then pointed at the
known greedy continuation, wrong on purpose at some positions) makes multi-token accepts and
rejections happen, so the histogram and accept-length figures are not all ones.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
import torch
from test_engine import OracleDraft, tiny_draft, tiny_target

from workbench import metrics
from workbench.engine import SpecDecoder, TraceWriter, read_trace, resolve_params
from workbench.errors import InUseError, WorkbenchError
from workbench.llama import Llama
from workbench.serving import client as lc
from workbench.serving.local import LocalConfig, LocalEngine, LocalServer, main, resolve_spec

pytestmark = pytest.mark.usefixtures("one_thread")
PARAMS = [(3, 1, 4), (3, 2, 5)]  # a chain and a tree


class Oracle(OracleDraft):
    ref: list[int] = []


@pytest.fixture(scope="module")
def model():
    return tiny_target()


@pytest.fixture(scope="module")
def llm(model):
    return Llama(model, torch.float32)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in (7, 19, 12)]


@pytest.fixture(scope="module")
def plain_out(llm, prompts):
    dec = SpecDecoder(llm, None)
    return [dec.generate(p, 40, [1]).tokens for p in prompts]


def _post(url: str, body: dict) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _body(ids: list[int], stream: bool = False, n: int = 40) -> dict:
    sp = {"max_new_tokens": n, "temperature": 0, "stop_token_ids": [1], "ignore_eos": True}
    return {"input_ids": ids, "sampling_params": sp, "stream": stream}


def _stream(url: str, body: dict) -> tuple[dict, int]:
    chunks = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunks.append(json.loads(line[5:]))
    return chunks[-1], len(chunks)


@pytest.mark.parametrize("s,k,n", PARAMS)
def test_greedy_through_server_matches_engine_and_plain(llm, model, prompts, plain_out, s, k, n):
    params = resolve_params(s, k, n)
    draft = tiny_draft(model, 256, cls=Oracle)
    eng = LocalEngine(llm, None, draft, params)
    direct = SpecDecoder(llm, draft, params)
    metas = []
    with LocalServer(eng).start() as srv:
        for p, ref in zip(prompts, plain_out, strict=True):
            draft.ref = p + ref
            got = _post(srv.url, _body(p))
            streamed, n_chunks = _stream(srv.url, _body(p, stream=True))
            want = direct.generate(p, 40, [1])
            assert got["output_ids"] == want.tokens == ref
            assert streamed["output_ids"] == ref
            meta = got["meta_info"]
            assert meta["spec_verify_ct"] == want.stats.verify_forwards
            assert n_chunks == meta["spec_verify_ct"] + 2  # prefill, each verify, the final
            metas += [meta, streamed["meta_info"]]
        m = lc.get_metrics(srv.url)
        info = lc.get_server_info(srv.url)
    for meta in metas:
        assert metrics.sglang_identity_problems(meta) == []
        assert meta["spec_accept_length"] == meta["completion_tokens"] / meta["spec_verify_ct"]
        assert sum(meta["spec_correct_drafts_histogram"]) == meta["spec_verify_ct"]
        assert meta["spec_num_proposed_drafts"] == s * meta["spec_verify_ct"]
        assert meta["finish_reason"]["type"] in ("stop", "length")
    assert max(m["spec_accept_length"] for m in metas) > 1.5  # the oracle gets accepts
    assert any(m["spec_correct_drafts_histogram"][0] for m in metas)  # and rejections
    vct = [meta["spec_verify_ct"] for meta in metas]
    assert m["sglang:spec_verify_calls_total"] == sum(vct)
    assert m["sglang:num_requests_total"] == len(metas)
    assert m["sglang:generation_tokens_total"] == sum(x["completion_tokens"] for x in metas)
    assert (
        m["sglang:spec_num_steps"] == s
        and m["sglang:spec_num_draft_tokens"] == params.num_draft_tokens
    )
    avg = info["internal_states"][0]["avg_spec_accept_length"]
    assert avg == pytest.approx(
        metrics.pooled_tau_sglang([x["completion_tokens"] for x in metas], vct)
    )
    assert info["speculative_num_steps"] == s


def test_plain_server_and_flush_cache(llm, model, prompts, plain_out):
    eng = LocalEngine(llm, None)
    with LocalServer(eng).start() as srv:
        got = _post(srv.url, _body(prompts[0]))
        assert got["output_ids"] == plain_out[0]
        assert "spec_verify_ct" not in got["meta_info"]
        assert httpx.get(srv.url + "/health").status_code == 200
        assert lc.get_server_info(srv.url)["speculative_algorithm"] is None
    spec = LocalEngine(llm, None, tiny_draft(model, 256), resolve_params(2, 1, 3))
    with LocalServer(spec).start() as srv:
        _post(srv.url, _body(prompts[1], n=10))
        assert lc.get_server_info(srv.url)["internal_states"][0]["avg_spec_accept_length"] > 0
        lc.flush_cache(srv.url)
        assert lc.get_server_info(srv.url)["internal_states"][0]["avg_spec_accept_length"] == 0
        assert lc.get_metrics(srv.url)["sglang:num_requests_total"] == 1  # counters keep counting


def test_trace_written_per_cycle(llm, model, prompts, tmp_path):
    path = tmp_path / "trace.jsonl"
    eng = LocalEngine(llm, None, tiny_draft(model, 256), resolve_params(3, 1, 4),
                      trace=TraceWriter(path))  # fmt: skip
    with LocalServer(eng).start() as srv:
        metas = [_post(srv.url, _body(p, n=12))["meta_info"] for p in prompts[:2]]
    recs = read_trace(path)
    assert len(recs) == sum(m["spec_verify_ct"] for m in metas)
    assert sorted({r.request_ids[0] for r in recs}) == sorted(m["id"] for m in metas)


def test_bad_requests_get_400_with_the_reason(llm, prompts):
    with LocalServer(LocalEngine(llm, None)).start() as srv:
        cases = [
            ({"text": "hi", "input_ids": [3]}, "exactly one of"),
            ({"input_ids": [3, 4], "sampling_params": {"top_p": 0.5}}, "top_p"),
            ({"input_ids": [3, 4], "sampling_params": {"beam_width": 2}}, "not supported"),
            ({"input_ids": [[3], [4]]}, "batch"),
            ({"text": "hi"}, "no tokenizer"),
        ]
        for body, why in cases:
            r = httpx.post(srv.url + "/generate", json=body)
            assert r.status_code == 400 and why in r.json()["message"], (body, r.text)
        assert httpx.get(srv.url + "/nope").status_code == 404
        assert _post(srv.url, _body(prompts[0], n=3))["meta_info"]["completion_tokens"] == 3


def test_bad_spec_settings_are_clear_errors(capsys):
    bad = [
        (LocalConfig(draft="d", num_steps=3), "set all three"),
        (
            LocalConfig(draft="d", num_steps=2, eagle_topk=2, num_draft_tokens=10),
            "num_draft_tokens - 1",
        ),
        (LocalConfig(draft="d", speculative_algorithm="MEDUSA"), "MEDUSA"),
        (LocalConfig(num_steps=3, eagle_topk=1, num_draft_tokens=4), "without a draft"),
    ]
    for cfg, why in bad:
        with pytest.raises(WorkbenchError, match=why):
            resolve_spec(cfg)
    t0 = time.perf_counter()
    code = main(["--speculative-draft-model-path", "d", "--speculative-num-steps", "3"])
    assert code == 2 and time.perf_counter() - t0 < 5  # refused before loading anything
    assert "set all three" in capsys.readouterr().err


def test_port_in_use_is_a_clear_error(llm):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(InUseError, match=f"port {port} .* in use"):
            LocalServer(LocalEngine(llm, None), port=port)


def test_client_summary_on_a_prompt_set(tiny_target, tmp_path):
    """The client against the server with a real tokenizer: prompts from a user JSONL file."""
    from workbench.draft.model import DraftConfig, Eagle3Draft, init_from_target
    from workbench.layers import LayerIds

    cfg = DraftConfig.from_target(tiny_target.model.config, LayerIds((1, 3, 5)), 512)
    torch.manual_seed(0)
    d = Eagle3Draft(cfg)
    d.set_vocab(torch.sort(torch.randperm(cfg.vocab_size)[:512]).values)
    d = init_from_target(d, tiny_target.model).eval()
    eng = LocalEngine(Llama(tiny_target.model, torch.float32), tiny_target.tokenizer, d,
                      resolve_params(2, 1, 3))  # fmt: skip
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."}]})
                            + "\n" for w in ("yes", "no", "maybe", "why")))  # fmt: skip
    reqs = lc.build_requests(str(data), 3, tiny_target.tokenizer)
    assert len(reqs) == 3 and all(r.input_ids for r in reqs)
    out = tmp_path / "load.json"
    with LocalServer(eng).start() as srv:
        run = lc.run_load(lc.LoadConfig(srv.url, max_new_tokens=12, concurrency=2), reqs, out)
    s = run.summary
    assert run.status == "complete" and s["n_ok"] == 3 and s["identities_ok"]
    ok = run.requests
    comp = [r.completion_tokens for r in ok]
    vct = [r.meta["spec_verify_ct"] for r in ok]
    assert s["pooled_tau_sglang"] == pytest.approx(sum(comp) / sum(vct))
    assert s["pooled_tau"] == pytest.approx((sum(comp) - len(comp)) / sum(vct))
    assert s["server_metrics_delta"]["sglang:spec_verify_calls_total"] == sum(vct)
    assert s["output_tokens"] == sum(comp) and s["ttft_s_p50"] > 0 and s["itl_s_p50"] > 0
    saved = json.loads(out.read_text())
    assert saved["status"] == "complete" and len(saved["requests"]) == 3
    assert saved["config"]["request_rate"] is None  # no limit, valid JSON


def test_paired_load_alternates_single_requests_between_servers(llm, model, prompts, tmp_path):
    """run_paired: request i goes to both servers, the order rotating with i; each server's
    time is its own requests' only; greedy speculative output equals plain, request by request."""
    d = tiny_draft(model, 96)
    spec = LocalEngine(llm, None, d, resolve_params(2, 1, 3))
    plain = LocalEngine(llm, None)
    reqs = [lc.LoadRequest(f"r{i}", input_ids=p) for i, p in enumerate(prompts * 2)]
    with LocalServer(spec).start() as a, LocalServer(plain).start() as b:
        cfgs = {n: lc.LoadConfig(s.url, max_new_tokens=16) for n, s in (("a", a), ("b", b))}
        t0 = time.perf_counter()
        runs = lc.run_paired(cfgs, reqs, {n: tmp_path / f"load-{n}.json" for n in cfgs})
        wall = time.perf_counter() - t0
        with pytest.raises(lc.LoadError, match="concurrency 1 and no rate"):
            lc.run_paired({"a": lc.LoadConfig(a.url, concurrency=2)}, reqs)
    ra, rb = runs["a"], runs["b"]
    assert ra.status == rb.status == "complete"
    assert ra.summary["speculative"] and not rb.summary["speculative"]
    assert [r.output_ids for r in ra.requests] == [r.output_ids for r in rb.requests]
    for i, (x, y) in enumerate(zip(ra.requests, rb.requests, strict=True)):
        assert (x.start_s < y.start_s) == (i % 2 == 0), i  # a first, then b first, ...
        later = max(x, y, key=lambda r: r.start_s)
        assert later.start_s >= min(x, y, key=lambda r: r.start_s).latency_s  # one at a time
    for r in (ra, rb):
        lat = sum(q.latency_s for q in r.requests)
        assert lat <= r.summary["duration_s"] < lat + 0.5 * len(reqs)
    assert ra.summary["duration_s"] + rb.summary["duration_s"] <= wall
    for n in cfgs:
        saved = json.loads((tmp_path / f"load-{n}.json").read_text())
        assert saved["status"] == "complete" and len(saved["requests"]) == len(reqs)


def test_paired_load_stops_for_all_when_one_server_dies(llm, prompts, tmp_path):
    """A server stopped mid-load: its results say it died, the other's say why they stopped,
    and both files keep what completed."""
    reqs = [lc.LoadRequest(f"r{i}", input_ids=p) for i, p in enumerate(prompts * 3)]
    a, b = LocalServer(LocalEngine(llm, None)).start(), LocalServer(LocalEngine(llm, None)).start()
    try:

        def stop_b_after_two() -> None:
            while lc.get_metrics(b.url).get("sglang:num_requests_total", 0) < 2:
                time.sleep(0.01)
            b.stop()

        killer = threading.Thread(target=stop_b_after_two, daemon=True)
        killer.start()
        cfgs = {
            "a": lc.LoadConfig(a.url, max_new_tokens=16),
            "b": lc.LoadConfig(b.url, max_new_tokens=16),
        }
        runs = lc.run_paired(cfgs, reqs, {n: tmp_path / f"load-{n}.json" for n in cfgs})
        killer.join(timeout=30)
    finally:
        a.stop()
        b.stop()
    ra, rb = runs["a"], runs["b"]
    assert rb.status == "partial" and "server died" in rb.reason
    assert ra.status == "partial" and "'b' died" in ra.reason
    assert 2 <= rb.summary["n_ok"] < len(reqs) and ra.summary["n_not_sent"] > 0
    for n, r in runs.items():
        saved = json.loads((tmp_path / f"load-{n}.json").read_text())
        assert (
            saved["status"] == "partial"
            and sum(q["ok"] for q in saved["requests"]) == (r.summary["n_ok"])
        )


def test_load_servers_pairs_single_request_loads_only(tiny_target_dir, tmp_path, monkeypatch):
    """session.load_servers: launched local servers are paired at concurrency 1 (sharing one
    loaded target), loaded one after another otherwise; both ways write load-<name>.json and
    tear the servers down."""
    import workbench.target
    from workbench.serving.session import Served, load_servers

    loads: list[str] = []
    real = workbench.target.load_target
    monkeypatch.setattr(workbench.target, "load_target", lambda p: loads.append(p) or real(p))

    cfg = LocalConfig(model_path=str(tiny_target_dir))
    servers = {"x": Served(cfg), "y": Served(cfg)}
    reqs = [lc.LoadRequest(f"r{i}", input_ids=[1, 50 + i, 60]) for i in range(3)]
    said: list[str] = []
    for conc, mode in ((1, "paired"), (2, "one after another")):
        out = tmp_path / str(conc)
        runs, got = load_servers("local", servers, dict(max_new_tokens=6, concurrency=conc), reqs,
                                 out, say=said.append)  # fmt: skip
        assert got == mode
        assert len(loads) == (1 if mode == "paired" else 2)  # paired: one target for both
        loads.clear()
        assert [r.output_ids for r in runs["x"].requests] == [
            r.output_ids for r in runs["y"].requests
        ]
        assert all(json.loads((out / f"load-{n}.json").read_text())["status"] == "complete"
                   for n in servers)  # fmt: skip
    assert len(said) == 4 and all("launched in" in x for x in said)
    urls = [x.split(": ")[1].split(" ")[0] for x in said]
    assert not any(lc.healthy(u, 1.0) for u in urls)  # torn down


def _group_gone(pgid: int, within_s: float) -> bool:
    """Whether process group `pgid` is gone (init reaps orphaned zombies a little later)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_client_keeps_and_marks_partial_results_when_the_server_dies(tiny_target_dir, tmp_path):
    """A real server process (workbench.serving.process) killed with SIGKILL mid-load."""
    from workbench.serving import process

    port = process.free_port()
    argv = LocalConfig(model_path=str(tiny_target_dir), draft="").argv(port=port)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    url = f"http://127.0.0.1:{port}"
    reqs = [lc.LoadRequest(f"r{i}", input_ids=[1, 100 + i, 200, 300]) for i in range(30)]
    with process.start(argv, tmp_path / "server.log", url, deadline_s=120, env=env) as server:

        def kill_after_two() -> None:
            # the counter moves as a request finishes, just before its last chunk is sent: at
            # 3 (200 tokens later), the first two have surely reached the client
            while lc.get_metrics(url).get("sglang:num_requests_total", 0) < 3:
                time.sleep(0.05)
            os.killpg(server.pgid, signal.SIGKILL)

        killer = threading.Thread(target=kill_after_two, daemon=True)
        killer.start()
        out = tmp_path / "load.json"
        cfg = lc.LoadConfig(url, max_new_tokens=200, ignore_eos=True, concurrency=2)
        run = lc.run_load(cfg, reqs, out)
        killer.join(timeout=30)
    s = run.summary
    assert run.status == "partial" and "server died" in run.reason
    assert s["n_ok"] >= 2 and s["n_failed"] >= 1 and s["n_ok"] + s["n_failed"] < 30
    assert s["n_not_sent"] == 30 - s["n_ok"] - s["n_failed"]
    assert all(r.completion_tokens == 200 for r in run.requests if r.ok)
    saved = json.loads(out.read_text())
    assert saved["status"] == "partial" and sum(r["ok"] for r in saved["requests"]) == s["n_ok"]
    assert _group_gone(server.pgid, within_s=10)


def test_cli_load_and_serve_errors(tiny_target, tiny_target_dir, tmp_path):
    from typer.testing import CliRunner

    from workbench.cli import app

    eng = LocalEngine(Llama(tiny_target.model, torch.float32), tiny_target.tokenizer)
    out = tmp_path / "cli-load.json"
    with LocalServer(eng).start() as srv:
        r = CliRunner().invoke(app, ["load", "--url", srv.url, "--prompts", "humaneval", "--n",
                                     "2", "--target", str(tiny_target_dir), "--max-new-tokens",
                                     "4", "--out", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "2/2 requests ok" in r.output
    saved = json.loads(out.read_text())
    assert saved["status"] == "complete" and all(
        q["completion_tokens"] <= 4 for q in saved["requests"]
    )
    r = CliRunner().invoke(app, ["serve", "--draft", "d", "--num-steps", "3"])
    assert r.exit_code == 2 and "set all three" in r.output
    r = CliRunner().invoke(app, ["serve", "--tp-size", "2"])
    assert r.exit_code == 2 and "--tp-size 1" in r.output


def test_a_draft_that_does_not_fit_the_target_is_refused(
    tiny_target, tiny_target_dir, model, tmp_path
):
    """Another target's fingerprint, or another hidden size / vocab: a clear error, no server."""
    from workbench.draft.export import export_sglang
    from workbench.draft.model import DraftConfig, Eagle3Draft, init_from_target
    from workbench.layers import LayerIds
    from workbench.serving.local import load_engine

    cfg = DraftConfig.from_target(tiny_target.model.config, LayerIds((1, 3, 5)), 512)
    d = Eagle3Draft(cfg)
    d.set_vocab(torch.sort(torch.randperm(cfg.vocab_size)[:512]).values)
    d = init_from_target(d, tiny_target.model).eval()
    other = export_sglang(d, tmp_path / "other", {"target_fingerprint": "0123456789abcdef"})
    with pytest.raises(WorkbenchError, match="fingerprint 0123456789abcdef"):
        load_engine(LocalConfig(str(tiny_target_dir), str(other), num_steps=2, eagle_topk=1,
                                num_draft_tokens=3))  # fmt: skip
    wrong = export_sglang(tiny_draft(model, 128), tmp_path / "wrong")  # hidden 64, vocab 256
    with pytest.raises(WorkbenchError, match="does not fit.*vocab mismatch"):
        load_engine(LocalConfig(str(tiny_target_dir), str(wrong)))


def test_summary_pools_sglang_trimmed_histograms():
    """SGLang trims a request's histogram after its last nonzero bin ([15] when nothing was
    accepted); pooling pads them, so per-position acceptance covers every draft step."""
    metas = [
        {"completion_tokens": 16, "spec_verify_ct": 15, "spec_accept_length": 16 / 15,
         "spec_num_correct_drafts": 0, "spec_correct_drafts_histogram": [15]},
        {"completion_tokens": 13, "spec_verify_ct": 6, "spec_accept_length": 13 / 6,
         "spec_num_correct_drafts": 6, "spec_correct_drafts_histogram": [2, 3, 0, 1]},
    ]  # fmt: skip
    res = [lc.RequestResult(f"r{i}", ok=True, sent=True, completion_tokens=m["completion_tokens"],
                            meta=m) for i, m in enumerate(metas)]  # fmt: skip
    s = lc.summarize(res, 2.0, num_steps=3)
    assert s["spec_correct_drafts_histogram"] == [17, 3, 0, 1]
    assert s["acceptance_from_histogram"] == pytest.approx([4 / 21, 1 / 4, 1.0])
    assert s["pooled_tau_sglang"] == pytest.approx(29 / 21)
    assert s["pooled_tau"] == pytest.approx((29 - 2) / 21)  # decode tokens: the prefill's left out
    assert s["output_tok_s"] == pytest.approx(29 / 2.0) and s["identities_ok"]


def test_client_request_rate_and_concurrency_bound(llm, prompts):
    """Poisson arrivals at the configured rate (seeded), never more in flight than allowed."""
    import random

    eng = LocalEngine(llm, None)
    reqs = [lc.LoadRequest(f"r{i}", input_ids=p) for i, p in enumerate(prompts * 2)]
    with LocalServer(eng).start() as srv:
        cfg = lc.LoadConfig(srv.url, max_new_tokens=6, concurrency=2, request_rate=20.0, seed=7)
        run = lc.run_load(cfg, reqs)
    rng = random.Random(7)
    due = [0.0]
    for _ in reqs[1:]:
        due.append(due[-1] + rng.expovariate(20.0))
    starts = [r.start_s for r in run.requests]
    assert all(s >= d for s, d in zip(starts, due, strict=True)), (starts, due)
    spans = [(r.start_s, r.start_s + r.latency_s) for r in run.requests]
    assert max(sum(a <= t < b for a, b in spans) for t, _ in spans) <= 2
    assert run.status == "complete" and eng.stats.requests == len(reqs)
