"""Capture backend `sglang`: the aux hidden states come from a real SGLang server.

Why: a target that needs tensor parallelism serves in SGLang long before it fits one HF
forward. SGLang 0.5.23 with `--enable-return-aux-hidden-states --speculative-algorithm EAGLE3`
runs the target in capture-only mode (no draft is loaded; the algorithm only names the
layer-id convention) and answers a `/generate` request that sets `return_hidden_states` with
the concatenated aux states of every prefilled token (`meta_info["hidden_states"]`, one list
per prefill chunk). The ids travel through `layers.sglang_return_aux_ids`: SGLang reads them as
`output_of_layer` and hooks the input of layer id+1.

What SGLang 0.5.23 cannot give: the last layer's pre-norm output (`last_hidden`, from which
training recomputes the target's logits). Its hooks capture a layer's output as the next
layer's input, so the last layer is never captured, and the final state it keeps in capture
mode (`LogitsProcessorOutput.last_hidden_states`, post-norm) is not passed to the client.
`last_hidden` therefore comes from the local target's forward (loaded for the tokenizer and
fingerprint anyway): the shards are complete and identical in layout, but this backend does
not yet spare the local forward. The radix cache is off: a cached prefix is not prefilled
again and would return fewer rows than tokens.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from workbench.capture import AuxRecorder, CaptureError
from workbench.layers import LayerIds, sglang_return_aux_ids
from workbench.serving import process, sglang


def capture_spec(
    target: str,
    layer_ids: LayerIds,
    num_layers: int,
    *,
    tp_size: int = 1,
    dtype: str = "auto",
    device: str = "cuda",
) -> sglang.ServeSpec:
    """The SGLang spec of a capture-only server for `layer_ids` (any convention)."""
    ids = sglang_return_aux_ids(layer_ids, num_layers)
    extra = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
             "--return-aux-hidden-state-layer-ids", *map(str, ids), "--disable-radix-cache"]  # fmt: skip
    return sglang.ServeSpec(target=target, draft=None, speculative_algorithm=None,
                            tp_size=tp_size, dtype=dtype, device=device, extra_args=extra,
                            enable_metrics=False)  # fmt: skip


@contextlib.contextmanager
def capture_server(
    spec: sglang.ServeSpec, log_path: str | os.PathLike, deadline_s: float = 900.0
) -> Iterator[str]:
    """Launch the capture server for the block; yields its URL, stops it after."""
    server = sglang.launch(spec, Path(log_path), deadline_s=deadline_s, check_draft=False)
    try:
        yield server.url
    finally:
        server.stop()


def server_aux(url: str, input_ids: list[int], width: int, timeout: float = 600.0) -> torch.Tensor:
    """[T, width] aux states of one token sequence, prefilled by the server (fp32)."""
    ans = sglang.generate(url, input_ids, 1, timeout=timeout, return_hidden_states=True)
    meta = ans["meta_info"]
    chunks = meta.get("hidden_states")
    if not chunks:
        raise CaptureError(
            f"{url} returned no hidden states: start it with --enable-return-aux-hidden-states "
            f"--speculative-algorithm EAGLE3 (capture_spec does)"
        )
    rows = [r for c in chunks for r in c]
    if len(rows) != len(input_ids) or any(len(r) != width for r in rows):
        raise CaptureError(
            f"{url} returned {len(rows)} rows of width {len(rows[0])} for {len(input_ids)} "
            f"tokens; expected width {width} (aux layers x hidden). Fewer rows: a cached prefix "
            f"(start it with --disable-radix-cache); another width: other aux layer ids"
        )
    return torch.tensor(rows, dtype=torch.float32)


class SGLangRecorder:
    """`capture.capture(recorder=...)` backend: aux from the server, last_hidden from the
    local target (see the module doc for why). Requests go out `workers` at a time."""

    name = "sglang"

    def __init__(self, url: str, target, layer_ids: LayerIds, workers: int = 4):
        self.url, self.workers = url, workers
        self.width = len(layer_ids.ids) * target.hidden_size
        self.local = AuxRecorder(target, layer_ids)

    def forward(
        self, target, batch_ids: list[list[int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with ThreadPoolExecutor(self.workers) as pool:
            aux = list(pool.map(lambda x: server_aux(self.url, x, self.width), batch_ids))
        local = self.local.forward(target, batch_ids)  # last_hidden; its aux is not used
        return [(a, last) for a, (_, last) in zip(aux, local, strict=True)]

    def __enter__(self) -> SGLangRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.local.remove()


def recorder(url: str, workers: int = 4):
    """The `recorder` argument of `capture.capture` for a capture server at `url`."""
    process.attach(url)
    return functools.partial(SGLangRecorder, url, workers=workers)
