"""The report code's user-facing errors (all `WorkbenchError`: one line, exit code 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError


class ReportError(WorkbenchError):
    """A report file (manifest, figures, stage cache) or an input artifact cannot be used."""


class ParameterError(WorkbenchError):
    """A parameter the notebook cannot take (wrong type, unreadable parameters file)."""


class UnknownParameters(ParameterError):
    """Parameter names the notebook's `parameters` cell does not define (refused before running)."""


def read_json_file(path: Path, what: str, missing: Any) -> Any:
    """`path`'s JSON, or `missing` when the file does not exist; a corrupt or unreadable file
    is a `ReportError` naming it (never silently replaced by a fresh one)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return missing
    except OSError as e:
        raise ReportError(f"cannot read {what} {path}: {e.strerror}") from e
    try:
        return json.loads(text)
    except ValueError as e:
        raise ReportError(
            f"{what} {path} is not valid JSON ({e}); fix or remove the file and rerun"
        ) from e
