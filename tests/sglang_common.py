"""Shared by the real-SGLang test modules (each starts one server): the embedded target, a
draft exported in SGLang's layout, and the local engine's greedy answers to compare with.

The draft is built, not trained: fc passes the last aux layer (output of layer 26 of 30)
through, the mid layer adds nothing (o_proj and down_proj zero), norm and lm_head are the
target's. Its first guess is the target's logit lens at layer 26 of the previous position,
i.e. it proposes to repeat the last token, which repetitive prompts accept often and other
prompts rarely: varied, non-trivial accept lengths from seconds of set-up. Agreement
between the engines needs identical semantics, not a good draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from workbench.serving import sglang

PROMPTS = [
    "a b c a b c a b c a b c a b c",  # the target goes on " c c c ...": repeats accepted
    "The capital of France is",
    "no no no no no no no no no no",
]
MAX_NEW_TOKENS = 16
GENERIC = [  # prompts of no special form, for the trace plugin's norms and accept counts
    "Water boils at a lower temperature on a high mountain because",
    "The three primary colours of light are",
    "A good way to learn a new language is to",
]
TRACE_NEW_TOKENS = 24
CHAIN = (3, 1, 4)  # steps / topk / draft tokens
STARTUP_DEADLINE_S = 400.0


def need_server_env() -> Path:
    py = sglang.server_python()
    if py is None:
        pytest.skip(
            "no SGLang server environment (.venv-sglang): `make test` builds it with "
            "`make sglang-env`; run that first"
        )
    return py


def export_repeat_draft(target, out: Path) -> Path:
    from workbench.draft.export import export_sglang
    from workbench.draft.model import DraftConfig, Eagle3Draft
    from workbench.layers import default_layer_ids

    cfg_t = target.model.config
    ids = default_layer_ids(cfg_t.num_hidden_layers)
    cfg = DraftConfig.from_target(cfg_t, ids, draft_vocab_size=cfg_t.vocab_size)
    d = Eagle3Draft(cfg)
    H = cfg.hidden_size
    with torch.no_grad():
        d.fc.weight.zero_()
        d.fc.weight[:, (cfg.num_aux - 1) * H :] = torch.eye(H)
        d.midlayer.self_attn.o_proj.weight.zero_()
        d.midlayer.mlp.down_proj.weight.zero_()
        d.norm.weight.copy_(target.model.model.norm.weight)
        d.lm_head.weight.copy_(target.model.get_output_embeddings().weight)
    return export_sglang(d, out, dtype=torch.float32)


@dataclass
class Reference:
    """The local engine's greedy answers: plain tokens, speculative tokens and stats."""

    prompts: list[list[int]]
    plain: list[list[int]]
    spec: list[list[int]] = field(default_factory=list)
    meta: list[dict] = field(default_factory=list)  # RequestStats.meta_info (SGLang's fields)


def engine_reference(target, draft_dir: Path | None) -> Reference:
    from workbench.draft.load import load_draft
    from workbench.engine import SpecDecoder, SpecParams
    from workbench.llama import Llama

    tok = target.tokenizer
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    eos = [tok.eos_token_id]
    llm = Llama(target.model, "float32")
    plain = SpecDecoder(llm, None)
    ref = Reference(prompts, [plain.generate(p, MAX_NEW_TOKENS, eos).tokens for p in prompts])
    if draft_dir is not None:
        loaded = load_draft(draft_dir, target.model)
        dec = SpecDecoder(llm, loaded.draft, SpecParams(*CHAIN), layer_ids=loaded.layer_ids)
        for i, p in enumerate(prompts):
            g = dec.generate(p, MAX_NEW_TOKENS, eos, request_id=str(i))
            ref.spec.append(g.tokens)
            ref.meta.append(g.stats.meta_info(CHAIN[0]))
    return ref


def cpu_spec(target_dir: Path, draft_dir: Path | None = None) -> sglang.ServeSpec:
    s, k, n = CHAIN if draft_dir is not None else (None, None, None)
    return sglang.ServeSpec(
        target=str(target_dir),
        draft=None if draft_dir is None else str(draft_dir),
        speculative_num_steps=s,
        speculative_eagle_topk=k,
        speculative_num_draft_tokens=n,
        dtype="float32",
        device="cpu",
        # one thread: the test process computes the engine's reference while SGLang starts
        env={"OMP_NUM_THREADS": "1"},
    )


def norm_manifest(target, draft_dir: Path, out: Path) -> dict:
    """A capture of the draft's layers on a few generic conversations: the norm statistics
    the live wiring check compares a served trace with."""
    from workbench.capture import CaptureConfig, capture
    from workbench.serving.wiring_live import served_layer_ids

    topics = ["rivers", "bread", "chess", "rain", "trains", "music", "bees", "glass", "maps"]
    convs = [
        [
            {"role": "user", "content": f"Tell me something about {t}."},
            {
                "role": "assistant",
                "content": f"Here are a few facts about {t}. People have "
                f"studied {t} for a long time, and there is much to say about how {t} work.",
            },
        ]  # fmt: skip
        for t in topics
    ]
    cfg = CaptureConfig(served_layer_ids(draft_dir), dtype="float32", max_length=128)
    return capture(target, convs, out, cfg, progress=False)
