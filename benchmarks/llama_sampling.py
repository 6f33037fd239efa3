"""What sampling a greedy row costs the llama engine at a large vocabulary: llama.cpp's greedy
sampler against numpy's argmax (what the engine uses), on the same logits rows.

    .venv/bin/python benchmarks/llama_sampling.py [--vocab 151936] [--rows 8]

Writes a tiny random-weight GGUF (``tests/tiny_gguf.py``) with a vocabulary of ``--vocab`` tokens
(Qwen2.5's by default), decodes ``--rows`` sequences together, then times each way of taking the
next token from every row of the last step, and one whole engine step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import mesh_llm  # noqa: F401, I001  (first: it loads a CUDA llama.cpp before numpy, mesh_llm/native.py)
import llama_cpp.llama_cpp as ll
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny_gguf  # noqa: E402

from mesh_llm.engines.base import EngineOptions, SamplingParams  # noqa: E402
from mesh_llm.engines.llama import LlamaEngine  # noqa: E402


def per_row(fn, rows: int, repeats: int = 50) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        for i in range(rows):
            fn(i)
    return (time.perf_counter() - start) / repeats / rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    tiny_gguf.VOCAB = args.vocab
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_gguf.write_tiny_gguf(Path(tmp) / "tiny.gguf", "llama")
        engine = LlamaEngine.load(path, EngineOptions(ctx_size=512, threads=2, max_batch=args.rows, cache_bytes=0))
        try:
            for seq in range(args.rows):
                engine.add(seq, list(range(300, 340)), SamplingParams(temperature=0), 400)
            while len(engine.step(4096)) < args.rows:
                pass
            start = time.perf_counter()
            for _ in range(20):
                engine.step(4096)
            step = (time.perf_counter() - start) / 20
            ctx, vocab = engine._ctx, engine.tokenizer.vocab_size  # noqa: SLF001 - the rows just computed
            greedy = ll.llama_sampler_init_greedy()
            try:
                llama = per_row(lambda i: ll.llama_sampler_sample(greedy, ctx, i), args.rows)
            finally:
                ll.llama_sampler_free(greedy)
            argmax = per_row(lambda i: int(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax()),
                             args.rows)
        finally:
            engine.close()
    print(f"vocabulary {args.vocab}, {args.rows} rows: llama.cpp's greedy sampler {llama * 1e3:.3f} ms a row, "
          f"numpy's argmax {argmax * 1e3:.3f} ms a row; an engine step {step * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
