"""Draft training: TTT alignment, metrics, resume equality, guard rails, 2-process gloo DDP.

Fixtures: a tiny random Llama target (hidden 64, 4 layers, vocab 256) saved as an HF dir and
a capture directory in the exact shard/manifest format, written with capture.AuxRecorder.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from workbench.capture import AuxRecorder, CaptureReader
from workbench.draft.checkpoint import latest_checkpoint, read_state
from workbench.draft.data import check_capture, split_indices
from workbench.draft.load import load_draft
from workbench.draft.model import SGLANG_KEYS
from workbench.draft.train import PRESETS, TrainConfig, TrainError, config_from_args, preset, train
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
        meta = {"layer_ids": IDS.to_dict(), "norm_stats": {}}  # as capture.py labels a shard
        data = save(t, metadata={"workbench": json.dumps(meta, sort_keys=True)})
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
        # fp32 on every CPU: amp "auto" trains in bf16 where bf16 is native (AMX/avx512_bf16),
        # and the exactness comparisons here (2 gloo ranks vs 1 process) are fp32 claims
        amp="off",
    )
    return replace(cfg, **kw)


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
        check_capture(reader, target, LayerIds((0, 1, 3)))
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
    d = load_draft(out, target.model).draft
    assert set(d.state_dict()) == set(SGLANG_KEYS) and d.config.draft_vocab_size == 128
    st = read_state(ck)
    assert {"optimizer", "scheduler", "rng", "step", "epoch", "batch_in_epoch", "metrics"} <= set(
        st
    )
    assert (out / "vocab.json").is_file() and (out / "draft_config.json").is_file()


def test_bf16_autocast_trains(env):
    target, reader, root = env
    s = train(base_cfg(root, "bf16", amp="bf16", max_steps=3, ckpt_every=100), target, reader)
    assert s["step"] == 3 and all(0 <= a <= 1 for a in s["acc"])
    d = load_draft(s["out"]).draft
    assert all(
        v.dtype in (torch.float32, torch.long, torch.bool) for v in d.state_dict().values()
    )  # fp32 master


def test_time_budget_stop_logs_its_final_eval(env):
    target, reader, root = env
    cfg = base_cfg(root, "budget", max_steps=10, ttt_len=2, epochs=1, time_budget_s=0.0)
    with pytest.warns(UserWarning, match="stopped early.*1 of 10 planned steps"):
        s = train(cfg, target, reader)
    assert s["step"] == 1 and latest_checkpoint(cfg.out).name == "step-00000001"
    assert s["stopped_early"] is True and s["steps_planned"] == 10
    recs = [json.loads(x) for x in Path(cfg.out, "log.jsonl").read_text().splitlines()]
    assert recs[-2]["event"] == "eval" and recs[-2]["step"] == 1 and recs[-2]["acc"] == s["acc"]
    assert recs[-1] == {"event": "stopped_early", "step": 1, "steps_planned": 10,
                        "reason": "time_budget_s 0.0 reached"}  # fmt: skip
    prov = load_draft(cfg.out).provenance["training"]
    assert prov["stopped_early"] is True and (prov["step"], prov["steps_planned"]) == (1, 10)


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
    a = load_draft(full.out).draft.state_dict()
    b = load_draft(killed.out).draft.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    la = [json.loads(x) for x in Path(full.out, "log.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in Path(killed.out, "log.jsonl").read_text().splitlines()]
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("tok_s",)} for r in rs]  # noqa: E731
    assert strip(la) == strip(lb)  # the killed run's tail is not duplicated in the log
    with pytest.raises(TrainError, match="(?s)lr: checkpoint.*--force.*draft folder aside"):
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


@pytest.mark.parametrize("pack_rows", [0, 2])
def test_two_gloo_processes_match_single_process(env, pack_rows):
    import torch.multiprocessing as mp

    target, reader, root = env
    single = base_cfg(root, f"single{pack_rows}", max_steps=4, eval_every=100, ckpt_every=100,
                      threads=None, pack_rows=pack_rows)  # fmt: skip
    train(single, target, reader)
    ddp = replace(single, out=str(root / f"ddp2-{pack_rows}"))
    mp.spawn(_ddp_worker, args=(2, _free_port(), str(root), ddp), nprocs=2, join=True)
    a = load_draft(single.out).draft.state_dict()
    b = load_draft(ddp.out).draft.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4, msg=k)
    st = read_state(latest_checkpoint(ddp.out))
    assert st["world_size"] == 2
    ev_a = [json.loads(x) for x in Path(single.out, "log.jsonl").read_text().splitlines()][-1]
    ev_b = [json.loads(x) for x in Path(ddp.out, "log.jsonl").read_text().splitlines()][-1]
    assert ev_a["event"] == ev_b["event"] == "eval"
    assert ev_a["count"] == ev_b["count"]
    assert ev_a["acc"] == pytest.approx(ev_b["acc"], abs=1e-6)


def test_presets_and_cli_args():
    q, f = preset("quick"), preset("full", lr=1e-4)
    assert q.ttt_len == 5 and f.ttt_len == 5 and f.lr == 1e-4
    # reproducible: presets are defined by epochs, never by the machine's clock
    assert q.time_budget_s is None and f.time_budget_s is None
    assert all("time_budget_s" not in p and p["epochs"] > 0 for p in PRESETS.values())
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
    with pytest.raises(TrainError, match="unknown preset 'nope'"):
        preset("nope")
    cfg = config_from_args(["--capture", "c", "--preset", "full", "--layer-ids", "2,3,4",
                            "--layer-convention", "input_of_layer"])  # fmt: skip
    assert cfg.layer_ids == LayerIds((2, 3, 4), "input_of_layer") and cfg.lr == 4e-3
    with pytest.raises(TrainError, match="--layer-convention"):
        config_from_args(["--capture", "c", "--layer-ids", "1,2,3"])  # a bare id list
    cfg = config_from_args(["--capture", "c", "--ttt-sample", "0.5", "--loss-on", "all"])
    assert (cfg.ttt_sample, cfg.loss_on) == (0.5, "all")


def test_init_lm_head_off_leaves_the_draft_head_random(env):
    """--no-init-lm-head: the ablation of copying the target's lm_head rows."""
    assert config_from_args(["--capture", "c"]).init_lm_head is True
    assert config_from_args(["--capture", "c", "--no-init-lm-head"]).init_lm_head is False
    target, reader, root = env
    W = target.model.get_output_embeddings().weight
    gaps = {}
    for on in (True, False):
        cfg = base_cfg(root, f"lm_head_{on}", init_lm_head=on, max_steps=1, lr=1e-9)
        d = load_draft(train(cfg, target, reader)["out"]).draft
        gaps[on] = float((d.lm_head.weight - W[d.draft_ids]).abs().max())
    assert gaps[True] < 1e-6 < 1e-2 < gaps[False]


def test_weight_decay_shrinks_the_matrices_and_never_the_norm_gains(env):
    """One step with and without decay: the same gradients, so every matrix differs and every
    norm gain is bit-identical (decay is on the matrices only)."""
    target, reader, root = env
    w = {}
    for wd in (0.0, 1.0):
        cfg = base_cfg(root, f"wd{wd:g}", weight_decay=wd, max_steps=1, ckpt_every=100)
        w[wd] = load_draft(train(cfg, target, reader)["out"]).draft.state_dict()
    gains = [k for k in w[0.0] if k.endswith("norm.weight")]
    mats = [k for k in w[0.0] if w[0.0][k].ndim >= 2 and k != "embed_tokens"]
    assert len(gains) >= 3 and len(mats) >= 5
    assert all(torch.equal(w[0.0][k], w[1.0][k]) for k in gains)
    for k in mats:
        assert w[1.0][k].norm() < w[0.0][k].norm(), k


def test_a_checkpoint_with_one_optimizer_group_resumes_as_it_began(env, monkeypatch):
    """Runs checkpointed before decay was split by parameter kind hold one AdamW group (norm
    gains decayed too): resumed by today's code they go on that way, bit for bit."""
    import workbench.draft.train as train_mod

    target, reader, root = env
    split_groups = train_mod.param_groups
    monkeypatch.setattr(
        train_mod, "param_groups", lambda d, wd, split=True: split_groups(d, wd, False)
    )
    cfg = base_cfg(root, "one_group", weight_decay=0.5)
    train(cfg, target, reader)
    killed = replace(cfg, out=str(root / "one_group_killed"), stop_after=5)
    train(killed, target, reader)
    monkeypatch.setattr(train_mod, "param_groups", split_groups)
    train(replace(killed, stop_after=None, resume=True), target, reader)
    a, b = load_draft(cfg.out).draft.state_dict(), load_draft(killed.out).draft.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    split = load_draft(train(replace(cfg, out=str(root / "two_groups")), target, reader)["out"])
    assert not torch.equal(split.draft.norm.weight, load_draft(cfg.out).draft.norm.weight)


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
    wa, wb = load_draft(a["out"]).draft.state_dict(), load_draft(b["out"]).draft.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(TrainError, match="ttt_sample: checkpoint 0.5, now 1.0"):
        train(replace(cfg, resume=True, ttt_sample=1.0), target, reader)


def test_split_keeps_answers_to_one_prompt_together():
    groups = [f"p{i % 50}" for i in range(150)]  # 3 answers to each of 50 prompts
    train_idx, val_idx = split_indices(150, 0.1, 256, seed=0, groups=groups)
    assert sorted(train_idx + val_idx) == list(range(150))
    assert 15 <= len(val_idx) <= 17 and len(val_idx) % 3 == 0
    assert not {groups[i] for i in val_idx} & {groups[i] for i in train_idx}
    # without groups: 15 of 150 held out, disjoint, the same for a seed, another for another
    tr, va = split_indices(150, 0.1, 256, seed=0)
    assert len(va) == 15 and sorted(tr + va) == list(range(150))
    assert split_indices(150, 0.1, 256, seed=0)[1] == va
    assert split_indices(150, 0.1, 256, seed=1)[1] != va
    assert len(split_indices(150, 0.5, 20, seed=0)[1]) == 20  # val_max caps it


def test_rerun_without_resume_is_refused_and_force_moves_the_old_run_aside(env):
    target, reader, root = env
    cfg = base_cfg(root, "rerun", max_steps=3, eval_every=100)
    train(cfg, target, reader)
    before = read_state(latest_checkpoint(cfg.out))["draft"]
    with pytest.raises(TrainError, match="already holds a training run.*--resume.*--force"):
        train(replace(cfg, lr=1e-2), target, reader)
    assert latest_checkpoint(cfg.out).name == "step-00000003"  # untouched
    assert torch.equal(read_state(latest_checkpoint(cfg.out))["draft"]["fc.weight"],
                       before["fc.weight"])  # fmt: skip
    s = train(replace(cfg, lr=1e-2, max_steps=2, force=True), target, reader)
    assert s["step"] == 2 and Path(s["checkpoint"]).name == "step-00000002"
    aside = list(root.glob("rerun.old-*"))
    assert len(aside) == 1 and latest_checkpoint(aside[0]).name == "step-00000003"
    with pytest.raises(TrainError, match="keep_ckpts must be an integer >= 1"):
        train(replace(cfg, keep_ckpts=0, resume=True), target, reader)


def test_a_second_training_into_a_locked_run_folder_is_refused(env):
    from workbench.errors import InUseError
    from workbench.fsutil import locked_dir

    target, reader, root = env
    cfg = base_cfg(root, "locked", max_steps=1)
    with locked_dir(root / "locked", "training run folder"):
        with pytest.raises(InUseError, match=f"in use by pid {os.getpid()}"):
            train(cfg, target, reader)
    assert not (root / "locked" / "log.jsonl").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ckpt-every", "0"], "ckpt_every must be an integer >= 1"),
        (["--log-every", "0"], "log_every must be an integer >= 1"),
        (["--ttt-len", "0"], "ttt_len must be an integer >= 1"),
        (["--draft-vocab-size", "0"], "draft_vocab_size must be an integer >= 1"),
        (["--amp", "fp8"], "amp must be auto, bf16 or off"),
        (["--lr", "-1"], "lr must be a positive number"),
        (["--weight-decay", "-0.1"], "weight_decay must be a number >= 0"),
        (["--max-steps", "0"], "max_steps must be an integer >= 1"),
        (["--keep-ckpts", "0"], "keep_ckpts must be an integer >= 1"),
        (["--device", "cuda"], "no CUDA GPU is available"),
        (["--layer-ids", "1,2,3"], "needs --layer-convention"),
    ],
)
def test_bad_arguments_are_one_line_errors_before_anything_is_written(tmp_path, args, message):
    from typer.testing import CliRunner

    from workbench.cli import app

    if args[0] == "--device" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "--capture", str(tmp_path / "cap"), "--out", str(out)]
                           + args)  # fmt: skip
    assert r.exit_code == 2 and message in r.output, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert not out.exists()


def test_full_disk_at_a_checkpoint_is_named_leaves_no_temp_folder_and_resumes(env, monkeypatch):
    import errno

    import workbench.fsutil as fsutil
    from workbench.errors import DiskFullError

    target, reader, root = env
    cfg = base_cfg(root, "diskfull", max_steps=6, ckpt_every=3, eval_every=100)
    real, calls = fsutil.os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if latest_checkpoint(cfg.out) is not None:  # the second checkpoint hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(fsutil.os, "fsync", fsync)
    with pytest.raises(DiskFullError, match="disk full while writing"):
        train(cfg, target, reader)
    monkeypatch.undo()
    ckpts = Path(cfg.out, "checkpoints")
    assert (
        not list(ckpts.glob(".tmp-step-*")) and latest_checkpoint(cfg.out).name == "step-00000003"
    )
    (ckpts / ".tmp-step-00000006-99999").mkdir()  # what a kill -9 mid-write leaves
    s = train(replace(cfg, resume=True), target, reader)
    assert s["step"] == 6 and not list(ckpts.glob(".tmp-step-*"))


def test_a_failed_fresh_run_leaves_no_run_folder(env, tmp_path):
    from workbench.draft.vocab import DraftVocab

    target, reader, root = env
    other = DraftVocab(torch.tensor([1, 3, 4, 7, 9, 12, 20, 30]), target_vocab_size=V + 1)
    other.save(tmp_path / "vocab.json")
    cfg = base_cfg(root, "failed", max_steps=2, vocab=str(tmp_path / "vocab.json"))
    with pytest.raises(TrainError, match="vocab is for a 257-token target"):
        train(cfg, target, reader)
    assert not Path(cfg.out).exists()


def test_a_crafted_argmax_cache_is_refused_and_runs_nothing(env, tmp_path):
    import pickle

    target, reader, root = env
    marker = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self):
            return (Path.touch, (marker,))

    out = tmp_path / "run"
    out.mkdir()
    (out / "train_config.json").write_text("{}")  # a run killed before its first checkpoint
    (out / "target_argmax.pt").write_bytes(pickle.dumps({"key": RunsCode()}))
    with pytest.raises(TrainError, match="refusing to load.*could run code"):
        train(base_cfg(root, "x", out=str(out), max_steps=1, resume=True), target, reader)
    assert not marker.exists()


def test_amp_auto_uses_bf16_only_where_it_is_native(monkeypatch):
    import workbench.draft.train as tr

    cpu = torch.device("cpu")
    monkeypatch.setattr(tr, "native_bf16", lambda device="cpu": False)
    with tr.amp_context(tr.TrainConfig(amp="auto"), cpu)():
        assert not torch.is_autocast_enabled("cpu")
    with tr.amp_context(tr.TrainConfig(amp="bf16"), cpu)():  # asked for: always honoured
        assert torch.is_autocast_enabled("cpu")
    monkeypatch.setattr(tr, "native_bf16", lambda device="cpu": True)
    with tr.amp_context(tr.TrainConfig(amp="auto"), cpu)():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert tr.preset("quick").amp == "auto" and tr.preset("full").amp == "auto"


def test_a_capture_rewritten_by_newer_code_still_resumes_its_training(env, tmp_path):
    """A finished capture resumed by newer code rewrites its manifest (git sha, package
    versions, regeneration timings); the drafts trained on it must still resume. A capture
    that holds something else (here: another truncation length) must not."""
    target, _, root = env
    cap = write_capture(target, tmp_path / "capture")
    cfg = base_cfg(root, "rewritten", capture=str(cap), out=str(tmp_path / "run"), max_steps=3,
                   eval_every=100)  # fmt: skip
    first = train(cfg, target, CaptureReader(cap))
    assert first["step"] == 3 and first["tau"] is not None and first["tok_s"] > 0
    mf = cap / "manifest.json"
    man = json.loads(mf.read_text())
    man |= {"git_sha": "0123abc", "versions": {"torch": "9.9"}, "norm_stats": {"x": 1},
            "prompt_set": man["prompt_set"] | {"regen": {"seconds_this_run": 0.0}}}  # fmt: skip
    mf.write_text(json.dumps(man))
    again = train(replace(cfg, resume=True), target, CaptureReader(cap))
    # nothing left to run: the latest held-out figures, and no throughput to claim
    assert again["step"] == 3 and again["tok_s"] is None
    assert (again["tau"], again["acc"]) == (first["tau"], first["acc"])
    mf.write_text(json.dumps(man | {"max_length": 32}))
    with pytest.raises(TrainError, match="capture hash: checkpoint"):
        train(replace(cfg, resume=True), target, CaptureReader(cap))


def test_collate_pads_to_a_multiple_of_64_within_max_len():
    """Few distinct batch shapes (oneDNN makes a GEMM kernel per shape), never past max_len."""
    from workbench.draft.data import collate

    def sample(n):
        return {"input_ids": torch.arange(n), "loss_mask": torch.ones(n), "aux_hidden":
                torch.ones(n, 6), "last_hidden": torch.ones(n, 2)}  # fmt: skip

    reader = [sample(70), sample(5), sample(130)]
    argmax = {i: torch.zeros(len(reader[i]["input_ids"]), dtype=torch.int32) for i in range(3)}
    t2d = torch.ones(4, dtype=torch.bool)
    cpu = torch.device("cpu")
    b = collate(reader, [0, 1], argmax, t2d, 1024, cpu)
    assert b["input_ids"].shape == (2, 128) and b["aux_hidden"].shape == (2, 128, 6)
    assert b["token_mask"].sum(1).tolist() == [70, 5]  # the padding is masked out
    assert collate(reader, [1], argmax, t2d, 1024, cpu)["input_ids"].shape == (1, 64)
    assert collate(reader, [2], argmax, t2d, 150, cpu)["input_ids"].shape == (1, 150)  # capped
    assert collate(reader, [2], argmax, t2d, 100, cpu)["token_mask"].sum() == 100  # truncated


def test_batches_bring_target_logits_sample_by_sample_and_keep_them_within_budget(env):
    """With a TargetHead, collate and collate_packed fill `target_logits` from each whole
    sample (zeros on padding): the values of one matmul over the batch, the same bits whether
    the sample was kept or computed again, and no more kept than `cache_mb` allows."""
    from workbench.draft.data import TargetHead, collate, collate_packed, target_argmax

    target, reader, root = env
    ids = torch.arange(0, 256, 2)
    cpu = torch.device("cpu")
    argmax = target_argmax(reader, TargetHead(target.model, ids, cpu), list(range(6)), None, {})
    t2d = torch.ones(target.vocab_size, dtype=torch.bool)
    one = TargetHead(target.model, ids, cpu, cache_mb=0.0)
    per_sample = reader[0]["input_ids"].numel() * len(ids) * 4  # fp32 bytes of sample 0
    kept = TargetHead(target.model, ids, cpu, cache_mb=1.5 * per_sample / 2**20)
    for make in (
        lambda h: collate(reader, [0, 1, 2], argmax, t2d, 40, cpu, 8, h),
        lambda h: collate_packed(reader, [[0, 1], [2]], argmax, t2d, 96, cpu, 8, h),
    ):
        plain = make(None)
        assert "target_logits" not in plain
        a, b, again = make(one), make(kept), make(kept)
        ref = one.draft_logits(plain["last_hidden"])
        torch.testing.assert_close(a["target_logits"], ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(a["target_logits"], b["target_logits"])
        assert torch.equal(b["target_logits"], again["target_logits"])
        assert not a["target_logits"][~a["token_mask"]].any()  # padding rows stay zero
    assert one.cached_samples == 0 and kept.cached_samples == 1  # only sample 0 fitted


def test_kept_target_logits_train_exactly_as_computed_ones(env):
    """target_cache_mb only decides what is kept: the run's losses, held-out figures and
    weights are bit-identical with a cache that holds everything and with none (packed)."""
    target, reader, root = env
    runs = []
    for mb in (0.0, 64.0):
        cfg = base_cfg(root, f"tcache{mb:g}", max_steps=10, pack_rows=1, max_len=96,
                       target_cache_mb=mb, ckpt_every=100)  # fmt: skip
        train(cfg, target, reader)
        log = [json.loads(x) for x in Path(cfg.out, "log.jsonl").read_text().splitlines()]
        runs.append(([r.get("loss") for r in log], [r.get("acc") for r in log],
                     load_draft(cfg.out).draft.state_dict()))  # fmt: skip
    (l0, a0, w0), (l1, a1, w1) = runs
    assert l0 == l1 and a0 == a1
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    with pytest.raises(TrainError, match="target_cache_mb must be >= 0"):
        train(base_cfg(root, "tcache-bad", target_cache_mb=-1.0), target, reader)


def test_epoch_batches_partition_the_epoch_and_larger_buckets_pad_less():
    from workbench.draft.data import epoch_batches

    g = torch.Generator().manual_seed(0)
    lengths = (torch.rand(400, generator=g) * 900 + 20).long().tolist()
    idx = list(range(0, 400, 2))  # the training split

    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b)
                   for b in batches)  # fmt: skip

    small, large = (epoch_batches(idx, lengths, 4, 0, 0, bucket) for bucket in (2, 50))
    for batches in (small, large):
        assert sorted(i for b in batches for i in b) == idx and all(len(b) == 4 for b in batches)
    assert padding(large) < padding(small) / 4
    assert epoch_batches(idx, lengths, 4, 0, 0, 50) == large  # a resumed epoch: the same batches
    assert epoch_batches(idx, lengths, 4, 1, 0, 50) != large  # the next epoch: others


def test_resume_refuses_another_bucketing_and_reads_old_checkpoints_as_bucket_16():
    from workbench.draft.checkpoint import RESUME_PAST, check_resume

    now = asdict(TrainConfig())
    old = {"capture_hash": "c", "target_fingerprint": "t",
           "config": {k: v for k, v in now.items() if k != "bucket_batches"}}  # fmt: skip
    defaults = {**now, **RESUME_PAST}
    check_resume(old, {**now, "bucket_batches": 16}, "c", "t", defaults)
    with pytest.raises(TrainError, match="bucket_batches: checkpoint 16, now 64"):
        check_resume(old, {**now, "bucket_batches": 64}, "c", "t", defaults)


def test_packed_epochs_hold_every_sample_once_in_full_rows():
    from workbench.draft.data import packed_epoch

    g = torch.Generator().manual_seed(0)
    lengths = (torch.randn(900, generator=g) * 0.6 + 5.48).exp().clamp(16, 1400).long().tolist()
    idx = list(range(0, 900, 2))
    steps = packed_epoch(idx, lengths, 1024, 2, 0, 0)
    rows = [r for st in steps for r in st]
    assert sorted(i for r in rows for i in r) == idx  # each sample once, none dropped
    fill = [sum(min(lengths[i], 1024) for i in r) for r in rows]
    assert max(fill) <= 1024 and sum(fill) / (1024 * len(rows)) > 0.95
    assert all(len(st) == 2 for st in steps[:-1]) and 2 <= len(steps[-1]) <= 3
    assert packed_epoch(idx, lengths, 1024, 2, 0, 0) == steps  # a resumed epoch: the same
    assert packed_epoch(idx, lengths, 1024, 2, 1, 0) != steps  # the next epoch: other rows


def test_packed_training_resumes_exactly_and_counts_its_own_epochs(env):
    """pack_rows: each step is N rows of whole samples; a killed and resumed packed run over
    several epochs ends with the weights of an uninterrupted one, and its planned steps are
    the epochs' own step counts."""
    from workbench.draft.data import packed_epoch

    target, reader, root = env
    kw = dict(max_steps=None, epochs=2.5, pack_rows=1, ttt_sample=0.5, ckpt_every=2)
    a = train(base_cfg(root, "pack_full", **kw), target, reader)
    train_idx, _ = split_indices(len(reader), 0.2, 256, 0, None)
    lengths = reader.lengths()
    counts = [len(packed_epoch(train_idx, lengths, 64, 1, e, 0)) for e in range(3)]
    assert a["steps_planned"] == counts[0] + counts[1] + -(-counts[2] // 2)
    assert counts[0] < len(train_idx) / 2  # whole samples share rows
    cfg = base_cfg(root, "pack_kill", **kw)
    train(replace(cfg, stop_after=counts[0] + 1), target, reader)  # killed in epoch 2
    b = train(replace(cfg, resume=True), target, reader)
    assert a["step"] == b["step"] == a["steps_planned"]
    wa, wb = load_draft(a["out"]).draft.state_dict(), load_draft(b["out"]).draft.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(TrainError, match="pack_rows: checkpoint 1, now 0"):
        train(replace(cfg, resume=True, pack_rows=0), target, reader)
    with pytest.raises(TrainError, match="pack_rows must be an integer >= 0"):
        train(replace(cfg, out=str(root / "pack_bad"), pack_rows=-1), target, reader)
