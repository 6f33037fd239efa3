"""What the server adds to a request's time to first token, against the raw engine (issue 11's
"<= 2 ms of TTFT").

    .venv/bin/python benchmarks/server_ttft.py [MODEL] [--engine llama|mlx] [--requests 40]
                                               [--prompt-tokens 64] [--out FILE]

The same token-id prompts (each a fresh one, the prompt cache off) sent two ways, alternated
request by request: to the engine loaded in this process (``add`` and ``step`` until the first
token, in steps of the budget the worker gives a newcomer's prompt when nothing else runs), and as
streamed ``/v1/completions`` to ``mesh-llm serve`` on the same model with the same settings (time
to the first streamed token, as a client sees it). On the llama engine a tiny random-weight GGUF
(``tests/tiny_gguf.py``) by default, so the engine's own time is small and the server's shows; on
the MLX engine the embedded SmolLM2's folder. Reports each way's median and the difference. One
token is asked for, so that no step of a request is still running when the next one comes (a CPU's
MLX decode step takes ~70 ms). Not a test.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from alternate import serve, write  # benchmarks/, the script's own folder
from hop_cpu import tiny_model

from mesh_llm.bench.backends import Server
from mesh_llm.engines import engine_class
from mesh_llm.engines.base import EngineOptions, SamplingParams
from mesh_llm.runtime.worker import IDLE_PREFILL_STEPS, prefill_budget

CONTEXT = 2048


def raw_ttft(engine, prompt: list[int], budget: int) -> float:
    """As the worker reads a newcomer's prompt with nothing else running: steps of ``budget`` tokens."""
    started = time.perf_counter()
    engine.add(0, prompt, SamplingParams(temperature=0), 1)
    while not engine.step(budget):
        pass
    ttft = time.perf_counter() - started
    engine.remove(0)
    return ttft


def http_ttft(http: httpx.Client, server: Server, prompt: list[int]) -> float:
    body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "ignore_eos": True}
    started = time.perf_counter()
    with http.stream("POST", server.url + "/v1/completions", json=body) as reply:
        for line in reply.iter_lines():
            if line.startswith('data: {"id"'):
                return time.perf_counter() - started
    raise RuntimeError("no token came")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="default: a tiny random-weight llama GGUF (llama "
                        "engine), the embedded SmolLM2's folder (MLX engine)")
    parser.add_argument("--engine", choices=["llama", "mlx"], default="llama")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="server-ttft-"))
    if args.model:
        model = args.model
    elif args.engine == "llama":
        model = str(tiny_model(logs))
    else:
        from mesh_llm.models import default_mlx_folder

        model = str(default_mlx_folder())
    rng = random.Random(7)
    times: dict[str, list[float]] = {"engine": [], "server": []}
    with ExitStack() as stack:
        server = serve(stack, "server", model, logs, ["--engine", args.engine, "--threads", "1", "--ctx-size",
                                                      str(CONTEXT), "--cache-bytes", "0"])
        engine = engine_class(args.engine).load(Path(model), EngineOptions(ctx_size=CONTEXT, threads=1,
                                                                          cache_bytes=0))
        stack.callback(engine.close)
        vocab = engine.tokenizer.vocab_size
        budget = IDLE_PREFILL_STEPS * prefill_budget(engine.info())
        http = stack.enter_context(httpx.Client(timeout=120))
        for k in range(args.requests + 2):  # the first pair warms both up
            prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
            pair = [("engine", lambda p: raw_ttft(engine, p, budget)),
                    ("server", lambda p: http_ttft(http, server, p))]
            for name, measure in pair[::1 if k % 2 == 0 else -1]:
                ttft = measure(prompt)
                if k >= 2:
                    times[name].append(ttft)
    medians = {name: 1000 * statistics.median(t) for name, t in times.items()}
    print(f"{args.engine}: TTFT median over {args.requests} requests of {args.prompt_tokens} tokens: engine "
          f"{medians['engine']:.2f} ms, server {medians['server']:.2f} ms, the server adds "
          f"{medians['server'] - medians['engine']:.2f} ms")
    write(args.out, args, medians_ms=medians, ttft_s=times)


if __name__ == "__main__":
    main()
