"""A compact Llama-family forward (gpt-fast style) with a preallocated static KV cache.

Why: HF `generate` spends most of its time in per-step Python and cache bookkeeping; on a
2-core CPU a batched decode wants one plain forward per step with no cache copies. The same
forward is meant to serve a speculative decoding engine, hence the cache API:

- `KVCache.lengths[b]` is the number of filled slots of row b; a forward writes its k new
  tokens at slots `lengths[b] .. lengths[b]+k-1`, so rows may be ragged (right-padded input
  with `n_valid`) or left-padded (`start[b]` = first valid slot).
- rolling back is only lowering `lengths` (`cache.rollback(n)`); stale slots get overwritten.
- `tree_mask` ([k, k] or [B, k, k], bool) replaces the causal mask among the new tokens;
  they always see the cached prefix. `positions` overrides RoPE positions (tree depths).
- `hidden_layers` returns the residual stream after 0-based decoder layer i (-1: embedding
  output), the EAGLE-3 aux features; `final_hidden` is the pre-norm last hidden state.

Weights come from a loaded HF Llama model (fused qkv and gate/up copies in a chosen dtype);
on CPU, fp32/bf16 matmul weights are packed once for oneDNN (see `linear`: verifying k tokens
then costs about one decode step, and fp32 decode/prefill ran 1.6x faster than on MKL on an AMD
CPU); on Intel CPUs fp32 inputs of 1-3 rows stay on MKL, which streams them faster there,
and verify-sized inputs (4-8 rows) run MKL's packed sgemm.
Per step, besides the matmuls, a layer applies RoPE to q and k in one pass, writes the cache
with one slice copy per tensor when all rows are at the same length (batch 1 always), and
SDPA gets an additive mask built once per forward: results are bit-identical to the
per-tensor/index-write forms, with fewer small ops (a third of a decode step is such ops).
On the all-oneDNN path a k-token verify gives bit for bit what k one-token decode steps give
(`linear`) where the CPU's kernels give a row the same bits whatever the row count (not on a
Zen 5 EPYC: there fp32 SDPA and a bf16 matmul differ in the last bit; tests/test_llama.py).
RoPE uses the HF module's own inverse frequencies, so default/linear/llama3/yarn scaling
match HF exactly; length-dependent types (dynamic, longrope) are refused.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from workbench.decode_attention import decode_attention
from workbench.errors import WorkbenchError


@dataclass
class KVCache:
    """Static cache `[layers, batch, kv_heads, max_len, head_dim]` plus per-row lengths."""

    k: Tensor
    v: Tensor
    lengths: Tensor  # [B] int64, filled slots per row
    start: Tensor  # [B] int64, first valid slot per row (left padding), usually 0

    @classmethod
    def allocate(cls, n_layers, batch, n_kv_heads, max_len, head_dim, dtype, device="cpu"):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        z = torch.zeros(batch, dtype=torch.long, device=device)
        k, v = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        return cls(k, v, z, z.clone())

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def rollback(self, n: int | Tensor) -> None:
        """Forget the last n tokens of every row (n may be a per-row tensor)."""
        self.lengths = torch.maximum(self.lengths - n, self.start)

    def reset(self) -> None:
        self.lengths.zero_()
        self.start.zero_()

    def select(self, rows: Tensor) -> KVCache:
        """A cache holding only `rows` (copies the filled part only; used to drop rows)."""
        s = int(self.lengths.max()) if self.lengths.numel() else 0
        out = KVCache.allocate(self.k.shape[0], len(rows), self.k.shape[2], self.max_len,
                               self.k.shape[4], self.k.dtype, self.k.device)  # fmt: skip
        out.k[:, :, :, :s] = self.k[:, rows, :, :s]
        out.v[:, :, :, :s] = self.v[:, rows, :, :s]
        out.lengths, out.start = self.lengths[rows].clone(), self.start[rows].clone()
        return out


@dataclass
class LayerWeights:
    wqkv: Tensor | Packed  # [(H + 2 Hkv) * D, dim]
    bqkv: Tensor | None
    wo: Tensor | Packed
    w13: Tensor | Packed  # [2 * inter, dim]: gate then up
    w2: Tensor | Packed
    ln1: Tensor
    ln2: Tensor


@dataclass
class Output:
    logits: Tensor | None  # [B, k, V] ("all"), [B, V] ("last") or None
    hidden: dict[int, Tensor] = field(default_factory=dict)  # layer id -> [B, k, dim]
    final_hidden: Tensor | None = None  # [B, k, dim], before the final norm


PACK_ROWS = 16  # oneDNN weight layout chosen for 16-row inputs: fastest for 1-64 rows here


PACKED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight"))  # fmt: skip


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU. It refuses bf16 where the CPU lacks
    AVX-512 (BW/VL/DQ) and AVX-NE-CONVERT ("bf16 path needs the cpu support ...": a Zen 3
    EPYC): bf16 then stays on plain F.linear, slow but right (`target.native_bf16` keeps the
    workbench's own defaults on fp32 there)."""
    if dtype not in PACKED_DTYPES or not onednn_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), PACK_ROWS)
    except RuntimeError as e:  # the CPU check above; anything else is a real failure
        if "cpu support" not in str(e):
            raise
        return False
    return True


def pack_weight(w: Tensor) -> Tensor:
    """An fp32/bf16 [out, in] weight in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS)


@dataclass
class Packed:
    """A packed weight plus its plain copy for inputs of at most `mkl_rows` rows, and MKL
    sgemm packs for verify-sized inputs: `mkl_packs[bs]` serves up to bs rows (`linear`)."""

    packed: Tensor
    plain: Tensor
    mkl_rows: int
    mkl_packs: dict[int, Tensor] = field(default_factory=dict)

    @property
    def shape(self) -> torch.Size:
        return self.plain.shape


def pack_matmul_weight(
    w: Tensor, mkl_rows: int = 0, mkl_packs: Sequence[int] = ()
) -> Tensor | Packed:
    """A weight as `linear` wants it: oneDNN-packed, plus its plain copy when inputs of at
    most `mkl_rows` rows stay on MKL and an MKL sgemm pack per size in `mkl_packs`."""
    if not (mkl_rows or mkl_packs):
        return pack_weight(w)
    mp = {bs: torch.ops.mkl._mkl_reorder_linear_weight(w, bs) for bs in sorted(mkl_packs)}
    return Packed(pack_weight(w), w, mkl_rows, mp)


def default_mkl_rows(dtype: torch.dtype) -> int:
    """Rows up to which fp32 matmuls stay on MKL (F.linear) rather than packed kernels.

    Measured with the whole 30-layer SmolLM2 forward, one thread, CPU clock: on a Xeon with
    AMX, MKL took 51.3 / 52.8 ms at 1 / 2 rows against oneDNN's 58.0 / 60.4 (85 vs 59 at 4
    rows, 113 vs 70 at 8); on an AMD EPYC, oneDNN won at every row count (MKL runs its slower
    kernels there). A 3-row verify on MKL took 44.5 ms, against 50.6 on a 4-row MKL pack and
    57.6 on oneDNN (Xeon with AMX, two threads, a 41 ms decode step). So 3 on Intel CPUs, 0
    elsewhere; bf16 always packs (F.linear in bf16 re-lays the weight out on every call). The
    environment variable WORKBENCH_MKL_ROWS overrides it."""
    import os

    if (env := os.environ.get("WORKBENCH_MKL_ROWS")) is not None:
        if not env.isdigit():
            raise WorkbenchError(f"WORKBENCH_MKL_ROWS={env!r}: expected a row count such as 0 or 3")
        return int(env)
    return 3 if dtype == torch.float32 and _intel_cpu() else 0


def mkl_packs_available() -> bool:
    """Whether this torch exposes MKL's packed sgemm (`torch.ops.mkl._mkl_linear`)."""
    return hasattr(torch.ops.mkl, "_mkl_linear") and hasattr(
        torch.ops.mkl, "_mkl_reorder_linear_weight"
    )


def default_mkl_packs(dtype: torch.dtype) -> tuple[int, ...]:
    """Row counts for which fp32 weights also get an MKL sgemm pack (verify-sized inputs).

    On a Xeon with AMX (two threads, decode 41 ms) a verify on oneDNN's packed weights cost
    58.6 ms at 4 rows and 67.4 at 8; on MKL packs made for 4 and 8 rows (smaller inputs
    padded with zero rows) 51.0 and 56.9. Each pack is another copy of the matmul weights
    (540 MB for SmolLM2-135M in fp32), so only two sizes, and `Llama` leaves them off when
    they would take over a quarter of the available memory. (4, 8) on Intel CPUs where
    fp32 stays on MKL for small inputs, () elsewhere; WORKBENCH_MKL_PACKS overrides it
    ("4,8", or "" for none)."""
    import os

    if dtype != torch.float32:
        return ()
    if (env := os.environ.get("WORKBENCH_MKL_PACKS")) is not None:
        parts = [p.strip() for p in env.split(",") if p.strip()]
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            raise WorkbenchError(
                f"WORKBENCH_MKL_PACKS={env!r}: expected row counts such as 4,8 (or empty for none)"
            )
        return tuple(sorted({int(p) for p in parts}))
    return (4, 8) if _intel_cpu() and mkl_packs_available() else ()


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@functools.cache
def _intel_cpu() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "GenuineIntel" in f.read(4096)
    except OSError:
        return False


def linear(x: Tensor, w: Tensor | Packed, b: Tensor | None = None) -> Tensor:
    """`F.linear`, or oneDNN's inner product when `w` is packed (`pack_weight`).

    Why: a decode step is bound by reading the weights, so verifying k tokens should cost
    about one decode step. torch sends fp32 matmuls to MKL sgemm, which on this AMD CPU runs
    its slower kernels (with or without MKL_CBWR): 2-8 rows cost 1.5-2x one row, and big row
    counts reach ~85 GFLOP/s per core. oneDNN on a weight packed once is faster at every row
    count measured (lm_head, one core: 1 row 3.1 vs 6.8 ms, 2 rows 3.4 vs 16, 8 rows 4.7 vs
    15; ~2x at 512-2048 rows) and agrees with F.linear to fp32 rounding. bf16 matmuls already
    run in oneDNN, but re-lay the weight out on every call: packed once they take half the
    time at 1-8 rows, with identical results. On Intel CPUs MKL streams 1-3 rows faster than
    oneDNN (`default_mkl_rows`), so a `Packed` weight sends inputs that small to F.linear,
    and inputs of up to 8 rows to MKL's packed sgemm (`default_mkl_packs`), padded with zero
    rows to the size a pack was made for (rows of a matmul are independent: the real rows
    come out the same, tests/test_llama.py).

    A lone fp32 row on oneDNN runs as two: oneDNN's one-row kernel splits long reductions
    (SmolLM2's 1536-wide down projection) its own way, while the rows of its 2+-row kernel
    are bit-identical at any row count. So on the all-oneDNN path (`mkl_rows` 0: bf16, AMD
    CPUs, `WORKBENCH_MKL_ROWS=0`) a k-token verify computes exactly the logits, hidden states
    and cache entries of k one-token decode steps (tests/test_llama.py), and greedy
    speculative decoding reproduces plain decoding bit for bit, not only to fp32 rounding,
    where SDPA is row-count invariant too (not on a Zen 5 EPYC, whose fp32 SDPA and bf16
    1536-wide matmul differ in the last bit with the row count: rounding only there).
    The second row costs ~3% of a decode step; bf16 needs no padding (measured identical).
    """
    if isinstance(w, Packed):
        rows = x.numel() // x.shape[-1]
        if rows <= w.mkl_rows:
            return F.linear(x, w.plain, b)
        for bs, pk in w.mkl_packs.items():  # ascending
            if rows <= bs:
                x2 = x.reshape(rows, -1)
                if rows < bs:  # rows are independent: zero rows pad to the packed size
                    x2 = torch.cat((x2, x2.new_zeros(bs - rows, x2.shape[1])))
                y = torch.ops.mkl._mkl_linear(x2, pk, w.plain, b, bs)
                return y[:rows].view(*x.shape[:-1], y.shape[-1])
        w = w.packed
    if not w.is_mkldnn:
        return F.linear(x, w, b)
    if x.numel() == x.shape[-1] and x.dtype == torch.float32:  # one fp32 row: run it as two
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(1, -1).expand(2, -1).contiguous(),
                                               w, b, "none", [], "")  # fmt: skip
        return y[:1].view(*x.shape[:-1], y.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """HF LlamaRMSNorm: normalize in fp32, cast back, then scale.

    torch's fused kernel computes HF's x * rsqrt(mean(x^2) + eps) in one op (a decode step
    runs 61 of these); tests/test_llama.py checks it against HF's formula.
    """
    return w * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, k, H, D]; cos/sin [B, k, 1, D] (HF rotate_half convention)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


class Llama:
    """Llama-family decoder running on weights taken from an HF model."""

    def __init__(
        self,
        hf_model,
        dtype: torch.dtype | str | None = None,
        onednn: bool | None = None,
        mkl_rows: int | None = None,
        mkl_packs: Sequence[int] | None = None,
    ):
        cfg = hf_model.config
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.dtype = dtype = dtype or next(hf_model.parameters()).dtype
        self.config = cfg
        self.n_layers, self.dim = cfg.num_hidden_layers, cfg.hidden_size
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.dim // self.n_heads
        self.eps = cfg.rms_norm_eps
        m = hf_model.model
        rope = m.rotary_emb
        if getattr(rope, "rope_type", "default") in ("dynamic", "longrope"):
            raise NotImplementedError(f"rope_type {rope.rope_type!r} depends on sequence length")
        self.inv_freq = rope.original_inv_freq.detach().float().cpu()
        self.rope_scale = float(rope.attention_scaling)
        dev = m.embed_tokens.weight.device

        def cv(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().to(device=dev, dtype=dtype)

        def cat(*ts: Tensor) -> Tensor:
            return torch.cat([t.detach() for t in ts]).to(dtype).contiguous()

        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            if mlp.down_proj.bias is not None or a.o_proj.bias is not None:
                raise NotImplementedError("o_proj/MLP biases are not supported")
            b = a.q_proj.bias
            self.layers.append(LayerWeights(
                wqkv=cat(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                bqkv=None if b is None else cat(b, a.k_proj.bias, a.v_proj.bias),
                wo=cv(a.o_proj.weight), w13=cat(mlp.gate_proj.weight, mlp.up_proj.weight),
                w2=cv(mlp.down_proj.weight), ln1=cv(layer.input_layernorm.weight),
                ln2=cv(layer.post_attention_layernorm.weight)))  # fmt: skip
        self.embed = cv(m.embed_tokens.weight)
        self.norm = cv(m.norm.weight)
        lm = hf_model.get_output_embeddings().weight
        self.lm_head = self.embed if lm is m.embed_tokens.weight else cv(lm)
        self.device = dev
        self._cos = self._sin = torch.empty(0)
        # fp32/bf16 on CPU: matmuls on packed weights through oneDNN (see `linear`); default on
        fits = dev.type == "cpu" and onednn_packs(dtype)
        self.onednn = fits if onednn is None else bool(onednn and fits)
        self.head = self.lm_head  # the weight the logits use (packed or `lm_head` itself)
        # inputs of at most mkl_rows rows keep plain F.linear (a second copy of each weight),
        # inputs of up to max(mkl_packs) rows MKL sgemm packs (a copy per size)
        self.mkl_rows = default_mkl_rows(dtype) if mkl_rows is None else mkl_rows
        if mkl_packs is None:  # packs sit beside the oneDNN weights: none without them
            mkl_packs = default_mkl_packs(dtype) if self.mkl_rows and self.onednn else ()
            mkl_packs = self._packs_that_fit(mkl_packs)
        self.mkl_packs = tuple(sorted(set(mkl_packs)))
        if self.mkl_packs and not (mkl_packs_available() and dtype == torch.float32):
            raise WorkbenchError(
                f"mkl_packs={self.mkl_packs}: MKL sgemm packs need fp32 and a torch built with "
                "MKL; pass mkl_packs=() (or set WORKBENCH_MKL_PACKS=)"
            )
        if self.onednn:
            pack = functools.partial(
                pack_matmul_weight, mkl_rows=self.mkl_rows, mkl_packs=self.mkl_packs
            )
            for L in self.layers:
                L.wqkv, L.wo, L.w13, L.w2 = map(pack, (L.wqkv, L.wo, L.w13, L.w2))
            self.head = pack(self.lm_head)

    def _packs_that_fit(self, packs: Sequence[int]) -> tuple[int, ...]:
        """The default packs, or none when their copies would take over a quarter of the
        memory available now: on a large target the verify speed-up gives way, not the RAM."""
        if not packs:
            return ()
        per_copy = (
            sum(
                t.numel() * t.element_size()
                for L in self.layers
                for t in (L.wqkv, L.wo, L.w13, L.w2)
            )
            + self.lm_head.numel() * self.lm_head.element_size()
        )
        avail = available_memory()
        if avail is not None and len(packs) * per_copy > avail // 4:
            warnings.warn(
                f"MKL verify packs {tuple(packs)} left off: {len(packs)} more copies of the "
                f"matmul weights ({len(packs) * per_copy / 2**30:.1f} GB) exceed a quarter of "
                f"the {avail / 2**30:.1f} GB available; verifies of 4-8 rows use oneDNN "
                "instead (pass mkl_packs=(4, 8) to force them)",
                stacklevel=3,
            )
            return ()
        return tuple(packs)

    def logits_of(self, h: Tensor) -> Tensor:
        """Logits of pre-norm hidden states h [..., dim] (final norm, then lm_head)."""
        return linear(rms_norm(h, self.norm, self.eps), self.head)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.allocate(self.n_layers, batch, self.n_kv, max_len, self.head_dim,
                                self.dtype, self.device)  # fmt: skip

    def _rope_tables(self, n: int) -> tuple[Tensor, Tensor]:
        """cos/sin for positions [0, n), computed in fp32 like HF, cast to the model dtype."""
        if self._cos.shape[0] < n:
            n = max(n, 2 * self._cos.shape[0], 256)
            freqs = torch.arange(n, dtype=torch.float)[:, None] * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = (emb.cos() * self.rope_scale).to(self.device, self.dtype)
            self._sin = (emb.sin() * self.rope_scale).to(self.device, self.dtype)
        return self._cos, self._sin

    @torch.no_grad()
    def forward(
        self,
        tokens: Tensor,
        cache: KVCache | None = None,
        *,
        n_valid: Tensor | None = None,
        positions: Tensor | None = None,
        tree_mask: Tensor | None = None,
        hidden_layers: Sequence[int] = (),
        logits: str = "all",
        advance: bool = True,
        attention: str = "sdpa",
    ) -> Output:
        """Run k new tokens per row [B, k] through the model, writing them into `cache`.

        n_valid [B]: real tokens per row (right padding; default k); `lengths` advances by it.
        positions [B, k]: RoPE positions (default: slot - start). logits: "all", "last"
        (at token n_valid-1 of each row) or "none". advance=False leaves `lengths` as is
        (the tokens are still written; a verifier then sets lengths to what it accepts).
        attention="c": one-token steps (k == 1, no tree) attend through the C kernel of
        `workbench.decode_attention` (batched generation); the default is torch's SDPA.
        """
        B, k = tokens.shape
        if cache is None:
            cache = self.new_cache(B, k)
        dev = tokens.device
        ar = torch.arange(k, device=dev)
        slots = cache.lengths[:, None] + ar  # [B, k]
        if positions is None:
            positions = (slots - cache.start[:, None]).clamp(min=0)
        S = int(slots[:, -1].max()) + 1  # attend over slots [0, S)
        cos, sin = self._rope_tables(int(positions.max()) + 1)
        cos, sin = cos[positions][:, :, None], sin[positions][:, :, None]

        if attention not in ("sdpa", "c"):
            raise ValueError(f"attention={attention!r}: expected 'sdpa' or 'c'")
        G = self.n_heads // self.n_kv
        kernel = attention == "c" and k == 1 and tree_mask is None
        if kernel:  # row b sees slots [start, length] (its prefix and the new token)
            hi = cache.lengths + 1
            lo = torch.minimum(cache.start, cache.lengths)
        else:
            # mask [B, 1, G*k, S]: cached prefix [start, length) + new tokens by causal/tree mask
            s = torch.arange(S, device=dev)
            rel = s[None, :] - cache.lengths[:, None]  # [B, S]; new token j sits at rel == j
            prefix = (s[None, :] >= cache.start[:, None]) & (rel < 0)
            if tree_mask is None:
                new = (rel[:, None, :] >= 0) & (rel[:, None, :] <= ar[None, :, None])
            else:
                tm = tree_mask.to(device=dev, dtype=torch.bool).expand(B, k, k)
                idx = rel.clamp(0, k - 1)[:, None, :].expand(B, k, S)
                new = ((rel >= 0) & (rel < k))[:, None, :] & torch.gather(tm, 2, idx)
            # left padding (slots < start) is hidden; each token always sees itself, so no row
            # of the softmax is empty (NaN would poison the cache through 0 * NaN)
            mask = ((prefix[:, None, :] | new) & (s >= cache.start[:, None])[:, None, :]) | (
                rel[:, None, :] == ar[None, :, None]
            )
            mask = mask[:, None, None].expand(B, 1, G, k, S)
            # additive form once per forward: SDPA would convert the bool mask this same way
            # (0 / -inf in the query dtype) in every layer
            keep = mask.reshape(B, 1, G * k, S)
            mask = torch.zeros(keep.shape, dtype=self.dtype, device=dev)
            mask.masked_fill_(~keep, float("-inf"))
        # rows at equal lengths (batch 1 always): cache writes are one slice copy per tensor
        l0 = int(cache.lengths[0])
        uniform = bool((cache.lengths == l0).all()) and l0 + k <= cache.max_len

        bidx = torch.arange(B, device=dev)[:, None].expand(B, k)
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        h = F.embedding(tokens, self.embed)
        hidden = {-1: h} if -1 in hidden_layers else {}
        for i, L in enumerate(self.layers):
            x = rms_norm(h, L.ln1, self.eps)
            qkv = linear(x, L.wqkv, L.bqkv)
            qk, vv = qkv.split(((H + Hkv) * D, Hkv * D), dim=-1)
            qk = apply_rope(qk.view(B, k, H + Hkv, D), cos, sin)  # q and k in one pass
            q, kk = qk.split((H, Hkv), dim=2)
            vv = vv.view(B, k, Hkv, D)
            if uniform:
                cache.k[i, :, :, l0 : l0 + k] = kk.transpose(1, 2)
                cache.v[i, :, :, l0 : l0 + k] = vv.transpose(1, 2)
            else:
                cache.k[i][bidx, :, slots] = kk  # [B, k, Hkv, D] into [B, Hkv, T, D]
                cache.v[i][bidx, :, slots] = vv
            # GQA without repeating K/V: fold the G query heads of a kv head into the rows
            q = q.view(B, k, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * k, D)
            if kernel:
                o = decode_attention(q, cache.k[i], cache.v[i], lo, hi)
            else:
                o = F.scaled_dot_product_attention(
                    q, cache.k[i, :, :, :S], cache.v[i, :, :, :S], attn_mask=mask
                )
            o = o.view(B, Hkv, G, k, D).permute(0, 3, 1, 2, 4).reshape(B, k, H * D)
            h = h + linear(o, L.wo)
            x = rms_norm(h, L.ln2, self.eps)
            gate, up = linear(x, L.w13).chunk(2, dim=-1)
            h = h + linear(F.silu(gate) * up, L.w2)
            if i in hidden_layers:
                hidden[i] = h
        if advance:
            cache.lengths = cache.lengths + (k if n_valid is None else n_valid)
        out = Output(None, {i: hidden[i] for i in hidden_layers}, h)
        if logits == "last":
            last = (k - 1) if n_valid is None else (n_valid - 1).clamp(min=0)
            x = h[torch.arange(B, device=dev), last] if n_valid is not None else h[:, last]
            out.logits = self.logits_of(x)
        elif logits == "all":
            out.logits = self.logits_of(h)
        return out

    __call__ = forward
