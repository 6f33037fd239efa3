"""Real vocabularies and model chat templates for the runtime's tests.

Templates in ``templates/`` are the models' own, as llama.cpp's test suite keeps them (the
llama-cpp-python 0.3.36 sdist, ``vendor/llama.cpp/models/templates``). Vocabularies are llama.cpp's
vocab-only GGUFs (``make test`` fetches them; MESH_LLM_GGUF_VOCABS names their folder).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TEMPLATES = Path(__file__).parent / "templates"


def read_template(name: str) -> str:
    return (TEMPLATES / name).read_text()


@pytest.fixture(scope="session")
def template():
    """A model's chat template by its file name in ``templates/``."""
    return read_template


class Vocab:
    """A real tokenizer (llama.cpp's, from a vocab-only GGUF) with another model's chat template."""

    def __init__(self, tokenizer, chat_template: str | None):
        self._tokenizer, self.chat_template = tokenizer, chat_template

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def vocab():
    import llama_cpp.llama_cpp as ll

    from mesh_llm.engines.llama.engine import LlamaTokenizer

    folder = os.environ.get("MESH_LLM_GGUF_VOCABS")
    models = []

    def load(name: str | Path, template_file: str | None) -> Vocab | LlamaTokenizer:
        """llama.cpp's vocab ``name`` with the template ``template_file``, or a GGUF file's own
        vocab and template (``name`` a path)."""
        path = name if isinstance(name, Path) else Path(folder or "") / f"ggml-vocab-{name}.gguf"
        if not path.is_file():
            pytest.skip(f"set MESH_LLM_GGUF_VOCABS to a folder with ggml-vocab-{name}.gguf (make test does)")
        params = ll.llama_model_default_params()
        params.vocab_only = True
        model = ll.llama_model_load_from_file(str(path).encode(), params)
        models.append(model)
        if isinstance(name, Path):
            return LlamaTokenizer(model)
        return Vocab(LlamaTokenizer(model), read_template(template_file) if template_file else None)

    yield load
    for model in models:
        ll.llama_model_free(model)
