"""Per-cycle trace records: one JSON line per decode cycle, in design.md's schema.

The same schema is written by the embedded engine and the SGLang plugin, so readers keep
unknown fields (in `extra`) instead of failing on them.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass
class CycleRecord:
    run_id: str
    rank: int
    cycle: int
    request_ids: list[str]
    batch_size: int
    num_steps: int
    topk: int
    num_draft_tokens: int
    accepted: list[int]  # tokens emitted per request this cycle, bonus included
    draft_ms: float
    verify_ms: float
    extend_ms: float
    total_ms: float
    hidden_in_dims: list[int] | None = None  # width fed to each draft step: [k*H, H, H, ...]
    hidden_norms: list[float] | None = None  # mean row L2 norm of each draft step's input
    aux_norms: list[float] | None = None  # mean L2 norm per aux layer (first step's input)
    extra: dict[str, Any] = field(default_factory=dict)  # unknown fields, kept on read

    def to_json(self) -> str:
        d = asdict(self)
        d.update(d.pop("extra"))
        return json.dumps({k: v for k, v in d.items() if v is not None})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CycleRecord:
        known = {f.name for f in fields(cls)} - {"extra"}
        rec = cls(**{k: d.get(k) for k in known})  # missing optional fields become None
        rec.extra = {k: v for k, v in d.items() if k not in known}
        return rec


class TraceWriter:
    """Collects cycle records in memory and, given a path, appends them as JSON lines."""

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        run_id: str | None = None,
        rank: int = 0,
        hidden_norms: bool = False,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.rank = rank
        self.hidden_norms = hidden_norms  # also record hidden_in_dims' norms (costs a sync)
        self.records: list[CycleRecord] = []
        self._cycle = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def next_cycle(self) -> int:
        c, self._cycle = self._cycle, self._cycle + 1
        return c

    def write(self, rec: CycleRecord) -> None:
        self.records.append(rec)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(rec.to_json() + "\n")


def read_trace(path: str | os.PathLike) -> list[CycleRecord]:
    """Records of a JSON-lines trace; unknown fields land in `extra`, blank lines skipped."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            out.append(CycleRecord.from_dict(json.loads(line)))
    return out
