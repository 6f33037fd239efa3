"""The fused decode attention (``engines/mlx_attention.py``) against MLX's own masked attention on a
CUDA GPU: the largest difference over random cases (head sizes, grouped heads, left paddings, keys
that are a view of a larger buffer, float16/bfloat16/float32), then the time of one call for a
0.5B-shaped and a 7B-shaped decode step.

    python3 benchmarks/gpu_attention.py        (GPU only; JSON to $OUT/attention.json when OUT is set)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from mesh_llm.engines.mlx_blas import ensure_fast_blas

ensure_fast_blas()

import mlx.core as mx  # noqa: E402

from mesh_llm.engines.mlx_attention import decode_attention  # noqa: E402


def case(batch, hq, hkv, size, length, dtype, seed):
    key = mx.random.key(seed)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    q = mx.random.normal((batch, hq, 1, size), key=k1).astype(dtype)
    buffer = 256 * ((length + 255) // 256)  # a cache's buffer, of which the first positions are read
    k = mx.random.normal((batch, hkv, buffer, size), key=k2).astype(dtype)
    v = mx.random.normal((batch, hkv, buffer, size), key=k3).astype(dtype)
    starts = mx.random.randint(0, length, (batch,), key=k4).astype(mx.int32)
    starts = mx.where(mx.arange(batch) == 0, 0, starts)  # one row unpadded
    mask = mx.arange(length)[None, None, None, :] >= starts[:, None, None, None]
    return q, k, v, starts, mask, length


def main() -> None:
    out = {"cases": [], "timing": []}
    worst = 0.0
    for i, (b, hq, hkv, d, length, dtype) in enumerate([
            (2, 14, 2, 64, 37, mx.float16), (8, 14, 2, 64, 700, mx.float16), (8, 28, 4, 128, 900, mx.float16),
            (5, 8, 8, 96, 300, mx.bfloat16), (3, 16, 4, 256, 129, mx.float16), (32, 14, 2, 64, 1500, mx.float16),
            (4, 14, 2, 64, 64, mx.float32), (1, 14, 2, 64, 1, mx.float16)]):
        q, k, v, starts, mask, n = case(b, hq, hkv, d, length, dtype, i)
        scale = d ** -0.5
        fused = decode_attention(q, k, v, scale, starts, length=n).astype(mx.float32)
        ref = mx.fast.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=scale,
                                                   mask=mask).astype(mx.float32)
        err = mx.max(mx.abs(fused - ref)).item()
        worst = max(worst, err if dtype != mx.bfloat16 else err / 8)
        row = {"batch": b, "heads": hq, "kv_heads": hkv, "head_size": d, "keys": length, "dtype": str(dtype),
               "max_abs_error": err}
        out["cases"].append(row)
        print(row, flush=True)
    for name, (b, hq, hkv, d, length) in {"0.5B, 8 rows": (8, 14, 2, 64, 700), "0.5B, 32 rows": (32, 14, 2, 64, 700),
                                          "7B, 8 rows": (8, 28, 4, 128, 700)}.items():
        q, k, v, starts, mask, n = case(b, hq, hkv, d, length, mx.float16, 99)
        scale = d ** -0.5
        timings = {}
        sdpa = mx.fast.scaled_dot_product_attention
        kv = (k[:, :, :n], v[:, :, :n])
        calls = {"fused": (decode_attention, (q, k, v, scale, starts), {"length": n}),
                 "mlx masked": (sdpa, (q, *kv), {"scale": scale, "mask": mask}),
                 "mlx unmasked": (sdpa, (q, *kv), {"scale": scale})}
        for label, (call, args, kwargs) in calls.items():
            def fn(call=call, args=args, kwargs=kwargs):
                return call(*args, **kwargs)

            for _ in range(3):
                mx.eval(fn())
            start = time.perf_counter()
            outs = [fn() for _ in range(200)]
            mx.eval(outs)
            timings[label] = 1e6 * (time.perf_counter() - start) / 200
        row = {"case": name, **{f"{k} us": round(t, 1) for k, t in timings.items()}}
        out["timing"].append(row)
        print(row, flush=True)
    print(f"largest error (bfloat16 / 8): {worst:.2e}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "attention.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
