"""What llama.cpp's unified KV pool costs a batched decode step: R rows, each with its own P-token
context, with every sequence's cells in one pool (``kv_unified``, what the llama engine uses, so that
sequences share a prefix's cells and any one may grow to the whole context) against one stream of
cells per sequence (llama-server's default). In one pool every row's attention spans every
sequence's cells, masked, so its cost grows with the sum of the contexts rather than each one's.

    .venv/bin/python benchmarks/llama_kv_unified.py [GGUF] [--rows 8] [--context 256,1024] [--threads N]

Raw llama.cpp through its bindings, no engine: random prompt tokens, one prompt per sequence, then
decode steps of all rows together; the median step of each layout, alternated.
"""

from __future__ import annotations

import argparse
import time

import mesh_llm  # noqa: F401, I001  (first: it loads a CUDA llama.cpp before numpy, mesh_llm/native.py)
import llama_cpp.llama_cpp as ll
import numpy as np

from mesh_llm.engines.llama_batch import Batch
from mesh_llm.engines.llama_cache import set_cache_params
from mesh_llm.machine import physical_cores
from mesh_llm.models.default import default_gguf

STEPS = 40


def median_step(model, rows: int, context: int, unified: bool, threads: int) -> float:
    cp = ll.llama_context_default_params()
    set_cache_params(cp, gpu=bool(ll.llama_supports_gpu_offload()), deterministic=False)  # the engine's cells
    cp.n_ctx, cp.n_seq_max, cp.kv_unified = rows * (context + STEPS + 64), rows, unified
    cp.n_batch = cp.n_ubatch = max(context, rows)
    cp.n_threads = cp.n_threads_batch = threads
    ctx = ll.llama_init_from_model(model, cp)
    batch = Batch(max(context, rows))
    rng = np.random.default_rng(0)
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))

    def decode() -> None:
        if ll.llama_decode(ctx, batch.ready()) != 0:
            raise SystemExit("llama_decode failed")
        ll.llama_synchronize(ctx)
        batch.clear()

    try:
        for seq in range(rows):
            batch.add(seq, rng.integers(10, n_vocab - 10, context), 0, True)
            decode()
        times = []
        for step in range(STEPS):
            start = time.perf_counter()
            for seq in range(rows):
                batch.add(seq, [int(rng.integers(10, n_vocab - 10))], context + step, True)
            decode()
            times.append(time.perf_counter() - start)
        return float(np.median(times[5:]))
    finally:
        ll.llama_free(ctx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?", help="default: the embedded model")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", default="256,1024")
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    ll.llama_backend_init()
    params = ll.llama_model_default_params()
    params.n_gpu_layers = -1 if ll.llama_supports_gpu_offload() else 0
    model = ll.llama_model_load_from_file(str(args.gguf or default_gguf()).encode(), params)
    try:
        for context in (int(c) for c in args.context.split(",")):
            steps = {True: [], False: []}
            for _ in range(args.repeats):
                for unified in (True, False):
                    steps[unified].append(median_step(model, args.rows, context, unified, args.threads))
            one, own = min(steps[True]), min(steps[False])
            print(f"{args.rows} rows, {context}-token contexts: one pool {one * 1e3:.2f} ms a step, "
                  f"a stream per sequence {own * 1e3:.2f} ms ({one / own:.2f}x)", flush=True)
    finally:
        ll.llama_model_free(model)


if __name__ == "__main__":
    main()
