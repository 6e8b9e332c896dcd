"""Offline inspection: metric definitions, the layer-wiring audit where the answer is known, the
norm check, the config audit and `workbench audit`.

The known answer: a tiny target (8 layers, weights large enough that layers differ) answers
training prompts greedily; its aux states at (1, 3, 5) are captured and a draft is trained on
them to τ ≈ 2 (teacher-forced on the target's own outputs, so it is learnable). Served with
(1, 3, 5) it must beat every shifted wiring; the same weights labelled (2, 4, 6) (an off-by-one
written into the config) must be flagged, by τ and by the norm check.
"""

from __future__ import annotations

import copy
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from workbench.audit import config_audit, parse_serving, wiring_audit, wirings
from workbench.data import spread
from workbench.engine import CycleRecord, SpecParams
from workbench.findings import ERROR, WARNING, Finding, has_errors
from workbench.inspect import (
    EvalResult,
    RequestResult,
    calibration_prompts,
    cycle_anatomy,
    evaluate_draft,
    load_prompts,
    missed_tokens,
    time_breakdown,
    token_html,
)
from workbench.layers import LayerConventionError, LayerIds
from workbench.metrics import per_position_acceptance, simulated_tau
from workbench.norms import norm_check, read_manifest, stored_norm_check

IDS = (1, 3, 5)
PARAMS = SpecParams(3, 1, 4)


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- metric definitions


def _req(accepted, steps=3, cat="a", rid="r"):
    n = 1 + sum(accepted)
    return RequestResult(rid, cat, [5, 6], list(range(10, 10 + n)), accepted, steps)


def test_spread_takes_evenly_spaced_items_in_order():
    assert spread(list(range(10)), 2) == [2, 7]
    assert spread(list(range(10)), 5) == [1, 3, 5, 7, 9]
    assert spread([1, 2], 5) == [1, 2] and spread([], 3) == [] and spread([1], 0) == []


def test_calibration_prompts_span_mtbench_categories_and_avoid_the_reported_ones():
    """MT-bench is 8 categories of 10: the set's last prompts are all humanities essays, where a
    draft accepts least, so a choice made there is a choice for one category."""
    pool = load_prompts("mtbench", 0)
    inspected = pool[:16]
    calib = calibration_prompts(pool, 4, [p.id for p in inspected[:4]], [p.id for p in inspected])
    assert len(calib) == 4 and len({p.category for p in calib}) == 4
    assert not {p.id for p in calib} & {p.id for p in inspected}
    # every prompt inspected (n_prompts 0): only the reporting prompts are kept out
    calib = calibration_prompts(pool, 4, [p.id for p in pool[:4]], [p.id for p in pool])
    assert len(calib) == 4 and not {p.id for p in calib} & {p.id for p in pool[:4]}
    assert calibration_prompts(pool[:4], 2, [p.id for p in pool[:4]]) == []


def test_sources_and_per_position_acceptance():
    r = _req([1, 4, 2, 3, 1])  # last cycle censored (left out of a_i)
    assert r.sources()[:8] == ["prefill", "correction", "draft", "draft", "draft", "bonus", "draft",
                               "correction"]  # fmt: skip
    assert r.tau == pytest.approx(11 / 5)
    # drafts accepted per (uncensored) cycle m = 0, 3, 1, 2: pos0 reached 4 acc 3; pos1 reached 3 acc 2;
    # pos2 reached 2 acc 1
    a = per_position_acceptance([r.accepted], 3)
    assert a == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert simulated_tau(a) == pytest.approx(1 + 0.75 + 0.5 + 0.25)
    assert simulated_tau([]) == 1.0


def test_pooled_tau_is_not_the_mean_of_per_request_tau():
    res = EvalResult(PARAMS, LayerIds(IDS), [_req([4] * 10, rid="long"), _req([1], rid="short")])
    assert res.tau == pytest.approx(41 / 11)  # pooled
    assert res.mean_request_tau == pytest.approx((4 + 1) / 2)
    assert res.tau_sglang == pytest.approx((41 + 2) / 11)  # prefill token counted, as SGLang does
    assert [r["category"] for r in res.by_category()] == ["a"]


def test_time_breakdown_splits_cycle_time():
    recs = [CycleRecord("r", 0, i, ["0"], 1, 3, 1, 4, [2], 2.0, 6.0, 1.0, 10.0) for i in range(3)]
    tb = time_breakdown(recs)
    assert tb["cycles"] == 3 and tb["verify_ms"] == 6.0 and tb["other_ms"] == pytest.approx(1.0)
    assert sum(tb["share"].values()) == pytest.approx(1.0)


def test_time_breakdown_shows_parts_that_outgrow_the_cycle():
    # draft 8 + verify 6 + extend 1 > total 10: an inconsistent trace shows as negative 'other'
    recs = [CycleRecord("r", 0, 0, ["0"], 1, 3, 1, 4, [2], 8.0, 6.0, 1.0, 10.0)]
    tb = time_breakdown(recs)
    assert tb["other_ms"] == pytest.approx(-5.0) and tb["share"]["other"] == pytest.approx(-0.5)


def test_cycle_anatomy_orders_requests_and_counts_hidden_dims():
    # a batched trace (SGLang's plugin): requests join and leave, cycles written out of order
    recs = [
        CycleRecord("r", 0, 1, ["a", "b"], 2, 3, 1, 4, [4, 1], 1.0, 20.0, 0.5, 22.0, [192, 64, 64]),
        CycleRecord("r", 0, 0, ["a"], 1, 3, 1, 4, [2], 1.0, 19.0, 0.5, 21.0, [192, 64, 64]),
        CycleRecord("r", 0, 2, ["b"], 1, 3, 1, 4, [3], 1.0, 18.0, 0.5, 20.0, [64, 64, 64]),
    ]
    an = cycle_anatomy(recs)
    assert an["accepted"] == {"a": [(0, 2), (1, 4)], "b": [(1, 1), (2, 3)]}
    assert an["hidden_in_dims"] == [{"dims": [192, 64, 64], "cycles": 2},
                                    {"dims": [64, 64, 64], "cycles": 1}]  # fmt: skip
    assert an["time"]["cycles"] == 3 and an["time"]["share"]["verify"] == pytest.approx(57 / 63)
    mine = cycle_anatomy(recs, request_ids={"b"})  # a load's own requests: "a" shared batches
    assert mine["accepted"] == {"b": [(1, 1), (2, 3)]} and mine["time"] == an["time"]
    bad = CycleRecord("r", 0, 3, ["a", "b"], 2, 3, 1, 4, [1], 1.0, 1.0, 1.0, 3.0)
    with pytest.raises(ValueError):  # a record whose counts do not match its requests
        cycle_anatomy([bad])


def test_wirings_skip_out_of_range_and_duplicates():
    w = wirings(LayerIds((0, 3, 7)), 8)
    assert w["configured"].ids == (0, 3, 7)
    assert "shift +1" not in w  # 8 is out of range for 8 layers
    assert w["shift -1"].ids == (-1, 2, 6) and "embedding first" in w  # (-1, 3, 7) differs


def test_parse_serving_argv():
    s = parse_serving("python -m sglang.launch_server --model-path T --speculative-algorithm EAGLE3 "
                      "--speculative-draft-model-path D --speculative-num-steps 3 "
                      "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --tp-size 8 "
                      "--context-length 4096")  # fmt: skip
    assert (s["algorithm"], s["draft_path"], s["num_steps"], s["context_length"]) == (
        "EAGLE3",
        "D",
        3,
        4096,
    )


def test_plots_take_data_not_modules():
    import ast
    import inspect as pyinspect

    from workbench import plots

    tree = ast.parse(pyinspect.getsource(plots))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("workbench")], imported
    summary = {"tokens": 40, "assistant_share": 0.25, "dtype": "bfloat16", "disk_bytes": 4e6,
               "bytes_per_token": 100.0, "bytes_per_token_parts": {"aux_hidden": 96, "input_ids": 8}}  # fmt: skip
    assert "25% assistant" in plots.length_histogram([10, 30], summary).layout.title.text
    assert "4.0 MB" in plots.bytes_per_token(summary).layout.title.text


# ---------------------------------------------------------------- a draft trained to a known answer


@pytest.fixture(scope="module")
def trained(tmp_path_factory, embedded_tokenizer_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    from workbench.capture import CaptureConfig, capture
    from workbench.data import load_train_prompts, prompt_ids
    from workbench.draft.load import load_draft
    from workbench.draft.train import TrainConfig, train
    from workbench.generate import generate_batch
    from workbench.llama import Llama
    from workbench.target import load_target

    root = tmp_path_factory.mktemp("inspect")
    tdir = root / "target"
    # initializer_range 0.1: layers change the residual stream enough that neighbours differ, and
    # greedy answers switch between tokens depending on context (0.02 repeats one token forever)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048,
                      tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                      initializer_range=0.1)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tdir, safe_serialization=True)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
    ):
        if (embedded_tokenizer_dir / name).is_file():
            shutil.copy(embedded_tokenizer_dir / name, tdir / name)
    tgt = load_target(tdir)
    llm = Llama(tgt.model, torch.float32)
    prompts = load_train_prompts()[:12]
    msgs = [p.messages(1) for p in prompts]
    ids = [prompt_ids(tgt.tokenizer, m) for m in msgs]
    answers = generate_batch(llm, ids, 40, None, dtype=torch.float32, progress=False)
    convs = [
        m + [{"role": "assistant", "content": tgt.tokenizer.decode(a)}]
        for m, a in zip(msgs, answers, strict=True)
    ]
    cap = root / "cap"
    capture(
        tgt,
        convs,
        cap,
        CaptureConfig(LayerIds(IDS), dtype="float32", max_length=160),
        progress=False,
    )
    run = root / "run"
    train(TrainConfig(capture=str(cap), out=str(run), draft_vocab_size=96, ttt_len=3, lr=3e-3,
                      batch_size=4, max_steps=600, eval_every=600, ckpt_every=600, val_fraction=0.0,
                      warmup=0.05, progress=False, threads=1), target=tgt)  # fmt: skip
    draft = load_draft(run, tgt.model).draft.eval()
    return SimpleNamespace(
        tgt=tgt, llm=llm, prompts=prompts, ids=ids, cap=cap, run=run, draft=draft, root=root
    )


def test_evaluate_draft_metrics(trained):
    res = evaluate_draft(
        trained.tgt, trained.draft, trained.prompts[:4], PARAMS, 32, llm=trained.llm
    )
    assert res.layer_ids == LayerIds(IDS) and len(res.requests) == 4
    assert res.summary()["layer_ids"] == {"ids": list(IDS), "convention": "output_of_layer"}
    assert res.tau > 1.3 and res.tau_sglang > res.tau
    assert len(res.cycles) == sum(r.verify_forwards for r in res.requests)
    assert all(r.category == trained.prompts[i].category for i, r in enumerate(res.requests))
    a = res.accept_pos
    assert len(a) == 3 and all(0 <= x <= 1 for x in a)
    tb = res.time_breakdown()
    assert tb["cycles"] == len(res.cycles) and tb["verify_ms"] > 0
    page = token_html(res, trained.tgt.tokenizer, n=2)
    assert page.count("<b>") == 2 and "background:#b7e4c7" in page  # some accepted draft tokens
    rows = missed_tokens(res, trained.tgt.tokenizer)
    assert rows and rows[0]["missed"] >= rows[-1]["missed"]


def test_wiring_audit_configured_wins_on_a_trained_draft(trained):
    audit = wiring_audit(trained.tgt, trained.draft, trained.prompts, PARAMS, 40, capture=trained.cap,
                         llm=trained.llm)  # fmt: skip
    taus = {r.name: round(r.tau, 3) for r in audit.rows}
    assert audit.rows[0].name == "configured" and audit.rows[0].tau > 1.5, taus
    assert audit.verdict == "configured wins" and audit.best == "configured", taus
    assert all(r.lo <= r.tau <= r.hi for r in audit.rows)
    assert not has_errors(audit.findings), [str(f) for f in audit.findings]
    assert [n.live_id for n in audit.norms] == list(IDS) and not any(n.flag for n in audit.norms)
    assert audit.rows[0].layer_ids == LayerIds(IDS)
    assert audit.table()[0]["layer_ids"] == "[1, 3, 5] (output_of_layer)"


def test_wiring_audit_flags_an_off_by_one_in_the_served_config(trained):
    shifted = copy.deepcopy(trained.draft)
    shifted.config.layer_ids = LayerIds((2, 4, 6))  # config written one layer off the capture
    audit = wiring_audit(trained.tgt, shifted, trained.prompts, PARAMS, 40, capture=trained.cap,
                         llm=trained.llm)  # fmt: skip
    taus = {r.name: round(r.tau, 3) for r in audit.rows}
    assert audit.verdict == "shifted wiring wins" and audit.best == "shift -1", taus
    assert has_errors(audit.findings)
    assert any("off-by-one" in f.why for f in audit.findings)
    assert any(n.flag for n in audit.norms), audit.norms  # live norms disagree with the capture
    assert any("hidden-state norms" in f.what and f.severity == ERROR for f in audit.findings)


def test_reconcile_downgrades_a_tau_verdict_the_teacher_forced_audit_contradicts(trained):
    """A τ audit naming a shifted wiring is an error on its own and next to a teacher-forced
    `shifted_wins`, but a warning naming both audits next to a decisive `configured_wins`."""
    from workbench.audit import reconcile

    shifted = copy.deepcopy(trained.draft)
    shifted.config.layer_ids = LayerIds((2, 4, 6))
    audit = wiring_audit(trained.tgt, shifted, trained.prompts, PARAMS, 40, llm=trained.llm)
    assert audit.verdict == "shifted wiring wins" and has_errors(audit.findings)
    tf = SimpleNamespace(verdict="shifted_wins", positions=900, sequences=30)
    assert reconcile(audit, tf) == audit.findings
    tf.verdict = "configured_wins"
    got = reconcile(audit, tf)
    assert not has_errors(got) and len(got) == len(audit.findings)
    assert any("teacher-forced audit disagrees" in f.why and "900 positions" in f.why for f in got)
    assert has_errors(audit.findings)  # the audit itself is left as it was


def test_norm_check_flags_shifted_ids_at_any_draft_quality(trained):
    man = read_manifest(trained.cap)
    seqs = [p + [0] for p in trained.ids[:4]]
    rows, finds = norm_check(trained.llm, seqs, man, LayerIds(IDS))
    assert len(rows) == 3 and not finds, [str(f) for f in finds]
    for served in ((2, 4, 6), (0, 2, 4)):
        rows, finds = norm_check(trained.llm, seqs, man, LayerIds(served))
        assert has_errors(finds), (served, rows)
        assert sum(bool(r.flag) for r in rows) >= 2, rows
        assert all(r.nearest_id == r.capture_id for r in rows if r.flag), rows
    with pytest.raises(LayerConventionError, match="output_of_layer"):
        norm_check(trained.llm, seqs, man, list(IDS))  # bare ids: which convention?


def test_stored_norm_check_names_the_captured_layer_exactly(trained):
    """On the capture's own tokens the served layer reproduces the stored states to rounding,
    and a shifted config names the layer the capture really holds, slot by slot."""
    from workbench.capture import CaptureReader

    reader = CaptureReader(trained.cap)
    rows, finds = stored_norm_check(trained.llm, reader, LayerIds(IDS), n_samples=4)
    assert len(rows) == 3 and not finds, [str(f) for f in finds]
    assert all(abs(r.ratio - 1) < 1e-3 and r.nearest_id == r.live_id for r in rows), rows
    for served in ((2, 4, 6), (0, 2, 4)):
        rows, finds = stored_norm_check(trained.llm, reader, LayerIds(served), n_samples=4)
        assert sum(f.severity == ERROR for f in finds) == 3, (served, rows)
        assert [r.nearest_id for r in rows] == list(IDS) and all(r.flag for r in rows), rows
    with pytest.raises(LayerConventionError, match="LayerIds"):
        stored_norm_check(trained.llm, reader, list(IDS))


# ---------------------------------------------------------------- config audit + CLI


@pytest.fixture(scope="module")
def exported(trained):
    from workbench.draft.export import export_sglang, reexport_provenance
    from workbench.draft.load import load_draft

    run = load_draft(trained.run)
    return export_sglang(run.draft, trained.root / "export", reexport_provenance(run),
                         target_max_position_embeddings=2048)  # fmt: skip


def _argv(draft, alg="EAGLE3", steps=("3", "1", "4"), extra=()):
    return ["python", "-m", "sglang.launch_server", "--model-path", "T", "--speculative-algorithm", alg,
            "--speculative-draft-model-path", str(draft), "--speculative-num-steps", steps[0],
            "--speculative-eagle-topk", steps[1], "--speculative-num-draft-tokens", steps[2], *extra]  # fmt: skip


def test_config_audit_agreeing_setup_has_no_errors(trained, exported):
    f = config_audit(exported, trained.cap, _argv(exported), target=trained.tgt)
    assert not has_errors(f), [str(x) for x in f]


def test_config_audit_lists_every_disagreement(trained, exported):
    man = json.loads(json.dumps(read_manifest(trained.cap)))
    man["layer_ids"] = {"ids": [2, 4, 6], "convention": "output_of_layer"}
    man["target"]["fingerprint"] = "0" * 16
    argv = _argv(exported, alg="EAGLE", steps=("2", "2", "9"), extra=["--context-length", "8192"])
    f = config_audit(exported, man, argv)
    errs = " | ".join(x.what for x in f if x.severity == ERROR)
    assert "aux layer ids: draft vs capture" in errs
    assert "target fingerprint" in errs
    assert "speculative algorithm" in errs and "step flags" in errs and "context length" in errs
    alg = next(x for x in f if "algorithm" in x.what)
    assert "skips fc" in alg.why
    # all-or-none rule, missing draft path
    f = config_audit(
        exported, None, ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3"]
    )
    whats = [x.what for x in f if x.severity == ERROR]
    assert any("step flags" in w for w in whats) and any("draft-model-path" in w for w in whats)
    # engine config dict with other layer ids
    f = config_audit(exported, None, {"layer_ids": {"ids": [2, 3, 4], "convention": "input_of_layer"},
                                      "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4})  # fmt: skip
    assert [x.what for x in f if x.severity == ERROR] == ["engine config: aux layer ids"]


def test_config_audit_vocab_and_architecture_quirks(trained, exported):
    d = copy.deepcopy(trained.draft)
    d.d2t.zero_()
    assert any("d2t" in x.what for x in config_audit(d) if x.severity == ERROR)
    man = json.loads(json.dumps(read_manifest(trained.cap)))
    for arch, needle in (("Qwen2ForCausalLM", "always get +1"), ("DeepseekV3ForCausalLM", "first id is 1"),
                         ("GptOssForCausalLM", "max(ids) == num_layers")):  # fmt: skip
        man["target"]["architecture"] = arch
        f = config_audit(exported, man)
        assert any(needle in x.what and x.severity == "warning" for x in f), (
            arch,
            [str(x) for x in f],
        )
    man["target"]["architecture"] = "DeepseekV3ForCausalLM"
    man["layer_ids"]["ids"] = [2, 3, 5]
    d.config.layer_ids = LayerIds((2, 3, 5))
    quirk = next(x for x in config_audit(d, man) if "Deepseek" in x.what)
    assert "one layer early" in quirk.why


def test_cli_audit_exit_codes(trained, exported):
    from typer.testing import CliRunner

    from workbench.cli import app

    ok = " ".join(_argv(exported))
    r = CliRunner().invoke(
        app, ["audit", "--draft", str(exported), "--capture", str(trained.cap), "--serving", ok]
    )
    assert r.exit_code == 0, r.output
    bad = " ".join(_argv(exported, alg="EAGLE"))
    r = CliRunner().invoke(app, ["audit", "--draft", str(exported), "--serving", bad])
    assert r.exit_code == 1 and "EAGLE3" in r.output
    r = CliRunner().invoke(
        app, ["audit", "--draft", str(exported), "--capture", str(trained.cap / "missing")]
    )
    assert r.exit_code == 2 and "no capture manifest" in r.output
    r = CliRunner().invoke(app, ["audit", "--draft", str(trained.cap / "nothing-here")])
    assert r.exit_code == 2 and "not a draft" in r.output


def test_finding_prints_only_the_sides_it_was_given():
    assert str(Finding(ERROR, "vocab_size", 49152, 32000)) == (
        "[error] vocab_size: expected 49152, got 32000"
    )
    assert str(Finding(WARNING, "draft import", got="d2t missing")) == (
        "[warning] draft import: got d2t missing"
    )
    assert str(Finding(ERROR, "ids", expected=[1, 2])) == "[error] ids: expected [1, 2]"
    assert str(Finding(WARNING, "quirk", why="SGLang adds 1")) == "[warning] quirk (SGLang adds 1)"
