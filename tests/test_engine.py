"""The speculative decoding engine: exactness (fp32 greedy), lossless sampling, aux selection,
SGLang parameter rules, draft/target mismatch errors, trace.

Fast tests use a tiny random Llama (vocab 256) and a tiny random draft; an "oracle" draft
(a real draft whose logits are replaced by the known greedy continuation, wrong on purpose at
some positions) makes multi-token accepts, sibling accepts and rollbacks happen.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import transformers

from workbench.draft.model import DraftConfig, Eagle3Draft, init_from_target
from workbench.draft.model import KVCache as DraftCache
from workbench.engine import (
    DraftTree,
    Measurement,
    SpecDecoder,
    SpecError,
    SpecParams,
    TraceWriter,
    choose_params,
    commit_path,
    read_trace,
    resolve_params,
    select_accepted_hidden,
    speculative_generate,
    speed_figures,
    speed_report,
)
from workbench.engine.spec import PackedLinear, packed_draft
from workbench.engine.speed import served_setting
from workbench.errors import WorkbenchError
from workbench.generate import generate_batch
from workbench.layers import LayerIds
from workbench.llama import Llama
from workbench.metrics import pooled_tau

CONFIGS = [(3, 1, 4), (5, 1, 6), (3, 2, 5), (4, 4, 8), (1, 4, 4), (5, 4, 16)]


def tiny_target(vocab: int = 256, seed: int = 0, layers: int = 4, hidden: int = 64):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
        max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=1,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).eval()


def tiny_draft(model, dvocab: int, seed: int = 1, cls=Eagle3Draft, ids=(0, 1, 2)) -> Eagle3Draft:
    cfg = DraftConfig.from_target(model.config, LayerIds(ids), dvocab)
    torch.manual_seed(seed)
    d = cls(cfg)
    V = model.config.vocab_size
    d.set_vocab(torch.sort(torch.randperm(V)[:dvocab]).values)
    return init_from_target(d, model).eval()


class OracleDraft(Eagle3Draft):
    """Runs the real draft (caches, masks, fc all exercised), then cheats: at draft position
    t it predicts `ref[t + 2]` (the true greedy continuation), except at positions % 5 == 3
    where the truth is only its second choice and positions % 7 == 6 where it is absent."""

    ref: list[int] = []

    def forward(self, input_ids, hidden, position_ids, cache=None, attn_mask=None, **kw):
        logits, h = super().forward(input_ids, hidden, position_ids, cache, attn_mask, **kw)
        out = torch.zeros_like(logits)
        t2d = torch.cumsum(self.t2d.long(), 0) - 1  # target id -> draft index
        for b, t in ((b, t) for b in range(out.shape[0]) for t in range(out.shape[1])):
            p = int(position_ids[b, t]) + 2
            if p >= len(self.ref) or not self.t2d[self.ref[p]]:
                continue
            truth = int(t2d[self.ref[p]])
            wrong = (truth + 1 + p) % out.shape[-1]
            if p % 7 == 6:
                out[b, t, wrong] = 10.0
            elif p % 5 == 3:
                out[b, t, wrong], out[b, t, truth] = 10.0, 9.0
            else:
                out[b, t, truth] = 10.0
        return out, h


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_target()


@pytest.fixture(scope="module")
def llm(model):
    return Llama(model, torch.float32)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in (9, 23)]


@pytest.fixture(scope="module")
def reference(llm, prompts):
    return generate_batch(llm, prompts, 48, None, dtype=torch.float32, progress=False)


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("s,k,n", CONFIGS)
def test_greedy_random_draft_matches_plain(llm, model, prompts, reference, s, k, n):
    draft = tiny_draft(model, 128)
    dec = SpecDecoder(llm, draft, resolve_params(s, k, n))
    for p, ref in zip(prompts, reference, strict=True):
        g = dec.generate(p, 48)
        assert g.tokens == ref
        assert g.stats.completion_tokens == 48 == 1 + g.stats.decode_tokens


@pytest.mark.parametrize("s,k,n", CONFIGS)
def test_greedy_oracle_draft_accepts_many_and_stays_exact(llm, model, prompts, reference, s, k, n):
    draft = tiny_draft(model, 256, cls=OracleDraft)
    stats = []
    for p, ref in zip(prompts, reference, strict=True):
        draft.ref = p + ref
        g = SpecDecoder(llm, draft, resolve_params(s, k, n)).generate(p, 48)
        assert g.tokens == ref
        stats.append(g.stats)
    tau = pooled_tau([st.accepted for st in stats])
    assert tau > 1.5  # multi-token accepts (and rejections at the planted positions) happened
    assert any(a == 1 for st in stats for a in st.accepted) or s == 1  # rollbacks too
    if k > 1 and s > 1:  # second-choice siblings get accepted: beats the chain at equal depth
        assert tau > 2.0


def test_eos_stops_and_matches_hf_generate(model, llm, prompts):
    p = prompts[1]
    with torch.no_grad():
        hf = model.generate(torch.tensor([p]), max_new_tokens=30, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
    draft = tiny_draft(model, 256, cls=OracleDraft)
    draft.ref = p + hf
    for s, k, n in [(3, 1, 4), (4, 4, 8)]:
        assert speculative_generate(llm, draft, p, 30, num_steps=s, eagle_topk=k,
                                    num_draft_tokens=n).tokens == hf  # fmt: skip
        eos = hf[10]  # stop at the first occurrence, eos included
        g = speculative_generate(llm, draft, p, 30, [eos], num_steps=s, eagle_topk=k,
                                 num_draft_tokens=n)  # fmt: skip
        assert g.tokens == hf[: hf.index(eos) + 1]


def test_plain_engine_matches(llm, prompts, reference):
    g = SpecDecoder(llm, None).generate(prompts[0], 48)
    assert g.tokens == reference[0] and g.stats.tau == 1.0


# ---------------------------------------------------------------- aux selection / cache


def test_select_accepted_hidden_by_index():
    aux = torch.arange(6.0)[:, None].expand(6, 9) * torch.tensor([1.0, 10.0, 100.0]).repeat(3)
    idx = torch.tensor([0, 2, 5])  # root + two accepted tree nodes (not positions 0, 1, 2)
    assert select_accepted_hidden(aux, idx)[:, 0].tolist() == [0.0, 2.0, 5.0]
    batched = torch.stack([aux, aux + 100])
    out = select_accepted_hidden(batched, torch.tensor([[0, 2, 5], [0, 1, 3]]))
    assert out[:, :, 0].tolist() == [[0.0, 2.0, 5.0], [100.0, 101.0, 103.0]]


def test_extend_reads_target_aux_of_accepted_tokens(llm, model, prompts, reference):
    """End to end: every k*H input the draft got equals a fresh full-sequence target forward's
    aux states at the same positions (an off-by-one in selection or rollback shows here)."""
    draft = tiny_draft(model, 256, cls=OracleDraft)
    p, ref = prompts[0], reference[0]
    draft.ref = p + ref
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    orig = draft.forward

    def spy(input_ids, hidden, position_ids, *a, **kw):
        if hidden.shape[-1] == draft.config.fc_in_features:
            seen.append((position_ids[0].clone(), hidden[0].clone()))
        return orig(input_ids, hidden, position_ids, *a, **kw)

    draft.forward = spy
    g = SpecDecoder(llm, draft, resolve_params(4, 4, 8)).generate(p, 48)
    assert g.tokens == ref and g.stats.tau > 1.5
    seq = torch.tensor([p + ref])
    full = llm(seq, llm.new_cache(1, seq.shape[1]), hidden_layers=[0, 1, 2], logits="none")
    aux = torch.cat([full.hidden[i] for i in (0, 1, 2)], -1)[0]
    covered = torch.cat([pos for pos, _ in seen])
    assert covered.tolist() == list(range(len(covered)))  # each position extended exactly once
    for pos, h in seen:
        torch.testing.assert_close(h, aux[pos], atol=1e-4, rtol=1e-4)


def test_packed_draft_matches_nn_linear_and_leaves_the_draft_as_is(llm, model):
    """The engine's draft copy runs its matmuls on packed weights: same logits and hidden
    states as the nn.Linear draft (to fp32 rounding) at chain and tree-step shapes; the
    draft itself keeps nn.Linear (training, offline evaluation) and shares its embedding."""
    if not llm.onednn:
        pytest.skip("this torch has no oneDNN packed linear: the engine keeps nn.Linear")
    draft = tiny_draft(model, 128)
    packed = packed_draft(llm, draft)
    assert packed is not draft and packed.embed_tokens is draft.embed_tokens
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 9  # fc, q/k/v/o, mlp, head
    assert sum(isinstance(m, torch.nn.Linear) for m in draft.modules()) == 9
    g = torch.Generator().manual_seed(0)
    n, H = 12, draft.config.hidden_size
    ids = torch.randint(0, 256, (1, n + 4), generator=g)
    aux = torch.randn(1, n, draft.config.fc_in_features, generator=g)
    h4 = torch.randn(1, 4, H, generator=g)
    mask = torch.ones(4, n + 4, dtype=torch.bool)
    outs = []
    for d in (draft, packed):
        c = DraftCache()
        with torch.no_grad():
            a = d(ids[:, :n], aux, torch.arange(n)[None], cache=c)  # extend (fc)
            b = d(ids[:, n : n + 1], h4[:, :1], torch.tensor([[n]]), cache=c)  # chain step
            c.crop(n)
            t = d(ids[:, n:], h4, torch.full((1, 4), n), cache=c, attn_mask=mask)  # tree step
        outs.append((a, b, t))
    for x, y in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
    assert SpecDecoder(llm, draft).draft is not draft  # the engine's default
    assert SpecDecoder(llm, draft, pack_draft=False).draft is draft
    assert packed_draft(Llama(model, torch.float32, onednn=False), draft) is draft  # not packed
    oracle = tiny_draft(model, 128, cls=OracleDraft)  # a subclass may keep its own state
    assert packed_draft(llm, oracle) is oracle


def test_commit_path_compacts_tree_kv(llm):
    c = llm.new_cache(1, 16)
    c.lengths[0] = 3
    c.k[:, 0, :, 3:9] = torch.arange(6.0)[None, None, :, None]
    commit_path(c, 3, torch.tensor([0, 2, 5]))
    assert c.lengths.tolist() == [6]
    assert c.k[0, 0, 0, 3:6, 0].tolist() == [0.0, 2.0, 5.0]


def test_tree_mask_and_children():
    t = DraftTree(tokens=torch.tensor([9, 1, 2, 3, 4]), parents=[-1, 0, 0, 1, 3],
                  depth=torch.tensor([0, 1, 1, 2, 3]))  # fmt: skip
    assert t.children == [[1, 2], [3], [], [4], []] and not t.is_chain
    assert t.mask()[4].tolist() == [True, True, False, True, True]


# ---------------------------------------------------------------- parameters / mismatch


def test_spec_error_is_a_workbench_error():
    assert issubclass(SpecError, WorkbenchError)


def test_sglang_parameter_rules():
    assert tuple(vars(resolve_params()).values()) == (5, 4, 8)
    with pytest.raises(SpecError, match="all three"):
        resolve_params(3, None, 4)
    with pytest.warns(UserWarning, match="forces num_draft_tokens = num_steps \\+ 1"):
        assert resolve_params(3, 1, 8).num_draft_tokens == 4
    with pytest.raises(SpecError, match=r"num_draft_tokens - 1 <= topk \+ \(num_steps - 1\)"):
        resolve_params(2, 2, 8)  # 7 > 2 + 1 * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert str(resolve_params(2, 2, 7)) == "2/2/7"


def test_mismatched_draft_is_named(llm, model):
    other = tiny_target(vocab=300, seed=1)
    with pytest.raises(SpecError, match="vocab"):
        SpecDecoder(llm, tiny_draft(other, 64))
    wide = tiny_target(hidden=96, seed=1)
    with pytest.raises(SpecError, match="hidden size"):
        SpecDecoder(llm, tiny_draft(wide, 64))
    with pytest.raises(SpecError, match="fc width"):
        SpecDecoder(llm, tiny_draft(model, 64, ids=(0, 1)), layer_ids=LayerIds((0, 1, 2)))


def test_choose_params_falls_back_to_no_speculation():
    plain = Measurement(None, 100, 10.0)
    fast = Measurement(SpecParams(2, 1, 3), 100, 6.0, tau=1.9)
    slow = Measurement(SpecParams(5, 4, 8), 100, 12.0, tau=1.1)
    assert choose_params([plain, fast, slow])[0] == SpecParams(2, 1, 3)
    chosen, why = choose_params([plain, slow])
    assert chosen is None and "no speculation" in why and "too weak" in why
    # a second baseline (a slow HF generate) would make a losing setting look like a win
    hf = Measurement(None, 100, 30.0)
    with pytest.raises(ValueError, match="exactly one baseline"):
        choose_params([hf, plain, slow])


def _row(config, tok_s, plain=10.0, hf=5.0):
    method = {"-": "engine (no speculation)"}.get(config, "EAGLE-3")
    return {"method": method, "config": config, "tok_s": tok_s, "tau": 1.0,
            "vs_hf": tok_s / hf, "vs_plain": tok_s / plain}  # fmt: skip


def test_a_slower_than_plain_setting_is_never_recorded_as_a_win():
    """Calibration: every setting is slower than plain. The served setting must be plain and the
    best speedup recorded as measured (below 1), not rounded up to a win."""
    calib = [Measurement(None, 100, 10.0), Measurement(SpecParams(2, 1, 3), 100, 11.0, tau=1.2),
             Measurement(SpecParams(3, 1, 4), 100, 13.0, tau=1.3)]  # fmt: skip
    served, _ = choose_params(calib)
    assert served is None
    rows = [_row("-", 10.0), _row("2/1/3", 9.0), _row("3/1/4", 7.5)]
    f = speed_figures(served, rows)
    assert f["served_config"] == "plain" and f["served_speedup"] is None
    assert f["best_speedup"] == pytest.approx(0.9) and f["best_speedup_config"] == "2/1/3"
    assert f["served_speedup_vs_hf"] == pytest.approx(2.0)  # plain decoding against HF generate


def test_served_setting_is_reported_as_measured_on_other_prompts():
    """Chosen on calibration prompts, slower on the reporting ones: the figures say so."""
    served = SpecParams(2, 1, 3)
    rows = [_row("-", 10.0), _row("2/1/3", 9.5), _row("3/1/4", 10.5)]
    f = speed_figures(served, rows)
    assert f["served_config"] == "2/1/3" and f["served_speedup"] == pytest.approx(0.95)
    assert f["best_speedup"] == pytest.approx(1.05) and f["best_speedup_config"] == "3/1/4"
    with pytest.raises(ValueError, match="not measured"):
        speed_figures(SpecParams(5, 4, 8), rows)


def test_served_setting_takes_the_calibrated_setting_and_says_when_it_falls_back():
    fallback = SpecParams(3, 1, 4)
    assert served_setting("1/1/2", fallback)[0] == SpecParams(1, 1, 2)
    assert served_setting(" 3/2/6 ", fallback)[0] == SpecParams(3, 2, 6)
    got, why = served_setting("", fallback)
    assert got == fallback and "3/1/4" in why
    got, why = served_setting("plain", fallback)  # the calibration chose no speculation
    assert got == fallback and "plain decoding" in why and "3/1/4" in why
    for bad in ("3-1-4", "3/1", "a/b/c", "3/1/4/5"):
        with pytest.raises(ValueError, match="steps/topk/tokens"):
            served_setting(bad, fallback)
    with pytest.raises(SpecError, match="hard limit|>= 1"):
        served_setting("0/1/1", fallback)


def test_speed_report_refuses_to_choose_on_the_reporting_prompts():
    """The served setting is chosen on other prompts than the figures are measured on."""
    with pytest.raises(ValueError, match="both calibration and reporting"):
        speed_report(None, None, None, [[5, 6, 7]], [[1, 2], [5, 6, 7]], [], 8, [])
    with pytest.raises(ValueError, match="needs calibration and reporting prompts"):
        speed_report(None, None, None, [], [[1, 2]], [], 8, [])


# ---------------------------------------------------------------- trace


def test_trace_schema_and_reader(llm, model, prompts, reference, tmp_path):
    draft = tiny_draft(model, 256, cls=OracleDraft)
    draft.ref = prompts[0] + reference[0]
    path = tmp_path / "trace.jsonl"
    tr = TraceWriter(path, run_id="r1", hidden_norms=True)
    g = SpecDecoder(llm, draft, resolve_params(3, 2, 5), trace=tr).generate(prompts[0], 48)
    with open(path, "a") as f:
        f.write('{"run_id": "r1", "cycle": 99, "accepted": [2], "future_field": 1}\n')
    recs = read_trace(path)
    assert recs[-1].extra == {"future_field": 1} and recs[-1].num_steps is None
    recs = recs[:-1]
    assert len(recs) == g.stats.verify_forwards and [r.cycle for r in recs] == list(
        range(len(recs))
    )
    assert sum(r.accepted[0] for r in recs) == g.stats.decode_tokens
    assert math.isclose(pooled_tau([r.accepted for r in recs]), g.stats.tau)
    r = recs[1]
    assert (r.num_steps, r.topk, r.num_draft_tokens, r.batch_size) == (3, 2, 5, 1)
    assert r.hidden_in_dims == [3 * 64, 64, 64] and len(r.hidden_norms) == 3
    assert len(r.aux_norms) == 3 and r.total_ms >= r.draft_ms + r.verify_ms


# ---------------------------------------------------------------- sampling (lossless)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square with cells of expected count < 5 pooled into one."""
    exp = probs * counts.sum()
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


class TableDraft(Eagle3Draft):
    """A draft whose logits at given positions come from a table (close to, not equal to, p)."""

    table: dict[int, torch.Tensor] = {}

    def forward(self, input_ids, hidden, position_ids, cache=None, attn_mask=None, **kw):
        logits, h = super().forward(input_ids, hidden, position_ids, cache, attn_mask, **kw)
        logits = logits.clone()
        for b in range(logits.shape[0]):
            for t in range(logits.shape[1]):
                row = self.table.get(int(position_ids[b, t]))
                if row is not None:
                    logits[b, t] = row
        return logits, h


@pytest.mark.parametrize("s,k,n", [(2, 1, 3), (2, 2, 4)])
def test_sampling_matches_target_distribution(s, k, n):
    """Tokens 2 and 3 (drawn through accept/reject/residual/bonus) follow the target's law."""
    V, T = 16, 1.0
    m = tiny_target(vocab=V, seed=5, layers=3, hidden=32)
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)  # peaked, context-dependent target
    llm = Llama(m, torch.float32)
    prompt = [3, 7, 11]
    with torch.no_grad():  # exact joint of the first three new tokens by enumeration
        p1 = torch.softmax(m(torch.tensor([prompt])).logits[0, -1] / T, -1)
        x12 = torch.cartesian_prod(torch.arange(V), torch.arange(V))
        lg = m(torch.cat([torch.tensor(prompt).expand(V * V, 3), x12], 1)).logits
        p2 = torch.softmax(lg[::V, -2] / T, -1)  # rows x1 = 0..V-1
        p3 = torch.softmax(lg[:, -1] / T, -1)
    joint12 = p1[:, None] * p2
    marg2, marg3 = joint12.sum(0), (joint12.flatten()[:, None] * p3).sum(0)
    draft = tiny_draft(m, 12, seed=6, cls=TableDraft)  # 4 tokens the draft never proposes
    ids = draft.draft_ids
    qs = {}
    for pos, marg in ((2, marg2), (3, marg3)):  # draft position 2 proposes x2, 3 proposes x3
        q = 0.5 * marg[ids] / marg[ids].sum() + 0.5 / len(ids)
        qs[pos] = q
        draft.table = {**draft.table, pos: q.log()}
        full_q = torch.zeros(V).index_put_((ids,), q)
        assert 0.5 * float((full_q - marg).abs().sum()) > 0.15  # q is visibly not p
    dec = SpecDecoder(llm, draft, resolve_params(s, k, n), temperature=T, seed=0)
    N = 1200
    c2, c3, stats = torch.zeros(V), torch.zeros(V), []
    for _ in range(N):
        g = dec.generate(prompt, 3)
        c2[g.tokens[1]] += 1
        c3[g.tokens[2]] += 1
        stats.append(g.stats)
    assert chi2_pvalue(c2, marg2) > 1e-3
    assert chi2_pvalue(c3, marg3) > 1e-3
    assert pooled_tau([st.accepted for st in stats]) > 1.3  # drafts do get accepted (and rejected)
    assert any(st.accepted[0] == 1 for st in stats)


# ---------------------------------------------------------------- embedded default


@pytest.mark.slow
@pytest.mark.parametrize("mkl_rows", [None, 0])  # the default path, and all-oneDNN (bitwise)
def test_embedded_default_greedy_exact(embedded_dir, mkl_rows):
    from workbench.data import load_mtbench, prompt_ids
    from workbench.draft.model import DraftConfig
    from workbench.layers import default_layer_ids
    from workbench.target import load_target

    t = load_target(embedded_dir)
    llm = Llama(t.model, torch.float32, mkl_rows=mkl_rows)
    p = prompt_ids(t.tokenizer, load_mtbench()[0].messages(1))
    ref = generate_batch(llm, [p], 40, None, dtype=torch.float32, progress=False)[0]
    cfg = DraftConfig.from_target(t.config, default_layer_ids(t.num_layers), 8192)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    init_from_target(draft, t.model, layer_index=t.num_layers - 1, embed_half_scale=0.0)
    for s, k, n in [(3, 1, 4), (3, 4, 8)]:
        g = SpecDecoder(llm, draft, resolve_params(s, k, n)).generate(p, 40)
        assert g.tokens == ref, (s, k, n)
