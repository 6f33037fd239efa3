"""llama.cpp on a GPU: the engine loads a GGUF with every layer offloaded and generates, and never
crashes the process whatever was imported first. A CUDA build that carries its own libstdc++ crashed
at model load when numpy came first (issue 9, mesh_llm/system/native.py): importing mesh_llm first loads it
first, and after numpy the engine refuses with the reason; a build that keeps libstdc++ to itself
generates in every order, after its warm-up (on by default on a GPU). And one pass reads several
newcomers' prompt chunks. Runs on the GPU machine with a CUDA llama.cpp (``LLAMA_CPP_LIB_PATH``) and
``MESH_LLM_GPU_GGUF`` naming a model; skipped elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.gpu("llama")]

GGUF = os.environ.get("MESH_LLM_GPU_GGUF")

SCRIPT = textwrap.dedent("""
    import logging, sys
    FIRST
    logging.basicConfig(level="INFO")  # the warm-up's line: on by default on a GPU
    from mesh_llm.engines.base import EngineOptions, SamplingParams
    from mesh_llm.engines.llama.engine import LlamaEngine
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


@pytest.mark.parametrize("first", ["import numpy", "import llama_cpp", "import mesh_llm"])
def test_loads_and_generates_on_the_gpu_or_says_why_whatever_was_imported_first(gguf, first):
    code = SCRIPT.replace("FIRST", first)
    done = subprocess.run([sys.executable, "-c", code, gguf], capture_output=True, text=True, timeout=600)
    assert done.returncode >= 0, f"killed by signal {-done.returncode}\n{done.stderr[-3000:]}"
    if first == "import numpy" and "carries its own copy of libstdc++" in done.stderr:
        print("refused, as it must for this build:", done.stderr.strip().splitlines()[-1][:200])
        return
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "warm-up:" in done.stderr and "warm-up cut short" not in done.stderr, done.stderr[-3000:]
    print(done.stdout.strip().splitlines()[-1], [ln for ln in done.stderr.splitlines() if "warm-up" in ln])


PASS_SCRIPT = textwrap.dedent("""
    import sys
    import mesh_llm
    from mesh_llm.engines.base import GPU_PREFILL_CHUNKS, EngineOptions, SamplingParams
    from mesh_llm.engines.llama.engine import LlamaEngine
    step = 128
    engine = LlamaEngine.load(sys.argv[1], EngineOptions(ctx_size=1024, max_batch=8, prefill_step=step,
                                                         cache_bytes=0))
    n = GPU_PREFILL_CHUNKS
    for seq in range(n):  # prompts of a chunk and a half: a chunk of each, then the halves
        engine.add(seq, [100 + seq + i for i in range(step + step // 2)], SamplingParams(temperature=0.0), 4)
    steps = 0
    started = set()
    while len(started) < n:
        started |= {seq for seq, _ in engine.step(n * step)}
        steps += 1
    print("passes until every first token:", steps)
    assert steps == 2, steps
""")


def test_on_the_gpu_one_pass_reads_a_chunk_of_several_newcomers_prompts(gguf):
    """The worker gives a GPU step GPU_PREFILL_CHUNKS chunks of prompt; the llama engine's pass must
    hold them all (on a CPU, where a pass holds one chunk, the same script takes seven passes)."""
    done = subprocess.run([sys.executable, "-c", PASS_SCRIPT, gguf], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    print(done.stdout.strip().splitlines()[-1])


STREAMS_SCRIPT = textwrap.dedent("""
    import sys
    import mesh_llm
    from mesh_llm.engines.base import EngineOptions, SamplingParams
    from mesh_llm.engines.llama.engine import LlamaEngine
    engine = LlamaEngine.load(sys.argv[1], EngineOptions(ctx_size=1024, max_batch=8))
    assert "a stream for each" in engine.info().details["kv_cells"], engine.info().details
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    shared = [200 + i for i in range(300)]  # three prompts share it: their copies of its stream
    prompts = [shared + [7, 8, s] if s < 3 else [100 + 13 * s + i for i in range(40 + 30 * s)] for s in range(8)]
    lengths = [6 + 3 * s for s in range(8)]  # they end at different steps: running ones move down
    for s in range(4):
        engine.add(s, prompts[s], greedy, lengths[s])
    out, running, added, steps = {s: [] for s in range(8)}, set(range(4)), 4, 0
    while any(len(out[s]) < lengths[s] for s in range(8)):
        for s, st in engine.step(2048):
            out[s].append(st)
        steps += 1
        for s in [s for s in running if len(out[s]) == lengths[s]]:
            engine.remove(s)
            running.discard(s)
        if steps % 3 == 0 and added < 8:  # one joins every third step
            engine.add(added, prompts[added], greedy, lengths[added])
            running.add(added)
            added += 1
    stats = engine.cache_stats()
    differ = []
    for s in range(8):
        alone = [st for st in engine.generate(prompts[s], greedy, max_tokens=lengths[s])]
        for k, (a, b) in enumerate(zip(alone, out[s])):
            assert abs(a.logprob - b.logprob) <= 0.5 or a.token != b.token, (s, k, a, b)
            if a.token != b.token:  # only at a near-tie
                margin = a.top_logprobs[0][1] - a.top_logprobs[1][1]
                assert margin <= 1.0, (s, k, margin)
                differ.append(s)
                break
    assert [out[s][0].cached_tokens > 0 for s in (1, 2)] == [True, True], [out[s][0] for s in range(3)]
    assert stats["kv_stream_copies"] >= 4, stats
    print("stream copies:", stats["kv_stream_copies"], "sequences parting from their solo run at a near-tie:", differ)
""")


def test_on_the_gpu_a_stream_per_sequence_keeps_every_sequence_what_it_is_alone(gguf):
    """The GPU default: a stream of cells per sequence. Eight sequences joining and ending at
    different steps (running ones move into the ids that ended ones leave), three sharing a prefix by
    copying a stream: each gives its solo tokens, parting only at a near-tie."""
    done = subprocess.run([sys.executable, "-c", STREAMS_SCRIPT, gguf], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    print(done.stdout.strip().splitlines()[-1])


MLX_LOAD = textwrap.dedent("""
    import sys
    import mesh_llm
    from pathlib import Path
    from mesh_llm.engines.base import EngineError, EngineOptions
    from mesh_llm.engines.mlx.engine import MLXEngine
    try:
        MLXEngine.load(Path(sys.argv[1]), EngineOptions(ctx_size=256, warm_up=False))
        print("loaded")
    except EngineError as exc:
        print("refused:", exc)
""")


@pytest.fixture
def mlx_folder():
    folder = os.environ.get("MESH_LLM_GPU_MODEL")
    if not folder:
        pytest.skip("set MESH_LLM_GPU_MODEL to an MLX model folder")
    if subprocess.run([sys.executable, "-c", "import mlx.core"], capture_output=True, check=False).returncode:
        pytest.skip("MLX is not installed here")
    return folder


def test_mlx_loads_or_says_why_after_this_build_was_loaded_first(mlx_folder):
    """A build that carries libstdc++, loaded first by `import mesh_llm`, made MLX's safetensors
    reader die with SIGSEGV (H100, 2026-12-06); the engine now refuses with the reason."""
    done = subprocess.run([sys.executable, "-c", MLX_LOAD, mlx_folder], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-3000:]}"
    print(done.stdout.strip()[:200])


def test_mlx_serves_beside_this_build(mlx_folder, tmp_path):
    """`mesh-llm serve --engine mlx` where this build is importable: a process that never loads it."""
    from support import start_server

    server = start_server(["--engine", "mlx", "--model", mlx_folder, "--ctx-size", "1024"], tmp_path / "log")
    try:
        reply = httpx.post(server.url + "/v1/completions", json={
            "model": os.path.basename(mlx_folder.rstrip("/")), "prompt": "Hello", "max_tokens": 4,
            "ignore_eos": True}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert "/libllama" not in Path(f"/proc/{server.proc.pid}/maps").read_text()
    finally:
        server.stop()
