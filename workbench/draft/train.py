"""Train an EAGLE-3 draft with the training-time test (TTT), resumable, single or DDP.

Reads top to bottom: the config and its presets, validation (before anything is written),
distributed setup, the run folder (lock, refusal, --force), the data, the loop, evaluation,
the CLI. The TTT unroll lives in `ttt.py`, batches in `data.py`, checkpoints in
`checkpoint.py`.

Presets are defined by epochs/steps only, so the same inputs give the same draft on any
machine; `time_budget_s` is an opt-in cap, and when it fires the result and the log say
`stopped_early` with the steps done of the steps planned.

Run: `python -m workbench.draft.train --capture DIR --out DIR` or under
`torchrun --nproc-per-node N -m workbench.draft.train ...` (NCCL on GPU, gloo on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workbench.draft.checkpoint import (
    RESUME_PAST,
    append_jsonl,
    check_resume,
    claim_run_dir,
    clean_tmp,
    latest_checkpoint,
    read_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from workbench.draft.data import (
    EpochPlan,
    TargetHead,
    check_capture,
    collate,
    collate_packed,
    open_capture,
    split_indices,
    target_argmax,
)
from workbench.draft.errors import TrainError
from workbench.draft.evaluate import evaluate_stats
from workbench.draft.model import DraftConfig, Eagle3Draft, init_from_target
from workbench.draft.presets import PRESETS
from workbench.draft.ttt import TTTModel, keep_freed_memory, summarize, unroll_masks
from workbench.draft.vocab import (
    EMBEDDED_DRAFT_VOCAB,
    DraftVocab,
    build_vocab,
    capture_hash,
    coverage,
)
from workbench.fsutil import atomic_write_json, atomic_write_text, locked_dir
from workbench.layers import CONVENTIONS, LayerIds
from workbench.target import native_bf16

__all__ = ["PRESETS", "TrainConfig", "TrainError", "latest_checkpoint", "preset", "train"]


@dataclass
class TrainConfig:
    capture: str = ""
    out: str = "runs/draft"
    target: str = "smollm2-135m"
    layer_ids: LayerIds | None = None  # expected aux ids (any convention); None: the capture's
    draft_vocab_size: int = EMBEDDED_DRAFT_VOCAB
    vocab: str | None = None  # reuse a stored vocab.json (fine-tuning must not rebuild d2t)
    ttt_len: int = 7
    loss_decay: float = 0.8
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup: float = 0.05  # fraction of total steps (or steps if >= 1)
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.5
    batch_size: int = 8  # samples per optimizer step, global (split across ranks)
    max_len: int = 2048  # truncate longer samples
    bucket_batches: int = 16  # batches' worth of shuffled samples sorted by length together
    pad_multiple: int = 64  # batch length rounded up to this (CPU kernels are built per shape)
    # 0: batches of batch_size samples; N: each step is N rows of max_len tokens holding whole
    # samples end to end (data.packed_epoch: one shape every step, almost no padding)
    pack_rows: int = 0
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    val_fraction: float = 0.05
    val_max_samples: int = 256
    eval_every: int = 100
    ckpt_every: int = 100
    keep_ckpts: int = 2
    log_every: int = 10
    seed: int = 0
    init_from_target: bool = True  # norm + lm_head rows from the target
    init_lm_head: bool = True  # with init_from_target: lm_head rows too (False: random)
    init_layer: int | None = None  # also start the decoder layer from this target layer
    embed_half_scale: float = 0.0
    ttt_sample: float = 1.0  # fraction of positions unrolled past step 0 (1 = all)
    loss_on: str = "assistant"  # assistant | all (also learn the target's view of user turns)
    amp: str = "auto"  # auto (bf16 on a GPU or a CPU with native bf16, else fp32) | bf16 | off
    device: str = "auto"
    # CPU: the draft-vocab target logits of up to this many MB of samples are kept in memory
    # across epochs (TargetHead.sample_logits; the quick capture's take ~1.6 GB); 0 keeps none
    target_cache_mb: float = 2048.0
    threads: int | None = None
    resume: bool = False  # continue the run in `out` from its latest checkpoint
    force: bool = False  # start afresh in `out`, moving an existing run aside (out.old-<time>)
    progress: bool = True
    time_budget_s: float | None = None  # opt-in cap: stop early (with a checkpoint) past this
    stop_after: int | None = None  # end this invocation after N steps w/o final ckpt (tests)

    def to_dict(self) -> dict:
        return asdict(self)


def param_groups(draft: torch.nn.Module, weight_decay: float, split: bool = True) -> list[dict]:
    """AdamW groups: decay on the matrices only (decayed norm gains would shrink the normalized
    activations). `split=False`: the one group that checkpoints written before hold."""
    params = [p for p in draft.parameters() if p.requires_grad]
    if not split:
        return [{"params": params, "weight_decay": weight_decay}]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def preset(name: str, **overrides: Any) -> TrainConfig:
    """A preset TrainConfig (`quick`, `full`: fixed epochs, no time cap) plus overrides."""
    if name not in PRESETS:
        raise TrainError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return TrainConfig(**{**PRESETS[name], **overrides})


def check_config(cfg: TrainConfig) -> None:
    """Refuse bad arguments before anything is loaded or written (one line each)."""
    at_least_one = ("ttt_len", "draft_vocab_size", "batch_size", "max_len", "eval_every",
                    "ckpt_every", "keep_ckpts", "log_every", "bucket_batches",
                    "pad_multiple")  # fmt: skip
    for k in at_least_one:
        v = getattr(cfg, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise TrainError(f"{k} must be an integer >= 1, got {v!r}")
    if not isinstance(cfg.pack_rows, int) or isinstance(cfg.pack_rows, bool) or cfg.pack_rows < 0:
        raise TrainError(
            f"pack_rows must be an integer >= 0 (0: no packing), got {cfg.pack_rows!r}"
        )
    for k in ("max_steps", "stop_after", "threads"):
        v = getattr(cfg, k)
        if v is not None and (not isinstance(v, int) or v < 1):
            raise TrainError(f"{k} must be an integer >= 1 (or unset), got {v!r}")
    if not (isinstance(cfg.lr, (int, float)) and math.isfinite(cfg.lr) and cfg.lr > 0):
        raise TrainError(f"lr must be a positive number, got {cfg.lr!r}")
    wd = cfg.weight_decay
    if not (isinstance(wd, (int, float)) and math.isfinite(wd) and wd >= 0):
        raise TrainError(f"weight_decay must be a number >= 0 (0 turns it off), got {wd!r}")
    if not cfg.epochs > 0:
        raise TrainError(f"epochs must be > 0, got {cfg.epochs!r}")
    if not 0 < cfg.ttt_sample <= 1:
        raise TrainError(
            f"ttt_sample must be in (0, 1] (a fraction of positions), got {cfg.ttt_sample}"
        )
    if cfg.loss_on not in ("assistant", "all"):
        raise TrainError(f"loss_on must be 'assistant' or 'all', got {cfg.loss_on!r}")
    if cfg.amp not in ("auto", "bf16", "off"):
        raise TrainError(f"amp must be auto, bf16 or off, got {cfg.amp!r}")
    if not 0 <= cfg.val_fraction < 1:
        raise TrainError(f"val_fraction must be in [0, 1), got {cfg.val_fraction}")
    if not (isinstance(cfg.target_cache_mb, (int, float)) and cfg.target_cache_mb >= 0):
        raise TrainError(
            f"target_cache_mb must be >= 0 (0: keep none), got {cfg.target_cache_mb!r}"
        )
    if cfg.time_budget_s is not None and cfg.time_budget_s < 0:
        raise TrainError(f"time_budget_s must be >= 0 (or unset), got {cfg.time_budget_s}")
    if cfg.resume and cfg.force:
        raise TrainError("--resume continues the run in --out, --force replaces it: pick one")
    if cfg.layer_ids is not None and not isinstance(cfg.layer_ids, LayerIds):
        raise TrainError(f"layer_ids must be LayerIds (ids + convention), got {cfg.layer_ids!r}")
    if not cfg.capture:
        raise TrainError("--capture DIR is required (a capture written by `workbench capture`)")
    device_of(cfg)


def device_of(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    try:
        device = torch.device(cfg.device)
    except RuntimeError:
        raise TrainError(f"device must be auto, cpu or cuda[:N], got {cfg.device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"device {cfg.device!r}: no CUDA GPU is available here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise TrainError(f"device must be auto, cpu or cuda[:N], got {cfg.device!r}")
    return device


def amp_context(cfg: TrainConfig, device: torch.device):
    mode = cfg.amp
    if mode == "auto":  # bf16 autocast is 3.6x slower than fp32 on a CPU without native bf16
        mode = "bf16" if native_bf16(device.type) else "off"
    if mode == "off":
        return lambda: torch.autocast(device.type, enabled=False)
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def lr_lambda(total: int, warmup: float, min_ratio: float):
    """Linear warmup, then cosine down to `min_ratio` of the peak."""
    w = int(warmup if warmup >= 1 else round(warmup * total))

    def f(step: int) -> float:
        if step < w:
            return (step + 1) / max(w, 1)
        prog = min(1.0, (step - w) / max(total - w, 1))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

    return f


# ---------------------------------------------------------------- distributed


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_dist(device: torch.device) -> Dist:
    """Join the torchrun group if WORLD_SIZE > 1 (NCCL on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    owns = False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns = True
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), owns)


def all_sum(x: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world > 1:
        dist.all_reduce(x)
    return x


# ---------------------------------------------------------------- train


def train(cfg: TrainConfig, target: Any = None, reader: Any = None) -> dict[str, Any]:
    """Train (or resume) a draft; returns held-out acc per step, tau, tokens/s, checkpoint dir."""
    check_config(cfg)
    device = device_of(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    d = setup_dist(device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if device.type == "cpu":
        keep_freed_memory()
    try:
        reader = reader if reader is not None else open_capture(cfg.capture)  # cheap: first
        if target is None:
            from workbench.target import load_target

            target = load_target(cfg.target, device=str(device))
        cap_ids = check_capture(reader, target, cfg.layer_ids)
        out = Path(cfg.out)
        if not d.main:
            return _train(cfg, target, reader, cap_ids, device, d)
        created = not out.exists()
        with contextlib.ExitStack() as locks:
            locks.enter_context(locked_dir(out, "training run folder"))
            try:
                if claim_run_dir(out, resume=cfg.resume, force=cfg.force) is not None:
                    created = True  # the old run went aside with its lock: lock the new folder
                    locks.enter_context(locked_dir(out, "training run folder"))
                return _train(cfg, target, reader, cap_ids, device, d)
            except BaseException:
                clean_tmp(out)
                if created and latest_checkpoint(out) is None:
                    shutil.rmtree(out, ignore_errors=True)  # a failed fresh run leaves nothing
                raise
    finally:
        if d.owns_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, target, reader, cap_ids: LayerIds, device, d: Dist) -> dict:
    from workbench.progress import progress as tqdm

    out = Path(cfg.out)
    chash = capture_hash(reader)
    state = None
    if cfg.resume and (ck := latest_checkpoint(out)) is not None:
        state = read_state(ck)
        check_resume(state, cfg.to_dict(), chash, target.fingerprint,
                     {**asdict(TrainConfig()), **RESUME_PAST})  # fmt: skip
    if d.main:
        clean_tmp(out)  # half-written step folders of a killed run

    # --- data: split, vocab (never rebuilt on resume or when given: a new d2t misaligns lm_head)
    train_idx, val_idx = split_indices(
        len(reader), cfg.val_fraction, cfg.val_max_samples, cfg.seed, reader.manifest.get("groups")
    )
    if state is not None:
        vocab = DraftVocab.from_dict(state["vocab"])
    elif cfg.vocab:
        vocab = DraftVocab.load(cfg.vocab)
    else:
        vocab = build_vocab(reader, cfg.draft_vocab_size, target.vocab_size, train_idx)
    if vocab.target_vocab_size != target.vocab_size:
        raise TrainError(
            f"vocab is for a {vocab.target_vocab_size}-token target, target has {target.vocab_size}"
        )
    lengths = (
        reader.lengths()
        if hasattr(reader, "lengths")
        else [int(reader[i]["input_ids"].numel()) for i in range(len(reader))]
    )
    if (cfg.pack_rows or cfg.batch_size) < d.world:
        what = "pack_rows" if cfg.pack_rows else "batch_size"
        raise TrainError(
            f"{what} {cfg.pack_rows or cfg.batch_size} < world size {d.world}: every rank "
            "needs samples"
        )
    plan = EpochPlan(train_idx, lengths, cfg.seed, cfg.batch_size, cfg.bucket_batches,
                     cfg.pack_rows, cfg.max_len)  # fmt: skip
    per_epoch = plan.count(0)
    if per_epoch == 0:
        raise TrainError("no training samples (capture too small for the held-out split?)")
    total = cfg.max_steps or plan.total_steps(cfg.epochs)

    # --- model, target head, the in-vocab filter, optimizer
    torch.manual_seed(cfg.seed)
    dcfg = DraftConfig.from_target(target.config, cap_ids, vocab.draft_vocab_size)
    draft = Eagle3Draft(dcfg)
    draft.set_vocab(vocab.ids)
    if cfg.init_from_target:
        init_from_target(draft, target.model, cfg.init_layer, cfg.embed_half_scale,
                         lm_head=cfg.init_lm_head)  # fmt: skip
    else:
        draft.embed_tokens.copy_(target.model.get_input_embeddings().weight.detach().float())
    draft.to(device)
    # on a CPU the target logits come sample by sample with the batch (and are kept across
    # epochs within target_cache_mb); on a GPU the matmul is cheap: once per batch, in the loop
    on_cpu = device.type == "cpu"
    head = TargetHead(target.model, vocab.ids, device, cfg.target_cache_mb if on_cpu else 0)
    batch_head = head if on_cpu else None
    t2d = vocab.t2d
    key = {"capture": chash, "target": target.fingerprint}
    all_idx = list(range(len(reader)))
    if d.main:
        argmax = target_argmax(reader, head, all_idx, out / "target_argmax.pt", key, cfg.progress)
    if d.world > 1:
        dist.barrier()
    if not d.main:
        argmax = target_argmax(reader, head, all_idx, out / "target_argmax.pt", key)
    model = TTTModel(draft, cfg.ttt_len, cfg.loss_decay)
    ddp = model
    if d.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        ddp = DDP(model, device_ids=ids, broadcast_buffers=False)
    # fused: one kernel over all parameters, 4.3 vs 21.7 ms a step at the quick shapes (CPU)
    # a checkpoint written before the groups split holds one group: it resumes as it began
    one_group = state is not None and len(state["optimizer"]["param_groups"]) == 1
    opt = torch.optim.AdamW(
        param_groups(draft, cfg.weight_decay, split=not one_group),
        lr=cfg.lr, betas=cfg.betas, fused=True,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, cfg.warmup, cfg.min_lr_ratio))
    amp_ctx = amp_context(cfg, device)

    step, metrics = 0, []
    if state is not None:
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step, metrics = state["step"], list(state["metrics"])
        set_rng_state(state["rng"])
    log = out / "log.jsonl"
    if d.main:  # the log holds exactly the checkpointed history (a killed run's tail is redone)
        atomic_write_text(log, "".join(json.dumps(m) + "\n" for m in metrics))
        vocab.save(out / "vocab.json")
        atomic_write_json(out / "draft_config.json", dcfg.to_dict())
        atomic_write_json(out / "train_config.json", cfg.to_dict())

    def emit(rec: dict) -> None:
        metrics.append(rec)
        if d.main:
            append_jsonl(log, rec)

    def checkpoint() -> None:
        if d.main:
            st = {"draft": draft.state_dict(), "optimizer": opt.state_dict(),
                  "scheduler": sched.state_dict(), "step": step, "epoch": plan.locate(step)[0],
                  "batch_in_epoch": plan.locate(step)[1], "rng": rng_state(), "metrics": metrics,
                  "config": cfg.to_dict(), "draft_config": dcfg.to_dict(),
                  "vocab": vocab.to_dict(), "capture_hash": chash,
                  "target_fingerprint": target.fingerprint, "world_size": d.world}  # fmt: skip
            save_checkpoint(out, step, st, cfg.keep_ckpts)
        if d.world > 1:
            dist.barrier()

    if d.main and state is None:
        emit({"event": "start", "step": 0, "train_samples": len(train_idx),
              "val_samples": len(val_idx), "total_steps": total,
              "draft_vocab_size": vocab.draft_vocab_size, "world_size": d.world,
              "val_coverage": coverage(vocab, reader, val_idx or train_idx)})  # fmt: skip

    # --- the loop
    bar = tqdm(total=total, initial=step, desc="train", disable=not (cfg.progress and d.main),
               dynamic_ncols=True)  # fmt: skip
    t0, toks, run_steps = time.perf_counter(), 0.0, 0
    # a resumed run reports its latest held-out figures even when no step is left to run
    last_eval: dict[str, Any] = next((m for m in reversed(metrics) if m["event"] == "eval"), {})
    killed = over_budget = False
    while step < total:
        gb = plan.step(step)
        mine = gb[d.rank :: d.world]  # samples, or packed rows of samples
        if cfg.pack_rows:
            batch = collate_packed(reader, mine, argmax, t2d, cfg.max_len, device,
                                   cfg.pad_multiple, batch_head)  # fmt: skip
            mine = [i for row in mine for i in row]
        else:
            batch = collate(reader, mine, argmax, t2d, cfg.max_len, device, cfg.pad_multiple,
                            batch_head)  # fmt: skip
        masks, idx = unroll_masks(batch, cfg.ttt_len, cfg.ttt_sample, cfg.loss_on == "all")
        ntok = torch.tensor([_ntok(mine, lengths, cfg.max_len)], device=device)
        counts = all_sum(torch.cat([torch.stack([m.sum() for m in masks]).float(), ntok]), d)
        tl = batch.pop("target_logits", None)
        if tl is None:
            tl = head.draft_logits(batch["last_hidden"])
        log_now = (step + 1) % cfg.log_every == 0 or step + 1 == total  # only these need stats
        with amp_ctx():
            loss, st = ddp(batch, tl, masks, counts[:-1], float(d.world), idx, stats=log_now)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        step += 1
        run_steps += 1
        toks += float(counts[-1])
        if log_now:
            s = summarize(all_sum(st.detach(), d))
            lval = float(all_sum(loss.detach().clone(), d)) / d.world
            rate = toks / max(time.perf_counter() - t0, 1e-9)
            emit({"event": "train", "step": step, "loss": lval, "acc": s["acc"],
                  "loss_i": s["loss_i"], "lr": sched.get_last_lr()[0],
                  "grad_norm": float(gnorm), "tok_s": rate})  # fmt: skip
            bar.set_postfix(loss=f"{lval:.3f}", acc0=f"{s['acc'][0]:.3f}",
                            tau=f"{last_eval.get('tau', float('nan')):.2f}")  # fmt: skip
        bar.update(1)
        if val_idx and (step % cfg.eval_every == 0 or step == total):
            last_eval = evaluate(model, reader, val_idx, argmax, t2d, head, cfg, device, amp_ctx, d)
            emit({"event": "eval", "step": step, **last_eval})
            bar.set_postfix(acc0=f"{last_eval['acc'][0]:.3f}", tau=f"{last_eval['tau']:.2f}")
        if cfg.stop_after is not None and run_steps >= cfg.stop_after:
            killed = True  # simulated kill: no checkpoint
            break
        if cfg.time_budget_s is not None:  # every rank votes each step (a collective on all)
            late = float(time.perf_counter() - t0 > cfg.time_budget_s)
            over_budget = bool(all_sum(torch.tensor([late], device=device), d) > 0)
        if step % cfg.ckpt_every == 0 or step == total or over_budget:
            checkpoint()
        if over_budget:
            break
    bar.close()
    elapsed = time.perf_counter() - t0
    stopped_early = over_budget and step < total
    if val_idx and not killed and (not metrics or metrics[-1].get("event") != "eval"):
        # the run ended off the eval grid (time budget, last partial interval): log it too
        last_eval = evaluate(model, reader, val_idx, argmax, t2d, head, cfg, device, amp_ctx, d)
        emit({"event": "eval", "step": step, **last_eval})
    if stopped_early:
        emit({"event": "stopped_early", "step": step, "steps_planned": total,
              "reason": f"time_budget_s {cfg.time_budget_s} reached"})  # fmt: skip
        if d.main:
            warnings.warn(
                f"training stopped early by time_budget_s={cfg.time_budget_s}: {step} of "
                f"{total} planned steps done; these figures are not the preset's",
                stacklevel=2,
            )
    ck = latest_checkpoint(out) if not killed else None
    ev = {
        k: last_eval.get(k) for k in ("acc", "a", "tau", "tau_k", "acc_all", "tau_all", "in_vocab")
    }
    return {"step": step, "steps_planned": total, "stopped_early": stopped_early,
            "stopped": killed, **ev, "tok_s": toks / max(elapsed, 1e-9) if run_steps else None,
            "elapsed_s": elapsed,
            "checkpoint": str(ck) if ck else None, "out": str(out), "world_size": d.world}  # fmt: skip


def _ntok(mine: list[int], lengths: list[int], max_len: int) -> float:
    """Tokens this rank trains on this step (for tokens/s after the all-reduce)."""
    return float(sum(min(lengths[i], max_len) for i in mine))


def evaluate(model, reader, indices, argmax, t2d, head, cfg: TrainConfig, device, amp_ctx, d: Dist):
    """Held-out per-step metrics (each rank a slice of the held-out set, summed)."""
    st = evaluate_stats(model, reader, indices, argmax, t2d, head, cfg.batch_size, cfg.max_len,
                        device, amp_ctx, d.rank, d.world)  # fmt: skip
    return summarize(all_sum(st, d))


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench train", description=__doc__.split("\n")[0])
    p.add_argument("--preset", "--profile", dest="preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--layer-convention", choices=CONVENTIONS, default=None,
                   help="what --layer-ids mean (required with --layer-ids)")  # fmt: skip
    for f in fields(TrainConfig):
        name = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=None)
        elif f.name == "betas":
            p.add_argument(name, type=float, nargs=2, default=None)
        elif f.name in ("max_steps", "init_layer", "threads", "stop_after"):
            p.add_argument(name, type=int, default=None)
        elif f.name == "time_budget_s":
            p.add_argument(name, type=float, default=None)
        else:
            conv = {int: int, float: float}.get(type(default), str)
            p.add_argument(name, type=conv, default=None)
    return p


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    args = vars(build_parser().parse_args(argv))
    name = args.pop("preset")
    convention = args.pop("layer_convention")
    given = {k: v for k, v in args.items() if v is not None}
    if "betas" in given:
        given["betas"] = tuple(given["betas"])
    if "layer_ids" in given:
        from workbench.draft.load import given_layer_ids

        if convention is None:
            raise TrainError(
                f"--layer-ids {given['layer_ids']} needs --layer-convention (one of "
                f"{', '.join(CONVENTIONS)}): a bare id list is ambiguous (off-by-one risk)"
            )
        given["layer_ids"] = given_layer_ids(given["layer_ids"], convention)
    elif convention is not None:
        raise TrainError("--layer-convention names what --layer-ids mean: pass both")
    cfg = preset(name, **given) if name else replace(TrainConfig(), **given)
    check_config(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(argv)
    summary = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary, indent=2))
        if summary["stopped_early"]:
            print(
                f"STOPPED EARLY: steps_done {summary['step']} of steps_planned "
                f"{summary['steps_planned']} (time_budget_s {cfg.time_budget_s})",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    from workbench.errors import WorkbenchError

    try:
        sys.exit(main())
    except WorkbenchError as e:  # the same one line as `workbench train`
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
