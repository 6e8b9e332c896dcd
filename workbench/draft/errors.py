"""The draft package's errors: each names what is wrong and how to fix it (WorkbenchError)."""

from __future__ import annotations

from workbench.errors import WorkbenchError


class TrainError(WorkbenchError):
    """The capture, target, vocab, arguments, run folder or checkpoint do not fit together."""


class ExportError(WorkbenchError):
    """The draft or its config would not load correctly (or would load silently wrong)."""


class DraftImportError(WorkbenchError):
    """A draft directory cannot be read, or (strict) has problems."""
