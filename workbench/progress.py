"""Progress bars that show up where the user is looking, and never in a report.

- In a notebook run by the report runner (`WORKBENCH_RUN_DIR` is set), the bar goes to the
  terminal that started `workbench run` / `make demo`, and the notebook gets one summary line
  when an outermost bar closes (`capture: 400/400 samples in 123.4s`). The terminal is the kernel's
  original stderr: ipykernel pipes file descriptors 1 and 2 into the notebook's outputs, and
  its `sys.stderr.fileno()` returns a copy of the descriptor from before that redirection
  (writing to `sys.__stderr__`, fd 2, would land in the report, one line per refresh).
- In JupyterLab, `tqdm.auto` draws a widget; on a terminal, a normal text bar.
"""

from __future__ import annotations

import functools
import io
import os
import sys
from typing import Any, TextIO

from tqdm.std import tqdm as _text_tqdm


@functools.lru_cache(maxsize=1)
def _terminal() -> TextIO:
    """The kernel's original stderr (see the module docstring), opened once."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, io.UnsupportedOperation):
        # ipykernel without fd capture (it skips it under pytest): fd 2 is the terminal
        return sys.__stderr__ or open(os.devnull, "w")  # noqa: SIM115 - lives with the process
    return open(os.dup(fd), "w", buffering=1)  # noqa: SIM115


class _TerminalBar(_text_tqdm):
    """A text bar on the terminal that leaves one summary line in the notebook when it closes
    (outermost bars only)."""

    def close(self) -> None:
        outermost = getattr(self, "pos", 0) == 0  # a nested bar's work is in its parent's line
        if (
            not self.disable
            and self.leave
            and outermost
            and not getattr(self, "_summarized", False)
        ):
            self._summarized = True
            done = f"{self.n:g}/{self.total:g}" if self.total else f"{self.n:g}"
            desc = f"{self.desc}: " if self.desc else ""
            elapsed = self.format_dict["elapsed"]
            print(f"{desc}{done} {self.unit} in {elapsed:.1f}s", file=sys.stdout, flush=True)
        super().close()


def progress(*args: Any, **kwargs: Any):
    """`tqdm(...)` routed as described above."""
    if not os.environ.get("WORKBENCH_RUN_DIR"):
        from tqdm.auto import tqdm

        return tqdm(*args, **kwargs)
    kwargs.setdefault("file", _terminal())
    kwargs.setdefault("mininterval", 2.0)
    kwargs.setdefault("dynamic_ncols", False)
    kwargs.setdefault("ncols", 100)
    return _TerminalBar(*args, **kwargs)
