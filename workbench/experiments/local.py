"""The local sweep backend: the embedded engine in this process, one config per call.

Every config decodes the same prompts (batch 1, greedy) after a short warm-up, with a trace
of every cycle (draft / verify / extend ms). Throughput is decode-only: decode tokens (the
prefill's token excluded) over decode seconds (request seconds minus the prompts' prefill,
timed once per backend), so the cost model's per-cycle figure and the measured one count
the same thing. With `repeats > 1` the prompts are decoded that many times and the fastest
pass counts (a stall on a shared machine only ever slows a pass down). Every pass is traced,
and the per-cycle times and the trace file come from that same fastest pass, so a stall in
another pass cannot make the traced parts outgrow the cycle they belong to; the accept counts
are the same in every pass (greedy decoding repeats them exactly).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench import metrics
from workbench.engine.spec import SpecDecoder, SpecParams
from workbench.engine.trace import TraceWriter
from workbench.errors import WorkbenchError
from workbench.fsutil import atomic_write_text


@dataclass
class LocalBackend:
    """`run_config` for `run_sweep`: `LocalBackend(llm, draft, prompts, ...)(config) -> dict`."""

    llm: Any  # workbench.llama.Llama
    draft: Any  # Eagle3Draft or None (then only the baseline runs)
    prompts: list[list[int]]
    max_new_tokens: int
    eos: list[int] = field(default_factory=list)
    warmup_tokens: int = 8
    trace_dir: Path | None = None  # one `<label>.jsonl` trace per config when set
    repeats: int = 1  # timed passes over the prompts; the fastest counts
    _prefill_s: float | None = None

    def prefill_seconds(self) -> float:
        """Sum over prompts of one prefill + first token (timed once, after a warm-up)."""
        if self._prefill_s is None:
            dec = SpecDecoder(self.llm, None)
            dec.generate(self.prompts[0], 1, self.eos)  # warm-up
            passes = []
            for _ in range(max(1, self.repeats)):
                t0 = time.perf_counter()
                for p in self.prompts:
                    dec.generate(p, 1, self.eos)
                passes.append(time.perf_counter() - t0)
            self._prefill_s = min(passes)
        return self._prefill_s

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        b = int(config.get("batch_size", 1))
        if b != 1:
            raise WorkbenchError(
                f"the local engine decodes batch 1, got batch_size={b}; sweep batch sizes "
                "on a server backend, or use batch_size 1"
            )
        spec = bool(config.get("spec", True))
        if spec and self.draft is None:
            raise WorkbenchError("a speculative config needs a draft; pass one to LocalBackend")
        params = None
        if spec:
            params = SpecParams(config["num_steps"], config["eagle_topk"],
                                config["num_draft_tokens"])  # fmt: skip
        prefill_s = self.prefill_seconds()
        name = f"{params}".replace("/", "-") if params else "plain"
        path = self.trace_dir / f"{name}.jsonl" if self.trace_dir else None
        dec = SpecDecoder(self.llm, self.draft if spec else None, params)
        dec.generate(self.prompts[0], self.warmup_tokens, self.eos, request_id="warmup")
        passes, traces = [], []
        for _ in range(max(1, self.repeats)):
            trace = TraceWriter()  # in memory; the fastest pass's records go to `path`
            dec.trace = trace if spec else None
            accepted, comp, fwd = [], 0, 0
            t0 = time.perf_counter()
            for i, p in enumerate(self.prompts):
                g = dec.generate(p, self.max_new_tokens, self.eos, request_id=str(i))
                accepted.append(g.stats.accepted)
                comp += g.stats.completion_tokens
                fwd += g.stats.verify_forwards
            passes.append(time.perf_counter() - t0)
            traces.append(trace)
        fastest = min(range(len(passes)), key=passes.__getitem__)
        seconds = passes[fastest]
        decode_tokens = comp - len(self.prompts)
        decode_s = max(seconds - prefill_s, 1e-9)
        recs = traces[fastest].records
        if path is not None and spec:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, "".join(r.to_json() + "\n" for r in recs))

        def mean(xs: list[float]) -> float | None:
            return statistics.fmean(xs) if xs else None

        out: dict[str, Any] = {
            "prompts": len(self.prompts),
            "completion_tokens": comp,
            "decode_tokens": decode_tokens,
            "verify_forwards": fwd,
            "seconds": seconds,
            "prefill_seconds": prefill_s,
            "decode_seconds": decode_s,
            "tok_s": decode_tokens / decode_s,
            "e2e_tok_s": comp / seconds,
            "tau": metrics.pooled_tau(accepted),
            "tau_sglang": metrics.pooled_tau_sglang(
                [sum(a) + 1 for a in accepted], [len(a) for a in accepted]
            ),
            "cycle_ms": 1e3 * decode_s / fwd if fwd else None,
            "draft_ms": mean([r.draft_ms for r in recs]),
            "verify_ms": mean([r.verify_ms for r in recs]),
            "extend_ms": mean([r.extend_ms for r in recs]),
            "traced_ms": mean([r.total_ms for r in recs]),
            "accepted": accepted,
            "threads": torch.get_num_threads(),
        }
        if spec:
            out["acceptance"] = metrics.per_position_acceptance(accepted, params.num_steps)
        if path is not None and spec:
            out["trace"] = str(path)
        return out


def load_local(
    target: str,
    draft: str | None,
    *,
    n_prompts: int = 4,
    max_new_tokens: int = 48,
    dtype: str = "float32",
    prompt_offset: int = 0,
    trace_dir: str | Path | None = None,
    repeats: int = 1,
) -> LocalBackend:
    """A LocalBackend over MT-bench first turns with the chat template (`draft=None`: only the
    baseline can run). `draft`: a training run, checkpoint or export dir (draft.load)."""
    from workbench.data import eos_ids, load_mtbench, prompt_ids
    from workbench.draft.load import load_draft
    from workbench.llama import Llama
    from workbench.target import load_target

    t = load_target(target, dtype=dtype)
    llm = Llama(t.model, getattr(torch, dtype))
    d = None
    if draft is not None:
        p = Path(draft)
        if not p.exists():
            raise WorkbenchError(
                f"no draft at {p}: train one (`make demo` or `workbench train`) or pass its "
                "run directory"
            )
        d = load_draft(p, t.model, dtype=getattr(torch, dtype)).draft.eval()
    mt = load_mtbench()[prompt_offset : prompt_offset + n_prompts]
    prompts = [prompt_ids(t.tokenizer, q.messages(1)) for q in mt]
    return LocalBackend(llm, d, prompts, max_new_tokens, eos_ids(t.tokenizer),
                        trace_dir=Path(trace_dir) if trace_dir else None,
                        repeats=repeats)  # fmt: skip


@torch.no_grad()
def time_verify_forward(llm: Any, tokens: int, context: int = 64, reps: int = 5) -> float:
    """Median ms of one target forward over `tokens` new tokens after `context` cached ones
    (the verify step's compute at TP=1 on this machine, without the draft)."""
    V = int(llm.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    cache = llm.new_cache(1, context + tokens + 1)
    llm(torch.randint(0, V, (1, context), generator=g), cache, logits="last")
    x = torch.randint(0, V, (1, tokens), generator=g)
    llm(x, cache, logits="all", advance=False)  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        llm(x, cache, logits="all", advance=False)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
