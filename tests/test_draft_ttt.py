"""The TTT unroll: step-mask alignment, step statistics (simulated τ via metrics), sampled unroll."""

from __future__ import annotations

import math

import pytest
import torch

from workbench.draft.ttt import (
    TTTModel,
    sample_positions,
    soft_ce,
    step_masks,
    subsample_masks,
    summarize,
    unroll_masks,
)


def random_batch(B: int, T: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A batch over the tiny draft's shapes (vocab 256, 3 aux layers of 64), every token real."""
    return {
        "input_ids": torch.randint(0, 256, (B, T)),
        "aux_hidden": torch.randn(B, T, 3 * 64, dtype=dtype),
        "loss_mask": torch.rand(B, T) < 0.8,
        "in_vocab": torch.rand(B, T) < 0.9,
        "token_mask": torch.ones(B, T, dtype=torch.bool),
    }


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


def test_subsampled_unroll_equals_full_unroll_at_the_sampled_positions():
    """ttt_sample < 1: steps >= 1 unroll a subset of positions. Their loss, metrics and
    gradients must equal the full unroll restricted (by mask) to the same positions."""
    from test_draft_model import tiny_draft

    torch.manual_seed(3)
    d = tiny_draft(dvocab=64).double()
    B, T, K = 3, 17, 4
    batch = random_batch(B, T, torch.float64)
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


def test_soft_ce_equals_the_log_softmax_formula_across_chunks():
    torch.manual_seed(4)
    z = torch.randn(10, 7, dtype=torch.float64, requires_grad=True)
    t = torch.randn(10, 7, dtype=torch.float64)
    g = torch.rand(10, dtype=torch.float64)
    ce, top = soft_ce(z, t, chunk=3)  # 3 + 3 + 3 + 1 rows
    (gz,) = torch.autograd.grad((ce * g).sum(), z)
    ref = -(t.softmax(-1) * z.log_softmax(-1)).sum(-1)
    (gref,) = torch.autograd.grad((ref * g).sum(), z)
    torch.testing.assert_close(ce, ref.float(), atol=1e-6, rtol=1e-6)  # fp32 math inside
    torch.testing.assert_close(gz, gref, atol=1e-6, rtol=1e-6)
    assert torch.equal(top, z.argmax(-1))


@pytest.mark.parametrize("sample", [1.0, 0.3])
def test_fast_unroll_equals_the_reference_unroll(sample, monkeypatch):
    """TTTModel's fast path (soft_ce, flat target gathers, fast attention) gives the loss,
    step statistics and gradients of the reference formulation, full and sampled."""
    from test_draft_model import tiny_draft

    torch.manual_seed(6)
    d = tiny_draft(dvocab=64)
    B, T, K = 3, 40, 4  # sampled: 13 positions, the attention runs in chunks
    batch = random_batch(B, T)
    tl = torch.randn(B, T, 64) * 3
    masks, idx = unroll_masks(batch, K, sample)
    assert (idx is None) == (sample == 1.0)
    masks_all = step_masks(batch, K, all_tokens=True) if idx is None else None
    denom = torch.stack([m.sum() for m in masks]).float()
    import workbench.draft.attention as attn_mod

    calls = []
    plain = attn_mod.ttt_attention_reference
    monkeypatch.setattr(
        attn_mod, "ttt_attention_reference", lambda *a: calls.append(1) or plain(*a)
    )
    out = []
    for reference in (False, True):
        d.zero_grad()
        model = TTTModel(d, K, 0.8, reference=reference)
        loss, st = model(batch, tl, masks, denom, idx=idx, masks_all=masks_all)
        loss.backward()
        out.append((loss.detach(), st, {k: p.grad.clone() for k, p in d.named_parameters()}))
    (l_fast, st_fast, g_fast), (l_ref, st_ref, g_ref) = out
    assert len(calls) == K - 1  # only the reference run took the reference attention
    torch.testing.assert_close(l_fast, l_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st_fast, st_ref, atol=1e-3, rtol=1e-5)  # ce sums; counts exact
    assert torch.equal(st_fast[:, 1:], st_ref[:, 1:])
    for k in g_ref:
        torch.testing.assert_close(g_fast[k], g_ref[k], atol=1e-5, rtol=1e-4)


def test_an_unroll_without_statistics_trains_the_same():
    """stats=False (the trainer's steps between log lines): the same loss and gradients, the
    ce sums kept, the accuracy counts left at zero; soft_ce(top=False) skips only the argmax."""
    from test_draft_model import tiny_draft

    torch.manual_seed(9)
    d = tiny_draft(dvocab=64)
    B, T, K = 3, 40, 4
    batch = random_batch(B, T)
    tl = torch.randn(B, T, 64) * 3
    masks, idx = unroll_masks(batch, K, 0.3)
    denom = torch.stack([m.sum() for m in masks]).float()
    out = []
    for stats in (True, False):
        d.zero_grad()
        loss, st = TTTModel(d, K, 0.8)(batch, tl, masks, denom, idx=idx, stats=stats)
        loss.backward()
        out.append((loss.detach(), st, {k: p.grad.clone() for k, p in d.named_parameters()}))
    (l1, st1, g1), (l0, st0, g0) = out
    assert torch.equal(l1, l0) and torch.equal(st1[:, 0], st0[:, 0])
    assert st1[:, 1:5].sum() > 0 and not st0[:, 1:].any()
    assert all(torch.equal(g1[k], g0[k]) for k in g1)
    z = torch.randn(5, 7)
    ce, top = soft_ce(z, torch.randn(5, 7), top=False)
    assert ce.shape == (5,) and top.numel() == 0


def test_right_padding_changes_nothing_but_the_shapes():
    """collate pads each batch to a multiple of 64 tokens (oneDNN builds a GEMM kernel per
    shape): the fast unroll scores every row and masks the loss, so extra right padding must
    leave loss, statistics and gradients as they were."""
    from test_draft_model import tiny_draft

    torch.manual_seed(8)
    d = tiny_draft(dvocab=64).double()
    B, T, K, P = 2, 21, 4, 11
    batch = random_batch(B, T, torch.float64)
    batch["token_mask"][1, 15:] = False  # a shorter row, already padded
    batch["loss_mask"][1, 15:] = False
    tl = torch.randn(B, T, 64, dtype=torch.float64) * 3
    padded = {k: torch.nn.functional.pad(v, (0, 0, 0, P) if v.dim() == 3 else (0, P))
              for k, v in batch.items()}  # fmt: skip
    tl_padded = torch.nn.functional.pad(tl, (0, 0, 0, P))
    out = []
    for b, t in ((batch, tl), (padded, tl_padded)):
        masks = step_masks(b, K, all_tokens=True)
        denom = torch.stack([m.sum() for m in masks]).double()
        d.zero_grad()
        loss, st = TTTModel(d, K, 0.8)(b, t, masks, denom)
        loss.backward()
        out.append((loss.detach(), st, {k: p.grad.clone() for k, p in d.named_parameters()}))
    (l0, st0, g0), (l1, st1, g1) = out
    torch.testing.assert_close(l1, l0, atol=1e-6, rtol=1e-6)  # soft_ce works in fp32
    torch.testing.assert_close(st1, st0, atol=1e-5, rtol=1e-6)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=1e-6, rtol=1e-5, msg=k)


def test_keep_freed_memory_stops_large_blocks_faulting_in_again():
    """After keep_freed_memory, a freed 64 MB tensor's pages are reused by the next one
    instead of being unmapped and faulted in again (run in a fresh process: it is global)."""
    import subprocess
    import sys

    code = (
        "import resource, sys, torch\n"
        "from workbench.draft.ttt import keep_freed_memory\n"
        "if sys.argv[1] == 'keep': assert keep_freed_memory()\n"
        "def faults():\n"
        "    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    torch.ones(16 << 20)\n"  # 64 MB, touched, freed
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0\n"
        "faults()\n"
        "print(min(faults() for _ in range(3)))\n"
    )
    got = {}
    for mode in ("default", "keep"):
        r = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        got[mode] = int(r.stdout.split()[-1])
    assert got["default"] > 10_000  # 16K 4 KB pages faulted in on every allocation
    assert got["keep"] < 1_000, got


# ---------------------------------------------------------------- packed rows


def tiny_samples(lengths: list[int], seed: int = 0) -> tuple[list[dict], dict, torch.Tensor]:
    """Capture-like samples over the tiny draft's shapes: (reader, target argmax, t2d)."""
    g = torch.Generator().manual_seed(seed)
    reader = [
        {"input_ids": torch.randint(0, 256, (n,), generator=g),
         "loss_mask": torch.rand(n, generator=g) < 0.7,
         "aux_hidden": torch.randn(n, 3 * 64, generator=g),
         "last_hidden": torch.randn(n, 64, generator=g)}
        for n in lengths
    ]  # fmt: skip
    argmax = {i: torch.randint(0, 256, (n,), generator=g) for i, n in enumerate(lengths)}
    return reader, argmax, torch.rand(256, generator=g) < 0.8


def _unroll(d, batch, tl, K, idx=None, masks=None):
    masks = masks if masks is not None else step_masks(batch, K, all_tokens=True)
    denom = torch.stack([m.sum() for m in masks]).double()
    d.zero_grad()
    loss, st = TTTModel(d, K, 0.8)(batch, tl, masks, denom, idx=idx)
    loss.backward()
    return loss.detach(), st, {k: p.grad.clone() for k, p in d.named_parameters()}, masks


@pytest.mark.parametrize("reference", [False, True])
def test_packed_rows_train_exactly_as_rows_of_their_own(reference):
    """Samples laid end to end in a row (position ids restarting per sample) give the loss,
    statistics and gradients of the same samples one per row: no position is scored on
    another sample's token and no attention crosses a sample (a sample of 1 token too)."""
    from test_draft_model import tiny_draft

    from workbench.draft.data import collate, collate_packed

    torch.manual_seed(4)
    d = tiny_draft(dvocab=64).double()
    lengths = [9, 14, 1, 6, 20, 11]
    reader, argmax, t2d = tiny_samples(lengths)
    W = torch.randn(64, 64, dtype=torch.float64)
    cpu = torch.device("cpu")
    rows = [[0, 1, 2, 3], [4, 5]]  # 30 and 31 tokens in rows of 32
    packed = collate_packed(reader, rows, argmax, t2d, 32, cpu, pad_multiple=8)
    assert packed["input_ids"].shape == (2, 32)
    assert packed["position_ids"][0].tolist() == [*range(9), *range(14), 0, *range(6), 0, 1]
    single = collate(reader, list(range(6)), argmax, t2d, 32, cpu, pad_multiple=8)
    K = 4
    out = []
    for b in (single, packed):
        tl = b["last_hidden"].double() @ W.T
        model = TTTModel(d, K, 0.8, reference=reference)
        masks = step_masks(b, K, all_tokens=True)
        denom = torch.stack([m.sum() for m in masks]).double()
        d.zero_grad()
        loss, st = model(b, tl, masks, denom)
        loss.backward()
        out.append((loss.detach(), st, {k: p.grad.clone() for k, p in d.named_parameters()}))
        # the masks keep the same positions: counted per sample, in each layout
        assert [int(m.sum()) for m in masks] == [
            sum(max(0, n - 2 - i) for n in lengths) - int((~t2d[torch.cat(
                [argmax[j][1 + i : max(1 + i, n - 1)] for j, n in enumerate(lengths)]
            )]).sum()) for i in range(K)
        ]  # fmt: skip
    (l0, st0, g0), (l1, st1, g1) = out
    torch.testing.assert_close(l1, l0, atol=1e-6, rtol=1e-6)  # soft_ce works in fp32
    torch.testing.assert_close(st1, st0, atol=1e-5, rtol=1e-6)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=1e-6, rtol=1e-5, msg=k)


def test_a_sampled_unroll_of_packed_rows_equals_the_full_one_at_its_positions():
    """ttt_sample < 1 on packed rows (the attention in chunks, each starting at its first
    query's sample): the same loss, statistics and gradients as the full unroll restricted
    to the sampled positions."""
    from test_draft_model import tiny_draft

    from workbench.draft.data import collate_packed

    torch.manual_seed(5)
    d = tiny_draft(dvocab=64).double()
    lengths = [30, 25, 40, 12, 33, 50, 17, 28]
    reader, argmax, t2d = tiny_samples(lengths, seed=1)
    rows = [[0, 1, 2, 3], [4, 5, 6, 7]]
    b = collate_packed(reader, rows, argmax, t2d, 128, torch.device("cpu"), pad_multiple=8)
    tl = torch.randn(*b["input_ids"].shape, 64, dtype=torch.float64)
    K = 4
    masks = step_masks(b, K, all_tokens=True)
    idx = sample_positions(masks[1], 0.3)
    assert idx.shape[1] >= 8  # enough queries for the chunked attention
    sub = subsample_masks(masks, idx)
    restricted = [masks[0]]
    for m in masks[1:]:
        keep = torch.zeros_like(m)
        for r in range(m.shape[0]):
            keep[r, idx[r][idx[r] < m.shape[1]]] = True
        restricted.append(m & keep)
    l_full, st_full, g_full, _ = _unroll(d, b, tl, K, masks=restricted)
    l_sub, st_sub, g_sub, _ = _unroll(d, b, tl, K, idx=idx, masks=sub)
    torch.testing.assert_close(l_sub, l_full, atol=1e-6, rtol=1e-6)  # soft_ce works in fp32
    torch.testing.assert_close(st_sub, st_full, atol=1e-5, rtol=1e-6)
    for k in g_full:
        torch.testing.assert_close(g_sub[k], g_full[k], atol=1e-6, rtol=1e-5, msg=k)
