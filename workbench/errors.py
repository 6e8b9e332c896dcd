"""One error family: every expected failure a user can fix is a `WorkbenchError`.

The CLI catches `WorkbenchError` once and prints its message as one line with exit code 2;
anything else is a bug and keeps its traceback. Module-specific errors (CaptureError,
TrainError, ...) subclass it so callers can still catch them narrowly.
"""

from __future__ import annotations


class WorkbenchError(ValueError):
    """A failure the user can fix; the message says what was wrong and how to fix it."""


class InUseError(WorkbenchError):
    """A run folder is locked by another live process."""


class DiskFullError(WorkbenchError):
    """A write failed because the disk (or quota) is full."""


class DataError(WorkbenchError):
    """A prompt set or data file could not be read."""
