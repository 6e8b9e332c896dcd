"""The teacher-forced wiring audit: both verdicts and the inconclusive case on a tiny model.

A tiny random Llama (vocab 64, 6 layers) is the target; a draft is trained for a few seconds
(step 0, teacher-forced) on its configured aux layers [1, 3, 4]. The same weights configured
with every id shifted by one play the field report's off-by-one export.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from workbench.draft.model import DraftConfig, Eagle3Draft, init_from_target
from workbench.layers import LayerIds
from workbench.llama import Llama
from workbench.wiring import (
    CONFIGURED_WINS,
    INCONCLUSIVE,
    SHIFTED_WINS,
    TFSequence,
    decisiveness,
    paired_bootstrap,
    response_scored,
    target_argmax,
    teacher_forced_audit,
    wiring_candidates,
)

V, H, N, T = 64, 32, 6, 32
IDS = LayerIds((1, 3, 4))


@pytest.fixture(scope="module")
def target(one_thread):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=2 * H, num_hidden_layers=N, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=V, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, Llama(model, torch.float32)


def _random_sequences(n: int, seed: int) -> list[TFSequence]:
    g = torch.Generator().manual_seed(seed)
    return [
        TFSequence(torch.randint(0, V, (T,), generator=g).tolist(), [True] * T, "random")
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def trained(target):
    """A draft trained briefly (step 0) on the configured wiring."""
    model, llm = target
    torch.manual_seed(1)
    draft = init_from_target(Eagle3Draft(DraftConfig.from_target(model.config, IDS, V)), model)
    x = torch.tensor([s.ids for s in _random_sequences(256, seed=2)])
    with torch.no_grad():
        r = llm(x, None, hidden_layers=list(IDS.canonical), logits="none")
        aux = torch.cat([r.hidden[i][:, :-1] for i in IDS.canonical], -1)
        tg = target_argmax(llm, r.final_hidden.reshape(-1, H)).reshape(len(x), T)[:, 1:]
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(3)
    for _ in range(250):
        j = torch.randint(0, len(x), (16,), generator=g)
        logits, _ = draft(x[j, 1:], aux[j], torch.arange(T - 1)[None].expand(16, -1))
        loss = F.cross_entropy(logits.reshape(-1, V), tg[j].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


def _with_ids(draft: Eagle3Draft, ids: LayerIds) -> Eagle3Draft:
    """The same weights with another configured wiring (an export with edited ids)."""
    d = Eagle3Draft(dataclasses.replace(draft.config, layer_ids=ids))
    d.load_state_dict(draft.state_dict())
    d.embed_tokens.copy_(draft.embed_tokens)
    return d.eval()


def test_trained_draft_configured_wiring_wins(target, trained):
    _, llm = target
    a = teacher_forced_audit(llm, trained, _random_sequences(32, seed=4))
    assert [r.name for r in a.rows] == ["configured", "shift-1", "shift+1", "embedding_first"]
    assert a.verdict == CONFIGURED_WINS and a.best == "configured"
    assert all(r.delta_hi < 0 for r in a.rows[1:])
    assert a.rows[0].accept > 0.3  # it did learn: far above chance (1/64)
    assert a.positions == 32 * (T - 2)
    line = a.result_line()
    assert line.startswith("RESULT verdict=configured_wins best=configured delta_lo=-")
    assert float(line.split("delta_hi=")[1]) < 0


def test_ids_shifted_by_one_name_the_shifted_wiring(target, trained):
    _, llm = target
    a = teacher_forced_audit(llm, _with_ids(trained, IDS.shifted(1)), _random_sequences(32, 4))
    assert a.rows[0].layer_ids == [2, 4, 5]
    assert a.verdict == SHIFTED_WINS and a.best == "shift-1"
    best = a.best_alternative
    assert best.name == "shift-1" and best.layer_ids == [1, 3, 4] and best.delta_lo > 0
    assert a.result_line().startswith("RESULT verdict=shifted_wins best=shift-1 delta_lo=")


def test_too_few_sequences_is_inconclusive(target, trained):
    _, llm = target
    a = teacher_forced_audit(llm, trained, _random_sequences(3, seed=4))
    assert a.verdict == INCONCLUSIVE and "too few sequences" in a.reason
    assert decisiveness(a)["decisive"] is False


def test_a_draft_that_ignores_its_aux_states_is_inconclusive(target, trained):
    """fc = 0: every wiring gives the same draft output, so no CI can exclude 0."""
    _, llm = target
    d = _with_ids(trained, IDS)
    with torch.no_grad():
        d.fc.weight.zero_()
    a = teacher_forced_audit(llm, d, _random_sequences(32, seed=4))
    assert a.verdict == INCONCLUSIVE
    assert all(r.delta == 0 and r.delta_lo == 0 == r.delta_hi for r in a.rows[1:])
    power = decisiveness(a)
    assert power["margin"] == 0 and power["positions_needed"] == float("inf")


def test_decisiveness_reports_positions_and_ci(target, trained):
    _, llm = target
    a = teacher_forced_audit(llm, trained, _random_sequences(32, seed=4))
    d = decisiveness(a)
    assert d["positions"] == a.positions and d["sequences"] == 32 and d["decisive"]
    assert d["margin"] > 1 and d["positions_needed"] < a.in_vocab
    hard = next(r for r in a.rows if r.name == d["hardest_alternative"])
    assert d["ci_width"] == pytest.approx(hard.delta_hi - hard.delta_lo)


def test_one_target_forward_per_sequence(target, trained, monkeypatch):
    _, llm = target
    calls = []
    orig = Llama.forward

    def counting(self, tokens, *a, **kw):
        calls.append(sorted(kw.get("hidden_layers", ())))
        return orig(self, tokens, *a, **kw)

    monkeypatch.setattr(Llama, "__call__", counting)
    teacher_forced_audit(llm, trained, _random_sequences(4, seed=5), min_sequences=1)
    # every layer the four wirings read, recorded in one forward per sequence
    assert calls == [[-1, 0, 1, 2, 3, 4, 5]] * 4


def test_wiring_candidates_drop_out_of_range_and_duplicates():
    w = wiring_candidates(LayerIds((1, 3, 5)), 6)
    assert list(w) == ["configured", "shift-1", "embedding_first"]  # shift+1 reaches layer 6
    assert w["embedding_first"].ids == (-1, 3, 5)
    w = wiring_candidates(LayerIds((0, 2, 4)), 6, shifts=(0, -1))
    assert list(w) == ["configured", "shift-1", "embedding_first"]  # shift+0 = configured
    assert w["shift-1"].ids == (-1, 1, 3)
    # ids in another convention are compared canonically
    w = wiring_candidates(LayerIds((2, 4, 5), "hf_hidden_states_index"), 6)
    assert w["configured"].ids == (1, 3, 4)


def test_response_scored_and_paired_bootstrap():
    assert response_scored([0, 0, 0, 1, 1]) == [False, True, True, False, False]
    assert response_scored([0, 0, 0, 1, 1], all_tokens=True) == [True, True, True, False, False]
    import numpy as np

    num = np.array([[1.0, 2.0, 3.0], [2.0, 3.0, 4.0]])
    d, lo, hi = paired_bootstrap(num, np.array([1.0, 1.0, 1.0]), 200, 0.9, 0)
    assert d[0] == 0 and d[1] == pytest.approx(1.0) and lo[1] == hi[1] == pytest.approx(1.0)


def test_result_line_is_parseable(target, trained):
    _, llm = target
    a = teacher_forced_audit(llm, trained, _random_sequences(8, seed=6))
    fields = dict(kv.split("=") for kv in a.result_line().split()[1:])
    assert set(fields) == {"verdict", "best", "delta_lo", "delta_hi"}
    assert fields["verdict"] in (CONFIGURED_WINS, SHIFTED_WINS, INCONCLUSIVE)
    json.dumps(a.table())  # the dataclass rows serialize for reports


# ---------------------------------------------------------------- CLI: a draft directory


def test_cli_audit_wiring_ends_with_result_line(tiny_target, tiny_target_dir, tmp_path, one_thread):
    """`workbench audit --wiring`: capture found from the export's provenance, target from
    --target; the held-out split + MT-bench continuations are scored; RESULT is the last line."""
    import re

    from typer.testing import CliRunner

    from workbench.capture import CaptureConfig, capture
    from workbench.cli import app
    from workbench.draft.export import export_sglang

    convs = [
        [{"role": "user", "content": f"Question {i}: " + "why? " * (i + 1)},
         {"role": "assistant", "content": "Because " + "it is so. " * (3 * i + 2)}]
        for i in range(24)
    ]  # fmt: skip
    cap = tmp_path / "cap"
    ids = LayerIds((1, 3, 4))
    capture(tiny_target, convs, cap, CaptureConfig(ids, dtype="float32", max_length=96),
            progress=False)  # fmt: skip
    model = tiny_target.model
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.from_target(model.config, ids, 512))
    draft.set_vocab(torch.sort(torch.randperm(model.config.vocab_size)[:512]).values)
    draft = init_from_target(draft, model)
    exp = export_sglang(draft, tmp_path / "export", {"capture": str(cap)},
                        target_max_position_embeddings=2048)  # fmt: skip
    r = CliRunner().invoke(
        app, ["audit", "--wiring", "--draft", str(exp), "--target", str(tiny_target_dir)]
    )
    lines = r.output.strip().splitlines()
    assert r.exit_code in (0, 1), r.output
    assert re.fullmatch(
        r"RESULT verdict=(configured_wins|shifted_wins|inconclusive) best=\S+ "
        r"delta_lo=-?\d+\.\d+ delta_hi=-?\d+\.\d+",
        lines[-1],
    ), lines[-1]
    assert "teacher-forced wiring audit" in r.output and "held-out" in r.output
    assert "continuation" in r.output  # greedy continuations of MT-bench prompts
    assert r.output.count("norms on the capture's tokens") == 3 and "<-" not in r.output
    # served one layer deeper than captured: the norm check names the captured layers, exit 1
    off = Eagle3Draft(DraftConfig.from_target(model.config, LayerIds((2, 4, 5)), 512))
    off.load_state_dict(draft.state_dict())
    exp2 = export_sglang(off, tmp_path / "off", {"capture": str(cap)},
                         target_max_position_embeddings=2048)  # fmt: skip
    r = CliRunner().invoke(
        app, ["audit", "--wiring", "--draft", str(exp2), "--target", str(tiny_target_dir)]
    )
    assert r.exit_code == 1, r.output
    for slot, (held, served) in enumerate([(1, 2), (3, 4), (4, 5)]):
        assert f"slot {slot}: served layer {served}" in r.output
        assert f"holds live layer {held}'s states" in r.output, r.output
    # without a capture in the provenance or --capture: a one-line error naming the fix
    bare = export_sglang(draft, tmp_path / "bare", {}, target_max_position_embeddings=2048)
    r = CliRunner().invoke(
        app, ["audit", "--wiring", "--draft", str(bare), "--target", str(tiny_target_dir)]
    )
    assert r.exit_code == 2 and "--capture" in r.output, r.output


def test_an_untrained_draft_is_inconclusive(target):
    """Random weights: wirings still change its (garbage) log-probs, but no verdict is named."""
    model, llm = target
    torch.manual_seed(5)
    d = Eagle3Draft(DraftConfig.from_target(model.config, IDS, V))
    d.embed_tokens.copy_(model.get_input_embeddings().weight.detach())
    a = teacher_forced_audit(llm, d.eval(), _random_sequences(32, seed=4))
    assert max(r.accept for r in a.rows) < 0.05
    assert a.verdict == INCONCLUSIVE and "too weak" in a.reason
    assert a.result_line().startswith("RESULT verdict=inconclusive")
