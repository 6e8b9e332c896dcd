"""Pure-torch stand-in for the CPU build of `sgl_kernel` (test support, not product code).

SGLang 0.5.23 in CPU mode (`--device cpu`, `SGLANG_USE_CPU_ENGINE=1`) imports these helper
ops from `sgl_kernel` at module load, and the `intel_amx` attention backend calls
`torch.ops.sgl_kernel.{decode,extend}_attention_cpu`. The CPU build of `sgl_kernel` is not
on PyPI (`sglang-kernel` there is the CUDA build), so this package provides them with the
semantics of SGLang's own Triton kernels (`sglang/kernels/ops/...`), written for clarity,
not speed. Only what a dense Llama-family target + EAGLE-3 draft needs; anything else
raises NotImplementedError naming the missing feature. See ../README.md.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

__version__ = "0.0.0+workbench.cpu.standin"

# ---------------------------------------------------------------- KV slot bookkeeping


def _lengths(start: Tensor, end: Tensor) -> list[int]:
    return [int(e) - int(s) for s, e in zip(start.tolist(), end.tolist(), strict=True)]


def assign_req_to_token_pool_cpu(
    req_pool_indices: Tensor,
    req_to_token: Tensor,
    start_offset: Tensor,
    end_offset: Tensor,
    out_cache_loc: Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th run of out_cache_loc."""
    off = 0
    for i, n in enumerate(_lengths(start_offset, end_offset)):
        row, s = int(req_pool_indices[i]), int(start_offset[i])
        req_to_token[row, s : s + n] = out_cache_loc[off : off + n].to(req_to_token.dtype)
        off += n


def assign_extend_cache_locs_cpu(
    req_pool_indices: Tensor,
    req_to_token: Tensor,
    start_offset: Tensor,
    end_offset: Tensor,
    out_cache_loc: Tensor,
    pool_len: int,
) -> None:
    """The reverse: the i-th run of out_cache_loc = req_to_token[rpi[i], start[i]:end[i]]."""
    off = 0
    for i, n in enumerate(_lengths(start_offset, end_offset)):
        row, s = int(req_pool_indices[i]), int(start_offset[i])
        out_cache_loc[off : off + n] = req_to_token[row, s : s + n].to(out_cache_loc.dtype)
        off += n


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: Tensor,
    req_to_token: Tensor,
    seq_lens: Tensor,
    out_cache_loc: Tensor,
    pool_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """Request i's `topk * num_cols` slots from seq_lens[i] on, packed per request."""
    n = topk * num_cols
    for i in range(seq_lens.numel()):
        row, s = int(req_pool_indices[i]), int(seq_lens[i])
        out_cache_loc[i * n : (i + 1) * n] = req_to_token[row, s : s + n].to(out_cache_loc.dtype)


def build_draft_decode_metadata_cpu(
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    topk: int,
    num_steps: int,
    pool_len: int,
) -> Tensor:
    """A req_to_token table with one row per draft candidate (request i, branch j):
    the request's prefix, then branch j's draft slots (`seq_len + j * num_steps + t`), so a
    plain decode over `seq_len + step + 1` tokens sees the prefix and that branch's drafts
    (as SGLang's `generate_draft_decode_kv_indices` lays out kv_indices for page size 1)."""
    bs = seq_lens.numel()
    out = torch.zeros((bs * topk, pool_len), dtype=req_to_token.dtype, device=req_to_token.device)
    for i in range(bs):
        row, s = int(req_pool_indices[i]), int(seq_lens[i])
        for j in range(topk):
            out[i * topk + j, :s] = req_to_token[row, :s]
            a = s + j * num_steps
            out[i * topk + j, s : s + num_steps] = req_to_token[row, a : a + num_steps]
    return out


def copy_all_layer_kv_cache_cpu(
    data_ptrs: Tensor, strides: Tensor, tgt_loc: Tensor, src_loc: Tensor
) -> None:
    """For every buffer b (raw address data_ptrs[b], row size strides[b] bytes): row tgt_loc[k]
    = row src_loc[k], all rows read before any is written (the Triton kernel loads a tile
    of every source row before storing)."""
    if tgt_loc.numel() == 0:
        return
    src, tgt = src_loc.long(), tgt_loc.long()
    rows = int(max(int(src.max()), int(tgt.max()))) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        view = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        view[tgt] = view[src]  # advanced indexing on the right copies first


# ---------------------------------------------------------------- EAGLE bookkeeping


def fill_bonus_tokens_cpu(
    accept_tokens: Tensor, accept_lens: Tensor, bonus_tokens: Tensor, accept_stride: int
) -> None:
    """bonus[i] = the last accepted token of request i (accept_lens include the bonus)."""
    flat = accept_tokens.reshape(-1)
    for i in range(accept_lens.numel()):
        bonus_tokens[i] = flat[accept_stride * i + int(accept_lens[i]) - 1]


def fill_accept_out_cache_loc_cpu(
    accept_index: Tensor, out_cache_loc: Tensor, accept_out_cache_loc: Tensor
) -> None:
    """Compact the cache slots of accepted entries (accept_index != -1), in order."""
    idx = accept_index.reshape(-1)
    kept = idx[idx != -1].long()
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def rotate_input_ids_cpu(
    input_ids: Tensor,
    extend_start_loc: Tensor,
    extend_seq_lens: Tensor,
    topk_index: Tensor,
    select_index: Tensor | None = None,
) -> None:
    """Shift each request's ids left by one and put its new token last (multi-layer EAGLE)."""
    new = topk_index.reshape(-1)
    for i in range(extend_seq_lens.numel()):
        s, n = int(extend_start_loc[i]), int(extend_seq_lens[i])
        if n <= 0:
            continue
        input_ids[s : s + n - 1] = input_ids[s + 1 : s + n].clone()
        last = int(select_index[i]) if select_index is not None else s + n - 1
        input_ids[last] = new[i]


def build_tree_kernel_efficient_cpu(
    parent_list: Tensor,
    selected_index: Tensor,
    verified_seq_len: Tensor,
    tree_mask: Tensor,
    positions: Tensor,
    retrieve_index: Tensor,
    retrieve_next_token: Tensor,
    retrieve_next_sibling: Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """The EAGLE tree from the draft's selection: positions, retrieve_* links, tree mask.

    Node 0 is the verified root; node x >= 1 is selected_index[x - 1]. A selected index
    divided by topk names its parent's beam (0 = the root); parent_list maps a beam to the
    selected index of its token. Mask modes: 0 FULL_MASK (rows of seq_len + ndt, prefix
    columns left as given), 1 QLEN_ONLY (rows of ndt). 2 (bit-packed) is not supported,
    as in SGLang's Triton version.
    """
    mode = int(tree_mask_mode)
    if mode not in (0, 1):
        raise NotImplementedError("tree mask mode QLEN_ONLY_BITPACKING is not supported on CPU")
    ndt = draft_token_num
    parents = parent_list.reshape(parent_list.shape[0], -1).tolist()
    selected = selected_index.reshape(selected_index.shape[0], -1).tolist()
    seq_lens = verified_seq_len.tolist()
    rnt, rns = retrieve_next_token, retrieve_next_sibling
    prefix = 0
    for b, seq_len in enumerate(seq_lens):
        sel, par = selected[b], parents[b]

        def parent_slot(x: int, sel=sel, par=par) -> int | None:
            """Position in `sel` of node x's parent; -1 = the root; None = not found."""
            beam = sel[x] // topk
            if beam == 0:
                return -1
            tok = par[beam]
            for pp in range(ndt - 1):
                if sel[pp] == tok:
                    return pp
            return None

        positions[b * ndt] = seq_len
        for i in range(ndt - 1, 0, -1):  # reverse: children end up in selection order
            retrieve_index[b, i] = b * ndt + i
            p = parent_slot(i - 1)
            if p is None:
                continue
            parent_pos = p + 1
            nxt = int(rnt[b, parent_pos])
            rnt[b, parent_pos] = i
            if nxt != -1:
                rns[b, i] = nxt
        retrieve_index[b, 0] = b * ndt

        for x in range(ndt):
            if mode == 0:
                row0 = prefix * ndt + ndt * ndt * b + (seq_len + ndt) * x + seq_len
            else:
                row0 = ndt * ndt * b + ndt * x
            tree_mask[row0] = True  # the root column
            tree_mask[row0 + 1 : row0 + ndt] = False
            if x == 0:
                continue
            cur, pos = x - 1, 0
            for _ in range(depth):
                pos += 1
                tree_mask[row0 + 1 + cur] = True
                p = parent_slot(cur)
                if p is None or p == -1:
                    break
                cur = p
            positions[b * ndt + x] = pos + seq_len
        prefix += seq_len


def verify_tree_greedy_cpu(
    predicts: Tensor,
    accept_index: Tensor,
    accept_token_num: Tensor,
    candidates: Tensor,
    retrive_index: Tensor,
    retrive_next_token: Tensor,
    retrive_next_sibling: Tensor,
    target_predict: Tensor,
) -> None:
    """Greedy tree verification: walk from the root, at each depth take the first child
    (in sibling order) whose draft token equals the target's argmax at the current node;
    record the accepted nodes' flat indices, their count (bonus excluded), and the
    target's token at each accepted node into `predicts` (flat)."""
    bs, ndt = candidates.shape
    num_spec = accept_index.shape[1]
    tp = target_predict.reshape(-1)
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        n_acc, cur = 0, 0
        for _ in range(1, num_spec):
            cur = int(retrive_next_token[b, cur])
            target = int(tp[last])
            matched = False
            while cur != -1:
                if int(candidates[b, cur]) == target:
                    predicts[last] = target
                    n_acc += 1
                    accept_index[b, n_acc] = retrive_index[b, cur]
                    last = int(retrive_index[b, cur])
                    matched = True
                    break
                cur = int(retrive_next_sibling[b, cur])
            if not matched:
                break
        accept_token_num[b] = n_acc
        predicts[last] = tp[last]


# ---------------------------------------------------------------- attention


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sm_scale: float,
    logit_cap: float,
    mask: Tensor | None,
) -> Tensor:
    """q [n, H, D], k/v [t, Hkv, D] -> [n, H, Dv] in fp32 math; mask [n, t] bool (True = see)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [t, H, D]
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,thd->hnt", q.float(), kf) * sm_scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hnt,thd->nhd", p, vf)


def _check_supported(is_cross_attn: bool, sinks: Tensor | None, k_buffer: Tensor) -> None:
    if is_cross_attn:
        raise NotImplementedError("cross-attention is not supported by the CPU stand-in")
    if sinks is not None:
        raise NotImplementedError("attention sinks are not supported by the CPU stand-in")
    if k_buffer.dtype == torch.float8_e4m3fn:
        raise NotImplementedError("an fp8 KV cache is not supported by the CPU stand-in")


def _window(ids: Tensor, sliding_window_size: int) -> Tensor:
    """The last `sliding_window_size` slots (SGLang passes window + 1; <= 0 means none)."""
    return ids[-sliding_window_size:] if sliding_window_size > 0 else ids


def decode_attention(
    query: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    key_scale: float,
    value_scale: float,
    output: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    loc: Tensor,
    attn_logits: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool,
    sliding_window_size: int,
    encoder_lens: Tensor | None,
    sinks: Tensor | None,
) -> None:
    """One query token per sequence; writes key/value (when given) to the cache at `loc`
    first, then attends over req_to_token[rpi[i], :seq_lens[i]] (GQA by head groups)."""
    _check_supported(is_cross_attn, sinks, k_buffer)
    if key is not None and value is not None:
        k_buffer[loc.long()] = key.reshape(-1, *k_buffer.shape[1:]).to(k_buffer.dtype)
        v_buffer[loc.long()] = value.reshape(-1, *v_buffer.shape[1:]).to(v_buffer.dtype)
    for i in range(seq_lens.numel()):
        ids = req_to_token[int(req_pool_indices[i]), : int(seq_lens[i])].long()
        ids = _window(ids, sliding_window_size)
        k = k_buffer[ids] * key_scale
        v = v_buffer[ids] * value_scale
        o = _attend(query[i : i + 1], k, v, sm_scale, logit_cap, None)
        output[i : i + 1] = o.to(output.dtype)


def extend_attention(
    q_extend: Tensor,
    k_extend: Tensor | None,
    v_extend: Tensor | None,
    o_extend: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    key_scale: float,
    value_scale: float,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    extend_seq_lens: Tensor,
    extend_start_loc: Tensor,
    max_len_extend: int | None,
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool,
    sliding_window_size: int,
    encoder_lens: Tensor | None,
    sinks: Tensor | None,
    custom_mask: Tensor | None,
    is_causal: bool,
) -> None:
    """Extend tokens of request i (rows extend_start_loc[i] + [0, n)) see the cached prefix
    req_to_token[rpi[i], :seq_lens[i] - n] and the extend tokens causally, or, with a
    custom mask (speculative verify trees, QLEN_ONLY layout [n, n] per request), the extend
    tokens the mask allows. The extend tokens' K/V come from k_extend/v_extend (from the
    cache when those are None: a layer sharing another layer's KV)."""
    _check_supported(is_cross_attn, sinks, k_buffer)
    mask_off = 0
    for i in range(seq_lens.numel()):
        n, s0 = int(extend_seq_lens[i]), int(extend_start_loc[i])
        total = int(seq_lens[i])
        prefix = total - n
        ids = req_to_token[int(req_pool_indices[i]), :total].long()
        k, v = k_buffer[ids].clone(), v_buffer[ids].clone()
        if k_extend is not None and v_extend is not None:
            k[prefix:] = k_extend[s0 : s0 + n].reshape(n, *k.shape[1:]).to(k.dtype)
            v[prefix:] = v_extend[s0 : s0 + n].reshape(n, *v.shape[1:]).to(v.dtype)
        k, v = k * key_scale, v * value_scale
        q_pos = torch.arange(prefix, total)[:, None]
        k_pos = torch.arange(total)[None, :]
        mask = (k_pos <= q_pos) if is_causal else torch.ones(n, total, dtype=torch.bool)
        if custom_mask is not None:
            tree = custom_mask[mask_off : mask_off + n * n].view(n, n).bool()
            mask[:, prefix:] = tree
            mask_off += n * n
        if sliding_window_size > 0:
            mask &= k_pos > q_pos - sliding_window_size
        o = _attend(q_extend[s0 : s0 + n], k, v, sm_scale, logit_cap, mask)
        o_extend[s0 : s0 + n] = o.to(o_extend.dtype)


# Registered as torch.ops.sgl_kernel.*, where SGLang calls them that way.
_lib = torch.library.Library("sgl_kernel", "DEF")
_lib.define(
    "decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "float key_scale, float value_scale, Tensor(c!) output, Tensor? key, Tensor? value, "
    "Tensor loc, Tensor(d!) attn_logits, Tensor req_to_token, Tensor req_pool_indices, "
    "Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, "
    "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"
)
_lib.define(
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, "
    "Tensor(a!) o_extend, Tensor(b!) k_buffer, Tensor(c!) v_buffer, float key_scale, "
    "float value_scale, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
    "Tensor extend_seq_lens, Tensor extend_start_loc, int? max_len_extend, float sm_scale, "
    "float logit_cap, bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, "
    "Tensor? sinks, Tensor? custom_mask, bool is_causal) -> ()"
)
_lib.impl("decode_attention_cpu", decode_attention, "CPU")
_lib.impl("extend_attention_cpu", extend_attention, "CPU")
