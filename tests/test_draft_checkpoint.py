"""Checkpoints: RNG state round trip without pickle, older checkpoints still readable, pruning,
temp folders, crafted files refused."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench.draft.checkpoint import (
    clean_tmp,
    latest_checkpoint,
    read_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from workbench.draft.errors import TrainError


def _state(step: int) -> dict:
    return {"step": step, "draft": {"w": torch.full((2,), float(step))}, "rng": rng_state(),
            "metrics": [{"event": "train", "step": step, "acc": [0.5]}],
            "draft_config": {"hidden_size": 2}, "config": {"betas": (0.9, 0.95)}}  # fmt: skip


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    ck = save_checkpoint(tmp_path, 1, _state(1), keep=2)
    want = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(read_state(ck)["rng"])
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]


def test_pruning_keeps_the_newest_and_latest_points_at_it(tmp_path):
    for step in (3, 6, 9):
        save_checkpoint(tmp_path, step, _state(step), keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-00000006", "step-00000009"]
    assert latest_checkpoint(tmp_path).name == "step-00000009"
    assert read_state(latest_checkpoint(tmp_path))["config"]["betas"] == (0.9, 0.95)
    with pytest.raises(TrainError, match="keep_ckpts must be >= 1"):
        save_checkpoint(tmp_path, 12, _state(12), keep=0)


def test_a_checkpoint_written_before_the_no_pickle_format_still_loads(tmp_path):
    """Older runs stored numpy's RNG state as an ndarray (the demo's drafts among them)."""
    ck = tmp_path / "checkpoints" / "step-00000001"
    ck.mkdir(parents=True)
    st = _state(1)
    st["rng"]["numpy"] = np.random.get_state()
    torch.save(st, ck / "state.pt")
    (ck.parent / "latest").write_text(ck.name + "\n")
    got = read_state(latest_checkpoint(tmp_path))
    assert got["rng"]["numpy"][0] == "MT19937" and torch.equal(got["draft"]["w"], st["draft"]["w"])
    set_rng_state({**got["rng"], "numpy": list(got["rng"]["numpy"])})


def test_crafted_state_is_refused_and_temp_folders_are_swept(tmp_path):
    marker = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self):
            return (Path.touch, (marker,))

    ck = tmp_path / "ck"
    ck.mkdir()
    torch.save({"step": RunsCode()}, ck / "state.pt")
    with pytest.raises(TrainError, match="refusing to load"):
        read_state(ck)
    assert not marker.exists()
    (tmp_path / "checkpoints" / ".tmp-step-00000004-123").mkdir(parents=True)
    assert [p.name for p in clean_tmp(tmp_path)] == [".tmp-step-00000004-123"]
    assert not list((tmp_path / "checkpoints").iterdir())
