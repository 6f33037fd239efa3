"""Fused q/k/v and gate/up projections against mlx-lm's separate ones, in one-stream decode loops.

    python3 benchmarks/gpu_fused_proj.py MODEL_FOLDER [--tokens 128] [--prompt 640] [--rounds 2]

An experiment the engine does not use yet. On the H200 one MLX stream of a small model is bound by
the host, at 6-13 µs of MLX's hand-over a kernel (``benchmarks/results/h200-host-20261203/``); a
llama or qwen2 layer runs 17 kernels a token, 3 of them products that could be one: q, k and v read
the same input, and so do gate and up. This loads the model twice, fuses one copy's projections
(one ``Linear`` over the concatenated weights, split after: views, no copy) and times pipelined
one-stream loops of both, alternated ``--rounds`` times (``gpu_mlx_step.pipelined_steps``), then
counts each one's kernels on a GPU (``gpu_mlx_step.kernels``). Prints a table, and the largest logit
difference between the two on the same prompt.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpu_mlx_step import hand_loop, kernels  # benchmarks/, the script's own folder

import mlx.core as mx  # noqa: E402 - gpu_mlx_step set up MLX's BLAS first
from mlx import nn  # noqa: E402
from mlx_lm.models.activations import swiglu  # noqa: E402
from mlx_lm.models.base import scaled_dot_product_attention  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mesh_llm.engines.base import EngineOptions  # noqa: E402
from mesh_llm.engines.mlx_load import cuda_settings, load_any  # noqa: E402


def fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    out = nn.Linear(1, 1, bias="bias" in parts[0])
    out.weight = mx.concatenate([p.weight for p in parts])
    if "bias" in parts[0]:
        out.bias = mx.concatenate([p.bias for p in parts])
    return out


def fuse(model) -> int:
    """Fuse the projections of every layer whose attention and MLP are mlx-lm's plain llama/qwen2
    ones with float weights; returns the layers fused."""
    fused = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        if any(type(p) is not nn.Linear for p in projections):
            continue
        nq, nk = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        attn.qkv_proj, attn.qkv_split = fused_linear(projections[:3]), [nq, nq + nk]
        mlp.gate_up_proj = fused_linear(projections[3:])
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
        attn.__class__ = type("Fused" + type(attn).__name__, (type(attn),), {"__call__": _attention})
        mlp.__class__ = type("Fused" + type(mlp).__name__, (type(mlp),), {"__call__": _mlp})
        fused += 1
    mx.eval(model.parameters())
    return fused


def _attention(self, x, mask=None, cache=None):
    """mlx-lm's llama/qwen2 attention, with q, k and v from one product."""
    b, length, _ = x.shape
    q, k, v = mx.split(self.qkv_proj(x), self.qkv_split, axis=-1)
    queries = q.reshape(b, length, self.n_heads, -1).transpose(0, 2, 1, 3)
    keys = k.reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = v.reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    offset = cache.offset if cache is not None else 0
    queries, keys = self.rope(queries, offset=offset), self.rope(keys, offset=offset)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


def _mlp(self, x):
    gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
    return self.down_proj(swiglu(gate, up))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=640)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    options = EngineOptions(ctx_size=4096)
    cuda_settings()  # MLX's own attention kernels and the kernel folder, as the engine has them
    plain = load_any(args.model, options, None)[0]
    fused = load_any(args.model, options, None)[0]
    layers = fuse(fused)
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
            print(f"{name}: {k['kernels_per_step']:.0f} kernels, {k['gpu_ms_per_step']:.2f} ms of kernels a step")


if __name__ == "__main__":
    main()
