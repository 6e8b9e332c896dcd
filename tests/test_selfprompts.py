"""Self-prompting: the user-turn prefix, the filters, and one tiny real run on the target."""

from __future__ import annotations

import json

import pytest

from workbench.data import load_mtbench, load_prompt_set, load_train_prompts
from workbench.selfprompts import (
    FilterConfig,
    PromptFilter,
    SelfPromptConfig,
    SelfPromptError,
    default_filter,
    distinct_ngram_ratio,
    stats_path,
    user_turn_prefix,
    write_prompts,
)

CLEAN = "How do I repot a cactus without getting pricked by its sharp spines?"


@pytest.fixture(scope="module")
def filt() -> PromptFilter:
    return default_filter()


def test_user_turn_prefix_opens_a_user_turn_after_the_default_system_turn(
    embedded_tokenizer_dir,
):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_tokenizer_dir)
    prefix = user_turn_prefix(tok)
    assert prefix.endswith("<|im_start|>user\n")
    assert prefix.startswith("<|im_start|>system\n")  # SmolLM2's template adds one by default
    hinted = user_turn_prefix(tok, "The user asks about math.")
    assert hinted == "<|im_start|>system\nThe user asks about math.<|im_end|>\n<|im_start|>user\n"


def test_a_template_that_hides_the_user_content_is_refused():
    class Tok:
        def apply_chat_template(self, msgs, **kw):
            return "<s>user turn</s>"

    with pytest.raises(SelfPromptError, match="user's content"):
        user_turn_prefix(Tok())


def test_overlap_with_mtbench_is_rejected_and_clean_prompts_kept(filt):
    q = load_mtbench()[0].turns[0]
    assert filt.check("Please help me with this: " + q) == "eval_overlap"  # shared 8-grams
    second = load_mtbench()[5].turns[1]
    assert filt.check(second) == "eval_overlap"  # second turns count too
    assert filt.check(CLEAN) is None


def test_paraphrase_sharing_many_trigrams_with_an_eval_is_rejected():
    f = PromptFilter(["write a persuasive essay about the benefits of public libraries"], [],
                     FilterConfig())  # fmt: skip
    # no shared 8-gram, but word 3-gram Jaccard > 0.3
    assert f.check("Write a persuasive essay on the benefits of public libraries today") == (
        "eval_overlap"
    )
    assert f.check("Tell me three facts about octopus camouflage and their skin") is None


def test_duplicates_near_duplicates_and_training_prompts_are_dropped(filt):
    f = PromptFilter([], [load_train_prompts()[0].turns[0]], FilterConfig())
    assert f.check(load_train_prompts()[0].turns[0]) == "train_overlap"
    assert f.check(CLEAN) is None
    assert f.check(CLEAN.upper() + "!!") == "duplicate"  # normalised text
    assert f.check(CLEAN[:-1] + " at all?") == "near_duplicate"
    assert f.check("Explain how tides are caused by the moon and the sun together.") is None


def test_length_and_script_filters():
    f = PromptFilter([], [], FilterConfig(max_words=20))
    assert f.check("   ") == "empty"
    assert f.check(CLEAN, finished=False) == "truncated"
    assert f.check("Hi there, friend") == "too_short"
    assert f.check(" ".join(["word"] * 21)) == "too_long"
    assert f.check("一二三四五六七八九十一二三四五 a b c d e") == "non_ascii"


def test_distinct_ngram_ratio():
    assert distinct_ngram_ratio(["a b c d", "a b c d"]) == pytest.approx(2 / 4)
    assert distinct_ngram_ratio(["a b c d", "x y z w"]) == 1.0


def test_bad_config_is_refused():
    with pytest.raises(SelfPromptError, match="hints"):
        SelfPromptConfig(hints="topics")
    with pytest.raises(SelfPromptError, match="greedy"):
        SelfPromptConfig(temperature=0)


@pytest.mark.slow
def test_tiny_real_run_writes_a_loadable_prompt_file(tmp_path):
    from workbench.target import load_target

    t = load_target("smollm2-135m")
    out = tmp_path / "self.jsonl"
    cfg = SelfPromptConfig(n=8, max_new_tokens=32, max_rounds=1, batch_size=8, seed=0)
    st = write_prompts(t, out, cfg, progress=False)
    assert st["n_generated"] == 8
    assert st["n_kept"] + sum(st["dropped"].values()) == 8
    assert st["n_kept"] >= 1, st["dropped"]
    assert json.loads(stats_path(out).read_text())["target"] == t.fingerprint
    loaded = load_prompt_set(out)
    assert len(loaded) == st["n_kept"]
    assert all(len(p.turns) == 1 and len(p.turns[0].split()) >= 5 for p in loaded)
    assert {p.id for p in loaded} == {f"self-{i:05d}" for i in range(1, st["n_kept"] + 1)}


def test_with_self_prompts_adds_nothing_at_zero_and_refuses_a_negative_count(tmp_path):
    from workbench.selfprompts import with_self_prompts

    convs = ["a", "b"]
    assert with_self_prompts(None, convs, 0, tmp_path / "self") == (convs, {})
    assert not (tmp_path / "self").exists()
    with pytest.raises(SelfPromptError, match="self_prompts=-1"):
        with_self_prompts(None, convs, -1, tmp_path / "self")


@pytest.mark.slow
def test_self_prompts_stage_answers_its_prompts_reuses_them_and_refuses_other_settings(
    tmp_path, monkeypatch
):
    from workbench import selfprompts
    from workbench.data import RegenConfig, load_prompt_set, select
    from workbench.selfprompts import with_self_prompts
    from workbench.target import load_target

    t = load_target("smollm2-135m")
    base = select(load_prompt_set("train"), 1)
    regen = RegenConfig(max_new_tokens=8, batch_size=8)
    cfg = SelfPromptConfig(max_new_tokens=32, max_rounds=1, batch_size=8)
    out = tmp_path / "self"
    convs, info = with_self_prompts(t, base, 6, out, regen, cfg, progress=False)
    kept = load_prompt_set(out / "prompts.jsonl")
    assert info["n_requested"] == 6 and info["n_kept"] == len(kept) >= 1, info
    assert convs[:1] == base and len(convs) == 1 + len(kept)
    mine = convs[1:]
    assert [p.id for p in mine] == [p.id for p in kept]
    assert all(p.complete and p.turns == q.turns for p, q in zip(mine, kept, strict=True))
    assert info["hash"] and info["regen"]["new_tokens_this_run"] > 0

    def fail(*a, **k):
        raise AssertionError("a rerun with the same settings must reuse the prompt file")

    monkeypatch.setattr(selfprompts, "write_prompts", fail)
    again, info2 = with_self_prompts(t, base, 6, out, regen, cfg, progress=False)
    assert [p.answers for p in again] == [p.answers for p in convs]
    assert info2["hash"] == info["hash"]
    with pytest.raises(SelfPromptError, match="seed differ"):
        with_self_prompts(t, base, 6, out, regen, SelfPromptConfig(seed=1, max_new_tokens=32,
                          max_rounds=1), progress=False)  # fmt: skip
