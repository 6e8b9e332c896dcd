"""`workbench pipeline`: every profile's stages pass the notebooks' own parameter checks
(names and types) before anything runs, and an unknown profile is a one-line user error."""

from __future__ import annotations

import pytest

from workbench.errors import WorkbenchError
from workbench.inspect import calibration_prompts, load_prompts
from workbench.pipeline import PIPELINE_PROFILES, stages
from workbench.report.params import validate_parameters
from workbench.report.stages import resolve_references


@pytest.mark.parametrize("profile", sorted(PIPELINE_PROFILES))
def test_stages_match_their_notebooks(profile):
    got = stages(profile)
    assert [s.name for s in got] == ["capture", "train", "inspect", "serve"]
    for s in got:
        assert s.notebook.is_file(), s.notebook
        validate_parameters(s.notebook, s.parameters)  # raises on an unknown name or type


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(WorkbenchError, match="unknown pipeline profile 'fast'.*full.*quick"):
        stages("fast")


def test_experiment_stages_are_opt_in_and_match_their_notebooks():
    got = stages("quick", experiments=True)
    assert [s.name for s in got] == ["capture", "train", "inspect", "serve", "steps", "nccl"]
    for s in got[4:]:
        validate_parameters(s.notebook, s.parameters)


def test_serve_stage_serves_the_setting_the_inspect_stage_chose():
    """Notebook 03 chooses the setting on its calibration prompts; the serve stage launches that
    setting, not notebook 04's default, and reports on prompts the calibration did not see."""
    serve = stages("quick")[-1]
    done = {
        "inspect": {"figures": {"served_config": "1/1/2"}, "parameters": {}},
        "train": {"figures": {}, "parameters": {"export_dir": "/x/export-sglang"}},
    }
    params = resolve_references(serve.parameters, done)
    assert params["spec_config"] == "1/1/2" and params["draft"] == "/x/export-sglang"
    validate_parameters(serve.notebook, params)
    inspect = stages("quick")[2]
    pool = load_prompts("mtbench", 0)
    calib = calibration_prompts(
        pool, 4, [p.id for p in pool[:4]], [p.id for p in pool[: inspect.parameters["n_prompts"]]]
    )
    assert not {p.id for p in calib} & {p.id for p in pool[: params["n_prompts"]]}


def test_train_stage_key_carries_the_preset_values():
    from workbench.draft.train import PRESETS

    train = stages("quick")[1]
    assert train.name == "train" and train.key_extra == {"preset": PRESETS["quick"]}
