"""Accept-length figures: each function of `workbench.metrics` on hand-counted cases, then
SGLang's identities on real engine runs (tiny target, a draft that knows the answer except at
planted positions, so cycles accept 0..num_steps draft tokens)."""

from __future__ import annotations

import pytest
import torch

from workbench import metrics
from workbench.draft.model import DraftConfig, Eagle3Draft, init_from_target
from workbench.engine import SpecDecoder, TraceWriter, resolve_params
from workbench.inspect import evaluate_draft
from workbench.layers import LayerIds
from workbench.llama import Llama

# ---------------------------------------------------------------- definitions


def test_tau_conventions():
    assert metrics.tau(12, 4) == 3.0 and metrics.tau(5, 0) == 0.0
    assert metrics.tau_sglang(13, 4) == 3.25 and metrics.tau_sglang(5, 0) == 0.0
    # plain decoding: one decode token per forward; SGLang's count adds the prefill token
    assert metrics.tau(9, 9) == 1.0 and metrics.tau_sglang(10, 9) == pytest.approx(10 / 9)


def test_pooled_tau_is_not_the_mean_of_per_request_tau():
    accepted = [[4] * 10, [1], []]  # a long well-drafted answer, a short one, an empty one
    assert metrics.pooled_tau(accepted) == pytest.approx(41 / 11)
    assert metrics.mean_request_tau(accepted) == pytest.approx((4 + 1) / 2)  # [] left out
    assert metrics.pooled_tau([]) == 0.0 and metrics.mean_request_tau([[]]) == 0.0
    assert metrics.pooled_tau_sglang([42, 2], [10, 1]) == pytest.approx(44 / 11)


def test_acceptance_counts_and_per_position_acceptance():
    acc = [[1, 4, 2, 3, 1]]  # drafts accepted per cycle: 0, 3, 1, 2, (0: last, censored)
    reached, accepted = metrics.acceptance_counts(acc, 3)
    assert (reached, accepted) == ([4, 3, 2], [3, 2, 1])
    assert metrics.acceptance_counts(acc, 3, drop_last=False) == ([5, 3, 2], [3, 2, 1])
    assert metrics.per_position_acceptance(acc, 3) == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert metrics.conditional_acceptance([4, 0], [3, 0]) == [0.75, 0.0]  # never reached: 0


def test_acceptance_from_histogram_matches_the_counts():
    acc = [1, 4, 2, 3, 1, 4, 4]
    h = metrics.histogram_from_accepted(acc, 3)
    assert h == [2, 1, 1, 3] and sum(h) == len(acc)
    assert sum(i * n for i, n in enumerate(h)) == sum(a - 1 for a in acc)
    from_counts = metrics.conditional_acceptance(*metrics.acceptance_counts([acc], 3, False))
    assert metrics.acceptance_from_histogram(h) == pytest.approx(from_counts)
    assert metrics.histogram_from_accepted([9], 3) == [0, 0, 0, 1]  # clamped to num_draft


def test_simulated_tau_bonus_and_specforge_convention():
    a = [0.75, 2 / 3, 0.5]
    assert metrics.simulated_tau_curve(a) == pytest.approx([1.75, 2.25, 2.5])
    assert metrics.simulated_tau(a) == pytest.approx(2.5)
    assert metrics.simulated_acc_len(a) == pytest.approx(1.5)  # no bonus token
    assert metrics.simulated_tau([]) == 1.0 and metrics.simulated_tau([1.0, 1.0]) == 3.0


def test_speedup_is_never_clamped():
    assert metrics.speedup(8.0, 10.0) == pytest.approx(0.8)
    assert metrics.speedup(15.0, 10.0) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="positive"):
        metrics.speedup(1.0, 0.0)


def test_bootstrap_pooled_tau_is_paired():
    tok = [[4, 10, 2, 30], [4, 10, 2, 30], [8, 20, 4, 60]]
    ver = [[2, 5, 2, 10], [2, 5, 2, 10], [2, 5, 2, 10]]
    boot = metrics.bootstrap_pooled_tau(tok, ver, 200, seed=0)
    assert boot.shape == (3, 200)
    assert (boot[0] == boot[1]).all()  # same requests resampled for every row
    assert boot[2] == pytest.approx(2 * boot[0])
    assert boot[0].min() >= 1.0 and boot[0].max() <= 3.0  # within the per-request τ range


def test_sglang_identity_problems_on_hand_made_meta():
    ok = {"completion_tokens": 13, "spec_verify_ct": 4, "spec_accept_length": 3.25,
          "spec_correct_drafts_histogram": [1, 0, 1, 2], "spec_num_correct_drafts": 8}  # fmt: skip
    assert metrics.sglang_identity_problems(ok) == []
    assert metrics.sglang_identity_problems({"completion_tokens": 5}) == []  # plain serving
    bad = ok | {"spec_accept_length": 3.0}
    assert "spec_accept_length" in metrics.sglang_identity_problems(bad)[0]


# ---------------------------------------------------------------- identities on engine runs


class ScriptedDraft(Eagle3Draft):
    """The real draft (caches, masks, fc run), whose logits then name `ref[position + 2]`,
    the target's true greedy continuation, except at positions % 11 in (2, 3, 7) (a wrong token)."""

    ref: list[int] = []

    def forward(self, input_ids, hidden, position_ids, cache=None, attn_mask=None, **kw):
        logits, h = super().forward(input_ids, hidden, position_ids, cache, attn_mask, **kw)
        out = torch.zeros_like(logits)
        t2d = torch.cumsum(self.t2d.long(), 0) - 1  # target id -> draft index
        for b in range(out.shape[0]):
            for t in range(out.shape[1]):
                p = int(position_ids[b, t]) + 2
                if p < len(self.ref) and self.t2d[self.ref[p]]:
                    truth = int(t2d[self.ref[p]])
                    out[b, t, (truth + 1) % out.shape[-1] if p % 11 in (2, 3, 7) else truth] = 10.0
        return out, h


STEPS = 3
MAX_NEW = 32


@pytest.fixture(scope="module")
def engine_runs(tiny_target):
    """Per (params, prompt): the engine's Generation and that request's trace records."""
    torch.set_num_threads(1)
    model = tiny_target.model
    llm = Llama(model, torch.float32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (7, 19, 12)]
    plain = SpecDecoder(llm, None)
    refs = [p + plain.generate(p, MAX_NEW).tokens for p in prompts]
    vocab = sorted({t for r in refs for t in r} | set(range(64)))
    draft = ScriptedDraft(DraftConfig.from_target(model.config, LayerIds((1, 3, 5)), len(vocab)))
    draft.set_vocab(torch.tensor(vocab))
    draft = init_from_target(draft, model).eval()
    runs = {}
    for s, k, n in ((STEPS, 1, STEPS + 1), (STEPS, 2, 5)):
        params = resolve_params(s, k, n)
        out = []
        for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
            draft.ref = ref
            tr = TraceWriter()
            gen = SpecDecoder(llm, draft, params, trace=tr).generate(p, MAX_NEW, request_id=str(i))
            assert gen.tokens == ref[len(p) :]  # greedy speculation is exact
            out.append((gen, tr.records))
        runs[str(params)] = out
    return {"runs": runs, "llm": llm, "draft": draft, "prompts": prompts, "refs": refs}


def test_engine_traces_satisfy_sglang_identities(engine_runs):
    for name, runs in engine_runs["runs"].items():
        accepted_any = set()
        for gen, recs in runs:
            st, verify_ct = gen.stats, len(recs)  # the trace counts verify forwards on its own
            hist = metrics.histogram_from_accepted([r.accepted[0] for r in recs], STEPS)
            accepted_any |= {i for i, c in enumerate(hist) if c}
            # accept length = completion tokens / verify count
            length = metrics.tau_sglang(len(gen.tokens), verify_ct)
            assert length == pytest.approx(st.completion_tokens / st.verify_forwards)
            assert length == pytest.approx(st.tau + 1 / verify_ct)  # prefill token counted
            # the histogram sums to the verify count
            assert sum(hist) == verify_ct == st.verify_forwards
            # Σ i·h[i] = accepted draft tokens: every token but the prefill's and one target
            # token per cycle was an accepted draft token
            assert sum(i * c for i, c in enumerate(hist)) == len(gen.tokens) - 1 - verify_ct
            meta = st.meta_info(STEPS)
            assert meta["spec_correct_drafts_histogram"] == hist
            assert metrics.sglang_identity_problems(meta) == [], name
        assert {0, STEPS} <= accepted_any and len(accepted_any) >= 3, (name, accepted_any)


def test_sglang_identity_problems_flags_a_tampered_engine_meta(engine_runs):
    gen, _ = engine_runs["runs"][f"{STEPS}/1/{STEPS + 1}"][1]
    meta = gen.stats.meta_info(STEPS)
    assert metrics.sglang_identity_problems(meta) == []
    h = list(meta["spec_correct_drafts_histogram"])
    i = next(j for j, c in enumerate(h) if c)
    moved = h[:i] + [h[i] - 1] + h[i + 1 :]
    moved[(i + 1) % len(h)] += 1  # one cycle recorded at the wrong accept count
    for tampered, needle in (
        ({"spec_accept_length": meta["spec_accept_length"] + 0.25}, "spec_accept_length"),
        ({"completion_tokens": meta["completion_tokens"] + 1}, "spec_accept_length"),
        ({"spec_correct_drafts_histogram": h + [1]}, "spec_verify_ct"),
        ({"spec_correct_drafts_histogram": moved}, "spec_num_correct_drafts"),
    ):
        problems = metrics.sglang_identity_problems(meta | tampered)
        assert any(needle in p for p in problems), (tampered, problems)


def test_eval_result_figures_agree_with_sglang_fields(engine_runs):
    """The inspection's figures are the same numbers SGLang's fields give for these requests."""
    params = resolve_params(STEPS, 1, STEPS + 1)
    draft, prompts, refs = engine_runs["draft"], engine_runs["prompts"], engine_runs["refs"]
    draft.ref = refs[0]  # evaluate_draft runs one draft over every prompt: use the first only
    res = evaluate_draft(None, draft, prompts[:1], params, MAX_NEW, llm=engine_runs["llm"], eos=())
    req = res.requests[0]
    assert res.tau_sglang == pytest.approx(metrics.tau_sglang(len(req.tokens), len(res.cycles)))
    hist = metrics.histogram_from_accepted(req.accepted, STEPS)
    uncensored = metrics.histogram_from_accepted(req.accepted[:-1], STEPS)
    assert res.accept_pos == pytest.approx(metrics.acceptance_from_histogram(uncensored))
    assert sum(hist) == len(res.cycles) == req.verify_forwards
    assert res.sim_tau == pytest.approx(metrics.simulated_tau(res.accept_pos))
