"""Shared fixtures: a tiny random Llama target (fast tests) and the embedded default (slow)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("MKL_CBWR", "AVX512")


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """HF directory of the converted embedded target (converted once per WORKBENCH_HOME)."""
    from workbench.target import EMBEDDED_NAME, resolve_target_dir

    return resolve_target_dir(EMBEDDED_NAME)[1]


@pytest.fixture(scope="session")
def embedded_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer and chat template, read from the embedded GGUF without converting its
    weights (a few seconds; `embedded_dir` dequantizes the whole 135M model, for slow tests)."""
    from transformers import AutoTokenizer

    from workbench.target import embedded_gguf_path

    gguf = embedded_gguf_path()
    out = tmp_path_factory.mktemp("embedded-tokenizer")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, embedded_tokenizer_dir) -> Path:
    """A tiny random Llama (8 layers, hidden 64) that shares SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-target")
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
    ):
        if (embedded_tokenizer_dir / name).is_file():
            shutil.copy(embedded_tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from workbench.target import load_target

    return load_target(tiny_target_dir)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a small shared CPU: a second torch thread only adds contention."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def pytest_collection_modifyitems(items):
    """`make test-fast` (-m "not slow") must never convert the real 135M target."""
    for item in items:
        uses_real = "embedded_dir" in getattr(item, "fixturenames", ())
        if uses_real and item.get_closest_marker("slow") is None:
            raise pytest.UsageError(
                f"{item.nodeid} uses the real embedded target (embedded_dir) but is not marked "
                "slow; mark it @pytest.mark.slow or use tiny_target_dir / embedded_tokenizer_dir"
            )
