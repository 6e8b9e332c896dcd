"""The end-to-end pipeline on one target: notebooks 01 → 02 → 03 → 04 as one report run.

`make demo` runs `workbench pipeline --profile quick` on the embedded default. Each stage's
artifacts live under `$WORKBENCH_HOME/demo/<profile>/` so a rerun resumes (capture shards,
training checkpoints) or skips a stage whose inputs are unchanged (the report runner's cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from workbench.draft.presets import PRESETS
from workbench.errors import WorkbenchError
from workbench.report import Stage
from workbench.target import EMBEDDED_NAME, workbench_home

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@dataclass(frozen=True)
class PipelineProfile:
    """How much data and training a pipeline run buys (sized for 2 CPU cores)."""

    name: str
    n_samples: int  # training prompts answered by the target and captured
    max_new_tokens: int  # regeneration length per assistant turn
    max_length: int  # capture truncation
    regen_samples: int  # answers per prompt (the first greedy, the others sampled)
    train_profile: str  # a training preset name (workbench.draft.train)
    inspect_prompts: int  # MT-bench first turns for the offline inspection
    inspect_new_tokens: int
    capture_dtype: str = "float32"  # the target's compute dtype in the capture forward
    prefill_fraction: float = 0.0  # share of prefill-only corpus conversations (workbench.corpus)
    self_prompts: int = 0  # prompts the target writes itself, answered too (workbench.selfprompts)
    pick: str = "first"  # which n_samples prompts (workbench.data.select)


PIPELINE_PROFILES = {
    "quick": PipelineProfile(
        "quick",
        n_samples=400,
        # the first 400 prompts cover 6 of the set's 15 categories, yet 400 spread over all 15
        # (pick="spread") trained a worse draft, scored on one MT-bench capture (80 prompts,
        # 26.8K tokens) + the engine: acc0 0.386 vs 0.401, MT-bench tau 1.39 vs 1.40, HumanEval
        # tau 1.39 vs 1.50 (the first 400 hold all 73 coding prompts, the spread 28)
        max_new_tokens=192,
        max_length=1024,
        regen_samples=1,
        train_profile="quick",
        inspect_prompts=16,
        inspect_new_tokens=96,
    ),
    # all 1033 prompts answered once (greedy) plus 1000 the target writes itself (the largest
    # data lever at the quick scale: +0.034 acc0 at equal steps), then 6 epochs
    "full": PipelineProfile(
        "full",
        n_samples=0,
        max_new_tokens=256,
        max_length=1536,
        regen_samples=1,
        train_profile="full",
        inspect_prompts=24,
        inspect_new_tokens=128,
        self_prompts=1000,
    ),
}


def artifacts_dir(profile: str, target: str = EMBEDDED_NAME) -> Path:
    """Where a profile's capture, draft and export live (stable across reruns)."""
    name = "demo" if target == EMBEDDED_NAME else Path(target).name
    return workbench_home() / name / profile


def default_draft_dir(profile: str = "quick", target: str = EMBEDDED_NAME) -> Path:
    """The draft training run that `make demo` leaves behind (benchmarks default to it)."""
    return artifacts_dir(profile, target) / "draft"


def stages(
    profile: str = "quick", target: str = EMBEDDED_NAME, experiments: bool = False
) -> list[Stage]:
    """The capture -> train -> inspect -> serve stages of `workbench pipeline --profile NAME`;
    `experiments` adds the step sweep (05) and the all-reduce / TP-scaling notebook (06)."""
    if profile not in PIPELINE_PROFILES:
        raise WorkbenchError(
            f"unknown pipeline profile {profile!r}; expected one of {sorted(PIPELINE_PROFILES)}"
        )
    p = PIPELINE_PROFILES[profile]
    home = artifacts_dir(profile, target)
    out = [
        Stage(
            NOTEBOOKS / "01_capture_hidden_states.ipynb",
            name="capture",
            outputs=("out_dir",),
            parameters={
                "target": target,
                "prompt_set": "train",
                "n_samples": p.n_samples,
                "max_new_tokens": p.max_new_tokens,
                "max_length": p.max_length,
                "regen_samples": p.regen_samples,
                "target_dtype": p.capture_dtype,
                "prefill_fraction": p.prefill_fraction,
                "self_prompts": p.self_prompts,
                "out_dir": str(home / "capture"),
                # only where it is not the default, so results made before it stay reusable
                **({"pick": p.pick} if p.pick != "first" else {}),
            },
        ),
        Stage(
            NOTEBOOKS / "02_train_draft.ipynb",
            name="train",
            outputs=("out_dir", "export_dir"),
            parameters={
                "target": target,
                "capture_dir": "${capture.capture_dir}",
                "profile": p.train_profile,
                "resume": True,
                "out_dir": str(home / "draft"),
                "export_dir": str(home / "export-sglang"),
            },
            key_extra={"preset": PRESETS[p.train_profile]},  # an edited preset retrains
        ),
        Stage(
            NOTEBOOKS / "03_inspect_draft.ipynb",
            name="inspect",
            parameters={
                "target": target,
                "draft": "${train.draft_dir}",
                "capture_dir": "${capture.capture_dir}",
                "n_prompts": p.inspect_prompts,
                "max_new_tokens": p.inspect_new_tokens,
            },
        ),
        Stage(  # the exported draft served over HTTP by the local backend, vs plain serving
            NOTEBOOKS / "04_live_serving.ipynb",
            name="serve",
            parameters={
                "backend": "local",
                "target": target,
                "draft": "${train.export_dir}",
                "spec_config": "${inspect.served_config}",  # chosen on other prompts than these
                "n_prompts": 8,
                "max_new_tokens": 64,
            },
        ),
    ]
    if experiments:
        out += [
            Stage(
                NOTEBOOKS / "05_step_sweep.ipynb",
                name="steps",
                parameters={"target": target, "draft": "${train.draft_dir}"},
            ),
            Stage(NOTEBOOKS / "06_nccl_sweep.ipynb", name="nccl", parameters={}),
        ]
    return out
