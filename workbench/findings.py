"""What an audit reports: findings with a severity, and their one-screen summary.

Shared by the config / wiring audits (audit.py) and the hidden-state norm checks (norms.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ERROR, WARNING, INFO = "error", "warning", "info"


@dataclass
class Finding:
    """One disagreement: severity error (will break acceptance) | warning | info."""

    severity: str
    what: str
    expected: Any = None
    got: Any = None
    why: str = ""

    def __str__(self) -> str:
        s = f"[{self.severity}] {self.what}"
        # only the sides that were given: a bare message (got=...) is not "expected None"
        parts = [f"{k} {v}" for k, v in (("expected", self.expected), ("got", self.got))
                 if v is not None]  # fmt: skip
        if parts:
            s += ": " + ", ".join(parts)
        return s + (f" ({self.why})" if self.why else "")


def has_errors(findings: Sequence[Finding]) -> bool:
    return any(f.severity == ERROR for f in findings)


def format_findings(findings: Sequence[Finding]) -> str:
    if not findings:
        return "no findings: draft, capture and serving agree"
    n = Counter(f.severity for f in findings)
    head = f"{n[ERROR]} error(s), {n[WARNING]} warning(s), {n[INFO]} note(s)"
    return "\n".join([head] + [f"  {f}" for f in findings])
