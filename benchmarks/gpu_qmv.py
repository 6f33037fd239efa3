"""4-bit decode products on CUDA: mesh-llm's kernel (``engines/mlx_quantized.py``) against MLX's own
``quantized_matmul``, then whole decode steps of random-weight Qwen2.5 shapes at 16 bits and at
4 bits with MLX's products and with the kernel, alternated in one process.

    python3 benchmarks/gpu_qmv.py [--shapes qwen2.5-0.5b,qwen2.5-7b] [--tokens 128] [--rounds 2]

(1) Every weight matrix of the shapes quantized to 4 bits in groups of 64, 1, 2, 4 and 8 activation
rows: microseconds a call and the quantized bytes read per second, each call on another copy of the
matrix so that none is served from L2; the largest error of each against a float32 product of the
dequantized weights. (2) A random-weight model of each shape (float16) reads a 512-token prompt,
then decodes ``--tokens`` greedy steps of each of ``--levels`` rows, the next step queued before the
last is read (as the engine runs on a GPU): at 16 bits (projections fused, as the engine serves
them), at 4 bits as mlx-lm's layers are, then fused and routed (``engines/mlx_quantized.py``) with
each way of making 2-7 rows' products (``VARIANTS``), alternated ``--rounds`` times. JSON to $OUT/qmv.json when OUT is set.
"""

from __future__ import annotations

from mesh_llm.engines.mlx_blas import prepare_mlx

prepare_mlx()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import qwen2  # noqa: E402

from gpu_gemv import SHAPES, arguments, decode, matrices, time_calls, write  # noqa: E402 - benchmarks/, the script's own folder
from mesh_llm.engines import mlx_quantized  # noqa: E402
from mesh_llm.engines.mlx_projections import fuse_projections  # noqa: E402

GROUP = 64


def products(shapes: list[str]) -> list[dict]:
    rows_out = []
    for name in shapes:
        for label, (n, k) in matrices(SHAPES[name]).items():
            size = n * k // 2 + 2 * (n * k // GROUP) * 2  # weights, scales and biases
            copies = min(2048, max(4, -(-512 * 2**20 // size)))  # up to 512 MiB: far past the 50 MB L2
            ws = []
            for c in range(copies):
                w = mx.random.normal((n, k), key=mx.random.key(c)).astype(mx.float16) * k ** -0.5
                ws.append(mx.quantize(w, GROUP, 4))
                mx.eval(ws[-1])
            for rows in (1, 2, 4, 8):
                x = mx.random.normal((rows, k), key=mx.random.key(99)).astype(mx.float16)
                reference = x.astype(mx.float32) @ mx.dequantize(*ws[0], GROUP, 4).astype(mx.float32).T

                def mlx(x, q):
                    return mx.quantized_matmul(x, *q, transpose=True, group_size=GROUP, bits=4)

                def kernel(x, q):
                    return mlx_quantized.qmv(x, *q, GROUP, 4)

                errors = {label_: mx.max(mx.abs(fn(x, ws[0]).astype(mx.float32) - reference)).item()
                          for label_, fn in (("mlx", mlx), ("kernel", kernel))}
                t_mlx, t_ker = time_calls(mlx, x, ws), time_calls(kernel, x, ws)
                variants = {}  # the kernel's settings against its defaults, where it matters most
                if n * k >= 3584 * 3584 and rows in (1, 8):
                    for per_warp in (1, 2, 4):
                        for unroll in (1, 2, 4):
                            variants[f"r{per_warp}u{unroll}"] = time_calls(
                                lambda x, q: mlx_quantized.qmv(x, *q, GROUP, 4, per_warp, unroll), x, ws) * 1e6
                row = {"shape": name, "matrix": label, "n": n, "k": k, "rows": rows,
                       "mlx_us": t_mlx * 1e6, "kernel_us": t_ker * 1e6,
                       "mlx_gbs": size / t_mlx / 1e9, "kernel_gbs": size / t_ker / 1e9,
                       "speedup": t_mlx / t_ker, "mlx_err": errors["mlx"], "kernel_err": errors["kernel"],
                       "scale": mx.max(mx.abs(reference)).item(), "variants_us": variants}
                rows_out.append(row)
                print(f"{name:13} {label:8} {n:6}x{k:<6} rows {rows}: MLX {row['mlx_us']:8.1f} us "
                      f"({row['mlx_gbs']:6.0f} GB/s)  kernel {row['kernel_us']:8.1f} us "
                      f"({row['kernel_gbs']:6.0f} GB/s)  x{row['speedup']:.2f}  "
                      f"err {errors['mlx']:.1e} / {errors['kernel']:.1e} of {row['scale']:.1e}", flush=True)
                if variants:
                    print("    variants (us): " + "  ".join(f"{v} {t:.1f}" for v, t in variants.items()), flush=True)
            del ws
            mx.clear_cache()
    return rows_out


# The engine's routed 4-bit products (rows flattened), 2-7 rows through the kernel from how many bytes
# of weights: never, the engine's default, always. (The first H100 runs, in
# benchmarks/results/h100-20261205/qmv-steps/, also had 2-7 rows padded to 8 for MLX's tiled kernel,
# the slowest, and one row over 16,384 outputs through the kernel, slower than MLX's.)
VARIANTS = {"mlx": 1 << 62, "default": mlx_quantized.KERNEL_BYTES, "kernel": 0}


def models(shapes: list[str], tokens: int, rounds: int, levels: list[int]) -> list[dict]:
    out = []

    def record(name, rows, r, label, model):
        step = decode(model, rows, tokens)
        weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        row = {"shape": name, "rows": rows, "round": r, "products": label, "step_ms": step * 1e3,
               "tok_s": rows / step, "weights_gb": weights / 1e9, "weight_gbs": weights / step / 1e9}
        out.append(row)
        print(f"{name:13} rows {rows:2} round {r} {label:22}: {row['step_ms']:6.2f} ms a step, "
              f"{row['tok_s']:6.0f} tok/s, {row['weight_gbs']:5.0f} GB/s of {row['weights_gb']:.2f} GB", flush=True)

    def build(name):
        model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1e6,
                                            **SHAPES[name]))
        model.set_dtype(mx.float16)
        return model

    for name in shapes:
        model = build(name)
        fuse_projections(model)  # as the engine serves 16-bit weights on a GPU
        mx.eval(model.parameters())
        for rows in levels:
            record(name, rows, 0, "16-bit, fused", model)
        del model
        mx.clear_cache()
        model = build(name)
        nn.quantize(model, GROUP, 4)
        mx.eval(model.parameters())
        for rows in levels:
            record(name, rows, 0, "4-bit MLX", model)
        fuse_projections(model)
        mlx_quantized.route(model, True)
        mx.eval(model.parameters())
        for rows in levels:
            for r in range(rounds):
                for label, threshold in VARIANTS.items():
                    mlx_quantized.KERNEL_BYTES = threshold
                    record(name, rows, r, f"4-bit fused, {label}", model)
        del model
        mx.clear_cache()
    return out


def main() -> None:
    args = arguments(__doc__, ("--levels", {"default": "1,2,4,8,16", "help": "decode rows"}))
    shapes = args.shapes.split(",")
    write({"products": [] if args.skip_products else products(shapes),
           "decode": models(shapes, args.tokens, args.rounds, [int(n) for n in args.levels.split(",")])}, "qmv.json")


if __name__ == "__main__":
    main()
