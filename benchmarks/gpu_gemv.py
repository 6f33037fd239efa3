"""A decode-time product kernel for few rows and small float weights on CUDA, against MLX's own
``x @ w.T``: the products alone, then whole decode steps of in-memory Qwen2.5 shapes with it off and
on, alternated in one process. An experiment, not part of the engine (below: why).

    python3 benchmarks/gpu_gemv.py [--shapes qwen2.5-0.5b,qwen2.5-7b] [--tokens 128] [--rounds 2]

MLX 0.32's CUDA backend has a matrix-vector kernel for one activation row and sends 2 rows and more
to cuBLAS, whose products of a few rows with a small matrix cost nearly as much as with a large one
(the 0.5B shape's 896x896 layer: 18-25 us for 2-8 rows against 6.4 for one). :func:`matmul_t`
computes ``x @ w.T`` for 2 to ``MAX_ROWS`` rows in one pass over the weights: 16-byte loads, four
weight rows per warp sharing each activation load, float accumulation, the bias in the same pass.

(1) Every weight matrix of the shapes, 1, 2, 4 and 8 activation rows: microseconds a call and the
weight bytes read per second, each call on another copy of the matrix so that none is served from
L2; the largest error of each against a float32 product. (2) A random-weight model of each shape
(float16) reads a 512-token prompt, then decodes ``--tokens`` greedy steps of 1 and of 8 rows, the
next step queued before the last is read, with MLX's products and with the kernel where it applies
(2-8 rows, weights up to ``MAX_WEIGHT_BYTES``), alternated ``--rounds`` times. JSON to
$OUT/gemv.json when OUT is set.

Measured on the H200 (2026-12-03, ``benchmarks/results/h200-gemv-20261203/``): the kernel led
cuBLAS 1.2-1.9x for 2-4 rows on small matrices, lost to MLX's one-row kernel and to cuBLAS on
large matrices from 4 rows (0.33-0.6x at 8 rows on the 7B shape's MLP), and whole steps moved
within the machine's noise (0.5B, 8 rows: 1.24-1.8x in some rounds, 0.97x in others). Through the
server, 8 streams on the 0.5B shape summed 833 tok/s with it against 868 without, while compiling
its variants at every start added 4.5 s to the warm-up. So the engine does not use it.
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
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import qwen2  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from gpu_mlx_step import pipelined_steps  # noqa: E402 - benchmarks/, the script's own folder


SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False),
}

MAX_ROWS = 8
MAX_WEIGHT_BYTES = 16 * 2**20  # the 0.5B shape's layers (at most 8.7 MB) and the 7B shape's k/v (3.7 MB)
_WARPS = 4  # warps per block
_WROWS = 4  # weight rows per warp
_DTYPES = (mx.float16, mx.bfloat16, mx.float32)

_SOURCE = """
    constexpr int VEC = 16 / sizeof(T);  // elements in one 16-byte load
    constexpr int CHUNKS = K / VEC;
    const int rows = x_shape[0];
    const int n_out = w_shape[0];
    const int lane = threadIdx.x & 31;
    const int first = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * WROWS;
    if (first >= n_out) return;  // the whole warp

    const T* wr[WROWS];
#pragma unroll
    for (int r = 0; r < WROWS; ++r) wr[r] = w + (size_t)min(first + r, n_out - 1) * K;
    float acc[WROWS][MAXM];
#pragma unroll
    for (int r = 0; r < WROWS; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) acc[r][m] = 0.0f;

    const bool aligned = ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(w)) & 15) == 0;
    if (aligned) {
#pragma unroll 2
        for (int c = lane; c < CHUNKS; c += 32) {
            uint4 wv[WROWS];
#pragma unroll
            for (int r = 0; r < WROWS; ++r) wv[r] = __ldg(reinterpret_cast<const uint4*>(wr[r]) + c);
#pragma unroll
            for (int m = 0; m < MAXM; ++m) {
                if (m < rows) {
                    const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * K) + c);
                    const T* xs = reinterpret_cast<const T*>(&xv);
#pragma unroll
                    for (int r = 0; r < WROWS; ++r) {
                        const T* ws = reinterpret_cast<const T*>(&wv[r]);
                        float s = acc[r][m];
#pragma unroll
                        for (int i = 0; i < VEC; ++i) s += static_cast<float>(ws[i]) * static_cast<float>(xs[i]);
                        acc[r][m] = s;
                    }
                }
            }
        }
    } else {  // a view at an odd offset: element by element, still correct
        for (int k = lane; k < K; k += 32) {
#pragma unroll
            for (int m = 0; m < MAXM; ++m) {
                if (m < rows) {
                    const float xk = static_cast<float>(x[(size_t)m * K + k]);
#pragma unroll
                    for (int r = 0; r < WROWS; ++r) acc[r][m] += static_cast<float>(wr[r][k]) * xk;
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < WROWS; ++r) {
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            float s = acc[r][m];
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffff, s, offset);
            acc[r][m] = s;
        }
    }
    // every lane holds every sum now: lane r * MAXM + m writes row r's product with activation m
#pragma unroll
    for (int r = 0; r < WROWS; ++r) {
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            const int n = first + r;
            if (lane == r * MAXM + m && n < n_out && m < rows) {
                out[(size_t)m * n_out + n] = static_cast<T>(acc[r][m] BIAS);
            }
        }
    }
"""

_kernels: dict[bool, object] = {}
_templates: dict[tuple, list] = {}


def _kernel(has_bias: bool):
    if has_bias not in _kernels:
        _kernels[has_bias] = mx.fast.cuda_kernel(
            name="mesh_llm_gemv_bias" if has_bias else "mesh_llm_gemv",
            input_names=["x", "w", "bias"] if has_bias else ["x", "w"],
            output_names=["out"],
            source=_SOURCE.replace("BIAS", "+ static_cast<float>(bias[n])" if has_bias else ""),
        )
    return _kernels[has_bias]


def applies(x: mx.array, w: mx.array) -> bool:
    """Whether :func:`matmul_t` computes ``x @ w.T`` for these operands."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    return (2 <= rows <= MAX_ROWS and w.ndim == 2 and w.nbytes <= MAX_WEIGHT_BYTES
            and x.shape[-1] == w.shape[1] and x.dtype == w.dtype and w.dtype in _DTYPES
            and w.shape[1] % (16 // w.dtype.size) == 0)


def matmul_t(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """``x @ w.T (+ bias)`` for x (..., K) with at most ``MAX_ROWS`` rows and w (N, K), as MLX's own
    product gives it up to float rounding (accumulated in float32)."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    rows, n = flat.shape[0], w.shape[0]
    inputs = [flat, w] if bias is None else [flat, w, bias if bias.dtype == x.dtype else bias.astype(x.dtype)]
    blocks = -(-n // (_WARPS * _WROWS))
    key = (x.dtype, k)
    if (template := _templates.get(key)) is None:  # built once: a model makes hundreds of calls a step
        template = _templates[key] = [("T", x.dtype), ("K", k), ("MAXM", MAX_ROWS), ("WARPS", _WARPS),
                                      ("WROWS", _WROWS)]
    (out,) = _kernel(bias is not None)(
        inputs=inputs,
        template=template,
        grid=(blocks * 32 * _WARPS, 1, 1),
        threadgroup=(32 * _WARPS, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(*lead, n)


class FastLinear(nn.Linear):
    """An ``nn.Linear`` whose calls of 2 to ``MAX_ROWS`` rows use :func:`matmul_t` where it applies."""

    def __call__(self, x: mx.array) -> mx.array:
        w = self["weight"]
        if applies(x, w):
            return matmul_t(x, w, self["bias"] if "bias" in self else None)
        return super().__call__(x)


class FastEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose ``as_linear`` (tied output weights) uses :func:`matmul_t`."""

    def as_linear(self, x: mx.array) -> mx.array:
        if applies(x, self.weight):
            return matmul_t(x, self.weight)
        return super().as_linear(x)


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
                for method, fn in (("mlx", lambda x, w: x @ w.T), ("kernel", matmul_t)):
                    errors[method] = mx.max(mx.abs(fn(x, ws[0]).astype(mx.float32) - reference)).item()
                t_mlx = time_calls(lambda x, w: x @ w.T, x, ws)
                t_ker = time_calls(matmul_t, x, ws)
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
                module.__class__ = FastLinear
            elif type(module) is nn.Embedding:
                module.__class__ = FastEmbedding
        elif type(module) is FastLinear:
            module.__class__ = nn.Linear
        elif type(module) is FastEmbedding:
            module.__class__ = nn.Embedding


def decoder(model, rows: int, prompt: int = 512):
    """``rows`` random prompts read into fresh caches; returns a greedy decode step and its first input."""
    cache = make_prompt_cache(model)
    ids = mx.random.randint(0, 1000, (rows, prompt), key=mx.random.key(rows))
    model(ids, cache=cache)
    mx.eval([c.state for c in cache])

    def forward(y):
        return mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)

    return forward, ids[:, -1]


def decode(model, rows: int, tokens: int, prompt: int = 512) -> float:
    """Seconds a decode step of ``rows`` rows, median, pipelined as the engine runs on a GPU."""
    return pipelined_steps(*decoder(model, rows, prompt), tokens)["step_ms"] / 1000


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


def arguments(doc: str, *extra: tuple[str, dict]) -> argparse.Namespace:
    """The command line this script and gpu_qmv.py share, plus ``extra`` options."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-7b")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-products", action="store_true")
    for flag, options in extra:
        parser.add_argument(flag, **options)
    return parser.parse_args()


def write(result: dict, name: str) -> None:
    """Into $OUT, where it is set (the device's folder that comes back)."""
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    args = arguments(__doc__)
    shapes = args.shapes.split(",")
    write({"products": [] if args.skip_products else products(shapes),
           "decode": models(shapes, args.tokens, args.rounds)}, "gemv.json")


if __name__ == "__main__":
    main()
