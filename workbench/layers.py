"""The layer-id convention: the one place that does index math on aux-layer ids.

Three conventions exist for "which target layers feed the EAGLE-3 draft":

| convention               | id k means                                  | N=30 default |
|--------------------------|---------------------------------------------|--------------|
| output_of_layer (ours)   | residual stream after 0-based decoder layer k | [1, 14, 26]  |
| hf_hidden_states_index   | index into HF `output_hidden_states` (0 = embeddings) | [2, 15, 27] |
| input_of_layer           | residual stream entering decoder layer k    | [2, 15, 27]  |

`output_of_layer` is canonical (SGLang/SpecForge `eagle_aux_hidden_state_layer_ids`);
`input_of_layer` is vLLM/speculators' meaning and SGLang's internal `layers_to_capture`.
In `output_of_layer`, id -1 names the embedding output (the input of layer 0); the wiring
audit uses it. Every stored id list carries its convention; a bare list is an error.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from workbench.errors import WorkbenchError

OUTPUT_OF_LAYER = "output_of_layer"
HF_HIDDEN_STATES_INDEX = "hf_hidden_states_index"
INPUT_OF_LAYER = "input_of_layer"
CANONICAL = OUTPUT_OF_LAYER
CONVENTIONS = (OUTPUT_OF_LAYER, HF_HIDDEN_STATES_INDEX, INPUT_OF_LAYER)

# Offset that maps a canonical id to each convention: id_conv = id_canonical + offset.
_OFFSET = {OUTPUT_OF_LAYER: 0, HF_HIDDEN_STATES_INDEX: 1, INPUT_OF_LAYER: 1}


class LayerConventionError(WorkbenchError):
    """Layer ids are missing their convention, out of range, or inconsistent."""


def check_convention(convention: str | None) -> str:
    if convention not in CONVENTIONS:
        raise LayerConventionError(
            f"unknown or missing layer-id convention {convention!r}; layer ids are stored "
            f"with one of {', '.join(CONVENTIONS)} (canonical: {CANONICAL}). "
            "Say which one your ids use; a bare id list is ambiguous (off-by-one risk)."
        )
    return convention


def convert(ids: Iterable[int], src: str, dst: str) -> list[int]:
    """Convert ids between conventions (pure offset arithmetic, done only here)."""
    check_convention(src)
    check_convention(dst)
    return [int(i) - _OFFSET[src] + _OFFSET[dst] for i in ids]


def valid_range(num_layers: int, convention: str) -> tuple[int, int]:
    """Inclusive id range for a target with `num_layers` decoder layers.

    Canonical ids run from -1 (embedding output) to N-1 (output of the last layer, before
    the final norm). HF index N is the *post-norm* final state in transformers, so it is
    not the pre-norm residual stream; it is accepted (as canonical N-1) but `validate` warns.
    """
    lo, hi = -1, num_layers - 1
    off = _OFFSET[check_convention(convention)]
    return lo + off, hi + off


@dataclass(frozen=True)
class LayerIds:
    """Aux-layer ids together with the convention that gives them meaning."""

    ids: tuple[int, ...]
    convention: str = CANONICAL

    def __post_init__(self) -> None:
        check_convention(self.convention)
        object.__setattr__(self, "ids", tuple(int(i) for i in self.ids))

    def to(self, convention: str) -> LayerIds:
        return LayerIds(tuple(convert(self.ids, self.convention, convention)), convention)

    @property
    def canonical(self) -> tuple[int, ...]:
        return self.to(CANONICAL).ids

    def shifted(self, delta: int) -> LayerIds:
        """Same convention, every id moved by `delta` (the wiring audit's what-if)."""
        return LayerIds(tuple(i + delta for i in self.ids), self.convention)

    def to_dict(self) -> dict:
        return {"ids": list(self.ids), "convention": self.convention}

    @classmethod
    def from_dict(cls, d: dict | None) -> LayerIds:
        if not isinstance(d, dict) or "ids" not in d:
            raise LayerConventionError(f"expected {{'ids': [...], 'convention': ...}}, got {d!r}")
        if "convention" not in d or d["convention"] is None:
            check_convention(None)
        return cls(tuple(d["ids"]), d["convention"])

    def __str__(self) -> str:
        return f"{list(self.ids)} ({self.convention})"


def default_layer_ids(num_layers: int) -> LayerIds:
    """EAGLE-3's default `[1, N//2 - 1, N - 4]` in `output_of_layer`.

    Below 7 layers the formula repeats ids (N=5: [1, 1, 1], N=6: [1, 2, 2]), so such targets
    must name their ids explicitly rather than get a silently different choice.
    """
    if num_layers < 7:
        raise LayerConventionError(
            f"the default aux layers [1, N//2-1, N-4] need at least 7 decoder layers to be "
            f"distinct; target has {num_layers}: pass explicit ids, e.g. "
            f"'{','.join(str(i) for i in range(min(3, num_layers)))}'"
        )
    return LayerIds((1, num_layers // 2 - 1, num_layers - 4), CANONICAL)


def validate(
    layer_ids: LayerIds,
    num_layers: int,
    *,
    fc_in_features: int | None = None,
    hidden_size: int | None = None,
) -> LayerIds:
    """Check range, order, distinctness and (optionally) the draft's fc width.

    Returns the ids unchanged so callers can write `ids = validate(ids, N)`.
    """
    ids = layer_ids.ids
    lo, hi = valid_range(num_layers, layer_ids.convention)
    if not ids:
        raise LayerConventionError("empty layer-id list")
    bad = [i for i in ids if not lo <= i <= hi]
    if bad:
        raise LayerConventionError(
            f"layer ids {bad} out of range [{lo}, {hi}] for a {num_layers}-layer target in "
            f"convention {layer_ids.convention}"
        )
    if list(ids) != sorted(ids):
        raise LayerConventionError(f"layer ids must be sorted ascending, got {list(ids)}")
    if len(set(ids)) != len(ids):
        raise LayerConventionError(f"layer ids must be distinct, got {list(ids)}")
    if layer_ids.convention == HF_HIDDEN_STATES_INDEX and num_layers in ids:
        warnings.warn(
            f"hf_hidden_states_index {num_layers} is the final norm's output in transformers' "
            f"output_hidden_states, not a residual stream; it is used as output_of_layer "
            f"{num_layers - 1} (the pre-norm output of the last layer). Pass "
            f"{num_layers - 1} in output_of_layer to say so without this warning",
            stacklevel=2,
        )
    if fc_in_features is not None:
        if hidden_size is None:
            raise ValueError("hidden_size is needed to check fc width")
        if fc_in_features != len(ids) * hidden_size:
            raise LayerConventionError(
                f"draft fc takes {fc_in_features} features = {fc_in_features / hidden_size:g} x "
                f"hidden {hidden_size}, but {len(ids)} aux layers {list(ids)} give "
                f"{len(ids) * hidden_size}"
            )
    return layer_ids


def parse_layer_spec(
    spec: str | Sequence[int] | None, num_layers: int, convention: str = CANONICAL
) -> LayerIds:
    """Parse `"default"`, `None`, `"1,14,26"` or a list into validated LayerIds."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "default")):
        return default_layer_ids(num_layers).to(convention)
    if isinstance(spec, str):
        try:
            ids = [int(x) for x in spec.replace(" ", "").split(",") if x]
        except ValueError as e:
            raise LayerConventionError(
                f"could not parse layer ids {spec!r}: expected comma-separated integers "
                "like '1,14,26' or 'default'"
            ) from e
    else:
        ids = [int(x) for x in spec]
    return validate(LayerIds(tuple(ids), convention), num_layers)


def sglang_return_aux_ids(layer_ids: LayerIds, num_layers: int) -> list[int]:
    """Ids for SGLang's `--return-aux-hidden-state-layer-ids` (EAGLE3 capture convention).

    SGLang 0.5.23 reads them as `output_of_layer` and captures at `layers_to_capture = id + 1`
    (the input of the next layer: its +1 convention, `input_of_layer`). Two consequences,
    refused here: the embedding output (-1) is not expressible (SGLang rejects negative ids),
    and the last layer's output is never captured (no layer follows it; SGLang fails at the
    first forward)."""
    ids = validate(layer_ids, num_layers).to(OUTPUT_OF_LAYER).ids
    cap = LayerIds(ids, OUTPUT_OF_LAYER).to(INPUT_OF_LAYER).ids  # what SGLang hooks
    bad = [i for i, c in zip(ids, cap, strict=True) if i < 0 or c >= num_layers]
    if bad:
        raise LayerConventionError(
            f"SGLang cannot return aux layers {bad} ({OUTPUT_OF_LAYER}) of a {num_layers}-layer "
            f"target: it captures the input of layer id+1, so -1 (embeddings) and "
            f"{num_layers - 1} (last layer) are out of its reach; use the HF backend"
        )
    return list(ids)
