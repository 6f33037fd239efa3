"""4-bit decode products on CUDA: mesh-llm's kernels (``engines/mlx_quantized.py``: ``qmv`` on CUDA
cores, ``qmm`` on tensor cores) against MLX's own ``quantized_matmul``, then whole decode steps of
random-weight Qwen2.5 shapes at 16 bits and at 4 bits, each way of routing the products, alternated
in one process.

    python3 benchmarks/gpu_qmv.py [--shapes qwen2.5-0.5b,qwen2.5-7b] [--tokens 128] [--rounds 2]
                                  [--levels 1,2,4,8,16] [--kernels] [--skip-products]
                                  [--product-shapes SHAPES] [--product-rows 1,2,4,8,16,64,256,640]
                                  [--variants mlx,default,...]

(1) Every weight matrix of the shapes (and the fused q/k/v and gate/up the engine makes) quantized
to 4 bits in groups of 64, ``--product-rows`` activation rows: each method's GPU microseconds a call, read by
PyTorch's profiler with each call evaluated alone on another copy of the matrix (nothing overlaps,
nothing is served from L2), the quantized bytes read per second, and the largest error against a
float32 product of the dequantized weights; ``qmm`` with the warps a block its rule gives, and with
4, 8 and 16; and for a prompt's rows (over 16), MLX's product against the dequantized weights'.
(2) A random-weight model of each shape (float16) reads a 512-token prompt, then decodes
``--tokens`` greedy steps of each of ``--levels`` rows, the next
step queued before the last is read (as the engine runs on a GPU): at 16 bits (projections fused,
as the engine serves them), at 4 bits as mlx-lm's layers are, then fused and routed with each of
``VARIANTS``, alternated ``--rounds`` times; each step split into building, handing over and
reading, and with ``--kernels`` its kernels and CUDA calls counted and timed. JSON to $OUT/qmv.json
when OUT is set.
"""

from __future__ import annotations

from mesh_llm.engines.mlx_blas import prepare_mlx

prepare_mlx()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import qwen2  # noqa: E402

from gpu_gemv import SHAPES, arguments, decoder, matrices, write  # noqa: E402 - benchmarks/, the script's own folder
from gpu_mlx_step import kernel_times, pipelined_steps, profile_steps  # noqa: E402
from mesh_llm.engines import mlx_quantized  # noqa: E402
from mesh_llm.engines.mlx_projections import fuse_projections  # noqa: E402

GROUP = 64


def kernel_us(fn, x, ws) -> float:
    """GPU microseconds a call (its kernels' summed time, PyTorch's profiler), each call evaluated
    alone on the next copy of the matrix: nothing overlaps, and nothing is served from L2."""
    import torch  # noqa: PLC0415 - only here, after MLX has its kernels

    mx.eval([fn(x, w) for w in ws])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for w in ws:
            mx.eval(fn(x, w))
    return kernel_times(prof)["gpu_ms"] * 1000 / len(ws)


METHODS = {"mlx": lambda x, q: mx.quantized_matmul(x, *q, transpose=True, group_size=GROUP, bits=4),
           "qmv": lambda x, q: mlx_quantized.qmv(x, *q, GROUP, 4),
           "qmm": lambda x, q: mlx_quantized.qmm(x, *q, GROUP),
           **{f"qmm w{w}": lambda x, q, w=w: mlx_quantized.qmm(x, *q, GROUP, warps=w) for w in (4, 8, 16)},
           "dequantized": lambda x, q: x @ mx.dequantize(*q, GROUP, 4).T}


def takes(method: str, rows: int) -> bool:
    """Rows a method is timed at: qmv's 1-8, qmm's 1-16, the dequantized weights' a prompt's chunk."""
    return {"mlx": True, "qmv": rows <= 8, "dequantized": rows > 16}.get(method, rows <= 16)


def products(shapes: list[str], counts: list[int]) -> list[dict]:
    rows_out = []
    for name in shapes:
        found = matrices(SHAPES[name])
        h, i = SHAPES[name]["hidden_size"], SHAPES[name]["intermediate_size"]
        found.update({"q/k/v fused": (h + 2 * found["k/v"][0], h), "gate/up fused": (2 * i, h)})
        for label, (n, k) in found.items():
            size = n * k // 2 + 2 * (n * k // GROUP) * 2  # weights, scales and biases
            copies = min(256, max(4, -(-512 * 2**20 // size)))  # up to 512 MiB: far past the 50 MB L2
            ws = []
            for c in range(copies):
                w = mx.random.normal((n, k), key=mx.random.key(c)).astype(mx.float16) * k ** -0.5
                ws.append(mx.quantize(w, GROUP, 4))
                mx.eval(ws[-1])
            for rows in counts:
                x = mx.random.normal((rows, k), key=mx.random.key(99)).astype(mx.float16)
                reference = x.astype(mx.float32) @ mx.dequantize(*ws[0], GROUP, 4).astype(mx.float32).T
                row = {"shape": name, "matrix": label, "n": n, "k": k, "rows": rows,
                       "scale": mx.max(mx.abs(reference)).item()}
                for method, fn in METHODS.items():
                    if not takes(method, rows):
                        continue
                    row[f"{method}_err"] = mx.max(mx.abs(fn(x, ws[0]).astype(mx.float32) - reference)).item()
                    row[f"{method}_us"] = us = kernel_us(fn, x, ws)
                    row[f"{method}_gbs"] = size / us / 1e3
                rows_out.append(row)
                print(f"{name:13} {label:13} {n:6}x{k:<6} rows {rows:2}: " + "  ".join(
                    f"{m} {row[m + '_us']:7.1f} us ({row[m + '_gbs']:5.0f} GB/s, err {row[m + '_err']:.1e})"
                    for m in METHODS if m + "_us" in row) + f" of {row['scale']:.1e}", flush=True)
            del ws
            mx.clear_cache()
    return rows_out


# The engine's routed 4-bit products (rows flattened), each way of choosing the kernel: MLX's alone;
# the engine's default; every 2-8-row product through qmv (CUDA cores); every 2-16-row, or 1-16-row,
# product through qmm (tensor cores); the default with one row through qmm for weights of 24 MB and
# more (the 7B's gate/up, down and output layer). Settings of engines/mlx_quantized.py.
DEFAULT = {name: getattr(mlx_quantized, name)
           for name in ("KERNEL_BYTES", "MMA_BYTES", "ONE_ROW_BYTES", "_TILED_ROWS", "MMA_ROWS")}
NEVER = 1 << 62
ALL = dict(DEFAULT, KERNEL_BYTES=0, MMA_BYTES=0)
VARIANTS = {"mlx": dict(DEFAULT, KERNEL_BYTES=NEVER, ONE_ROW_BYTES=NEVER, MMA_ROWS=()),
            "default": DEFAULT,
            "qmv-2-8": dict(ALL, _TILED_ROWS=9, MMA_ROWS=()),
            "qmm-2-16": dict(ALL, MMA_ROWS=range(2, 17)),
            "qmm-1-16": dict(ALL, ONE_ROW_BYTES=0),
            "qmm-1-big": dict(DEFAULT, ONE_ROW_BYTES=24 * 2**20)}


def profile(model, rows: int, tokens: int = 16) -> dict:
    """A synchronous decode step's GPU kernels and the host's CUDA calls (PyTorch's profiler)."""
    found = profile_steps(*decoder(model, rows), tokens)
    return {"kernels": found["kernels"] / tokens, "gpu_ms": found["gpu_ms"] / tokens,
            "api_ms": found["api_ms"] / tokens,
            "top_us": [(n, t / tokens) for n, t in found["top"]],
            "api_top_us": [(n, t / tokens) for n, t in found["api_top"]]}


def models(shapes: list[str], tokens: int, rounds: int, levels: list[int], kernels: bool,
           variants: list[str]) -> list[dict]:
    out = []

    def record(name, rows, r, label, model):
        split = pipelined_steps(*decoder(model, rows), tokens)
        step = split["step_ms"] / 1000
        weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        row = {"shape": name, "rows": rows, "round": r, "products": label, **split,
               "tok_s": rows / step, "weights_gb": weights / 1e9, "weight_gbs": weights / step / 1e9}
        print(f"{name:13} rows {rows:2} round {r} {label:26}: {row['step_ms']:6.2f} ms a step (build "
              f"{split['build_ms']:.2f}, submit {split['submit_ms']:.2f}, read {split['read_ms']:.2f}), "
              f"{row['tok_s']:6.0f} tok/s, {row['weight_gbs']:5.0f} GB/s of {row['weights_gb']:.2f} GB", flush=True)
        if kernels and r == 0:
            row["profile"] = k = profile(model, rows)
            print(f"    {k['kernels']:.0f} kernels, {k['gpu_ms']:.2f} ms of GPU, {k['api_ms']:.2f} ms of CUDA "
                  "calls a step; kernels: " + "; ".join(f"{n} {t:.0f} us" for n, t in k["top_us"][:6])
                  + "\n    calls: " + "; ".join(f"{n} {t:.0f} us" for n, t in k["api_top_us"][:5]), flush=True)
        out.append(row)

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
                for label in variants:
                    for attribute, value in VARIANTS[label].items():
                        setattr(mlx_quantized, attribute, value)
                    record(name, rows, r, f"4-bit fused, {label}", model)
        del model
        mx.clear_cache()
    return out


def main() -> None:
    args = arguments(__doc__, ("--levels", {"default": "1,2,4,8,16", "help": "decode rows"}),
                     ("--kernels", {"action": "store_true", "help": "profile each case's kernels (torch)"}),
                     ("--product-shapes", {"help": "the shapes whose products are timed (--shapes')"}),
                     ("--product-rows", {"default": "1,2,4,8,16,64,256,640", "help": "their rows"}),
                     ("--variants", {"default": ",".join(VARIANTS), "help": "the routings whose steps are timed"}))
    shapes = args.shapes.split(",")
    write({"products": [] if args.skip_products else products(
               (args.product_shapes or args.shapes).split(","), [int(n) for n in args.product_rows.split(",")]),
           "decode": models(shapes, args.tokens, args.rounds, [int(n) for n in args.levels.split(",")],
                            args.kernels, args.variants.split(","))}, "qmv.json")


if __name__ == "__main__":
    main()
