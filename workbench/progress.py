"""Progress bars that show up where the user is looking.

- In a notebook run by the report runner (`WORKBENCH_RUN_DIR` is set), bars go to the
  kernel process's own stderr, which is the terminal that started `workbench run` /
  `make demo`: progress stays visible there and the executed notebook stays clean.
- In JupyterLab, `tqdm.auto` draws a widget; on a terminal, a normal text bar.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def progress(*args: Any, **kwargs: Any):
    """`tqdm(...)` routed as described above."""
    if os.environ.get("WORKBENCH_RUN_DIR") and sys.__stderr__ is not None:
        from tqdm.std import tqdm

        kwargs.setdefault("file", sys.__stderr__)
        kwargs.setdefault("mininterval", 2.0)
        kwargs.setdefault("dynamic_ncols", False)
        kwargs.setdefault("ncols", 100)
        return tqdm(*args, **kwargs)
    from tqdm.auto import tqdm

    return tqdm(*args, **kwargs)
