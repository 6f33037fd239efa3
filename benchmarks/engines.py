"""Raw engine speed, no server: load time, TTFT at several prompt lengths, and decode tok/s, for the
MLX and llama.cpp engines on the same model (by default the embedded SmolLM2, its imported MLX folder
against its GGUF). Not a test: run it on a quiet machine.

    .venv/bin/python benchmarks/engines.py [--runs 3] [--decode-tokens 128] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from mesh_llm.engines import engine_class
from mesh_llm.engines.base import EngineOptions, SamplingParams

PROMPT_LENGTHS = (128, 512, 2048)
GREEDY = SamplingParams(temperature=0.0)


def prompt_of(engine, length: int, salt: int) -> list[int]:
    """Real text tokens, cut to ``length``, starting with a salt so no prefix is shared between runs."""
    text = (f"Run {salt}. " + Path(__file__).read_text() * 20)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= length, "the text is too short for this prompt length"
    return ids[:length]


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


def measure(name: str, path: Path, runs: int, decode_tokens: int, threads: int | None) -> dict:
    cls = engine_class(name)
    start = time.perf_counter()
    engine = cls.load(path, EngineOptions(ctx_size=4096, threads=threads))
    load_s = time.perf_counter() - start
    info = engine.info()
    time_first_token(engine, prompt_of(engine, 32, -1))  # warm-up: first-use costs stay out
    salt = 0
    ttft = {}
    for length in PROMPT_LENGTHS:
        samples = []
        for _ in range(runs):
            salt += 1
            samples.append(time_first_token(engine, prompt_of(engine, length, salt)))
        ttft[length] = statistics.median(samples)
    decode = statistics.median(time_decode(engine, prompt_of(engine, 128, 1000 + i), decode_tokens)
                               for i in range(runs))
    engine.close()
    return {"engine": name, "path": str(path), "load_s": load_s, "ttft_s": ttft, "decode_tok_s": decode,
            "device": info.device, "backend": info.backend, "details": info.details}


def main() -> None:
    from mesh_llm.models import default_gguf, default_mlx_folder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mlx", type=Path, help="MLX model folder (default: the embedded model's)")
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: the embedded model's)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    targets = [("llama", args.gguf or default_gguf()), ("mlx", args.mlx or default_mlx_folder())]
    results = [measure(name, path, args.runs, args.decode_tokens, args.threads) for name, path in targets]
    header = "| engine | backend | load s | " + " | ".join(f"TTFT {n} ms" for n in PROMPT_LENGTHS) + \
        " | decode tok/s |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for r in results:
        cells = [r["engine"], r["backend"], f"{r['load_s']:.2f}",
                 *(f"{1000 * r['ttft_s'][n]:,.0f}" for n in PROMPT_LENGTHS), f"{r['decode_tok_s']:.1f}"]
        print("| " + " | ".join(cells) + " |")
    if args.out:
        args.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                        "results": results}, indent=2))


if __name__ == "__main__":
    main()
