"""Local speculative decoding: EAGLE-3 chain + tree drafting, verify, rollback, trace, speed.

Accept lengths are computed by `workbench.metrics` only."""

from workbench.engine.spec import (
    AUTO_PARAMS,
    DraftTree,
    Generation,
    RequestStats,
    SpecDecoder,
    SpecError,
    SpecParams,
    accept_greedy,
    accept_sampling,
    check_draft,
    commit_path,
    resolve_params,
    select_accepted_hidden,
    speculative_generate,
)
from workbench.engine.speed import (
    PLAIN,
    Measurement,
    SpeedReport,
    choose_params,
    speed_figures,
    speed_report,
    speed_table,
)
from workbench.engine.trace import CycleRecord, TraceWriter, read_trace

__all__ = [
    "AUTO_PARAMS",
    "PLAIN",
    "CycleRecord",
    "DraftTree",
    "Generation",
    "Measurement",
    "RequestStats",
    "SpecDecoder",
    "SpecError",
    "SpecParams",
    "SpeedReport",
    "TraceWriter",
    "accept_greedy",
    "accept_sampling",
    "check_draft",
    "choose_params",
    "commit_path",
    "read_trace",
    "resolve_params",
    "select_accepted_hidden",
    "speculative_generate",
    "speed_figures",
    "speed_report",
    "speed_table",
]
