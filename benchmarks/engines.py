"""Engine step rates, no server: load time, TTFT at several prompt lengths and one stream's decode
tok/s, for the MLX and llama.cpp engines on the same model (by default the embedded SmolLM2, its
imported MLX folder against its GGUF); with ``--batch``, N sequences decoded together through the
public engine interface (``add`` / ``step`` / ``remove``). Not a test: run it on a quiet machine.

    .venv/bin/python benchmarks/engines.py [--runs 3] [--decode-tokens 128] [--prompt-lengths 128,512,2048]
        [--out results.json]
    .venv/bin/python benchmarks/engines.py --engine mlx --batch 1,4,8,16,32 [--prompt-tokens 128] \\
        [--decode-tokens 64] [--constrained K] [--mlx FOLDER | --gguf FILE] [--out results.json]

Batch mode: for each N, N sequences with different prompts of ``--prompt-tokens`` tokens are added
at once and stepped (prefill budget ``--prefill-budget`` a step) until each has ``--decode-tokens``
tokens (greedy; EOS is not a stop here), then removed. Reported: summed decode tok/s (tokens after
each sequence's first, over the time from the last first token to the end), the median step time
while all N decode and N over it (the rate without stalls from other processes), and TTFT (first
and last). One unrecorded pass of each N warms up first (a GPU
compiles kernels for each new shape). ``--constrained K`` gives K of the N sequences a constraint
that allows every token, so the cost of per-row masks shows against the same run without them.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import mesh_llm  # noqa: F401, I001  (first: it loads a CUDA llama.cpp before numpy, mesh_llm/system/native.py)
from mesh_llm.engines import engine_class
from mesh_llm.engines.base import EngineOptions, SamplingParams

PROMPT_LENGTHS = "128,512,2048"
GREEDY = SamplingParams(temperature=0.0)


def prompt_of(engine, length: int, salt: int) -> list[int]:
    """Real text tokens, cut to ``length``, starting with a salt so no prefix is shared between runs."""
    source, chars = Path(__file__).read_text(), 8 * length + 64
    while True:  # tokenize only as much text as the length needs
        text = f"Run {salt}. " + (source * (chars // len(source) + 1))[:chars]
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= length:
            return ids[:length]
        chars *= 2


def time_first_token(engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    steps = engine.generate(prompt, GREEDY)
    next(steps)
    elapsed = time.perf_counter() - start
    steps.close()
    return elapsed


def time_decode(engine, prompt: list[int], tokens: int) -> float:
    steps = engine.generate(prompt, GREEDY)
    next(steps)
    start = time.perf_counter()
    for _ in range(tokens):
        next(steps)
    elapsed = time.perf_counter() - start
    steps.close()
    return tokens / elapsed


def measure(name: str, path: Path, args) -> dict:
    runs, decode_tokens, lengths = args.runs, args.decode_tokens, args.prompt_lengths
    cls = engine_class(name)
    start = time.perf_counter()
    engine = cls.load(path, EngineOptions(ctx_size=args.ctx_size, threads=args.threads, warm_up=False,
                                          deterministic=args.deterministic))
    load_s = time.perf_counter() - start
    info = engine.info()
    time_first_token(engine, prompt_of(engine, min(32, *lengths), -1))  # warm-up: first-use costs stay out
    salt = 0
    ttft = {}
    for length in lengths:
        samples = []
        for _ in range(runs):
            salt += 1
            samples.append(time_first_token(engine, prompt_of(engine, length, salt)))
        ttft[length] = statistics.median(samples)
    decode = statistics.median(time_decode(engine, prompt_of(engine, min(128, *lengths), 1000 + i), decode_tokens)
                               for i in range(runs))
    engine.close()
    return {"engine": name, "path": str(path), "load_s": load_s, "ttft_s": ttft, "decode_tok_s": decode,
            "device": info.device, "backend": info.backend, "details": info.details}


class AllowAll:
    """A constraint that allows every token: its mask is built, sent and applied every step."""

    def __init__(self, vocab: int):
        self._mask = np.ones(vocab, dtype=bool)

    def mask(self) -> np.ndarray:
        return self._mask

    def advance(self, token: int) -> None:
        pass


def run_batch(engine, n: int, prompt_tokens: int, decode_tokens: int, budget: int, constrained: int,
              salt: int) -> dict:
    """N sequences added at once, stepped until each has ``decode_tokens`` tokens."""
    vocab = engine.tokenizer.vocab_size
    prompts = [prompt_of(engine, prompt_tokens, salt + seq) for seq in range(n)]
    start = time.perf_counter()
    for seq, prompt in enumerate(prompts):
        constraint = AllowAll(vocab) if seq < constrained else None
        engine.add(seq, prompt, SamplingParams(temperature=0.0, constraint=constraint), decode_tokens)
    counts, first_at, steps = [0] * n, [None] * n, []
    while any(c < decode_tokens for c in counts):
        before = time.perf_counter()
        out = engine.step(budget)
        now = time.perf_counter()
        if len(out) == n and all(f is not None for f in first_at):
            steps.append(now - before)  # a step in which every sequence decodes
        for seq, _ in out:
            counts[seq] += 1
            if first_at[seq] is None:
                first_at[seq] = now
            if counts[seq] == decode_tokens:
                engine.remove(seq)
    end = time.perf_counter()
    decode_s = end - max(first_at)
    step = statistics.median(steps) if steps else None
    return {"batch": n, "decode_tok_s": n * (decode_tokens - 1) / decode_s if decode_s > 0 else None,
            "step_ms": 1000 * step if step else None, "step_tok_s": n / step if step else None,
            "ttft_first_s": min(first_at) - start, "ttft_last_s": max(first_at) - start,
            "total_s": end - start}


def measure_batches(name: str, path: Path, batches: list[int], args) -> dict:
    cls = engine_class(name)
    ctx = args.prompt_tokens + args.decode_tokens + 16
    engine = cls.load(path, EngineOptions(ctx_size=ctx, threads=args.threads, max_batch=max(batches),
                                          cache_bytes=0, quantize=args.quantize, warm_up=False,
                                          deterministic=args.deterministic))
    info = engine.info()
    rows = []
    for i, n in enumerate(batches):
        run_batch(engine, n, min(32, args.prompt_tokens), 4, args.prefill_budget,
                  min(args.constrained, n), salt=-1000 * (i + 1))  # warm-up for this shape
        samples = [run_batch(engine, n, args.prompt_tokens, args.decode_tokens, args.prefill_budget,
                             min(args.constrained, n), salt=1000 * (i * args.runs + r))
                   for r in range(args.runs)]
        rows.append({key: statistics.median(s[key] for s in samples) if samples[0][key] is not None
                     else None for key in samples[0]})
        print(f"{name} batch {n}: {rows[-1]['decode_tok_s']:.1f} tok/s summed over the wall time, "
              f"step {rows[-1]['step_ms']:.1f} ms", flush=True)
    engine.close()
    return {"engine": name, "path": str(path), "device": info.device, "backend": info.backend,
            "details": info.details, "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens, "prefill_budget": args.prefill_budget,
            "constrained": args.constrained, "runs": args.runs, "batches": rows}


def print_ttft_table(results: list[dict]) -> None:
    lengths = list(results[0]["ttft_s"])
    header = "| engine | backend | load s | " + " | ".join(f"TTFT {n} ms" for n in lengths) + \
        " | decode tok/s |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for r in results:
        cells = [r["engine"], r["backend"], f"{r['load_s']:.2f}",
                 *(f"{1000 * r['ttft_s'][n]:,.0f}" for n in lengths), f"{r['decode_tok_s']:.1f}"]
        print("| " + " | ".join(cells) + " |")


def print_batch_table(results: list[dict]) -> None:
    """tok/s summed over the sequences: over the wall time of the decode phase, and from the median
    step (N / step time: robust to stalls from other processes on a shared machine)."""
    print("| engine | backend | batch | tok/s (wall) | step ms (median) | tok/s (median step) | "
          "per sequence | vs smallest batch | TTFT first / last s |")
    print("|" + " --- |" * 9)
    for r in results:
        base = r["batches"][0]["step_tok_s"]
        for b in r["batches"]:
            rate = b["step_tok_s"]
            cells = [r["engine"], r["backend"], str(b["batch"]), f"{b['decode_tok_s']:,.1f}",
                     f"{b['step_ms']:.1f}" if rate else "-", f"{rate:,.1f}" if rate else "-",
                     f"{rate / b['batch']:.1f}" if rate else "-", f"{rate / base:.2f}x" if rate and base else "-",
                     f"{b['ttft_first_s']:.2f} / {b['ttft_last_s']:.2f}"]
            print("| " + " | ".join(cells) + " |")


def main() -> None:
    from mesh_llm.models import default_gguf, default_mlx_folder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["mlx", "llama", "both"], default="both")
    parser.add_argument("--mlx", type=Path, help="MLX model folder (default: the embedded model's)")
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: the embedded model's)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=None,
                        help="tokens decoded (default: 128; 64 in batch mode)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompt-lengths", default=PROMPT_LENGTHS,
                        help="TTFT mode: comma-separated prompt lengths in tokens")
    parser.add_argument("--ctx-size", type=int, default=4096, help="TTFT mode: the engine's context")
    parser.add_argument("--deterministic", action="store_true", help="the llama engine's bfloat16 KV cells")
    parser.add_argument("--batch", type=str, help="batch mode: comma-separated N, e.g. 1,4,8,16,32")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="batch mode: each prompt's length")
    parser.add_argument("--prefill-budget", type=int, default=2048, help="batch mode: prompt tokens a step")
    parser.add_argument("--constrained", type=int, default=0,
                        help="batch mode: sequences that carry an allow-everything constraint")
    parser.add_argument("--quantize", type=int, choices=[4, 8], help="batch mode: MLX quantizes on load")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    names = ["llama", "mlx"] if args.engine == "both" else [args.engine]
    paths = {"llama": lambda: args.gguf or default_gguf(), "mlx": lambda: args.mlx or default_mlx_folder()}
    if args.batch:
        args.decode_tokens = args.decode_tokens or 64
        batches = sorted({int(n) for n in args.batch.split(",")})
        results = [measure_batches(name, paths[name](), batches, args) for name in names]
        print_batch_table(results)
    else:
        args.decode_tokens = args.decode_tokens or 128
        args.prompt_lengths = [int(n) for n in args.prompt_lengths.split(",")]
        results = [measure(name, paths[name](), args) for name in names]
        print_ttft_table(results)
    if args.out:
        args.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                        "results": results}, indent=2))


if __name__ == "__main__":
    main()
