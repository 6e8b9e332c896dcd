import pytest

from workbench.layers import (
    CANONICAL,
    CONVENTIONS,
    HF_HIDDEN_STATES_INDEX,
    INPUT_OF_LAYER,
    OUTPUT_OF_LAYER,
    LayerConventionError,
    LayerIds,
    convert,
    default_layer_ids,
    parse_layer_spec,
    valid_range,
    validate,
)

# The table in design.md, plus a DeepSeek-V3/Kimi-sized target (61 layers).
TABLE = {
    30: {
        OUTPUT_OF_LAYER: [1, 14, 26],
        HF_HIDDEN_STATES_INDEX: [2, 15, 27],
        INPUT_OF_LAYER: [2, 15, 27],
    },
    61: {
        OUTPUT_OF_LAYER: [1, 29, 57],
        HF_HIDDEN_STATES_INDEX: [2, 30, 58],
        INPUT_OF_LAYER: [2, 30, 58],
    },
}


@pytest.mark.parametrize("n", sorted(TABLE))
def test_default_and_table(n):
    d = default_layer_ids(n)
    assert d.convention == CANONICAL
    assert list(d.ids) == TABLE[n][OUTPUT_OF_LAYER]
    for conv, ids in TABLE[n].items():
        assert list(d.to(conv).ids) == ids
        validate(d.to(conv), n)


@pytest.mark.parametrize("n", sorted(TABLE))
def test_round_trip_every_pair(n):
    base = TABLE[n][OUTPUT_OF_LAYER]
    for src in CONVENTIONS:
        for dst in CONVENTIONS:
            there = convert(TABLE[n][src], src, dst)
            assert there == TABLE[n][dst]
            assert convert(there, dst, src) == TABLE[n][src]
        assert list(LayerIds(tuple(TABLE[n][src]), src).canonical) == base


def test_embedding_output_is_minus_one():
    # The embedding output is the input of layer 0 and HF hidden_states[0].
    assert convert([-1], OUTPUT_OF_LAYER, INPUT_OF_LAYER) == [0]
    assert convert([-1], OUTPUT_OF_LAYER, HF_HIDDEN_STATES_INDEX) == [0]
    assert valid_range(30, OUTPUT_OF_LAYER) == (-1, 29)
    assert valid_range(30, INPUT_OF_LAYER) == (0, 30)


def test_validation_errors():
    with pytest.raises(LayerConventionError, match="out of range"):
        validate(LayerIds((1, 14, 30)), 30)
    with pytest.raises(LayerConventionError, match="sorted"):
        validate(LayerIds((14, 1, 26)), 30)
    with pytest.raises(LayerConventionError, match="distinct"):
        validate(LayerIds((1, 1, 26)), 30)
    with pytest.raises(LayerConventionError, match="fc takes 1152"):
        validate(LayerIds((1, 14, 26)), 30, fc_in_features=2 * 576, hidden_size=576)
    validate(LayerIds((1, 14, 26)), 30, fc_in_features=3 * 576, hidden_size=576)
    with pytest.raises(LayerConventionError, match="at least 7"):
        default_layer_ids(4)


def test_ids_without_convention_are_rejected():
    with pytest.raises(LayerConventionError, match="output_of_layer"):
        LayerIds.from_dict({"ids": [1, 14, 26]})
    with pytest.raises(LayerConventionError, match="unknown or missing"):
        LayerIds((1, 2, 3), "layer_index")
    d = LayerIds((2, 15, 27), INPUT_OF_LAYER).to_dict()
    assert d == {"ids": [2, 15, 27], "convention": INPUT_OF_LAYER}
    assert LayerIds.from_dict(d).canonical == (1, 14, 26)


def test_parse_layer_spec():
    assert parse_layer_spec("default", 30).ids == (1, 14, 26)
    assert parse_layer_spec("2,15,27", 30, INPUT_OF_LAYER).canonical == (1, 14, 26)
    assert parse_layer_spec([3, 4, 5], 30).ids == (3, 4, 5)
    with pytest.raises(LayerConventionError, match="comma-separated"):
        parse_layer_spec("1;2", 30)
    assert parse_layer_spec(None, 61, INPUT_OF_LAYER).ids == (2, 30, 58)


@pytest.mark.parametrize("n", [5, 6])
def test_default_ids_on_small_targets_are_refused_not_duplicated(n):
    # [1, N//2-1, N-4] is [1, 1, 1] at N=5 and [1, 2, 2] at N=6.
    with pytest.raises(LayerConventionError, match=rf"at least 7 decoder layers.*has {n}"):
        default_layer_ids(n)
    with pytest.raises(LayerConventionError, match="explicit ids"):
        parse_layer_spec("default", n)
    assert default_layer_ids(7).ids == (1, 2, 3)


def test_hf_index_of_the_final_norm_output_warns():
    with pytest.warns(UserWarning, match="hf_hidden_states_index 30 is the final norm's output"):
        ids = parse_layer_spec("2,15,30", 30, HF_HIDDEN_STATES_INDEX)
    assert ids.canonical == (1, 14, 29)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_layer_spec("2,15,29", 30, HF_HIDDEN_STATES_INDEX)
        parse_layer_spec("1,14,29", 30, OUTPUT_OF_LAYER)
        parse_layer_spec("2,15,30", 30, INPUT_OF_LAYER)


def test_layer_errors_are_workbench_errors():
    from workbench.errors import WorkbenchError

    assert issubclass(LayerConventionError, WorkbenchError)
