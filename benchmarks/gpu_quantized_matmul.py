"""MLX's own quantized products (``mx.quantized_matmul``) on this device against the product of the
dequantized weights, by element type, width, outputs and rows: where the GPU test of a 4-bit model
found MLX's logits all zero on the tests' tiny float32 llama (64 wide) on an H100.

    python3 benchmarks/gpu_quantized_matmul.py [--out FILE]

Prints one line per case (the largest error against the reference's largest value) and writes them
as JSON. Not a test.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import mlx.core as mx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    print(mx.__version__, mx.default_device())
    results = []
    bits, group = 4, 64
    for dtype, k, n, rows in itertools.product((mx.float32, mx.float16, mx.bfloat16), (64, 896), (64, 4864),
                                               (1, 3, 40)):
        w = mx.random.normal((n, k), key=mx.random.key(k + n)).astype(dtype)
        q = mx.quantize(w, group_size=group, bits=bits)
        x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(dtype)
        out = mx.quantized_matmul(x, *q, transpose=True, group_size=group, bits=bits)
        ref = x.astype(mx.float32) @ mx.dequantize(*q, group_size=group, bits=bits).astype(mx.float32).T
        error = mx.max(mx.abs(out.astype(mx.float32) - ref)).item()
        scale = mx.max(mx.abs(ref)).item()
        zero = mx.max(mx.abs(out)).item() == 0
        case = {"dtype": str(dtype).rsplit(".", 1)[-1], "bits": bits, "k": k, "n": n, "rows": rows,
                "error": error, "scale": scale, "all_zero": zero}
        results.append(case)
        flag = "ZERO" if zero else ("ok" if error <= 0.05 * scale else "BAD")  # NaN: BAD
        print(f"{case['dtype']:8} {bits}b k={k:4} n={n:5} rows={rows:2}: error {error:.4g} of {scale:.4g} {flag}",
              flush=True)
    bad = [c for c in results if c["all_zero"] or not c["error"] <= 0.05 * c["scale"]]
    print(f"{len(bad)} of {len(results)} cases wrong")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
