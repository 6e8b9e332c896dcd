"""The hooks: time each EAGLE v2 decode cycle's phases, take per-request accepted counts where
they reach the CPU, write one JSON line per cycle (workbench trace schema).

Where they sit (SGLang 0.5.23, `speculative/eagle_worker_v2.py`):
  EAGLEWorkerV2.forward_batch_generation  one decode cycle: draft -> verify -> draft extend
  EagleDraftWorker.draft                  the draft steps (the whole `draft`, not
                                          `draft_forward`: CUDA graphs replay the steps as one)
  EAGLEWorkerV2.verify                    the target forward over the draft tokens
  EagleDraftWorker._draft_extend_for_decode  the draft's forward over the verify's 3H target
                                          states (fc applied): the next cycle's first draft step
and in the scheduler (`managers/scheduler_components/batch_result_processor.py`):
  SchedulerBatchResultProcessor._resolve_spec_v2_tokens  accept lengths reach the CPU here
  SchedulerBatchResultProcessor.process_batch_result_decode  after it, eos / max_new_tokens
                                          cuts are known (the record is final)

Timing: wall clock on CPU. On GPU, CUDA events recorded on the current stream at each phase
boundary and read only once the cycle's last event has completed (`query()`), never
synchronising inside the cycle. With the overlap scheduler the next cycle's launch overlaps
this cycle's result processing; events measure GPU stream time between the boundaries, and
`total_ms` spans the cycle's first to last event (draft start to extend end).

Records are matched to cycles in launch order (a FIFO): SGLang processes decode results in
the order it launched them. `accepted` is what each request emitted this cycle (bonus
included; cut at eos / max_new_tokens, as SGLang's `completion_tokens` counts it); a cut
cycle also carries `truncated: true` and `verified` (the verify's own counts). Requests
listed are those SGLang counted (`spec_verify_ct`): rows of already finished requests that
the overlap scheduler still carried are left out (`overshoot_rows` says how many).
"""

from __future__ import annotations

import atexit
import json
import os
import pkgutil
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

W = "sglang.srt.speculative.eagle_worker_v2"
P = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
CYCLE = f"{W}.EAGLEWorkerV2.forward_batch_generation"
DRAFT = f"{W}.EagleDraftWorker.draft"
VERIFY = f"{W}.EAGLEWorkerV2.verify"
EXTEND = f"{W}.EagleDraftWorker._draft_extend_for_decode"
ACCEPT = f"{P}._resolve_spec_v2_tokens"
PROCESS = f"{P}.process_batch_result_decode"
TARGETS = (CYCLE, DRAFT, VERIFY, EXTEND, ACCEPT, PROCESS)
SUPPORTED = "0.5.23"


class MissingHookTarget(SystemExit):
    """A hook target is absent from the installed SGLang. SystemExit on purpose: SGLang's
    load_plugins() logs and swallows a plugin's Exception (tracing nothing, silently); this
    stops the server process at start-up with the message instead."""


def check_targets(targets: tuple[str, ...] = TARGETS) -> None:
    """Resolve every hook target now; a missing one stops start-up naming it and SGLang's version."""
    import sglang

    version = getattr(sglang, "__version__", "unknown")
    for t in targets:
        obj_path, attr = t.rsplit(".", 1)
        try:
            obj = pkgutil.resolve_name(obj_path)
            getattr(obj, attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise MissingHookTarget(
                f"workbench_trace plugin: SGLang {version} has no hook target {t} ({e}); the "
                f"plugin was written against SGLang {SUPPORTED}'s EAGLE v2 worker. Unset "
                f"WORKBENCH_TRACE_DIR to serve without tracing, or install sglang=={SUPPORTED}."
            ) from e


def install(trace_dir: str, run_id: str | None, hidden: bool) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_targets()
    t = Tracer(trace_dir, run_id, hidden)
    for target, fn in ((CYCLE, t.on_cycle), (DRAFT, t.on_draft), (VERIFY, t.on_verify),
                       (EXTEND, t.on_extend), (ACCEPT, t.on_accept), (PROCESS, t.on_process)):  # fmt: skip
        HookRegistry.register(target, fn, HookType.AROUND)
    atexit.register(t.flush, True)


# ---------------------------------------------------------------- clocks


class Clock:
    """Marks: perf_counter floats on CPU, CUDA events on GPU (read when complete)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.name = "cuda_events" if cuda else "wall"

    def mark(self) -> Any:
        if self.cuda:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def done(self, m: Any) -> bool:
        return m.query() if self.cuda else True

    def ms(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) if self.cuda else (b - a) * 1e3


@dataclass
class Cycle:
    start: Any = None
    end: Any = None
    phases: dict[str, list] = field(
        default_factory=lambda: {"draft": [], "verify": [], "extend": []}
    )
    num_steps: int = 0
    topk: int = 0
    num_draft_tokens: int = 0
    draft_width: int | None = None  # hidden width fed to the later draft steps (H)
    extend_width: int | None = None  # hidden width fed to the draft extend (3H for EAGLE-3)
    aux_norms: Any = None  # tensor [k] until written
    # set once the scheduler has the accepted counts
    request_ids: list[str] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    overshoot_rows: int = 0


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else (args[i] if len(args) > i else None)


def _visible_len(req: Any) -> int:
    """Output tokens SGLang reports for a request (finished_len caps an over-accepted run)."""
    n = getattr(req, "finished_len", None)
    return int(n) if req.finished() and n is not None else len(req.output_ids)


class Tracer:
    def __init__(self, trace_dir: str, run_id: str | None, hidden: bool) -> None:
        self.dir = Path(trace_dir)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.hidden = hidden
        self.clock: Clock | None = None
        self.cur: Cycle | None = None
        self.launched: deque[Cycle] = deque()  # launched decode cycles awaiting their counts
        self.pending: tuple | None = None  # (cycle, reqs, before) between accept and process
        self.ready: deque[Cycle] = deque()  # complete cycles awaiting their events
        self.cycle = 0
        self.rank: int | None = None
        self.file = None

    # -- worker side: phases of one decode cycle --------------------------------------------

    def on_cycle(self, orig, worker, batch, *args, **kwargs):
        mode = batch.forward_mode
        if mode.is_extend() or mode.is_idle() or getattr(batch, "is_extend_in_batch", False):
            return orig(worker, batch, *args, **kwargs)
        if self.clock is None:
            self.clock = Clock(str(getattr(worker, "device", "cpu")).startswith("cuda"))
        c = Cycle(start=self.clock.mark())
        self.cur = c
        try:
            out = orig(worker, batch, *args, **kwargs)
        finally:
            self.cur = None
        c.end = self.clock.mark()
        self.launched.append(c)
        return out

    def _timed(self, phase: str, orig, args, kwargs):
        c = self.cur
        s = self.clock.mark()
        out = orig(*args, **kwargs)
        c.phases[phase].append((s, self.clock.mark()))
        return out

    def on_draft(self, orig, dw, batch, *args, **kwargs):
        c = self.cur
        if c is None:
            return orig(dw, batch, *args, **kwargs)
        c.num_steps = int(dw.speculative_num_steps)
        c.topk = int(dw.topk)
        c.num_draft_tokens = int(dw.speculative_num_draft_tokens)
        h = getattr(batch.spec_info, "hidden_states", None)
        if h is not None and h.dim() == 2:
            c.draft_width = int(h.shape[-1])
        return self._timed("draft", orig, (dw, batch, *args), kwargs)

    def on_verify(self, orig, worker, *args, **kwargs):
        if self.cur is None:
            return orig(worker, *args, **kwargs)
        return self._timed("verify", orig, (worker, *args), kwargs)

    def on_extend(self, orig, dw, *args, **kwargs):
        c = self.cur
        if c is None:
            return orig(dw, *args, **kwargs)
        res = _arg(args, kwargs, 1, "batch_result")
        h = getattr(getattr(res, "logits_output", None), "hidden_states", None)
        if h is not None and h.dim() == 2:
            c.extend_width = int(h.shape[-1])
            H = c.draft_width
            if self.hidden and H and c.extend_width > H and c.extend_width % H == 0 and len(h):
                # mean row L2 norm per aux layer; on GPU an async copy to (pinned) host memory,
                # complete once the cycle's last event is: read then, no sync in the cycle
                n = h.float().view(len(h), -1, H).norm(dim=-1).mean(0)
                c.aux_norms = n.to("cpu", non_blocking=True) if n.is_cuda else n
        return self._timed("extend", orig, (dw, *args), kwargs)

    # -- scheduler side: accepted counts, then cuts at eos / max_new_tokens ------------------

    def on_accept(self, orig, proc, result, batch, *args, **kwargs):
        out = orig(proc, result, batch, *args, **kwargs)
        c = self.launched.popleft() if self.launched else Cycle()
        rows = [(i, r) for i, r in enumerate(batch.reqs) if not (r.is_retracted or r.finished())]
        c.request_ids = [str(r.rid) for _, r in rows]
        c.verified = [len(out[i]) for i, _ in rows]
        c.overshoot_rows = len(batch.reqs) - len(rows)
        self.pending = (c, [r for _, r in rows], [_visible_len(r) for _, r in rows])
        return out

    def on_process(self, orig, proc, batch, result, *args, **kwargs):
        if batch.spec_algorithm.is_none():
            return orig(proc, batch, result, *args, **kwargs)
        self.pending = None
        out = orig(proc, batch, result, *args, **kwargs)
        p, self.pending = self.pending, None
        if p is not None:
            c, reqs, before = p
            c.accepted = [min(v, _visible_len(r) - b)
                          for v, r, b in zip(c.verified, reqs, before, strict=True)]  # fmt: skip
            if c.request_ids:
                self.ready.append(c)
        self.flush()
        return out

    # -- writing -----------------------------------------------------------------------------

    def flush(self, final: bool = False) -> None:
        """Write complete cycles in order; `final` (at exit) waits for outstanding GPU work."""
        if final and self.clock is not None and self.clock.cuda and self.ready:
            import torch

            torch.cuda.synchronize()
        while self.ready and (final or self._done(self.ready[0])):
            self._write(self.ready.popleft())

    def _done(self, c: Cycle) -> bool:
        return c.end is None or self.clock.done(c.end)

    def _write(self, c: Cycle) -> None:
        if self.file is None:
            self.rank = _rank()
            self.dir.mkdir(parents=True, exist_ok=True)
            self.file = open(self.dir / f"trace-rank{self.rank}.jsonl", "a")  # noqa: SIM115
        ck = self.clock
        nan = float("nan")

        def phase(name: str) -> float:
            spans = c.phases[name]
            return sum(ck.ms(a, b) for a, b in spans) if ck is not None else nan

        rec = {
            "run_id": self.run_id,
            "rank": self.rank,
            "cycle": self.cycle,
            "request_ids": c.request_ids,
            "batch_size": len(c.request_ids),
            "num_steps": c.num_steps,
            "topk": c.topk,
            "num_draft_tokens": c.num_draft_tokens,
            "accepted": c.accepted,
            "draft_ms": phase("draft"),
            "verify_ms": phase("verify"),
            "extend_ms": phase("extend"),
            "total_ms": ck.ms(c.start, c.end) if c.start is not None else nan,
            "clock": ck.name if ck is not None else None,
        }
        if c.extend_width is not None:
            later = [c.draft_width] * max(c.num_steps - 1, 0) if c.draft_width else []
            rec["hidden_in_dims"] = [c.extend_width, *later]
        if c.aux_norms is not None:
            rec["aux_norms"] = [float(x) for x in c.aux_norms.tolist()]
        if c.accepted != c.verified:
            rec["truncated"] = True
            rec["verified"] = c.verified
        if c.overshoot_rows:
            rec["overshoot_rows"] = c.overshoot_rows
        self.cycle += 1
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", 0))
