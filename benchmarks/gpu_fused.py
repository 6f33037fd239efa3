"""The engine's fused layers (``engines/mlx_fused.py``) against mlx-lm's own, in one-stream decode
loops.

    python3 benchmarks/gpu_fused.py MODEL_FOLDER [--tokens 128] [--prompt 640] [--rounds 2]

Loads the model three times, as the engine loads it with ``MESH_LLM_FUSED_PROJECTIONS`` and
``MESH_LLM_FUSED_NORMS`` set: mlx-lm's layers (both 0), fused projections alone, and fused projections
and norms (the GPU default). Times pipelined one-stream loops of each, alternated ``--rounds`` times
(``gpu_mlx_step.hand_loop``), then counts each one's kernels on a GPU (``gpu_mlx_step.kernels``).
Prints a table, and each one's largest logit difference from mlx-lm's layers on the same prompt.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gpu_mlx_step import hand_loop, kernels  # benchmarks/, the script's own folder

import mlx.core as mx  # noqa: E402 - gpu_mlx_step set up MLX's BLAS first
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mesh_llm.engines.base import EngineOptions  # noqa: E402
from mesh_llm.engines.mlx_load import cuda_settings, load_any  # noqa: E402

VARIANTS = {  # name: the engine's switches as it loads
    "separate": {"MESH_LLM_FUSED_PROJECTIONS": "0", "MESH_LLM_FUSED_NORMS": "0"},
    "projections": {"MESH_LLM_FUSED_NORMS": "0"},
    "projections+norms": {},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=640)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    options = EngineOptions(ctx_size=4096)
    cuda_settings()  # MLX's own attention kernels and the kernel folder, as the engine has them
    models = {}
    for name, switches in VARIANTS.items():
        os.environ.update(switches)
        models[name] = load_any(args.model, options, None)
        for key in switches:
            del os.environ[key]
    prompt = [(13 * j) % 1000 + 10 for j in range(args.prompt)]
    logits = {}
    for name, (model, *_) in models.items():
        logits[name] = model(mx.array(prompt)[None], cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
    for name, (_, _, _, _, details, _) in models.items():
        difference = mx.max(mx.abs(logits[name] - logits["separate"])).item()
        print(f"{name}: {details.get('projections', '-')}; {details.get('norms', '-')}; "
              f"largest logit difference from separate on the prompt: {difference:.2e}")
    rows = []
    for _ in range(args.rounds + 1):  # the first round compiles kernels
        rows = [dict(hand_loop(m[0], prompt, args.tokens), case=name)
                for name, m in models.items()] + rows[:len(models) * args.rounds]
    print("| layers | step ms | build ms | submit ms | tok/s |\n| --- | --- | --- | --- | --- |")
    for r in rows[: len(models) * args.rounds]:
        print(f"| {r['case']} | {r['step_ms']:.2f} | {r['build_ms']:.2f} | {r['submit_ms']:.2f} | "
              f"{1000 / r['step_ms']:.0f} |")
    if mx.cuda.is_available():
        for name, m in models.items():
            k = kernels(m[0], prompt, 32, None)
            print(f"{name}: {k['kernels_per_step']:.0f} kernels, "
                  f"{k['gpu_ms_per_step']:.2f} ms of kernels a step")


if __name__ == "__main__":
    main()
