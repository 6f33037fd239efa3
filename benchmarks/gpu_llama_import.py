"""Why the CUDA build of llama.cpp segfaults at model load when numpy was imported first (issue 9).

Run on the GPU machine after `.device/llama/build-llama.sh`, with llama-cpp-python's Python part on
PYTHONPATH and LLAMA_CPP_LIB_PATH set (benchmarks/gpu_session.sh does both):

    python3 benchmarks/gpu_llama_import.py MODEL.gguf

Each variant runs in a fresh interpreter: some libraries are loaded first, then llama_cpp, then the
model is loaded with every layer on the GPU and one token decoded. A variant that crashes is run once
more under cuda-gdb (the machine has no gdb) for the native backtrace. Prints one line per variant,
then the backtraces; writes everything as JSON to $OUT/llama-import.json when OUT is set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

LOAD = textwrap.dedent("""
    import ctypes, os, sys
    import llama_cpp.llama_cpp as ll
    ll.llama_backend_init()
    mp = ll.llama_model_default_params(); mp.n_gpu_layers = int(os.environ.get('NGL', '99'))
    model = ll.llama_model_load_from_file(sys.argv[1].encode(), mp)
    assert model, "load failed"
    cp = ll.llama_context_default_params(); cp.n_ctx = 256
    ctx = ll.llama_init_from_model(model, cp)
    batch = ll.llama_batch_get_one((ll.llama_token * 2)(1, 2), 2)
    assert ll.llama_decode(ctx, batch) == 0
    print("decoded")
""")

VARIANTS = {
    "llama first": ("", {}),
    "numpy first": ("import numpy", {}),
    "numpy first, OPENBLAS_NUM_THREADS=1": ("import numpy", {"OPENBLAS_NUM_THREADS": "1"}),
    "numpy first, OMP_NUM_THREADS=1": ("import numpy", {"OMP_NUM_THREADS": "1"}),
    "numpy first, no layer on the GPU": ("import numpy", {"NGL": "0"}),
    "numpy first, CUDA initialised before it": (
        "import ctypes; cuda = ctypes.CDLL('libcuda.so.1'); assert cuda.cuInit(0) == 0; import numpy", {}),
    "numpy's openblas lib only (RTLD_LOCAL)": (
        "import ctypes, glob, importlib.util, os\n"
        "root = os.path.dirname(importlib.util.find_spec('numpy').origin)\n"
        "libs = glob.glob(root + '/../scipy_openblas*/lib/libscipy_openblas*.so') + "
        "glob.glob(root + '/../numpy.libs/libscipy_openblas*.so')\n"
        "print('preloaded', libs)\n"
        "[ctypes.CDLL(p) for p in libs]", {}),
    "libgomp, then numpy": ("import ctypes; ctypes.CDLL('libgomp.so.1', ctypes.RTLD_GLOBAL); import numpy", {}),
    "ggml libs, then numpy": (
        "import ctypes, os\n"
        "d = os.environ['LLAMA_CPP_LIB_PATH']\n"
        "for n in ('libggml-base.so', 'libggml-cpu.so', 'libggml-cuda.so', 'libggml.so', 'libllama.so'):\n"
        "    p = os.path.join(d, n)\n"
        "    if os.path.exists(p): ctypes.CDLL(p, ctypes.RTLD_GLOBAL)\n"
        "import numpy", {}),
    "mesh_llm.engines.llama (as served)": ("import mesh_llm.engines.llama", {}),
}


def run(prelude: str, env: dict, model: str, debugger: bool = False) -> tuple[int, str]:
    code = prelude + "\n" + LOAD
    argv = [sys.executable, "-c", code, model]
    if debugger:
        argv = ["cuda-gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 40", "-ex", "info sharedlibrary",
                "--args", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    return done.returncode, (done.stdout + done.stderr)[-6000:]


def main() -> None:
    model = sys.argv[1]
    results = {}
    for name, (prelude, env) in VARIANTS.items():
        code, out = run(prelude, env, model)
        results[name] = {"returncode": code, "ok": code == 0 and "decoded" in out, "tail": out[-1500:]}
        print(f"{name:45s} exit {code:4d}  {'ok' if results[name]['ok'] else 'FAILED'}", flush=True)
    for name, r in results.items():
        if not r["ok"] and r["returncode"] < 0:
            code, out = run(*VARIANTS[name], model, debugger=True)
            r["backtrace"] = out
            print(f"\n=== {name}: cuda-gdb ===\n{out[-4000:]}", flush=True)
            break
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "llama-import.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
