"""Draft training: TTT alignment, metrics, resume equality, guard rails, 2-process gloo DDP.

Fixtures: a tiny random Llama target (hidden 64, 4 layers, vocab 256) saved as an HF dir and
a capture directory in the exact shard/manifest format, written with capture.AuxRecorder.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from workbench.capture import AuxRecorder, CaptureReader
from workbench.draft.model import SGLANG_KEYS
from workbench.draft.train import (
    TrainConfig,
    TrainError,
    check_capture,
    config_from_args,
    latest_checkpoint,
    load_draft,
    profile,
    step_masks,
    summarize,
    train,
)
from workbench.layers import LayerIds
from workbench.target import Target, fingerprint_dir

H, V, N_LAYERS = 64, 256, 4
IDS = LayerIds((0, 1, 2))


def tiny_target(path: Path) -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        cfg = LlamaConfig(
            hidden_size=H,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=N_LAYERS,
            vocab_size=V,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
        )
        LlamaForCausalLM(cfg).save_pretrained(path)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    return Target(
        name="tiny", path=path, model=model, tokenizer=None, fingerprint=fingerprint_dir(path)
    )


@torch.no_grad()
def write_capture(
    target: Target, out: Path, n: int = 24, seed: int = 0, per_shard: int = 10
) -> Path:
    """Greedy continuations of random prompts (so the data is learnable), in the capture format."""
    from safetensors.torch import save

    g = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    p = 5
    prompts = torch.randint(0, V, (n, p), generator=g)
    full = target.model.generate(
        prompts, max_new_tokens=20, do_sample=False, pad_token_id=0
    )  # one batch
    lens = torch.randint(8, 21, (n,), generator=g).tolist()
    samples = [(full[i, : p + a], torch.arange(p + a) >= p) for i, a in enumerate(lens)]
    shards, rec = [], AuxRecorder(target, IDS)
    for si in range(0, n, per_shard):
        chunk = samples[si : si + per_shard]
        aux, last = [], []
        for ids, _ in chunk:
            target.model.model(input_ids=ids[None])
            a_, l_ = rec.pop()
            aux.append(a_[0])
            last.append(l_[0])
        t = {
            "input_ids": torch.cat([c[0] for c in chunk]),
            "loss_mask": torch.cat([c[1] for c in chunk]),
            "offsets": torch.tensor([0] + [c[0].numel() for c in chunk]).cumsum(0),
            "aux_hidden": torch.cat(aux).bfloat16(),
            "last_hidden": torch.cat(last).bfloat16(),
        }
        data = save(t)
        name = f"shard-{len(shards):05d}.safetensors"
        (out / name).write_bytes(data)
        shards.append(
            {
                "file": name,
                "sha256": hashlib.sha256(data).hexdigest(),
                "num_samples": len(chunk),
                "num_tokens": int(t["input_ids"].numel()),
                "num_loss_tokens": int(t["loss_mask"].sum()),
            }
        )
    rec.remove()
    man = {
        "format_version": 1,
        "target": {
            "name": "tiny",
            "fingerprint": target.fingerprint,
            "tokenizer_hash": "none",
            "num_layers": N_LAYERS,
            "hidden_size": H,
            "vocab_size": V,
            "architecture": "LlamaForCausalLM",
        },
        "layer_ids": IDS.to_dict(),
        "hidden_size": H,
        "dtype": "bfloat16",
        "max_length": 64,
        "num_samples": n,
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_loss_tokens": sum(s["num_loss_tokens"] for s in shards),
        "prompt_set": {"name": "random"},
        "norm_stats": {},
        "shards": shards,
        "versions": {},
        "git_sha": None,
    }
    (out / "manifest.json").write_text(json.dumps(man))
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_train")
    target = tiny_target(root / "target")
    cap = write_capture(target, root / "capture")
    return target, CaptureReader(cap), root


def base_cfg(root: Path, name: str, **kw) -> TrainConfig:
    cfg = TrainConfig(
        capture=str(root / "capture"),
        out=str(root / name),
        draft_vocab_size=128,
        ttt_len=3,
        lr=3e-3,
        batch_size=4,
        max_len=64,
        max_steps=8,
        val_fraction=0.2,
        eval_every=4,
        ckpt_every=3,
        log_every=1,
        progress=False,
        warmup=2,
    )
    return replace(cfg, **kw)


def test_step_masks_alignment():
    lm = torch.tensor([[0, 0, 1, 1, 1, 1, 0]], dtype=torch.bool)  # last token is padding
    inv = torch.tensor([[1, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    b = {"loss_mask": lm, "in_vocab": inv}
    m = step_masks(b, 3)
    # step 0, t: tok[t+2] assistant and argmax at t+1 in vocab
    assert m[0].tolist() == [[True, True, False, True, False, False]]
    assert m[1].tolist() == [[True, False, True, False, False]]  # tok[t+3] and argmax at t+2
    assert m[2].tolist() == [[False, True, False, False]]


def test_summarize_conditional_acceptance_and_tau():
    st = torch.tensor([[0, 8, 10, 8, 10], [0, 5, 10, 4, 8], [0, 1, 10, 1, 4]], dtype=torch.float)
    s = summarize(st)
    assert s["acc"] == [0.8, 0.5, 0.1] and s["a"] == [0.8, 0.5, 0.25]
    assert abs(s["tau"] - (1 + 0.8 + 0.4 + 0.1)) < 1e-9


def test_summarize_counts_out_of_vocab_targets_as_misses():
    # step 0: 8 of 10 in-vocab right; 12 positions in all (2 targets outside the draft vocab)
    st = torch.tensor(
        [[0, 8, 10, 8, 10, 8, 12, 8, 12], [0, 4, 10, 4, 8, 4, 12, 4, 8]], dtype=torch.float
    )
    s = summarize(st)
    assert s["acc"] == [0.8, 0.4] and s["acc_all"] == [8 / 12, 4 / 12]
    assert s["a_all"] == [8 / 12, 0.5] and abs(s["tau_all"] - (1 + 8 / 12 + 4 / 12)) < 1e-9
    assert abs(s["in_vocab"] - 10 / 12) < 1e-9
    assert "acc_all" not in summarize(st[:, :5])  # training stats: in-vocab figures only


def test_guard_rails(env, tmp_path):
    target, reader, root = env
    assert check_capture(reader, target) == IDS
    other = replace(target, fingerprint="0123456789abcdef", name="other")
    with pytest.raises(
        TrainError, match="target fingerprint: capture .* given target 0123456789abcdef"
    ):
        check_capture(reader, other)
    with pytest.raises(
        TrainError, match=r"layer ids: capture has \[0, 1, 2\].*requested \[0, 1, 3\]"
    ):
        check_capture(reader, target, "0,1,3")
    # the off-by-one: vLLM-style ids taken for canonical ones
    with pytest.raises(
        TrainError, match=r"capture has \[0, 1, 2\].*requested \[-1, 0, 1\].*input_of_layer"
    ):
        check_capture(reader, target, LayerIds((0, 1, 2), "input_of_layer"))
    assert check_capture(reader, target, LayerIds((1, 2, 3), "input_of_layer")) == IDS

    class Wide:  # a target with another hidden size
        fingerprint, name, num_layers, hidden_size, vocab_size = (
            target.fingerprint,
            "wide",
            4,
            96,
            V,
        )

    with pytest.raises(
        TrainError, match="hidden size: capture hidden_size=64, target hidden_size=96"
    ):
        check_capture(reader, Wide())

    class Conv:
        manifest, target_fingerprint = reader.manifest, reader.target_fingerprint
        layer_ids = IDS.to("input_of_layer")

        def __len__(self):
            return 0

    with pytest.raises(TrainError, match="layer convention"):
        check_capture(Conv(), target)


def test_train_smoke_metrics_checkpoint(env):
    target, reader, root = env
    cfg = base_cfg(root, "smoke", max_steps=10, ttt_len=3, lr=1e-2, epochs=1)
    s = train(cfg, target, reader)
    assert s["step"] == 10 and len(s["acc"]) == 3 and s["tau"] >= 1.0 and s["tok_s"] > 0
    # out-of-draft-vocab targets counted as misses: never better than the in-vocab figures
    assert 0 < s["in_vocab"] < 1  # 128 of 256 ids: some targets are outside
    assert all(x <= y + 1e-9 for x, y in zip(s["acc_all"], s["acc"], strict=True))
    assert 1.0 <= s["tau_all"] <= s["tau"]
    out = Path(cfg.out)
    recs = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    kinds = [r["event"] for r in recs]
    assert kinds[0] == "start" and kinds.count("train") == 10 and kinds.count("eval") >= 2
    tr = [r for r in recs if r["event"] == "train"]
    assert tr[-1]["loss"] < tr[0]["loss"]  # it learns (greedy data from the target)
    assert tr[-1]["acc"][0] > tr[0]["acc"][0]
    ck = latest_checkpoint(out)
    assert ck is not None and ck.name == "step-00000010" and Path(s["checkpoint"]) == ck
    assert len(list((out / "checkpoints").glob("step-*"))) <= cfg.keep_ckpts
    d = load_draft(out, target.model)
    assert set(d.state_dict()) == set(SGLANG_KEYS) and d.config.draft_vocab_size == 128
    st = torch.load(ck / "state.pt", weights_only=False)
    assert {"optimizer", "scheduler", "rng", "step", "epoch", "batch_in_epoch", "metrics"} <= set(
        st
    )
    assert (out / "vocab.json").is_file() and (out / "draft_config.json").is_file()


def test_bf16_autocast_trains(env):
    target, reader, root = env
    s = train(base_cfg(root, "bf16", amp="bf16", max_steps=3, ckpt_every=100), target, reader)
    assert s["step"] == 3 and all(0 <= a <= 1 for a in s["acc"])
    d = load_draft(s["out"])
    assert all(
        v.dtype in (torch.float32, torch.long, torch.bool) for v in d.state_dict().values()
    )  # fp32 master


def test_time_budget_stop_logs_its_final_eval(env):
    target, reader, root = env
    cfg = base_cfg(root, "budget", max_steps=10, ttt_len=2, epochs=1, time_budget_s=0.0)
    s = train(cfg, target, reader)
    assert s["step"] == 1 and latest_checkpoint(cfg.out).name == "step-00000001"
    last = json.loads(Path(cfg.out, "log.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "eval" and last["step"] == 1 and last["acc"] == s["acc"]


def test_resume_after_kill_equals_uninterrupted(env):
    target, reader, root = env
    full = base_cfg(
        root, "full_run", max_steps=None, epochs=2.0
    )  # several epochs: data position matters
    sa = train(full, target, reader)
    killed = replace(full, out=str(root / "killed"), stop_after=5)
    sk = train(killed, target, reader)
    assert sk["stopped"] and latest_checkpoint(killed.out).name == "step-00000003"
    sr = train(replace(killed, stop_after=None, resume=True), target, reader)
    assert sr["step"] == sa["step"]
    a = load_draft(full.out).state_dict()
    b = load_draft(killed.out).state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    la = [json.loads(x) for x in Path(full.out, "log.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in Path(killed.out, "log.jsonl").read_text().splitlines()]
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("tok_s",)} for r in rs]  # noqa: E731
    assert strip(la) == strip(lb)  # the killed run's tail is not duplicated in the log
    with pytest.raises(TrainError, match="lr: checkpoint"):
        train(replace(killed, resume=True, lr=1.0), target, reader)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, root: str, cfg: TrainConfig) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    target = tiny_target(Path(root) / "target")
    train(cfg, target, CaptureReader(Path(root) / "capture"))


def test_two_gloo_processes_match_single_process(env):
    import torch.multiprocessing as mp

    target, reader, root = env
    single = base_cfg(root, "single", max_steps=4, eval_every=100, ckpt_every=100, threads=None)
    train(single, target, reader)
    ddp = replace(single, out=str(root / "ddp2"))
    mp.spawn(_ddp_worker, args=(2, _free_port(), str(root), ddp), nprocs=2, join=True)
    a = load_draft(single.out).state_dict()
    b = load_draft(ddp.out).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4, msg=k)
    st = torch.load(latest_checkpoint(ddp.out) / "state.pt", weights_only=False)
    assert st["world_size"] == 2
    ev_a = [json.loads(x) for x in Path(single.out, "log.jsonl").read_text().splitlines()][-1]
    ev_b = [json.loads(x) for x in Path(ddp.out, "log.jsonl").read_text().splitlines()][-1]
    assert ev_a["event"] == ev_b["event"] == "eval"
    assert ev_a["count"] == ev_b["count"]
    assert ev_a["acc"] == pytest.approx(ev_b["acc"], abs=1e-6)


def test_profiles_and_cli_args():
    q, f = profile("quick"), profile("full", lr=1e-4)
    assert q.ttt_len == 5 and f.ttt_len == 5 and f.lr == 1e-4 and q.time_budget_s <= 15 * 60
    assert q.ttt_sample == f.ttt_sample == 0.25 and q.loss_on == f.loss_on == "all"
    cfg = config_from_args(
        [
            "--capture",
            "c",
            "--profile",
            "quick",
            "--ttt-len",
            "3",
            "--no-progress",
            "--init-layer",
            "29",
            "--betas",
            "0.9",
            "0.99",
        ]
    )
    assert (cfg.ttt_len, cfg.progress, cfg.init_layer, cfg.betas, cfg.lr) == (
        3,
        False,
        29,
        (0.9, 0.99),
        2e-3,
    )
    with pytest.raises(ValueError):
        profile("nope")
    cfg = config_from_args(["--capture", "c", "--ttt-sample", "0.5", "--loss-on", "all"])
    assert (cfg.ttt_sample, cfg.loss_on) == (0.5, "all")


def test_bad_ttt_sample_and_loss_on_are_refused(env):
    target, reader, root = env
    with pytest.raises(TrainError, match="ttt_sample"):
        train(base_cfg(root, "bad1", ttt_sample=0.0, max_steps=1), target, reader)
    with pytest.raises(TrainError, match="loss_on"):
        train(base_cfg(root, "bad2", loss_on="users", max_steps=1), target, reader)


def test_sampled_unroll_trains_and_resumes_exactly(env):
    """ttt_sample draws positions from the global RNG, which checkpoints carry: a killed and
    resumed run ends with the same weights as an uninterrupted one."""
    target, reader, root = env
    kw = dict(max_steps=8, ttt_len=3, ttt_sample=0.5, loss_on="all", ckpt_every=3, lr=1e-2)
    a = train(base_cfg(root, "samp_full", **kw), target, reader)
    cfg = base_cfg(root, "samp_kill", **kw)
    train(replace(cfg, stop_after=5), target, reader)  # killed after step 5 (ckpt at 3)
    b = train(replace(cfg, resume=True), target, reader)
    assert a["step"] == b["step"] == 8 and len(a["acc"]) == 3
    wa, wb = load_draft(a["out"]).state_dict(), load_draft(b["out"]).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(TrainError, match="ttt_sample: checkpoint 0.5, now 1.0"):
        train(replace(cfg, resume=True, ttt_sample=1.0), target, reader)


def test_split_keeps_answers_to_one_prompt_together():
    from workbench.draft.train import split_indices

    groups = [f"p{i % 50}" for i in range(150)]  # 3 answers to each of 50 prompts
    train_idx, val_idx = split_indices(150, 0.1, 256, seed=0, groups=groups)
    assert sorted(train_idx + val_idx) == list(range(150))
    assert 15 <= len(val_idx) <= 17 and len(val_idx) % 3 == 0
    assert not {groups[i] for i in val_idx} & {groups[i] for i in train_idx}
    # without groups the split is the plain per-sample one (old runs resume unchanged)
    assert split_indices(150, 0.1, 256, seed=0) == split_indices(150, 0.1, 256, 0, None)


def test_subsampled_unroll_equals_full_unroll_at_the_sampled_positions():
    """ttt_sample < 1: steps >= 1 unroll a subset of positions. Their loss, metrics and
    gradients must equal the full unroll restricted (by mask) to the same positions."""
    from tests.test_draft_model import tiny_draft
    from workbench.draft.train import TTTModel, sample_positions, subsample_masks

    torch.manual_seed(3)
    d = tiny_draft(dvocab=64).double()
    B, T, K = 3, 17, 4
    batch = {
        "input_ids": torch.randint(0, 256, (B, T)),
        "aux_hidden": torch.randn(B, T, 3 * 64, dtype=torch.float64),
        "loss_mask": torch.rand(B, T) < 0.8,
        "in_vocab": torch.rand(B, T) < 0.9,
        "token_mask": torch.ones(B, T, dtype=torch.bool),
    }
    batch["loss_mask"][2, 12:] = False  # a short row
    tl = torch.randn(B, T, 64, dtype=torch.float64)
    model = TTTModel(d, K, 0.8)
    masks = step_masks(batch, K)
    idx = sample_positions(masks[1], 0.3)
    assert idx.shape == (B, math.ceil(0.3 * T)) and (idx.diff(dim=1) > 0).all()
    # valid step-1 positions are taken first
    for b in range(B):
        assert masks[1][b, idx[b]].sum() == min(idx.shape[1], int(masks[1][b].sum()))
    sub = subsample_masks(masks, idx)
    # the full unroll with steps >= 1 masked down to the sampled positions
    restricted = [masks[0]]
    for m in masks[1:]:
        keep = torch.zeros_like(m)
        for b in range(B):
            keep[b, idx[b][idx[b] < m.shape[1]]] = True
        restricted.append(m & keep)
    denom = torch.stack([m.sum() for m in sub]).double()
    assert torch.equal(denom, torch.stack([m.sum() for m in restricted]).double())

    def run(masks_, idx_):
        d.zero_grad()
        loss, st = model(batch, tl, masks_, denom, idx=idx_)
        loss.backward()
        return loss.detach(), st, {k: p.grad.clone() for k, p in d.named_parameters()}

    l_full, st_full, g_full = run(restricted, None)
    l_sub, st_sub, g_sub = run(sub, idx)
    assert torch.allclose(l_full, l_sub, atol=1e-10)
    assert torch.allclose(st_full, st_sub, atol=1e-9)
    for k in g_full:
        assert torch.allclose(g_full[k], g_sub[k], atol=1e-9), k


def test_loss_on_all_tokens_widens_the_mask_only():
    lm = torch.tensor([[0, 0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    b = {"loss_mask": lm, "in_vocab": torch.ones(1, 7, dtype=torch.bool)}
    b["token_mask"] = torch.tensor([[1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    assert step_masks(b, 1)[0].tolist() == [[False, True, True, True, False, False]]
    assert step_masks(b, 1, all_tokens=True)[0].tolist() == [[True, True, True, True, False, False]]
