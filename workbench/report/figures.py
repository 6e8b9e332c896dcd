"""Key figures recorded from inside notebooks (`record("tau", tau)`), machine-readably.

Under the runner, values go to `<run dir>/figures.json` under the notebook's name, and from
there into the run manifest and the index. Run interactively (JupyterLab, no runner), `record`
only keeps them in `RECORDED`, so notebooks run as-is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from workbench.fsutil import atomic_write_json
from workbench.report.errors import read_json_file

RUN_DIR_ENV = "WORKBENCH_RUN_DIR"  # set by the runner for the kernel; `record()` writes there
NOTEBOOK_ENV = "WORKBENCH_NOTEBOOK"
FIGURES = "figures.json"
# Shown as index columns when any run has them; every other recorded figure is listed too.
KEY_FIGURES = ("tau", "best_speedup", "served_config", "step0_acc", "stopped_early")

# Interactive fallback of `record()`: figures stay in this dict.
RECORDED: dict[str, Any] = {}


def jsonable(value: Any) -> Any:
    """numpy/torch scalars and arrays, paths, tuples -> plain JSON values."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # numpy / torch
        return jsonable(value.tolist())
    if hasattr(value, "item"):
        return jsonable(value.item())
    return str(value)


def read_figures(run_dir: Path) -> dict[str, dict[str, Any]]:
    """{notebook: {name: value}} recorded in a run directory so far."""
    return read_json_file(Path(run_dir) / FIGURES, "figures file", {})


def record(name: str, value: Any) -> Any:
    """Record a key figure (tau, best_speedup, served_config, ...) machine-readably; returns `value`."""
    value = jsonable(value)
    RECORDED[name] = value
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        data = read_figures(Path(run_dir))
        data.setdefault(os.environ.get(NOTEBOOK_ENV, "notebook"), {})[name] = value
        atomic_write_json(Path(run_dir) / FIGURES, data, sort_keys=False)
    return value
