import json
import re
from collections import Counter

import pytest

from workbench.chat import encode_conversation
from workbench.data import (
    DataError,
    Prompt,
    RegenConfig,
    import_jsonl,
    load_humaneval,
    load_mtbench,
    load_prompt_set,
    load_train_prompts,
    read_regenerated,
    regenerate,
)


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", s.lower()).strip()


def test_train_prompts_are_many_diverse_and_disjoint_from_evals():
    train = load_train_prompts()
    assert len(train) >= 400
    cats = Counter(p.category for p in train)
    assert len(cats) >= 8 and min(cats.values()) >= 20, cats
    assert sum(len(p.turns) > 1 for p in train) >= 0.1 * len(train)  # multi-turn follow-ups
    firsts = [_norm(p.turns[0]) for p in train]
    assert len(set(firsts)) == len(firsts), "duplicate training prompts"
    assert len({p.id for p in train}) == len(train)
    evals = {_norm(t) for p in load_mtbench() for t in p.turns}
    evals |= {_norm(p.turns[0]) for p in load_humaneval()}
    for p in train:
        for t in p.turns:
            assert _norm(t) not in evals, f"training prompt {p.id} is an eval prompt"

    # no long verbatim overlap with MT-bench first turns either (12-word shingles)
    def shingles(text, k=12):
        w = _norm(text).split()
        return {" ".join(w[i : i + k]) for i in range(max(len(w) - k + 1, 0))}

    eval_sh = set().union(*(shingles(p.turns[0]) for p in load_mtbench()))
    assert not any(shingles(p.turns[0]) & eval_sh for p in train)


def test_eval_sets_from_packages():
    mt = load_mtbench()
    assert len(mt) == 80 and all(len(p.turns) == 2 for p in mt)
    assert len({p.category for p in mt}) == 8
    he = load_humaneval()
    assert len(he) == 164 and he[0].id == "HumanEval/0" and "def " in he[0].turns[0]


def test_import_sharegpt_and_openai_with_bad_lines(tmp_path):
    f = tmp_path / "user.jsonl"
    lines = [
        json.dumps(
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
        ),
        "{not json",
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "q2"},
                ]
            }
        ),
        json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),
        "",
        json.dumps({"conversations": [{"from": "gpt", "value": "answer first"}]}),
        json.dumps({"text": "no known keys"}),
    ]
    f.write_text("\n".join(lines) + "\n")
    prompts, report = import_jsonl(f)
    assert report.kept == 2 and len(prompts) == 2
    bad = dict(report.errors)
    assert set(bad) == {2, 4, 6, 7}
    assert "invalid JSON" in bad[2] and "unknown role 'wizard'" in bad[4]
    assert "alternate" in bad[6] and "none of 'messages'" in bad[7]
    assert "line 2:" in report.summary()
    assert prompts[0].turns == ["hi"] and prompts[0].answers == ["hello"] and prompts[0].complete
    assert (
        prompts[1].system == "be brief"
        and prompts[1].turns == ["q", "q2"]
        and not prompts[1].complete
    )
    assert load_prompt_set(f)[1].messages()[0] == {"role": "system", "content": "be brief"}
    with pytest.raises(DataError, match="no such file"):
        import_jsonl(tmp_path / "missing.jsonl")


def test_loss_mask_covers_exactly_the_assistant_tokens(tiny_target):
    tok = tiny_target.tokenizer
    msgs = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green, of course."},
    ]
    ids, mask = encode_conversation(tok, msgs)
    assert len(ids) == len(mask)
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode(ids) == text
    masked = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert masked.replace("<|im_end|>", "|").replace("\n", "") == "Blue.|Green, of course.|"
    ids2, mask2 = encode_conversation(tok, msgs, max_length=10)
    assert ids2 == ids[:10] and mask2 == mask[:10]


def test_regenerate_is_resumable_and_refuses_other_arguments(tiny_target, tmp_path, monkeypatch):
    prompts = [
        Prompt(f"p{i}", "test", [f"Say {i}."] + (["And again?"] if i % 2 else [])) for i in range(5)
    ]
    cfg = RegenConfig(max_new_tokens=6, chunk_size=2, batch_size=4, dtype="float32")
    ref = tmp_path / "ref"
    info = regenerate(tiny_target, prompts, ref, cfg, progress=False)
    assert info["chunks"] == 3 and info["new_tokens_this_run"] > 0
    done = read_regenerated(ref)
    assert [p.id for p in done] == [p.id for p in prompts]
    assert all(len(p.answers) == len(p.turns) for p in done)

    # Kill after the first chunk, then resume: same result, only the rest is generated.
    import workbench.data as data

    calls = {"n": 0}
    real = data.atomic_write_text

    def dying_write(path, text):
        if str(path).endswith(".jsonl"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
        return real(path, text)

    out = tmp_path / "resumed"
    monkeypatch.setattr(data, "atomic_write_text", dying_write)
    with pytest.raises(KeyboardInterrupt):
        regenerate(tiny_target, prompts, out, cfg, progress=False)
    monkeypatch.setattr(data, "atomic_write_text", real)
    assert sorted(p.name for p in out.glob("chunk-*.jsonl")) == ["chunk-00000.jsonl"]
    assert not list(out.glob("*.tmp"))
    regenerate(tiny_target, prompts, out, cfg, progress=False)
    for a, b in zip(sorted(ref.glob("chunk-*")), sorted(out.glob("chunk-*")), strict=True):
        assert a.read_text() == b.read_text()
    # A rerun with nothing left keeps the throughput of the runs that did the work.
    again = regenerate(tiny_target, prompts, out, cfg, progress=False)
    assert again["new_tokens_this_run"] == 0 and again["tok_s"] is None
    runs = json.loads((out / "regen.json").read_text())["runs"]
    # (the killed run wrote no record; the resume answered chunks 1-2 only)
    assert len(runs) == 1 and runs[0]["tok_s"] > 0
    assert 0 < runs[0]["new_tokens"] < info["new_tokens_this_run"]

    with pytest.raises(DataError, match=r"different arguments:\n  max_new_tokens: was 6, now 7"):
        regenerate(
            tiny_target,
            prompts,
            out,
            RegenConfig(max_new_tokens=7, chunk_size=2, batch_size=4, dtype="float32"),
            progress=False,
        )


def test_extra_sampled_answers_follow_greedy_ones(tiny_target, tmp_path):
    from workbench.data import base_id, eos_ids, prepare_conversations, prompt_ids
    from workbench.generate import generate_batch

    prompts = [
        Prompt(f"p{i}", "t", [f"Count to {i}."] + (["More?"] if i == 1 else [])) for i in range(3)
    ]
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "category": "t", "turns": p.turns}) + "\n"
                            for p in prompts))  # fmt: skip
    cfg = RegenConfig(max_new_tokens=8, chunk_size=4, batch_size=4, dtype="float32", samples=3,
                      sample_temperature=1.0)  # fmt: skip
    convs, _ = prepare_conversations(
        tiny_target, path, None, tmp_path / "regen", cfg, progress=False
    )
    assert [c.id for c in convs] == ["p0", "p1", "p2", "p0@sample1", "p1@sample1", "p2@sample1",
                                     "p0@sample2", "p1@sample2", "p2@sample2"]  # fmt: skip
    assert [base_id(c.id) for c in convs] == ["p0", "p1", "p2"] * 3
    assert all(c.complete for c in convs) and len(convs[4].answers) == 2
    # the first answers are the greedy ones; the sampled ones differ from them
    tok = tiny_target.tokenizer
    greedy = generate_batch(tiny_target.model, [prompt_ids(tok, prompts[0].messages(1))], 8,
                            eos_ids(tok), dtype="float32", progress=False)[0]  # fmt: skip
    assert convs[0].answers[0] == tok.decode(greedy, skip_special_tokens=True).strip()
    assert len({c.answers[0] for c in convs if base_id(c.id) == "p0"}) > 1
    with pytest.raises(DataError, match="sample_temperature > 0"):
        regenerate(
            tiny_target, prompts, tmp_path / "x", RegenConfig(samples=2, sample_temperature=0)
        )


def test_import_refuses_silent_coercions_with_line_numbers(tmp_path):
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    lines = [
        json.dumps(good),
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]}),
        json.dumps({"conversations": [{"from": "human", "value": 42}]}),
        json.dumps({"turns": ["q"], "answers": "not a list"}),
        json.dumps({"turns": ["q"], "answers": [None]}),
        json.dumps({"turns": ["q"], "system": ["be brief"]}),
        json.dumps({"turns": ["q"], "answers": ["a", "b"]}),
        json.dumps({"turns": ["q"], "answers": ["a"], "system": "be brief"}),
    ]  # fmt: skip
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines) + "\n")
    prompts, report = import_jsonl(f)
    bad = dict(report.errors)
    assert set(bad) == {2, 3, 4, 5, 6, 7} and report.kept == 2
    assert "conversations[1].value must be a string, got null" in bad[2]
    assert "got int" in bad[3]
    assert "'answers' must be a list of strings" in bad[4] and bad[5] == bad[4]
    assert "'system' must be a string, got list" in bad[6]
    assert "2 'answers' for 1 'turns'" in bad[7]
    assert "None" not in "".join(p.answers[0] for p in prompts)
    assert prompts[1].system == "be brief"


def test_non_utf8_line_rejects_only_itself(tmp_path):
    good = json.dumps({"turns": ["caf\u00e9?"], "answers": ["oui"]}).encode()
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(good + b"\n" + '{"turns": ["caf\xe9"]}'.encode("latin-1") + b"\n" + good + b"\n")
    prompts, report = import_jsonl(f)
    assert report.kept == 2 and [n for n, _ in report.errors] == [2]
    assert "not UTF-8 (byte 0xe9" in report.errors[0][1]
    from typer.testing import CliRunner

    from workbench.cli import app

    res = CliRunner().invoke(app, ["import-data", str(f)])
    assert res.exit_code == 0 and "kept 2" in res.output and "line 2: not UTF-8" in res.output


def test_bad_regeneration_arguments_are_refused_before_anything_is_written(
    tiny_target_dir, tmp_path
):
    from typer.testing import CliRunner

    from workbench.cli import app
    from workbench.data import check_n, select

    for kw, frag in (
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"max_new_tokens": -3}, "max_new_tokens=-3"),
        ({"dtype": "foo"}, "unknown generation dtype 'foo'"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"top_p": 0}, "top_p=0"),
        ({"samples": 2, "sample_temperature": 0}, "sample_temperature > 0"),
    ):
        with pytest.raises(DataError, match=re.escape(frag)):
            RegenConfig(**kw)
    with pytest.raises(DataError, match="--n -1"):
        check_n(-1)
    with pytest.raises(DataError, match="--n -1"):
        select(load_train_prompts(), -1)
    out = tmp_path / "regen"
    base = ["regenerate", "--target", str(tiny_target_dir), "--out", str(out), "--n", "2"]
    for extra, frag in (
        (["--dtype", "foo"], "unknown generation dtype 'foo'"),
        (["--max-new-tokens", "0"], "max_new_tokens=0"),
        (["--n", "-1"], "--n -1"),
        (["--pick", "random"], "pick='random': expected one of first, spread"),
    ):
        res = CliRunner().invoke(app, base + extra)
        assert res.exit_code == 2 and res.stderr.startswith("error: "), res.output
        assert res.stderr.count("\n") == 1 and frag in res.stderr, res.stderr
        assert not out.exists()
    res = CliRunner().invoke(app, base + ["--max-new-tokens", "3", "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    assert len(read_regenerated(out)) == 2


def test_regeneration_builds_the_llama_once_and_locks_its_folder(
    tiny_target, tmp_path, monkeypatch
):
    import os

    import workbench.llama as llama
    from workbench.errors import InUseError
    from workbench.fsutil import locked_dir

    built = []
    real_init = llama.Llama.__init__

    def counting_init(self, *a, **k):
        built.append(1)
        real_init(self, *a, **k)

    monkeypatch.setattr(llama.Llama, "__init__", counting_init)
    prompts = [Prompt(f"p{i}", "t", [f"Say {i}.", "Again?"]) for i in range(4)]
    cfg = RegenConfig(max_new_tokens=3, chunk_size=2, batch_size=4, dtype="float32", samples=2)
    regenerate(tiny_target, prompts, tmp_path / "r", cfg, progress=False)
    assert len(built) == 1  # 4 chunks x 2 turns x (greedy, sampled): one build
    built.clear()
    regenerate(tiny_target, prompts, tmp_path / "r", cfg, progress=False)  # all done: none
    assert built == []
    with locked_dir(tmp_path / "r", "regeneration folder"):
        with pytest.raises(
            InUseError, match=rf"regeneration folder .* in use by pid {os.getpid()}"
        ):
            regenerate(tiny_target, prompts, tmp_path / "r", cfg, progress=False)


def test_cross_chunk_refill_gives_the_per_chunk_answers(tiny_target, tmp_path):
    from workbench.data import eos_ids, prompt_ids
    from workbench.generate import generate_batch

    prompts = [
        Prompt(f"p{i}", "t", [f"Say {i}."] + (["Why?"] if i % 3 == 0 else [])) for i in range(7)
    ]
    cfg = RegenConfig(max_new_tokens=8, chunk_size=3, batch_size=4, dtype="float32", samples=2,
                      sample_temperature=1.0)  # fmt: skip
    cross = regenerate(tiny_target, prompts, tmp_path / "cross", cfg, progress=False)
    per = regenerate(tiny_target, prompts, tmp_path / "per", cfg, progress=False,
                     cross_chunk=False)  # fmt: skip
    names = sorted(p.name for p in (tmp_path / "cross").glob("chunk-*.jsonl"))
    assert names == sorted(p.name for p in (tmp_path / "per").glob("chunk-*.jsonl"))
    assert len(names) == 5  # 14 answers (7 greedy + 7 sampled) in chunks of 3
    a, b = read_regenerated(tmp_path / "cross"), read_regenerated(tmp_path / "per")
    assert [p.id for p in a] == [p.id for p in b] and all(p.complete for p in a)
    greedy = [p for p in a if "@" not in p.id]
    assert greedy == [p for p in b if "@" not in p.id]
    # sampled answers draw from their own generators, seeded as in the per-chunk run; the
    # tiny random model's flat distributions let a batch's float rounding flip a draw, so
    # only their first turns' first words are compared
    sampled = [(p, q) for p, q in zip(a, b, strict=True) if "@" in p.id]
    assert sum(p.answers[0][:6] == q.answers[0][:6] for p, q in sampled) >= len(sampled) - 1
    assert all(p.answers[0] != g.answers[0] for (p, _), g in zip(sampled, greedy, strict=True))
    # the same tokens in fewer forwards: no batch drained (or compacted) at each chunk end
    assert cross["decode_steps"] < per["decode_steps"]
    assert cross["new_tokens_this_run"] > 0
    # the greedy answers are plain generate_batch's, turn by turn (the per-chunk code's path)
    tok, eos = tiny_target.tokenizer, eos_ids(tiny_target.tokenizer)
    done = {p.id: p for p in read_regenerated(tmp_path / "cross")}
    for turn in (0, 1):
        ps = [done[p.id] for p in prompts if len(p.turns) > turn]
        ids = [prompt_ids(tok, Prompt(p.id, "t", p.turns[: turn + 1], p.answers[:turn]).messages())
               for p in ps]  # fmt: skip
        outs = generate_batch(tiny_target.model, ids, 8, eos, dtype="float32", progress=False)
        for p, o in zip(ps, outs, strict=True):
            want = tok.decode([t for t in o if t not in eos], skip_special_tokens=True).strip()
            assert p.answers[turn] == want, (p.id, turn)


def test_spread_pick_covers_every_category_of_the_built_in_set():
    """The built-in set comes in category blocks: its first 400 prompts miss 9 of the 15
    categories; 400 spread over it cover all 15, none twice; a bad pick is named."""
    from workbench.data import select

    ps = load_train_prompts()
    cats = {p.category for p in ps}
    first, spread_ = select(ps, 400), select(ps, 400, pick="spread")
    assert len({p.category for p in first}) == 6 and len(cats) == 15
    assert {p.category for p in spread_} == cats and len({p.id for p in spread_}) == 400
    assert [p.id for p in select(ps, 0, pick="spread")] == [p.id for p in ps]
    with pytest.raises(DataError, match="pick='random': expected one of first, spread"):
        select(ps, 4, pick="random")


def test_a_profile_passes_its_pick_to_notebook_01_only_when_it_is_not_the_default(monkeypatch):
    """A profile's pick reaches the capture stage; the default passes none, so stage keys
    (and cached results) from before the parameter existed stay as they were."""
    import dataclasses

    import workbench.pipeline as P

    assert all("pick" not in P.stages(name)[0].parameters for name in P.PIPELINE_PROFILES)
    spread_quick = dataclasses.replace(P.PIPELINE_PROFILES["quick"], pick="spread")
    monkeypatch.setitem(P.PIPELINE_PROFILES, "quick", spread_quick)
    assert P.stages("quick")[0].parameters["pick"] == "spread"
