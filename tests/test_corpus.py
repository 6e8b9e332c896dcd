import json
import time

import pytest

from workbench.chat import encode_conversation
from workbench.corpus import (
    CorpusError,
    CorpusReport,
    build,
    chunk_topic,
    eval_ngrams,
    humaneval_names,
    main,
    mix,
    mix_counts,
    ngrams,
    overlaps,
    stdlib_functions,
    tokenizer_counter,
    with_prefill,
    write_prompts,
)
from workbench.data import Prompt, load_mtbench, load_prompt_set


@pytest.fixture(scope="module")
def tokenizer(embedded_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir))


@pytest.fixture(scope="module")
def small(tokenizer):
    t0 = time.perf_counter()
    prompts, report = build(tokenizer, max_items=40, max_tokens=128, seed=3)
    return prompts, report, time.perf_counter() - t0


def test_small_build_is_fast_complete_and_loads_back(small, tokenizer, tmp_path):
    prompts, report, seconds = small
    assert seconds < 30, f"a 40-item build took {seconds:.1f}s"
    assert len(prompts) == 40 and sum(report.items.values()) == 40
    assert len({p.id for p in prompts}) == 40
    path = tmp_path / "corpus.jsonl"
    write_prompts(path, prompts)
    back = load_prompt_set(path)
    assert [p.id for p in back] == [p.id for p in prompts]
    count = tokenizer_counter(tokenizer)
    for p in back:
        assert p.complete and len(p.turns) == 1
        assert count(p.answers[0]) <= 128
        ids, mask = encode_conversation(tokenizer, p.messages())  # an exact loss mask
        assert sum(mask) >= count(p.answers[0])
    code = [p for p in back if p.id.startswith("stdlib-")]
    assert code and all("```python\ndef " in p.answers[0] for p in code)
    assert all(p.turns[0].startswith("Write a Python ") for p in code)


def test_build_is_deterministic_and_a_prefix_of_a_bigger_build(small, tokenizer):
    again, _ = build(tokenizer, max_items=40, max_tokens=128, seed=3)
    assert [p.id for p in again] == [p.id for p in small[0]]
    other, _ = build(tokenizer, max_items=40, max_tokens=128, seed=4)
    assert [p.id for p in other] != [p.id for p in small[0]]


def test_both_sources_appear_with_per_source_counts(tokenizer):
    prompts, report = build(tokenizer, max_items=200, max_tokens=256, banned=set())
    assert report.items["pydoc"] > 0 and report.items["stdlib"] > 0
    assert report.items["pydoc"] == sum(p.id.startswith("pydoc-") for p in prompts)
    assert report.tokens["stdlib"] > report.items["stdlib"] * 20
    assert "pydoc:" in report.summary() and "stdlib:" in report.summary()


def test_overlap_filter_rejects_an_mtbench_8gram():
    banned = eval_ngrams()
    words = load_mtbench()[0].turns[1].split()[:8]
    hand = Prompt("x", "python-docs", ["Explain lists in Python."], ["Lists hold items. " + " ".join(words) + " and more."])  # fmt: skip
    assert overlaps(hand, banned)
    seven = Prompt("y", "python-docs", ["Explain lists."], [" ".join(words[:7])])
    assert not overlaps(seven, banned)


class WordCount:
    """A stand-in tokenizer, one token a word: fast builds for filter tests."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


def test_build_drops_items_with_a_banned_8gram():
    items, report = build(WordCount(), max_items=30, max_tokens=400, banned=set())
    assert not report.dropped_overlap
    victim = items[5]
    ban = set(list(ngrams(victim.answers[0]))[:1])
    again, report = build(WordCount(), max_items=30, max_tokens=400, banned=ban)
    assert victim.id not in {p.id for p in again}
    assert sum(report.dropped_overlap.values()) >= 1 and len(again) == 30


def test_humaneval_function_names_are_skipped():
    names = humaneval_names()
    assert "has_close_elements" in names
    report = CorpusReport()
    kept = stdlib_functions({"dedent", "fill"} | names, report)
    assert report.skipped_humaneval_names >= 2
    assert not {u.node.name for u in kept} & ({"dedent", "fill"} | names)
    assert "indent" in {u.node.name for u in kept if u.module == "textwrap"}


def test_chunks_respect_the_limit_and_paragraphs():
    count = len  # one token a character
    text = "Title\n*****\n\n" + "\n\n".join(f"para {i} " + "x" * 30 for i in range(10))
    chunks = chunk_topic(text, 100, count)
    assert all(len(c) <= 100 for _, c in chunks) and len(chunks) > 1
    assert all(h == "Title" for h, _ in chunks)
    assert "*" not in "".join(c for _, c in chunks)
    assert "\n\n".join(c for _, c in chunks).count("para ") == 10  # no paragraph cut


# ---------------------------------------------------------------- mixer


def _regen_dir(tmp_path, n):
    d = tmp_path / "regen"
    d.mkdir()
    rows = [{"id": f"r{i}", "category": "chat", "turns": [f"q{i}"], "answers": [f"a{i}"],
             "system": None} for i in range(n)]  # fmt: skip
    (d / "chunk-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _prefill(tmp_path, n):
    f = tmp_path / "prefill.jsonl"
    write_prompts(f, [Prompt(f"p{i}", "python-docs", [f"u{i}"], [f"v{i}"]) for i in range(n)])
    return f


def test_mix_counts():
    assert mix_counts(10, 100, 0.5) == (10, 10)
    assert mix_counts(10, 4, 0.5) == (4, 4)
    assert mix_counts(30, 100, 0.25) == (30, 10)
    assert mix_counts(10, 100, 0.0) == (10, 0) and mix_counts(10, 100, 1.0) == (0, 100)
    with pytest.raises(CorpusError, match=r"\[0, 1\]"):
        mix_counts(1, 1, 1.5)


def test_mix_writes_a_complete_interleaved_deterministic_set(tmp_path):
    regen, pre = _regen_dir(tmp_path, 12), _prefill(tmp_path, 50)
    info = mix(regen, pre, tmp_path / "a.jsonl", 0.6, seed=1)
    assert (info["regenerated"], info["prefill"]) == (12, 18)
    out = load_prompt_set(tmp_path / "a.jsonl")
    assert len(out) == 30 and all(p.complete for p in out)
    assert sum(p.id.startswith("r") for p in out) == 12
    assert {p.id for p in out if p.id.startswith("r")} == {f"r{i}" for i in range(12)}
    first_half = [p.id[0] for p in out[:15]]
    assert "r" in first_half and "p" in first_half  # interleaved, not appended
    mix(regen, pre, tmp_path / "b.jsonl", 0.6, seed=1)
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    mix(regen, pre, tmp_path / "c.jsonl", 0.6, seed=2)
    assert (tmp_path / "a.jsonl").read_text() != (tmp_path / "c.jsonl").read_text()


def test_mix_refuses_bad_input(tmp_path, capsys):
    pre = _prefill(tmp_path, 5)
    with pytest.raises(CorpusError, match="not a directory"):
        mix(tmp_path / "missing", pre, tmp_path / "o.jsonl", 0.5)
    regen = _regen_dir(tmp_path, 3)
    with pytest.raises(CorpusError, match=r"must be in \[0, 1\]"):
        mix(regen, pre, tmp_path / "o.jsonl", -0.1)
    with pytest.raises(CorpusError, match="no such file"):
        mix(regen, tmp_path / "nope.jsonl", tmp_path / "o.jsonl", 0.5)
    open_ended = tmp_path / "open.jsonl"
    open_ended.write_text(json.dumps({"turns": ["no answer"]}) + "\n")
    with pytest.raises(CorpusError, match="lack answers"):
        mix(regen, open_ended, tmp_path / "o.jsonl", 0.5)
    assert not (tmp_path / "o.jsonl").exists()
    rc = main(["mix", "--regen", str(regen), "--prefill", str(pre), "--out",
               str(tmp_path / "o.jsonl"), "--fraction", "2"])  # fmt: skip
    assert rc == 2 and "[0, 1]" in capsys.readouterr().err
    rc = main(["mix", "--regen", str(regen), "--prefill", str(pre), "--out",
               str(tmp_path / "o.jsonl"), "--fraction", "0.5"])  # fmt: skip
    assert rc == 0 and len(load_prompt_set(tmp_path / "o.jsonl")) == 6


def test_with_prefill_adds_the_share_and_keeps_every_regenerated_conversation(tokenizer, small):
    regen = [Prompt(f"r{i}", "user", [f"question {i}"], [f"answer {i}"]) for i in range(12)]
    same, info = with_prefill(regen, tokenizer, 0.0)
    assert same is regen and info == {}
    out, info = with_prefill(regen, tokenizer, 0.25, seed=3, max_tokens=128)
    assert out[:12] == regen and len(out) == 16  # 4 / 16 = 0.25
    assert (info["regenerated"], info["prefill"]) == (12, 4) and info["prefill_tokens"] > 0
    assert {p.id for p in out[12:]} <= {p.id for p in small[0]}  # items of the same seed's build
    with pytest.raises(CorpusError, match=r"\[0, 1\)"):
        with_prefill(regen, tokenizer, 1.0)
