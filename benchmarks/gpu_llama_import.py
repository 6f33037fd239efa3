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
import re
import subprocess
import sys
import textwrap
from pathlib import Path

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
    "numpy first, ggml libs then preloaded with RTLD_DEEPBIND": (
        "import numpy, ctypes, os\n"
        "d = os.environ['LLAMA_CPP_LIB_PATH']\n"
        "flags = os.RTLD_NOW | os.RTLD_GLOBAL | os.RTLD_DEEPBIND\n"
        "for n in ('libggml-base.so', 'libggml-cpu.so', 'libggml-cuda.so', 'libggml.so', 'libllama.so'):\n"
        "    p = os.path.join(d, n)\n"
        "    if os.path.exists(p): ctypes.CDLL(p, flags)", {}),
}


def run(prelude: str, env: dict, model: str, debugger: bool = False) -> tuple[int, str]:
    code = prelude + "\n" + LOAD
    argv = [sys.executable, "-c", code, model]
    if debugger:
        argv = ["cuda-gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 40", "--args", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    out = done.stdout + "\n" + done.stderr
    if debugger:  # the frames and the signal, not the program's own log
        out = "\n".join(line for line in out.splitlines()
                        if line.startswith("#") or "SIG" in line or "signal" in line)
    return done.returncode, out[-6000:]


def bindings(prelude: str, model: str) -> dict[str, str]:
    """Which library each symbol that libllama/libggml* look up was bound to (LD_DEBUG=bindings)."""
    env = {"LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": "/tmp/ld-bindings"}
    for old in Path("/tmp").glob("ld-bindings*"):
        old.unlink()
    run(prelude, env, model)
    found = {}
    for log in Path("/tmp").glob("ld-bindings*"):
        for line in log.read_text(errors="replace").splitlines():
            m = re.search(r"binding file (\S+) \[0\] to (\S+) \[0\]: normal symbol `([^']+)'", line)
            if m and ("libggml" in m.group(1) or "libllama" in m.group(1)):
                found[f"{Path(m.group(1)).name}:{m.group(3)}"] = Path(m.group(2)).name
    return found


def main() -> None:
    model = sys.argv[1]
    quick = "--quick" in sys.argv  # the variants alone: no debugger, no bindings
    results = {}
    for name, (prelude, env) in VARIANTS.items():
        code, out = run(prelude, env, model)
        results[name] = {"returncode": code, "ok": code == 0, "tail": out[-1500:]}
        print(f"{name:45s} exit {code:4d}  {'ok' if results[name]['ok'] else 'FAILED'}", flush=True)
    for name, r in results.items():
        if not quick and not r["ok"] and r["returncode"] < 0:
            code, out = run(*VARIANTS[name], model, debugger=True)
            r["backtrace"] = out
            print(f"\n=== {name}: cuda-gdb ===\n{out[-4000:]}", flush=True)
            break
    good, bad = ({}, {}) if quick else (bindings("", model), bindings("import numpy", model))
    differ = {k: (good.get(k), bad.get(k)) for k in set(good) | set(bad) if good.get(k) != bad.get(k)}
    results["bindings that differ (llama first, numpy first)"] = differ
    print(f"\n=== {len(differ)} symbols of libllama/libggml bound elsewhere after numpy ===")
    for k, (a, b) in sorted(differ.items())[:60]:
        print(f"{k:70s} {a} -> {b}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "llama-import.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
