"""Prometheus text for SGLang's metric names: the local server writes it, the client reads it.

Names as SGLang's `--enable-metrics` exposes them (`sglang:spec_accept_length`,
`sglang:spec_verify_calls_total`, `sglang:time_to_first_token_seconds`, ...), each with a
`model_name` label. Counters run since start; `spec_accept_length`/`spec_accept_rate`/
`gen_throughput` are last-value gauges (SGLang's are too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # cumulative, one per bucket
    total: float = 0.0
    n: int = 0

    def observe(self, v: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.total += v
        self.n += 1

    def lines(self, name: str, labels: str) -> list[str]:
        counts = self.counts or [0] * len(self.buckets)
        out = [
            f'{name}_bucket{{{labels},le="{b}"}} {c}'
            for b, c in zip(self.buckets, counts, strict=True)
        ]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        return out + [f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {self.n}"]


@dataclass
class ServerStats:
    """Counters since start and the pooled accept length since the last /flush_cache."""

    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    verify_calls: int = 0
    running: int = 0
    queued: int = 0
    last_accept_length: float = 0.0
    last_accept_rate: float = 0.0
    last_gen_throughput: float = 0.0
    flushed_completion: int = 0  # since the last /flush_cache
    flushed_verify: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))


def render(s: ServerStats, model_name: str, num_steps: int, num_draft_tokens: int) -> str:
    """The exposition text of `s` (SGLang's names; spec gauges are 0 without speculation)."""
    lab = f'model_name="{model_name}"'
    rows: list[tuple[str, str, str, float]] = [
        ("num_requests_total", "counter", "Finished requests", s.requests),
        ("num_aborted_requests_total", "counter", "Aborted requests", s.aborted),
        ("prompt_tokens_total", "counter", "Prefill tokens", s.prompt_tokens),
        ("generation_tokens_total", "counter", "Generated tokens", s.generation_tokens),
        ("spec_verify_calls_total", "counter", "Target verify forwards", s.verify_calls),
        ("num_running_reqs", "gauge", "Running requests", s.running),
        ("num_queue_reqs", "gauge", "Queued requests", s.queued),
        ("gen_throughput", "gauge", "Last request's decode tokens/s", s.last_gen_throughput),
        ("spec_accept_length", "gauge", "Last request's accept length", s.last_accept_length),
        ("spec_accept_rate", "gauge", "Last request's accept rate", s.last_accept_rate),
        ("spec_num_steps", "gauge", "Draft steps per cycle", num_steps),
        ("spec_num_draft_tokens", "gauge", "Draft tokens per verify", num_draft_tokens),
    ]
    out = []
    for name, kind, doc, v in rows:
        name = "sglang:" + name
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{{{lab}}} {v}"]
    for name, h in (
        ("sglang:time_to_first_token_seconds", s.ttft),
        ("sglang:inter_token_latency_seconds", s.itl),
        ("sglang:e2e_request_latency_seconds", s.e2e),
    ):
        out += [f"# HELP {name} Histogram", f"# TYPE {name} histogram"]
        out += h.lines(name, lab)
    return "\n".join(out) + "\n"


def parse(text: str) -> dict[str, float]:
    """`name -> value` of an exposition, summed over label sets (histogram buckets skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name.endswith("_bucket"):
            continue
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out
