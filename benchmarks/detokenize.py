"""What the worker's incremental detokenizer costs a token (``runtime/detokenize.py``), with and
without a stop string to watch for: the text of README.md through the embedded SmolLM2's Hugging
Face tokenizer, a token at a time.

    .venv/bin/python benchmarks/detokenize.py [--tokens 1000]

Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from mesh_llm.engines.hf_tokenizer import HFTokenizer
from mesh_llm.models import default_mlx_folder
from mesh_llm.runtime.detokenize import IncrementalDetokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000)
    args = parser.parse_args()
    tokenizer = HFTokenizer.from_folder(default_mlx_folder())
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)[: 50 + args.tokens]
    prompt, answer = ids[:50], ids[50:]
    for stop in ((), ("\n\n###",)):
        per_token = []
        for _ in range(5):
            detok = IncrementalDetokenizer(tokenizer, prompt, stop)
            started = time.perf_counter()
            for token in answer:
                detok.add(token)
            per_token.append((time.perf_counter() - started) / len(answer))
        print(f"stop strings {list(stop)}: {1e6 * statistics.median(per_token):.1f} µs a token "
              f"(median of 5 passes over {len(answer)} tokens)")


if __name__ == "__main__":
    main()
