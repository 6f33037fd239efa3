"""A tiny random-weight llama model with SmolLM2's real tokenizer, as an MLX folder and a GGUF."""

from __future__ import annotations

import pytest

from mesh_llm.bench.runner import ModelPair
from mesh_llm.bench.synth import write_pair


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory, default_gguf) -> ModelPair:
    folder, gguf = write_pair("tiny", tmp_path_factory.mktemp("tiny"), default_gguf, dtype="float32")
    return ModelPair("tiny", folder, gguf)
