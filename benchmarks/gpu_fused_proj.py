"""Fused q/k/v and gate/up projections (``engines/mlx_projections.py``) against mlx-lm's separate
ones, in one-stream decode loops.

    python3 benchmarks/gpu_fused_proj.py MODEL_FOLDER [--tokens 128] [--prompt 640] [--rounds 2]

Loads the model twice, one copy with separate projections (``MESH_LLM_FUSED_PROJECTIONS=0``, as the
engine loaded before) and one fused, and times pipelined one-stream loops of both, alternated
``--rounds`` times (``gpu_mlx_step.pipelined_steps``), then counts each one's kernels on a GPU
(``gpu_mlx_step.kernels``). Prints a table, and the largest logit difference between the two on the
same prompt.
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
from mesh_llm.engines.mlx_projections import fuse_projections  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=640)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    options = EngineOptions(ctx_size=4096)
    cuda_settings()  # MLX's own attention kernels and the kernel folder, as the engine has them
    os.environ["MESH_LLM_FUSED_PROJECTIONS"] = "0"  # the engine fuses on a GPU as it loads
    plain = load_any(args.model, options, None)[0]
    fused = load_any(args.model, options, None)[0]
    del os.environ["MESH_LLM_FUSED_PROJECTIONS"]
    layers = fuse_projections(fused)
    prompt = [(13 * j) % 1000 + 10 for j in range(args.prompt)]
    logits = []
    for model in (plain, fused):
        cache = make_prompt_cache(model)
        logits.append(model(mx.array(prompt)[None], cache=cache)[0, -1].astype(mx.float32))
    difference = mx.max(mx.abs(logits[0] - logits[1])).item()
    rows = []
    for _ in range(args.rounds + 1):  # the first round compiles kernels
        rows = [dict(hand_loop(m, prompt, args.tokens), case=name)
                for name, m in (("separate", plain), ("fused", fused))] + rows[:2 * args.rounds]
    print(f"{layers} layers fused; largest logit difference on the prompt: {difference:.2e}")
    print("| projections | step ms | build ms | submit ms | tok/s |\n| --- | --- | --- | --- | --- |")
    for r in rows[: 2 * args.rounds]:
        print(f"| {r['case']} | {r['step_ms']:.2f} | {r['build_ms']:.2f} | {r['submit_ms']:.2f} | "
              f"{1000 / r['step_ms']:.0f} |")
    if mx.cuda.is_available():
        for name, m in (("separate", plain), ("fused", fused)):
            k = kernels(m, prompt, 32, None)
            print(f"{name}: {k['kernels_per_step']:.0f} kernels, "
                  f"{k['gpu_ms_per_step']:.2f} ms of kernels a step")


if __name__ == "__main__":
    main()
