"""Continuous batching in the llama.cpp engine, engine-level (no server): N sequences at once against one.

For each stream count: N sequences with distinct prompts of --prompt-tokens real-text tokens are added
together and stepped until each has --tokens tokens (EOS ignored: the engine never stops a sequence
itself); summed tokens per second of wall time, and time to first token (median, p95). ``--share``
gives every prompt the same document and a different ending, with the prompt cache on and off: the
KV cells held once every sequence has its first token, and the times. ``--attention`` times raw
llama.cpp passes with the engine's CPU attention (flash attention over bfloat16 cells, which keeps a
sequence's numbers independent of its batch) against float16 cells without flash attention.
``--kv-cells 0,N`` runs the streams in engines with KV pools of those sizes (0: the engine's own),
the prompt cache on as when serving, taking turns run by run: a pool too small for every sequence's
whole length makes the engine preempt (``kv_preemptions``), and the times show what that costs.

    .venv/bin/python benchmarks/llama_batch.py --streams 1,8 --runs 3 [--model X.gguf] [--share] [--attention]
    .venv/bin/python benchmarks/llama_batch.py --streams 4 --prompt-tokens 256 --tokens 512 --kv-cells 0,1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mesh_llm  # noqa: F401, I001  (first: it loads a CUDA llama.cpp before numpy, mesh_llm/native.py)
import llama_cpp.llama_cpp as ll

from mesh_llm.engines.base import EngineOptions, SamplingParams
from mesh_llm.engines.llama import LlamaEngine
from mesh_llm.engines.llama_batch import Batch
from mesh_llm.engines.llama_cache import GGML_TYPE_BF16
from mesh_llm.machine import physical_cores
from mesh_llm.models.default import default_gguf

GREEDY = SamplingParams(temperature=0)


def prompts_for(engine, n: int, length: int, shared: int, salt: int) -> list[list[int]]:
    """``n`` prompts of about ``length`` tokens of real text; the first ``shared`` tokens are the same
    within a call, and no two calls (``salt``) share a prefix."""
    ids = engine.tokenizer.encode(f"Run {salt}. " + Path(__file__).read_text() * 40, add_special_tokens=False)
    document = ids[:shared]
    return [document + engine.tokenizer.encode(f"Stream {i}. ", False) + ids[shared + 7 * i:][: length - shared]
            for i in range(n)]


def run_streams(engine, prompts: list[list[int]], tokens: int) -> dict:
    start = time.perf_counter()
    for seq, prompt in enumerate(prompts):
        engine.add(seq, prompt, GREEDY, tokens)
    got, first, cells = {seq: 0 for seq in range(len(prompts))}, {}, None
    while got:
        for seq, _ in engine.step(512):
            got[seq] += 1
            first.setdefault(seq, time.perf_counter() - start)
            if len(first) == len(prompts) and cells is None:
                cells = engine.cache_stats()["kv_cells_used"]
            if got[seq] == tokens:
                engine.remove(seq)
                del got[seq]
    wall = time.perf_counter() - start
    ttft = sorted(first.values())
    return {"wall_s": wall, "tok_s": len(prompts) * tokens / wall, "ttft_median_s": statistics.median(ttft),
            "ttft_p95_s": ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))], "cells_at_first_tokens": cells}


def decode_rate(ctx, batch: Batch, seqs: dict[int, int]) -> float:
    """Tokens per second of 16 raw passes of one row for each ``{sequence: its length}``, which are
    then cut back to those lengths."""
    start = time.perf_counter()
    for k in range(16):
        batch.clear()
        for seq, length in seqs.items():
            batch.add(seq, [100], length + k, True)
        ll.llama_decode(ctx, batch.ready())
    rate = 16 * len(seqs) / (time.perf_counter() - start)
    for seq, length in seqs.items():
        ll.llama_memory_seq_rm(ll.llama_get_memory(ctx), seq, length, -1)
    return rate


def attention(path: Path, threads: int, runs: int) -> dict:
    """Raw llama.cpp: prefill 1,024 tokens in 512-token passes; decode one row at 1,024 cells, then
    at 200 (the sequence cut back), then eight rows (seven more sequences at 64 cells). The two
    settings take turns, run by run, so that a busy machine weighs on both alike."""
    model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    keys = ("prefill_1024_s", "decode_1_row_at_1024_tok_s", "decode_1_row_at_200_tok_s", "decode_8_rows_tok_s")
    settings = {"flash attention, bfloat16 cells (the engine)": (True, GGML_TYPE_BF16),
                "no flash attention, float16 cells": (False, 1)}
    contexts, rows = {}, {name: [] for name in settings}
    for name, (flash, cell_type) in settings.items():
        params = ll.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 4096, 520, 520, 8
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified, params.type_k, params.type_v = True, cell_type, cell_type
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        contexts[name] = ll.llama_init_from_model(model, params)
    batch = Batch(520)
    for _ in range(runs):
        for name, ctx in contexts.items():
            ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
            start = time.perf_counter()
            for pos in range(0, 1024, 512):
                batch.clear()
                batch.add(0, [(pos + i) % n_vocab for i in range(512)], pos, True)
                ll.llama_decode(ctx, batch.ready())
            prefill = time.perf_counter() - start
            at_1024 = decode_rate(ctx, batch, {0: 1024})
            ll.llama_memory_seq_rm(ll.llama_get_memory(ctx), 0, 200, -1)
            at_200 = decode_rate(ctx, batch, {0: 200})
            for seq in range(1, 8):
                batch.clear()
                batch.add(seq, list(range(10, 74)), 0, False)
                ll.llama_decode(ctx, batch.ready())
            rows[name].append((prefill, at_1024, at_200, decode_rate(ctx, batch, {0: 200, **{s: 64 for s in range(1, 8)}})))
    for ctx in contexts.values():
        ll.llama_free(ctx)
    ll.llama_model_free(model)
    return {name: {key: statistics.median(r[i] for r in rows[name]) for i, key in enumerate(keys)}
            for name in settings}


def pools(path: Path, args, streams: list[int]) -> dict:
    """The same streams in engines of each ``--kv-cells`` pool size, taking turns run by run."""
    engines = {int(c): LlamaEngine.load(path, EngineOptions(ctx_size=args.ctx_size, threads=args.threads,
                                                            max_batch=max(streams)), kv_cells=int(c) or None)
               for c in args.kv_cells.split(",")}
    out = {}
    for n in streams:
        runs = {cells: [] for cells in engines}
        for salt in range(args.runs):
            for cells, engine in engines.items():
                before = engine.cache_stats()["kv_preemptions"]
                run = run_streams(engine, prompts_for(engine, n, args.prompt_tokens, 0, salt), args.tokens)
                runs[cells].append({**run, "preemptions": engine.cache_stats()["kv_preemptions"] - before})
        for cells, engine in engines.items():
            key = f"{n} streams, pool of {engine.cache_stats()['kv_cells']} cells"
            out[key] = {k: statistics.median(r[k] for r in runs[cells]) for k in runs[cells][0]
                        if runs[cells][0][k] is not None}
            print(key, json.dumps(out[key]), flush=True)
    for engine in engines.values():
        engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--prompt-tokens", type=int, default=640)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--ctx-size", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--share", action="store_true")
    parser.add_argument("--attention", action="store_true")
    parser.add_argument("--kv-cells", default=None, help="pool sizes to alternate, e.g. 0,1024 (0: the default)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    path = args.model or default_gguf()
    streams = [int(n) for n in args.streams.split(",")]
    result = {"model": str(path), "prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "runs": {}}
    if args.kv_cells:
        result["runs"] = pools(path, args, streams)
    for cache in (() if args.kv_cells else (1 << 30, 0) if args.share else (0,)):
        engine = LlamaEngine.load(path, EngineOptions(ctx_size=args.ctx_size, threads=args.threads,
                                                      max_batch=max(streams), cache_bytes=cache))
        result["info"] = engine.info().details
        for n in streams:
            shared = args.prompt_tokens - 40 if args.share else 0
            key = f"{n} streams" + (f", sharing {'on' if cache else 'off'}" if args.share else "")
            runs = [run_streams(engine, prompts_for(engine, n, args.prompt_tokens, shared, salt), args.tokens)
                    for salt in range(args.runs)]
            result["runs"][key] = {k: statistics.median(r[k] for r in runs) for k in runs[0] if runs[0][k] is not None}
            print(key, json.dumps(result["runs"][key]), flush=True)
        engine.close()
    if args.attention:
        result["attention"] = attention(path, args.threads or physical_cores(), args.runs)
        print(json.dumps(result["attention"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
