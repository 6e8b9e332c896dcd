"""Held-out evaluation of a TTT draft: per-step statistics over a slice of the held-out set.

Each rank evaluates `indices[rank::world]`; the caller sums the stats across ranks and
summarizes them (`ttt.summarize`).
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.draft.data import TargetHead, collate
from workbench.draft.ttt import TTTModel, release_freed_memory, step_masks


@torch.no_grad()
def evaluate_stats(
    model: TTTModel,
    reader: Any,
    indices: list[int],
    argmax: dict[int, torch.Tensor],
    t2d: torch.Tensor,
    head: TargetHead,
    batch_size: int,
    max_len: int,
    device: torch.device,
    amp_ctx: Any,
    rank: int = 0,
    world: int = 1,
) -> torch.Tensor:
    """This rank's summed step stats [ttt_len, 9] (with the out-of-vocab-as-miss columns)."""
    model.eval()
    stats = torch.zeros(model.ttt_len, 9, device=device)
    mine = indices[rank::world]
    per = max(1, batch_size // world)
    for a in range(0, len(mine), per):
        batch = collate(reader, mine[a : a + per], argmax, t2d, max_len, device)
        masks = step_masks(batch, model.ttt_len)
        everything = {**batch, "in_vocab": torch.ones_like(batch["in_vocab"])}
        masks_all = step_masks(everything, model.ttt_len)
        denom = torch.stack([m.sum() for m in masks]).float()
        tl = head.draft_logits(batch["last_hidden"])
        with amp_ctx():
            _, st = model(batch, tl, masks, denom, masks_all=masks_all)
        stats += st
    model.train()
    release_freed_memory()  # its blocks (other shapes than a step's) would stay in the heap
    return stats
