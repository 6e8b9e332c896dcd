"""The static-cache Llama forward and `generate_batch` against HF transformers (fp32).

Fast tests use a tiny random Llama; one slow smoke test uses the embedded target.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from workbench.generate import GenerationStats, generate_batch, generate_batch_with_stats
from workbench.llama import Llama, rms_norm

ATOL = 2e-5


def tiny(tie: bool = False, rope: dict | None = None, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
        tie_word_embeddings=tie, pad_token_id=0, eos_token_id=1,
        **({"rope_parameters": rope} if rope else {}),
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).eval()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny()


def rand_ids(n: int, seed: int, lo: int = 2) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, 256, (n,), generator=g).tolist()


LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip


@pytest.mark.parametrize("tie,rope", [(False, None), (True, None), (False, LLAMA3)])
def test_prefill_and_cached_decode_match_hf(tie, rope):
    m = tiny(tie, rope)
    llm = Llama(m, torch.float32)
    x = torch.randint(0, 256, (3, 40))
    with torch.no_grad():
        ref = m(x).logits
    c = llm.new_cache(3, 64)
    got = [llm(x[:, :30], c).logits]  # prefill
    got += [llm(x[:, i : i + 1], c).logits for i in range(30, 40)]  # one-token decode
    torch.testing.assert_close(torch.cat(got, 1), ref, atol=ATOL, rtol=0)
    assert c.lengths.tolist() == [40] * 3


def test_ragged_and_left_padded_rows(model):
    llm = Llama(model, torch.float32)
    prompts = [rand_ids(n, n) for n in (5, 12, 1, 9)]
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
    T, B = 12, len(prompts)
    lens = torch.tensor([len(p) for p in prompts])
    right = torch.zeros(B, T, dtype=torch.long)
    left = torch.zeros(B, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        right[i, : len(p)] = torch.tensor(p)
        left[i, T - len(p) :] = torch.tensor(p)
    c = llm.new_cache(B, 32)
    out = llm(right, c, n_valid=lens, logits="last")  # ragged: right padding + n_valid
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)
    assert c.lengths.tolist() == lens.tolist()
    c2 = llm.new_cache(B, 32)
    c2.start[:] = T - lens  # left padding: slots before start are hidden
    out2 = llm(left, c2, logits="last")
    torch.testing.assert_close(out2.logits, ref, atol=ATOL, rtol=0)
    # one decode step on both layouts agrees with HF
    nxt = torch.randint(2, 256, (B, 1))
    with torch.no_grad():
        ref2 = torch.stack(
            [
                model(torch.tensor([p + [int(t)]])).logits[0, -1]
                for p, t in zip(prompts, nxt, strict=True)
            ]
        )
    torch.testing.assert_close(llm(nxt, c).logits[:, 0], ref2, atol=ATOL, rtol=0)
    torch.testing.assert_close(llm(nxt, c2).logits[:, 0], ref2, atol=ATOL, rtol=0)


def test_rollback_redecode_is_identical(model):
    llm = Llama(model, torch.float32)
    c = llm.new_cache(2, 32)
    llm(torch.randint(0, 256, (2, 8)), c)
    toks = torch.randint(0, 256, (2, 5))
    first = [llm(toks[:, i : i + 1], c).logits for i in range(5)]
    c.rollback(3)
    assert c.lengths.tolist() == [10, 10]
    again = [llm(toks[:, i : i + 1], c).logits for i in range(2, 5)]
    for a, b in zip(first[2:], again, strict=True):
        assert torch.equal(a, b)
    c.rollback(torch.tensor([0, 2]))  # per-row rollback, then a 2-token verify-style step
    assert c.lengths.tolist() == [13, 11]


def test_hidden_states_match_hf(model):
    llm = Llama(model, torch.float32)
    x = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        hs = model(x, output_hidden_states=True).hidden_states
    n = model.config.num_hidden_layers
    out = llm(x, llm.new_cache(2, 16), hidden_layers=tuple(range(-1, n)))
    assert list(out.hidden) == list(range(-1, n))
    for i in range(-1, n - 1):  # HF index i+1 is the output of layer i
        torch.testing.assert_close(out.hidden[i], hs[i + 1], atol=ATOL, rtol=0)
    # HF's last entry is post-norm; ours stays pre-norm
    assert torch.equal(out.hidden[n - 1], out.final_hidden)
    normed = rms_norm(out.final_hidden, llm.norm, llm.eps)
    torch.testing.assert_close(normed, hs[n], atol=ATOL, rtol=0)


def test_tree_mask(model):
    llm = Llama(model, torch.float32)
    prefix = torch.randint(0, 256, (2, 6))
    new = torch.randint(0, 256, (2, 4))
    c1, c2 = llm.new_cache(2, 16), llm.new_cache(2, 16)
    llm(prefix, c1), llm(prefix, c2)
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    a = llm(new, c1).logits
    b = llm(new, c2, tree_mask=causal).logits
    assert torch.equal(a, b)
    # a real tree: root a with children b, c; c's logits equal the chain prefix+a+c
    c3 = llm.new_cache(2, 16)
    llm(prefix, c3)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    pos = torch.tensor([[6, 7, 7]]).expand(2, 3)
    t = llm(new[:, :3], c3, tree_mask=tree, positions=pos, advance=False).logits
    chain = torch.cat([prefix, new[:, [0, 2]]], 1)
    with torch.no_grad():
        ref = model(chain).logits
    torch.testing.assert_close(t[:, 2], ref[:, -1], atol=ATOL, rtol=0)
    torch.testing.assert_close(t[:, 1], model(torch.cat([prefix, new[:, :2]], 1)).logits[:, -1],
                               atol=ATOL, rtol=0)  # fmt: skip
    assert c3.lengths.tolist() == [6, 6]


def test_generate_greedy_matches_hf(model):
    prompts = [rand_ids(n, 100 + n) for n in (3, 17, 8, 1, 30, 12, 5, 9)]
    # choose eos tokens the model emits, so that rows stop early at different steps
    with torch.no_grad():
        full = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                               pad_token_id=0, eos_token_id=None)[0, len(p):] for p in prompts]  # fmt: skip
    eos = sorted({int(f[4]) for f in full[:3]})
    refs = []
    with torch.no_grad():
        for p in prompts:
            o = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                               pad_token_id=0, eos_token_id=eos)  # fmt: skip
            refs.append(o[0, len(p) :].tolist())
    assert any(len(r) < 12 for r in refs) and any(len(r) == 12 for r in refs)
    for bs in (1, 3, 8):  # padding, refills and compaction must not change the tokens
        stats = GenerationStats()
        got = generate_batch(model, prompts, 12, eos, dtype="float32", batch_size=bs,
                             progress=False, stats=stats)  # fmt: skip
        assert got == refs, bs
        assert stats.new_tokens == sum(map(len, refs)) and stats.prompts == len(prompts)


def test_sampling_reproducible(model):
    llm = Llama(model, torch.float32)
    prompts = [rand_ids(n, n) for n in (4, 9, 2)]
    kw = dict(temperature=0.9, top_p=0.9, batch_size=2, progress=False)
    a = generate_batch(llm, prompts, 10, None, seed=7, **kw)
    b = generate_batch(llm, prompts, 10, None, seed=7, **kw)
    c = generate_batch(llm, prompts, 10, None, seed=8, **kw)
    assert a == b and a != c and all(len(r) == 10 for r in a)
    greedy = generate_batch(llm, prompts, 10, None, progress=False)
    tiny_p = generate_batch(llm, prompts, 10, None, temperature=1.0, top_p=1e-9, seed=1,
                            progress=False)  # fmt: skip
    assert tiny_p == greedy


def test_stats_and_edge_cases(model):
    res, st = generate_batch_with_stats(model, [[5, 6], [7]], 1, None, progress=False)
    assert [len(r) for r in res] == [1, 1] and st.new_tokens == 2 and st.tok_s > 0
    assert generate_batch(model, [], 5, None, progress=False) == []


@pytest.mark.slow
def test_embedded_target_matches_hf_generate():
    from workbench.target import load_target

    t = load_target("smollm2-135m", dtype="float32")
    tok = t.tokenizer
    msgs = ["What is the capital of France?", "Write a haiku about the sea.", "Hi!"]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": m}],
                                            add_generation_prompt=True, return_dict=True)["input_ids"])
               for m in msgs]  # fmt: skip
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    got = generate_batch(t.model, prompts, 16, [eos], dtype="float32", progress=False)
    with torch.no_grad():
        for p, g in zip(prompts, got, strict=True):
            o = t.model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)  # fmt: skip
            assert g == o[0, len(p) :].tolist()
    bf = generate_batch(t.model, prompts, 16, [eos], dtype="bfloat16", progress=False)
    assert all(0 < len(r) <= 16 for r in bf)


def test_queue_rows_sample_independently_of_their_batch(model):
    from workbench.generate import RequestQueue, run_queue

    llm = Llama(model, torch.float32)
    prompts = [rand_ids(n, 40 + n) for n in (4, 9, 2, 7, 3)]

    def run(keys, temperature, top_p=1.0, batch=4):
        got = {}
        q = RequestQueue(got.__setitem__)
        for k in keys:
            q.push(k, prompts[k], priority=k, temperature=temperature, seed=100 + k)
        run_queue(llm, q, 10, None, q.sampler(top_p), batch, GenerationStats())
        return got

    alone = run([1], 0.9)
    shared = run(range(5), 0.9)
    assert shared[1] == alone[1] and run(range(5), 0.9) == shared  # batch-free, reproducible
    assert len({tuple(v) for v in shared.values()}) == 5
    greedy = generate_batch(llm, prompts, 10, None, progress=False)
    assert run(range(5), 0.0, batch=2) == dict(enumerate(greedy))
    assert run(range(5), 1.0, top_p=1e-9) == dict(enumerate(greedy))
    assert run(range(5), 0.9) != dict(enumerate(greedy))


def test_queue_takes_requests_pushed_while_decoding(model):
    """Follow-ups arrive after the batch was compacted: it grows back, and longer prompts
    than any before get a longer cache."""
    from workbench.generate import RequestQueue, run_queue

    llm = Llama(model, torch.float32)
    got = {}

    def on_done(key, toks):
        got[key] = toks
        if key < 10:  # a "next turn": the prompt plus its answer plus more
            q.push(key + 10, prompts[key] + toks + [7, 8, 9], priority=1)

    q = RequestQueue(on_done)
    prompts = [rand_ids(n, 60 + n) for n in (5, 3)]
    for k, p in enumerate(prompts):
        q.push(k, p)
    st = run_queue(llm, q, 6, None, q.sampler(1.0), 4, GenerationStats())
    follow = [prompts[k] + got[k] + [7, 8, 9] for k in range(2)]
    assert [got[k + 10] for k in range(2)] == generate_batch(llm, follow, 6, None, progress=False)
    assert got[0] + got[1] == sum(generate_batch(llm, prompts, 6, None, progress=False), [])
    # 2 x 5 decode steps, each on 2 rows of the 4: compacted, grown back, compacted again
    assert (st.steps, st.row_steps, st.new_tokens) == (10, 20, 24)
