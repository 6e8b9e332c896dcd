"""Reproducible reports: Papermill runs into `reports/<run-id>/`, self-contained HTML, a run
manifest, key figures recorded from inside notebooks, pipelines with a stage cache, the index
and the run comparison. See reports/README.md.

- `figures`: `record()` (inside notebooks) and the figures file
- `params`: parameter parsing and the check against a notebook's `parameters` cell
- `manifest`: the run manifest, run ids, the list of runs
- `runner`: one notebook through Papermill (`run_notebook`)
- `stages`: pipelines of notebooks and the stage cache (`run_stages`)
- `html`: HTML export, index and comparison pages
- `browser`: the headless-Chromium check
"""

from workbench.report.browser import check_html_in_browser, find_chromium
from workbench.report.errors import ParameterError, ReportError, UnknownParameters
from workbench.report.figures import KEY_FIGURES, RECORDED, record
from workbench.report.html import compare_runs, export_html, write_index
from workbench.report.manifest import MANIFEST, list_runs, new_run_id
from workbench.report.params import load_parameters, notebook_parameters, parse_value
from workbench.report.runner import NotebookFailed, RunResult, run_notebook
from workbench.report.stages import STAGE_CACHE, Stage, run_stages

__all__ = [
    "KEY_FIGURES", "MANIFEST", "RECORDED", "STAGE_CACHE", "NotebookFailed", "ParameterError",
    "ReportError", "RunResult", "Stage", "UnknownParameters", "check_html_in_browser",
    "compare_runs", "export_html", "find_chromium", "list_runs", "load_parameters",
    "new_run_id", "notebook_parameters", "parse_value", "record", "run_notebook", "run_stages",
    "write_index",
]  # fmt: skip
