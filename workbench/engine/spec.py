"""EAGLE-3 speculative decoding on the static-cache `Llama` (batch 1), readable in one file.

A cycle (SGLang's worker flow, in the order the data flows):

1. extend: the draft runs over the tokens accepted last cycle with the target's concatenated
   aux states of those tokens (k*H, through `fc`). Draft position t reads emb(tok[t+1]) and
   aux[t]; its last output is the first draft distribution + hidden (draft step 1).
2. draft: `num_steps - 1` more draft forwards on the draft's own H. Chain (topk = 1) or the
   EAGLE-2/3 dynamic tree: each step expands the top-k beams by cumulative draft log-prob,
   all k*k candidates join a pool, the best `num_draft_tokens - 1` pool nodes are verified.
3. verify: ONE target forward over [last committed token, draft nodes] with a tree mask and
   depth positions; accept the longest path the target agrees with (greedy), or by
   speculative sampling (lossless); the bonus token comes from the target. The accepted
   path's KV is compacted in place, the rest rolled back by lowering `lengths`; the path's
   aux states are selected (`select_accepted_hidden`) for the next extend.

Invariants: the target cache holds every committed token but the last (the root of the next
tree); the draft cache holds draft positions [0, root position).
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from workbench import metrics
from workbench.draft.model import Eagle3Draft
from workbench.draft.model import KVCache as DraftCache
from workbench.engine.trace import CycleRecord, TraceWriter
from workbench.errors import WorkbenchError
from workbench.layers import LayerIds, validate
from workbench.llama import KVCache, Llama, linear, pack_matmul_weight

# SGLang's automatic choice for LlamaForCausalLM targets when none of the three is set.
AUTO_PARAMS = (5, 4, 8)
RULE_ALL_OR_NONE = "set all three of num_steps, eagle_topk, num_draft_tokens, or none of them"
RULE_HARD_LIMIT = "num_draft_tokens - 1 <= topk + (num_steps - 1) * topk^2"


class SpecError(WorkbenchError):
    """Speculation parameters, or a draft and target, that do not fit together."""


# ---------------------------------------------------------------- parameters


@dataclass(frozen=True)
class SpecParams:
    num_steps: int
    eagle_topk: int
    num_draft_tokens: int

    @property
    def chain(self) -> bool:
        return self.eagle_topk == 1

    def __str__(self) -> str:
        return f"{self.num_steps}/{self.eagle_topk}/{self.num_draft_tokens}"


def resolve_params(
    num_steps: int | None = None,
    eagle_topk: int | None = None,
    num_draft_tokens: int | None = None,
) -> SpecParams:
    """Validate like SGLang's ServerArgs: all or none; topk 1 forces ndt = steps + 1; hard limit."""
    vals = (num_steps, eagle_topk, num_draft_tokens)
    if all(v is None for v in vals):
        return SpecParams(*AUTO_PARAMS)
    if any(v is None for v in vals):
        raise SpecError(
            f"SGLang rule: {RULE_ALL_OR_NONE} (got num_steps={num_steps}, "
            f"eagle_topk={eagle_topk}, num_draft_tokens={num_draft_tokens})"
        )
    s, k, n = (int(v) for v in vals)  # type: ignore[arg-type]
    if s < 1 or k < 1 or n < 1:
        raise SpecError(f"num_steps, eagle_topk, num_draft_tokens must be >= 1, got {s}/{k}/{n}")
    if k == 1 and n != s + 1:
        warnings.warn(
            f"SGLang rule: eagle_topk = 1 forces num_draft_tokens = num_steps + 1; "
            f"adjusting num_draft_tokens {n} -> {s + 1}",
            stacklevel=2,
        )
        n = s + 1
    if n - 1 > k + (s - 1) * k * k:
        raise SpecError(
            f"SGLang rule: {RULE_HARD_LIMIT}; got num_draft_tokens={n}, eagle_topk={k}, "
            f"num_steps={s}: {n - 1} > {k + (s - 1) * k * k}"
        )
    return SpecParams(s, k, n)


def check_draft(llm: Llama, draft: Eagle3Draft, layer_ids: LayerIds | None = None) -> LayerIds:
    """Fail with a message naming what differs (vocab, hidden size, fc width, layer ids)."""
    c = draft.config
    V, H = int(llm.config.vocab_size), llm.dim
    if c.vocab_size != V or draft.t2d.numel() != V:
        raise SpecError(f"vocab mismatch: draft vocab_size {c.vocab_size}, target vocab {V}")
    if int(draft.draft_ids.max()) >= V or int(draft.draft_ids.min()) < 0:
        raise SpecError(f"vocab mismatch: draft d2t maps outside the target vocab of {V}")
    if c.target_hidden_size != H:
        raise SpecError(
            f"hidden size mismatch: draft target_hidden_size {c.target_hidden_size}, "
            f"target hidden {H}"
        )
    ids = layer_ids or c.layer_ids
    if draft.fc.in_features != len(ids.ids) * H:
        raise SpecError(
            f"fc width mismatch: draft fc takes {draft.fc.in_features} features, "
            f"{len(ids.ids)} aux layers x target hidden {H} give {len(ids.ids) * H}"
        )
    validate(ids, llm.n_layers)
    if draft.embed_tokens.shape != (V, c.hidden_size):
        raise SpecError(f"hidden size mismatch: draft embeddings {tuple(draft.embed_tokens.shape)}")
    if not bool(draft.embed_tokens.any()):
        if c.hidden_size != H:
            raise SpecError(
                f"hidden size mismatch: draft hidden {c.hidden_size} != target hidden {H} and "
                "the draft has no embeddings of its own (SGLang shares the target's only "
                "when the sizes agree)"
            )
        draft.embed_tokens.copy_(llm.embed.to(draft.embed_tokens))  # frozen, never stored
    return ids


class PackedLinear(nn.Module):
    """`nn.Linear` (no bias) for inference on a weight packed like the target's (`llama.linear`)."""

    def __init__(self, lin: nn.Linear, mkl_rows: int, mkl_packs: Sequence[int]) -> None:
        super().__init__()
        self.weight = lin.weight.detach()  # the plain copy: `project` reads its dtype
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.packed = pack_matmul_weight(self.weight, mkl_rows, mkl_packs)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.packed)


def packed_draft(llm: Llama, draft: Eagle3Draft) -> Eagle3Draft:
    """A copy of `draft` whose matmuls run like the target's: on packed weights, by row count.

    Why: the engine runs the draft at 1 row (extend, chains) or topk rows (tree steps), where
    `nn.Linear`'s MKL sgemm is slow on AMD CPUs. On an AMD EPYC (2 threads) one draft forward
    took 2.3 ms at 1 row and 1.7 ms at 4 rows, 1.3 and 1.1 ms packed; a 4/4/8 cycle runs four.
    The copy shares the draft's buffers (the 113 MB embedding) and leaves `draft` untouched
    (training and offline evaluation keep autograd-friendly `nn.Linear`). Returns `draft`
    itself where the target is not packed (GPU, other dtypes), the dtypes differ, or the draft
    is a subclass (it may keep state of its own that a copy would not follow)."""
    w = draft.fc.weight
    if type(draft) is not Eagle3Draft or not llm.onednn or w.dtype != llm.dtype:
        return draft
    d = copy.deepcopy(draft, memo={id(b): b for b in draft.buffers()})
    d.eval()
    for parent in list(d.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None:
                setattr(parent, name, PackedLinear(child, llm.mkl_rows, llm.mkl_packs))
    return d


# ---------------------------------------------------------------- results


@dataclass
class RequestStats:
    """Per-request counts. `tau` is `metrics.tau` (prefill token excluded); `meta_info` gives
    the same request in SGLang's `meta_info` fields (`spec_accept_length` = `metrics.tau_sglang`)."""

    request_id: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    verify_forwards: int = 0  # target forwards after prefill (one per cycle)
    seconds: float = 0.0
    accepted: list[int] = field(default_factory=list)  # per cycle, bonus included

    @property
    def decode_tokens(self) -> int:
        return sum(self.accepted)

    @property
    def tau(self) -> float:
        return metrics.tau(self.decode_tokens, self.verify_forwards)

    def meta_info(self, num_steps: int) -> dict:
        """This request as SGLang's `meta_info` reports it, so engine and server compare 1:1."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            **metrics.sglang_spec_meta(self.completion_tokens, self.accepted, num_steps),
        }


@dataclass
class Generation:
    tokens: list[int]
    stats: RequestStats


# ---------------------------------------------------------------- tree


@dataclass
class DraftTree:
    """Nodes in creation order (parents before children); node 0 is the root."""

    tokens: Tensor  # [N] target ids
    parents: list[int]  # parents[0] = -1
    depth: Tensor  # [N]
    q: Tensor | None = None  # [N, V] draft probs that proposed each node (sampled chain)
    children: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.children = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], 1):
            self.children[p].append(i)  # in pool order = best draft score first per parent

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def mask(self) -> Tensor:
        """[N, N] bool: node i sees its ancestors and itself."""
        n = len(self.parents)
        m = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            m[i] |= m[self.parents[i]]
        return m


def select_accepted_hidden(aux: Tensor, accept_index: Tensor) -> Tensor:
    """Aux states of the accepted tokens, for the next cycle's first draft step.

    aux [N, k*H] (or [B, N, k*H]) are the target's aux states of the verified tokens in tree
    order; accept_index [m] (or [B, m]) the tree indices of the accepted path, root first.
    Row j of the result is the state at sequence position root + j, which the next extend
    pairs with the token at root + j + 1. (The Kimi-K2.5 report's bug class: selecting by
    position in the flattened verify batch instead of by accepted index.)
    """
    if aux.dim() == 2:
        return aux.index_select(0, accept_index)
    idx = accept_index[..., None].expand(*accept_index.shape, aux.shape[-1])
    return aux.gather(1, idx)


def commit_path(cache: KVCache, root_slot: int, path: Tensor) -> None:
    """Move the accepted path's KV (batch row 0) to consecutive slots; drop the rest."""
    m = len(path)
    dst = torch.arange(root_slot, root_slot + m, device=cache.k.device)
    src = path.to(cache.k.device) + root_slot
    if not torch.equal(src, dst):  # a chain path is already in place
        for kv in (cache.k[:, 0], cache.v[:, 0]):  # [layers, kv_heads, T, D] views
            kv.index_copy_(2, dst, kv.index_select(2, src))
    cache.lengths[0] = root_slot + m


# ---------------------------------------------------------------- decoder


class SpecDecoder:
    """Target (`Llama`, static cache) + EAGLE-3 draft. `draft=None` decodes without speculation."""

    def __init__(
        self,
        llm: Llama,
        draft: Eagle3Draft | None,
        params: SpecParams | None = None,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        trace: TraceWriter | None = None,
        layer_ids: LayerIds | None = None,
        pack_draft: bool = True,
    ) -> None:
        """`pack_draft`: run the draft's matmuls on packed weights (`packed_draft`)."""
        self.llm, self.draft = llm, draft
        self.params = params or SpecParams(*AUTO_PARAMS)
        self.temperature = float(temperature)
        self.gen = torch.Generator().manual_seed(seed if seed is not None else 0)
        self.trace = trace
        if draft is not None:
            ids = check_draft(llm, draft, layer_ids)
            self.draft = packed_draft(llm, draft) if pack_draft else draft
            self.aux_ids = list(ids.canonical)  # output_of_layer, as llama.forward wants
            self.draft_ids = draft.draft_ids.to(llm.device)
            self.H = draft.config.hidden_size

    # -- sampling helpers -----------------------------------------------------------

    def _pick(self, logits: Tensor) -> int:
        if self.temperature <= 0:
            return int(logits.argmax())
        p = torch.softmax(logits.float() / self.temperature, -1)
        return int(torch.multinomial(p, 1, generator=self.gen))

    # -- public ---------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        request_id: str = "0",
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> Generation:
        """New tokens (stopping at eos inclusive or max_new_tokens) + per-request stats.

        `on_tokens` gets each batch of new tokens as it is committed (streaming servers)."""
        if not prompt:
            raise ValueError("empty prompt")
        t0 = time.perf_counter()
        prompt = [int(t) for t in prompt]
        st = RequestStats(request_id, prompt_tokens=len(prompt))
        eos, out = set(int(e) for e in eos_ids), []
        if max_new_tokens <= 0:
            return Generation(out, st)
        spec = self.draft is not None
        ndt = self.params.num_draft_tokens if spec else 1
        cache = self.llm.new_cache(1, len(prompt) + max_new_tokens + ndt + 1)
        res = self.llm(torch.tensor([prompt]), cache, hidden_layers=self.aux_ids if spec else (),
                       logits="last")  # fmt: skip
        out.append(self._pick(res.logits[0]))
        if on_tokens is not None:
            on_tokens(out[-1:])
        if spec:
            pend_ids, pend_aux = prompt[1:] + out, self._aux(res)[0]
            dcache, pend_pos = DraftCache(), 0
        while out[-1] not in eos and len(out) < max_new_tokens:
            rec = None
            if spec:
                root = int(cache.lengths[0])
                new, pend_aux, rec = self._cycle(cache, dcache, pend_ids, pend_aux, pend_pos, st)
                pend_pos = root  # the next extend starts at this cycle's root
            else:
                logits = self.llm(torch.tensor([[out[-1]]]), cache, logits="last").logits[0]
                new = [self._pick(logits)]
            st.verify_forwards += 1
            for i, t in enumerate(new):  # truncate at eos / max_new_tokens
                if t in eos or len(out) + i + 1 >= max_new_tokens:
                    new = new[: i + 1]
                    break
            out.extend(new)
            if on_tokens is not None:
                on_tokens(new)
            st.accepted.append(len(new))
            pend_ids = new
            if rec is not None:
                rec.accepted = [len(new)]
                self.trace.write(rec)
        st.completion_tokens, st.seconds = len(out), time.perf_counter() - t0
        return Generation(out, st)

    # -- one cycle ------------------------------------------------------------------

    def _aux(self, res) -> Tensor:
        return torch.cat([res.hidden[i] for i in self.aux_ids], dim=-1)

    def _cycle(
        self,
        cache: KVCache,
        dcache: DraftCache,
        ids: list[int],
        aux: Tensor,
        pos0: int,
        st: RequestStats,
    ) -> tuple[list[int], Tensor, CycleRecord | None]:
        """extend -> draft -> verify: (new tokens, aux states of the accepted path, record)."""
        t0 = time.perf_counter()
        root = int(cache.lengths[0])  # sequence position of the last committed token
        if dcache.length != pos0 or pos0 + len(ids) != root:
            raise RuntimeError(
                f"cache invariant broken: draft {dcache.length}, pos {pos0}, root {root}"
            )
        pos = torch.arange(pos0, root)[None]
        dlogits, dh = self.draft(torch.tensor([ids]), aux[None], pos, cache=dcache)
        dims, norms = [aux.shape[-1]], [aux]
        t1 = time.perf_counter()
        tree = self._draft_tree(dcache, dlogits[0, -1], dh[0, -1], root, ids[-1], dims, norms)
        dcache.crop(root)
        t2 = time.perf_counter()
        new, aux_next = self._verify(cache, tree, root)
        t3 = time.perf_counter()
        rec = None
        if self.trace is not None:
            p, tr = self.params, self.trace
            rec = CycleRecord(tr.run_id, tr.rank, tr.next_cycle(), [st.request_id], 1,
                              p.num_steps, p.eagle_topk, p.num_draft_tokens, [len(new)],
                              (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t1 - t0) * 1e3,
                              (time.perf_counter() - t0) * 1e3, hidden_in_dims=dims)  # fmt: skip
            if tr.hidden_norms:
                rec.hidden_norms = [float(h.float().norm(dim=-1).mean()) for h in norms]
                chunks = aux.float().split(self.llm.dim, dim=-1)
                rec.aux_norms = [float(c.norm(dim=-1).mean()) for c in chunks]
        return new, aux_next, rec  # generate() writes it once truncation is known

    def _draft_tree(
        self,
        dcache: DraftCache,
        logits0: Tensor,
        h0: Tensor,
        root: int,
        root_token: int,
        dims: list[int],
        norms: list[Tensor],
    ) -> DraftTree:
        """Expand top-k beams for num_steps levels; keep the best num_draft_tokens - 1 nodes.

        A node of depth d sits at sequence position root + d and is fed to the draft at
        draft position root + d - 1 (it is the *next* token there).
        """
        S, k, n = self.params.num_steps, self.params.eagle_topk, self.params.num_draft_tokens
        sample = self.temperature > 0 and k == 1  # sampled chain: keep q for p/q acceptance
        pool_tok: list[Tensor] = []  # draft-vocab ids, per expansion
        pool_score: list[Tensor] = []
        pool_parent: list[int] = []  # pool index, -1 = root
        pool_depth: list[int] = []
        pool_q: list[Tensor] = []

        def expand(logits: Tensor, base: Tensor, parents: list[int], depth: int):
            lp = torch.log_softmax(logits.float(), -1)  # [B, Vd]
            if sample:
                q = torch.softmax(logits.float() / self.temperature, -1)
                tok = torch.multinomial(q, 1, generator=self.gen)
                pool_q.extend(q)
            else:
                tok = lp.topk(k, dim=-1).indices  # [B, k], best first
            sc = base[:, None] + lp.gather(-1, tok)
            pool_tok.extend(tok.flatten())
            pool_score.extend(sc.flatten())
            pool_parent.extend(p for p in parents for _ in range(k))
            pool_depth.extend([depth] * (len(parents) * k))
            return sc.flatten()

        expand(logits0[None], torch.zeros(1), [-1], 1)
        beams, beam_sc = list(range(k)), torch.stack(pool_score[:k])
        beam_h = h0[None].expand(k, -1)
        anc = torch.zeros(k, 0, dtype=torch.bool)  # ancestors among the fed tree slots
        eye = torch.eye(k, dtype=torch.bool)
        for i in range(1, S):
            ids = self.draft.to_target_ids(torch.stack([pool_tok[b] for b in beams]))
            mask = torch.cat([torch.ones(k, root, dtype=torch.bool), anc, eye], dim=1)
            pos = torch.full((1, k), root + i - 1)
            dims.append(beam_h.shape[-1])
            norms.append(beam_h)
            dl, dh = self.draft(ids[None], beam_h[None], pos, cache=dcache, attn_mask=mask)
            base = len(pool_score)
            flat = expand(dl[0], beam_sc, beams, i + 1)  # [k*k]
            best = flat.topk(k).indices
            rows = best // k
            beams, beam_sc = (base + best).tolist(), flat[best]
            beam_h = dh[0, rows]
            anc = torch.cat([anc, eye], dim=1)[rows]
        # best n-1 nodes; stable sort keeps a parent (score >= child's) ahead of its children
        scores = torch.stack(pool_score)
        order = torch.sort(scores, descending=True, stable=True).indices[: n - 1]
        chosen = sorted(order.tolist())
        where = {j: i + 1 for i, j in enumerate(chosen)}
        parents = [-1] + [0 if pool_parent[j] < 0 else where[pool_parent[j]] for j in chosen]
        toks = self.draft.to_target_ids(torch.stack([pool_tok[j] for j in chosen]))
        q = None
        if sample:
            q = torch.zeros(len(chosen) + 1, int(self.llm.config.vocab_size))
            q[1:, self.draft_ids] = torch.stack([pool_q[j] for j in chosen])
        return DraftTree(
            tokens=torch.cat([torch.tensor([root_token]), toks]),
            parents=parents,
            depth=torch.tensor([0] + [pool_depth[j] for j in chosen]),
            q=q,
        )

    def _verify(self, cache: KVCache, tree: DraftTree, root: int) -> tuple[list[int], Tensor]:
        """One target forward over the tree; accept, commit the cache, select aux states."""
        chain = tree.is_chain
        res = self.llm(
            tree.tokens[None],
            cache,
            positions=None if chain else (root + tree.depth)[None],
            tree_mask=None if chain else tree.mask(),
            hidden_layers=self.aux_ids,
            logits="all",
            advance=False,
        )
        logits = res.logits[0]
        if self.temperature <= 0:
            path, bonus = accept_greedy(tree, logits)
        else:
            path, bonus = accept_sampling(tree, logits, self.temperature, self.gen)
        idx = torch.tensor(path)
        commit_path(cache, root, idx)
        new = tree.tokens[idx[1:]].tolist() + [bonus]
        return new, select_accepted_hidden(self._aux(res)[0], idx)


# ---------------------------------------------------------------- acceptance


def accept_greedy(tree: DraftTree, logits: Tensor) -> tuple[list[int], int]:
    """Longest path whose every token is the target's argmax after its parent; + bonus."""
    am = logits.argmax(-1).tolist()
    toks = tree.tokens.tolist()
    path, cur = [0], 0
    while True:
        nxt = next((c for c in tree.children[cur] if toks[c] == am[cur]), None)
        if nxt is None:
            return path, am[cur]
        path.append(nxt)
        cur = nxt


def accept_sampling(
    tree: DraftTree, logits: Tensor, temperature: float, gen: torch.Generator
) -> tuple[list[int], int]:
    """Speculative sampling, lossless in distribution.

    Sampled chain (tree.q set): accept x with prob min(1, p(x)/q(x)), else draw from
    norm(max(p - q, 0)). Deterministic top-k children (a tree): q is a point mass at each
    child, tried best-first: accept child x with prob r(x), else zero r(x), renormalize and
    try the next sibling; the bonus comes from what is left (the recursive rule over siblings).
    """
    probs = torch.softmax(logits.float() / temperature, -1)
    toks = tree.tokens.tolist()
    path, cur = [0], 0

    def draw(r: Tensor) -> int:
        return int(torch.multinomial(r / r.sum(), 1, generator=gen))

    while True:
        r, kids = probs[cur], tree.children[cur]
        if not kids:
            return path, draw(r)
        if tree.q is not None:
            c = kids[0]
            x, q = toks[c], tree.q[c]
            if float(torch.rand((), generator=gen)) * float(q[x]) < float(r[x]):
                path.append(c)
                cur = c
                continue
            res = (r - q).clamp(min=0)
            return path, draw(res if float(res.sum()) > 0 else r)
        for c in kids:
            x = toks[c]
            if float(torch.rand((), generator=gen)) < float(r[x]) / float(r.sum()):
                path.append(c)
                cur = c
                break
            r = r.clone()
            r[x] = 0
        else:
            return path, draw(r)


# ---------------------------------------------------------------- convenience


def speculative_generate(
    llm: Llama,
    draft: Eagle3Draft | None,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    *,
    num_steps: int | None = None,
    eagle_topk: int | None = None,
    num_draft_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int | None = None,
    trace: TraceWriter | None = None,
) -> Generation:
    """One request: validate SGLang-style parameters, build a `SpecDecoder`, generate."""
    params = resolve_params(num_steps, eagle_topk, num_draft_tokens)
    dec = SpecDecoder(llm, draft, params, temperature=temperature, seed=seed, trace=trace)
    return dec.generate(prompt, max_new_tokens, eos_ids)
