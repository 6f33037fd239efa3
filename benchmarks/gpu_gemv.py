"""The decode product (engines/mlx_gemv.py) against MLX's own ``x @ w.T`` on CUDA, then whole decode
steps of in-memory Qwen2.5 shapes with it off and on, alternated in one process.

    python3 benchmarks/gpu_gemv.py [--shapes qwen2.5-0.5b,qwen2.5-7b] [--tokens 128] [--rounds 2]

(1) Every weight matrix of the shapes, 1, 2, 4 and 8 activation rows: microseconds a call and the
weight bytes read per second, each call on another copy of the matrix so that none is served from
L2; the largest error of each against a float32 product. (2) A random-weight model of each shape
(float16) reads a 512-token prompt, then decodes ``--tokens`` greedy steps of 1 and of 8 rows, the
next step queued before the last is read, with MLX's product and with the kernel, alternated
``--rounds`` times. The floor: weight bytes ÷ the GPU's bandwidth. JSON to $OUT/gemv.json when OUT
is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from mesh_llm.engines.mlx_blas import prepare_mlx

prepare_mlx()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models import qwen2  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mesh_llm.engines import mlx_gemv  # noqa: E402

SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False),
}


def matrices(shape: dict) -> dict[str, tuple[int, int]]:
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return {"q/o": (h, h), "k/v": (kv, h), "gate/up": (i, h), "down": (h, i),
            "lm_head": (shape["vocab_size"], h)}


def time_calls(fn, xs, ws, repeats: int = 5) -> float:
    """Median seconds a call, each call of a round on the next copy of the matrix."""
    mx.eval([fn(xs, w) for w in ws])
    times = []
    for _ in range(repeats):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval([fn(xs, w) for w in ws])
        mx.synchronize()
        times.append((time.perf_counter() - start) / len(ws))
    return statistics.median(times)


def products(shapes: list[str]) -> list[dict]:
    rows_out = []
    for name in shapes:
        for label, (n, k) in matrices(SHAPES[name]).items():
            size = n * k * 2
            copies = max(4, -(-512 * 2**20 // size))  # 512 MiB of copies: far past the 50 MB L2
            ws = [mx.random.normal((n, k), key=mx.random.key(c)).astype(mx.float16) * k ** -0.5
                  for c in range(copies)]
            mx.eval(ws)
            for rows in (1, 2, 4, 8):
                x = mx.random.normal((rows, k), key=mx.random.key(99)).astype(mx.float16)
                reference = x.astype(mx.float32) @ ws[0].astype(mx.float32).T
                errors = {}
                for method, fn in (("mlx", lambda x, w: x @ w.T), ("kernel", mlx_gemv.matmul_t)):
                    errors[method] = mx.max(mx.abs(fn(x, ws[0]).astype(mx.float32) - reference)).item()
                t_mlx = time_calls(lambda x, w: x @ w.T, x, ws)
                t_ker = time_calls(mlx_gemv.matmul_t, x, ws)
                row = {"shape": name, "matrix": label, "n": n, "k": k, "rows": rows,
                       "mlx_us": t_mlx * 1e6, "kernel_us": t_ker * 1e6,
                       "mlx_gbs": size / t_mlx / 1e9, "kernel_gbs": size / t_ker / 1e9,
                       "speedup": t_mlx / t_ker, "mlx_err": errors["mlx"], "kernel_err": errors["kernel"]}
                rows_out.append(row)
                print(f"{name:13} {label:8} {n:6}x{k:<6} rows {rows}: MLX {row['mlx_us']:8.1f} us "
                      f"({row['mlx_gbs']:6.0f} GB/s)  kernel {row['kernel_us']:8.1f} us "
                      f"({row['kernel_gbs']:6.0f} GB/s)  x{row['speedup']:.2f}  "
                      f"err {errors['mlx']:.1e} / {errors['kernel']:.1e}", flush=True)
            del ws
    return rows_out


def set_kernel(model: nn.Module, on: bool) -> None:
    for _, module in model.named_modules():
        if on:
            if type(module) is nn.Linear:
                module.__class__ = mlx_gemv.FastLinear
            elif type(module) is nn.Embedding:
                module.__class__ = mlx_gemv.FastEmbedding
        elif type(module) is mlx_gemv.FastLinear:
            module.__class__ = nn.Linear
        elif type(module) is mlx_gemv.FastEmbedding:
            module.__class__ = nn.Embedding


def decode(model, rows: int, tokens: int, prompt: int = 512) -> float:
    """Seconds a decode step of ``rows`` rows, median, pipelined as the engine runs on a GPU."""
    cache = make_prompt_cache(model)
    ids = mx.random.randint(0, 1000, (rows, prompt), key=mx.random.key(rows))
    model(ids, cache=cache)
    mx.eval([c.state for c in cache])

    def forward(y):
        return mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)

    pending = forward(ids[:, -1])
    mx.async_eval(pending)
    times, last = [], time.perf_counter()
    for _ in range(tokens):
        nxt = forward(pending)
        mx.async_eval(nxt)
        pending.tolist()
        pending = nxt
        now = time.perf_counter()
        times.append(now - last)
        last = now
    pending.tolist()
    return statistics.median(times[4:])


def models(shapes: list[str], tokens: int, rounds: int) -> list[dict]:
    out = []
    for name in shapes:
        model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1e6,
                                            **SHAPES[name]))
        model.set_dtype(mx.float16)
        mx.eval(model.parameters())
        weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        print(f"{name}: {weights / 1e9:.2f} GB of weights", flush=True)
        for rows in (1, 8):
            for r in range(rounds):
                for on in (False, True):
                    set_kernel(model, on)
                    step = decode(model, rows, tokens)
                    row = {"shape": name, "rows": rows, "round": r, "kernel": on, "step_ms": step * 1e3,
                           "tok_s": rows / step, "weights_gb": weights / 1e9,
                           "weight_gbs": weights / step / 1e9}
                    out.append(row)
                    print(f"{name:13} rows {rows} round {r} {'kernel' if on else 'MLX   '}: "
                          f"{row['step_ms']:.2f} ms a step, {row['tok_s']:.0f} tok/s, "
                          f"{row['weight_gbs']:.0f} GB/s of weights", flush=True)
        set_kernel(model, False)
        del model
        mx.clear_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-7b")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-products", action="store_true")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    result = {"products": [] if args.skip_products else products(shapes),
              "decode": models(shapes, args.tokens, args.rounds)}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemv.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
