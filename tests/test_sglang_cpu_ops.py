"""The pure-torch `sgl_kernel` CPU stand-in (support/sglang_cpu), op by op, against plain
references written from the ops' meaning (not from the stand-in's code). Torch-only: runs in
the workbench venv and in .venv-sglang alike."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "sglang_cpu"))
import sgl_kernel as sk  # noqa: E402


def _runs(start, end):
    return [(int(s), int(e)) for s, e in zip(start, end, strict=True)]


def test_assign_req_to_token_pool_and_extend_cache_locs_are_inverse_copies():
    r2t = torch.zeros((4, 16), dtype=torch.int32)
    rpi = torch.tensor([2, 0, 3])
    start, end = torch.tensor([1, 0, 5]), torch.tensor([4, 2, 9])
    locs = torch.arange(100, 109, dtype=torch.int64)
    sk.assign_req_to_token_pool_cpu(rpi, r2t, start, end, locs, 16)
    want = torch.zeros_like(r2t)
    off = 0
    for row, (s, e) in zip(rpi.tolist(), _runs(start, end), strict=True):
        for j in range(s, e):
            want[row, j] = 100 + off
            off += 1
    assert torch.equal(r2t, want)
    out = torch.full((9,), -1, dtype=torch.int64)
    sk.assign_extend_cache_locs_cpu(rpi, r2t, start, end, out, 16)
    assert out.tolist() == locs.tolist()


def test_assign_draft_cache_locs_contiguous():
    r2t = torch.arange(3 * 20, dtype=torch.int64).view(3, 20)
    rpi, seq = torch.tensor([1, 2]), torch.tensor([5, 3])
    out = torch.empty(2 * 2 * 3, dtype=torch.int64)
    sk.assign_draft_cache_locs_contiguous_cpu(rpi, r2t, seq, out, 20, 2, 3)
    assert out.tolist() == [25, 26, 27, 28, 29, 30, 43, 44, 45, 46, 47, 48]


def test_build_draft_decode_metadata_gives_each_branch_prefix_plus_its_drafts():
    topk, steps, pool = 2, 3, 16
    r2t = torch.arange(2 * pool, dtype=torch.int32).view(2, pool) + 1000
    rpi, seq = torch.tensor([1, 0]), torch.tensor([4, 2])
    out = sk.build_draft_decode_metadata_cpu(r2t, rpi, seq, topk, steps, pool)
    assert out.shape == (4, pool) and out.dtype == r2t.dtype
    for i in range(2):
        s, row = int(seq[i]), int(rpi[i])
        for j in range(topk):
            for step in range(steps):  # draft step `step` sees prefix + steps 0..step of branch j
                seen = out[i * topk + j, : s + step + 1].tolist()
                want = r2t[row, :s].tolist() + [
                    int(r2t[row, s + j * steps + t]) for t in range(step + 1)
                ]
                assert seen == want


def test_copy_all_layer_kv_cache_copies_rows_of_every_buffer_from_a_snapshot():
    bufs = [torch.randn(10, 3, 4), torch.randn(10, 2, 8, dtype=torch.float64)]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    tgt, src = torch.tensor([2, 3, 7]), torch.tensor([3, 5, 2])  # 3 is both a source and a target
    sk.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, old in zip(bufs, before, strict=True):
        want = old.clone()
        for t, s in zip(tgt.tolist(), src.tolist(), strict=True):
            want[t] = old[s]
        assert torch.equal(b, want)


def test_fill_bonus_tokens_and_accept_out_cache_loc():
    accept_tokens = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    bonus = torch.zeros(2, dtype=torch.int64)
    sk.fill_bonus_tokens_cpu(accept_tokens, torch.tensor([3, 1]), bonus, 4)
    assert bonus.tolist() == [7, 8]
    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1], [6, 7, 8]], dtype=torch.int32)
    out_cache_loc = torch.arange(50, 59)
    res = torch.full((9,), -1, dtype=torch.int64)
    sk.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, res)
    assert res.tolist()[:6] == [50, 52, 54, 56, 57, 58] and res.tolist()[6:] == [-1] * 3


def test_rotate_input_ids():
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    sk.rotate_input_ids_cpu(ids, torch.tensor([0, 3]), torch.tensor([3, 4]), torch.tensor([9, 8]))
    assert ids.tolist() == [2, 3, 9, 5, 6, 7, 8]


# ---------------------------------------------------------------- trees


def _random_tree(rng: random.Random, topk: int, depth: int, ndt: int):
    """A draft selection the way SGLang's EAGLE draft lays it out: step-0 candidates have
    indices [0, topk) (parent = root); step s >= 1 expands `topk` beams, beam b's children
    have indices topk + (s-1)*topk^2 + (b-1')*topk + c, and index // topk names the beam;
    parent_list[beam] is the selected-index of the token the beam extends."""
    parent_list = [-1]
    cands = [(i, None) for i in range(topk)]  # (index, parent index)
    frontier = list(range(topk))
    for _ in range(1, depth):
        beams = rng.sample(frontier, min(topk, len(frontier)))
        new = []
        for tok in beams:
            beam_id = len(parent_list)
            parent_list.append(tok)
            for c in range(topk):
                idx = beam_id * topk + c
                new.append(idx)
                cands.append((idx, tok))
        frontier = new
    while len(parent_list) < topk * (depth - 1) + 1:
        parent_list.append(-1)
    parent_of = dict(cands)
    chosen: set[int] = set()
    order = [i for i, _ in cands]
    rng.shuffle(order)
    for i in order:  # closed under ancestors
        path, p = [i], parent_of[i]
        while p is not None:
            path.append(p)
            p = parent_of[p]
        if len(chosen | set(path)) <= ndt - 1:
            chosen |= set(path)
    sel = sorted(chosen)
    if len(sel) < ndt - 1:  # the ancestor closure came out too small: draw again
        return _random_tree(rng, topk, depth, ndt)
    return parent_list, sel, parent_of


def _tree_reference(sel, parent_of, ndt):
    node_of = {idx: x + 1 for x, idx in enumerate(sel)}
    parent = [-1] + [0 if parent_of[i] is None else node_of[parent_of[i]] for i in sel]
    depth = [0] * ndt
    for x in range(1, ndt):
        depth[x] = depth[parent[x]] + 1
    children = [[c for c in range(1, ndt) if parent[c] == x] for x in range(ndt)]
    nxt = [ch[0] if ch else -1 for ch in children]
    sib = [-1] * ndt
    for ch in children:
        for a, b in zip(ch, ch[1:], strict=False):
            sib[a] = b
    mask = torch.zeros(ndt, ndt, dtype=torch.bool)
    for x in range(ndt):
        y = x
        while y != -1:
            mask[x, y] = True
            y = parent[y]
    return parent, depth, nxt, sib, mask


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", [0, 1])
def test_build_tree_matches_the_tree_the_selection_describes(seed, mode):
    rng = random.Random(seed)
    topk, depth = rng.choice([(2, 3), (3, 3), (2, 4), (4, 2)])
    ndt = rng.randint(3, min(8, topk + (depth - 1) * topk * topk) + 1)
    bs = 2
    trees = [_random_tree(rng, topk, depth, ndt) for _ in range(bs)]
    seq_lens = torch.tensor([5, 3])
    parent_list = torch.tensor([t[0] for t in trees])
    selected = torch.tensor([t[1] for t in trees])
    if mode == 0:
        tree_mask = torch.full((int(seq_lens.sum()) * ndt + ndt * ndt * bs,), True)
    else:
        tree_mask = torch.full((ndt * ndt * bs,), True)
    positions = torch.empty(bs * ndt, dtype=torch.long)
    ri, rn, rs = torch.full((3, bs, ndt), -1, dtype=torch.long)
    sk.build_tree_kernel_efficient_cpu(
        parent_list, selected, seq_lens, tree_mask, positions, ri, rn, rs, topk, depth, ndt, mode
    )
    off = 0
    for b, (_, sel, parent_of) in enumerate(trees):
        _, dep, nxt, sib, mask = _tree_reference(sel, parent_of, ndt)
        s = int(seq_lens[b])
        assert positions[b * ndt : (b + 1) * ndt].tolist() == [s + d for d in dep]
        assert ri[b].tolist() == [b * ndt + x for x in range(ndt)]
        assert rn[b].tolist() == nxt and rs[b].tolist() == sib
        if mode == 0:
            rows = tree_mask[off : off + ndt * (s + ndt)].view(ndt, s + ndt)
            assert rows[:, :s].all()  # the prefix stays visible
            assert torch.equal(rows[:, s:], mask)
            off += ndt * (s + ndt)
        else:
            assert torch.equal(tree_mask[b * ndt * ndt : (b + 1) * ndt * ndt].view(ndt, ndt), mask)


def _verify_reference(cands, nxt, sib, target, num_spec):
    """Greedy by enumeration: every root path whose tokens each equal the target's argmax at
    their parent; the longest wins, ties to the earlier sibling (the first found in DFS)."""
    best: list[int] = [0]

    def dfs(node, path):
        nonlocal best
        if len(path) > len(best):
            best = list(path)
        if len(path) == num_spec:
            return
        c = nxt[node]
        while c != -1:
            if cands[c] == target[node]:
                dfs(c, path + [c])
                return  # the first matching sibling is taken, never a later one
            c = sib[c]

    dfs(0, [0])
    return best


@pytest.mark.parametrize("seed", range(8))
def test_verify_tree_greedy_matches_enumeration(seed):
    rng = random.Random(100 + seed)
    topk, depth = rng.choice([(1, 4), (2, 3), (3, 3)])
    ndt = rng.randint(2, min(7, topk + (depth - 1) * topk * topk) + 1)
    bs, vocab = 3, 4  # a small vocab so that drafts often match
    trees = [_random_tree(rng, topk, depth, ndt) for _ in range(bs)]
    refs = [_tree_reference(t[1], t[2], ndt) for t in trees]
    cands = torch.randint(0, vocab, (bs, ndt), generator=torch.Generator().manual_seed(seed))
    target = torch.randint(0, vocab, (bs, ndt), generator=torch.Generator().manual_seed(99 + seed))
    ri = torch.arange(bs * ndt).view(bs, ndt)
    rn = torch.tensor([r[2] for r in refs])
    rs = torch.tensor([r[3] for r in refs])
    num_spec = depth + 1
    predicts = torch.full((bs * ndt,), -1, dtype=torch.int32)
    accept_index = torch.full((bs, num_spec), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    sk.verify_tree_greedy_cpu(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=cands,
        retrive_index=ri,
        retrive_next_token=rn,
        retrive_next_sibling=rs,
        target_predict=target,
    )
    for b in range(bs):
        path = _verify_reference(cands[b].tolist(), rn[b].tolist(), rs[b].tolist(),
                                 target[b].tolist(), num_spec)  # fmt: skip
        assert int(accept_num[b]) == len(path) - 1
        got = accept_index[b].tolist()
        assert got[: len(path)] == [b * ndt + x for x in path]
        assert got[len(path) :] == [-1] * (num_spec - len(path))
        for x in path:  # the target's token at every accepted node (the last one: the bonus)
            assert int(predicts[b * ndt + x]) == int(target[b, x])


# ---------------------------------------------------------------- attention


def _sdpa_reference(q, k, v, scale, mask):
    """q [n,H,D], k/v [t,Hkv,D], mask [n,t]: torch's own SDPA on grouped heads."""
    g = q.shape[1] // k.shape[1]
    kq = k.repeat_interleave(g, 1).transpose(0, 1)
    vq = v.repeat_interleave(g, 1).transpose(0, 1)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kq, vq, attn_mask=mask, scale=scale
    )
    return o.transpose(0, 1)


def _pool(n_slots=64, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_slots, hkv, d, generator=g), torch.randn(n_slots, hkv, d, generator=g)


def test_decode_attention_writes_new_kv_then_attends_over_the_request():
    H, hkv, d = 6, 2, 8
    kb, vb = _pool(hkv=hkv, d=d)
    r2t = torch.zeros(3, 32, dtype=torch.int32)
    r2t[0, :5] = torch.tensor([3, 9, 1, 20, 40])
    r2t[2, :3] = torch.tensor([7, 8, 41])
    rpi, seq = torch.tensor([0, 2]), torch.tensor([5, 3])
    loc = torch.tensor([40, 41])
    q = torch.randn(2, H, d)
    knew, vnew = torch.randn(2, hkv, d), torch.randn(2, hkv, d)
    out = torch.empty(2, H, d)
    logits = torch.empty(2, H, 8, d + 1)
    torch.ops.sgl_kernel.decode_attention_cpu(
        q, kb, vb, 1.0, 1.0, out, knew, vnew, loc, logits, r2t, rpi, seq, 0.3, 0.0, False, 0,
        None, None,
    )  # fmt: skip
    assert torch.equal(kb[40], knew[0]) and torch.equal(vb[41], vnew[1])
    for i in range(2):
        ids = r2t[int(rpi[i]), : int(seq[i])].long()
        want = _sdpa_reference(q[i : i + 1], kb[ids], vb[ids], 0.3, None)
        torch.testing.assert_close(out[i : i + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tree", [False, True])
def test_extend_attention_prefix_plus_causal_or_tree_masked_extend(tree):
    H, hkv, d = 4, 2, 8
    kb, vb = _pool(hkv=hkv, d=d, seed=1)
    r2t = torch.zeros(2, 32, dtype=torch.int32)
    r2t[0, :7] = torch.tensor([1, 2, 3, 4, 10, 11, 12])  # prefix 4 + extend 3
    r2t[1, :5] = torch.tensor([20, 21, 30, 31, 32])  # prefix 2 + extend 3
    rpi, seq = torch.tensor([0, 1]), torch.tensor([7, 5])
    ext, start = torch.tensor([3, 3]), torch.tensor([0, 3])
    q = torch.randn(6, H, d)
    k_ext, v_ext = torch.randn(6, hkv, d), torch.randn(6, hkv, d)
    # a tree over the 3 extend tokens: node 0 the root, 1 and 2 siblings (QLEN_ONLY rows)
    tm = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    custom = torch.cat([tm.flatten(), tm.flatten()]) if tree else None
    out = torch.empty(6, H, d)
    torch.ops.sgl_kernel.extend_attention_cpu(
        q, k_ext, v_ext, out, kb, vb, 1.0, 1.0, r2t, rpi, seq, ext, start, 3, 0.25, 0.0,
        False, 0, None, None, custom, True,
    )  # fmt: skip
    for i in range(2):
        n, s0, total = 3, int(start[i]), int(seq[i])
        prefix = total - n
        ids = r2t[i, :prefix].long()
        k = torch.cat([kb[ids], k_ext[s0 : s0 + n]])
        v = torch.cat([vb[ids], v_ext[s0 : s0 + n]])
        mask = torch.ones(n, total, dtype=torch.bool)
        mask[:, prefix:] = tm if tree else torch.tril(torch.ones(n, n, dtype=torch.bool))
        want = _sdpa_reference(q[s0 : s0 + n], k, v, 0.25, mask)
        torch.testing.assert_close(out[s0 : s0 + n], want, rtol=1e-5, atol=1e-5)


def test_unsupported_attention_features_say_so():
    kb, vb = _pool()
    with pytest.raises(NotImplementedError, match="sinks"):
        torch.ops.sgl_kernel.decode_attention_cpu(
            torch.randn(1, 2, 8), kb, vb, 1.0, 1.0, torch.empty(1, 2, 8), None, None,
            torch.tensor([0]), torch.empty(1, 2, 8, 9), torch.zeros(1, 4, dtype=torch.int32),
            torch.tensor([0]), torch.tensor([1]), 1.0, 0.0, False, 0, None, torch.zeros(2),
        )  # fmt: skip
