"""The llama.cpp library llama-cpp-python loads uses no instruction set this CPU lacks.

The Makefile builds llama-cpp-python with this CPU's own vector extensions (``tools/llama_cmake_args.py``)
and caches the wheel under a hash of those flags; a wheel built on an AVX-512 machine and reused on an
AVX2-only one (a copied cache, a shared image, LLAMA_CPP_LIB_PATH) would die with SIGILL. llama.cpp
reports what it was compiled with (``llama_print_system_info()``): every feature it reports on must be
one /proc/cpuinfo lists. The library is loaded in a child process, so a SIGILL fails this test only.
"""

from __future__ import annotations

import importlib.util
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from mesh_llm.engines import is_installed
from mesh_llm.system.blas import cpu_flags

if not is_installed("llama"):
    pytest.skip("the llama extra is not installed", allow_module_level=True)

TOOL = Path(__file__).resolve().parents[2] / "tools" / "llama_cmake_args.py"
# Features llama.cpp reports that are not instruction sets.
NOT_ISA = {"LLAMAFILE", "OPENMP", "REPACK", "KLEIDIAI", "ACCELERATE", "SVE_CNT"}
ARM = {"NEON": {"asimd"}, "ARM_FMA": {"asimd"}, "FP16_VA": {"asimdhp"}, "DOTPROD": {"asimddp"},
       "MATMUL_INT8": {"i8mm"}, "SVE": {"sve"}, "SME": {"sme"}}


def isa_flags() -> dict[str, set[str]]:
    """llama.cpp feature name -> the /proc/cpuinfo flags it needs: on x86 those of the build's own
    GGML_<feature> options (one table for the build and this test), plus what has no option."""
    spec = importlib.util.spec_from_file_location("llama_cmake_args", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    x86 = {opt.removeprefix("GGML_"): set(flags) for opt, flags in tool.FLAGS.items()}
    return {**x86, "SSE3": {"pni"}, "SSSE3": {"ssse3"}, "AMX_INT8": {"amx_int8"}, **ARM}


def cpu_features(info: str) -> dict[str, str]:
    """The "CPU : NAME = VALUE | ..." part of llama_print_system_info()."""
    features, backend = {}, None
    for part in info.split("|"):
        if " : " in part:
            backend, part = (s.strip() for s in part.split(" : ", 1))
        if backend == "CPU" and "=" in part:
            name, value = (s.strip() for s in part.split("=", 1))
            features[name] = value
    return features


def missing(features: dict[str, str], flags: set[str]) -> dict[str, list[str]]:
    """Each feature compiled in whose instructions ``flags`` lack (unknown features count as lacking)."""
    needs = isa_flags()
    return {name: sorted(needs.get(name, {f"<unknown feature {name}: add it to this test>"}) - flags)
            for name, value in features.items()
            if value == "1" and name not in NOT_ISA and not needs.get(name, {"?"}) <= flags}


# Real output of this project's build on the 2-core Zen 4 EPYC (AVX-512), and the vector flags of a
# Zen 3 EPYC (AVX2, no AVX-512).
ZEN4_BUILD = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
              "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | "
              "OPENMP = 1 | REPACK = 1 | ")
ZEN3 = set("fpu sse sse2 pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c "
           "rdrand abm sse4a bmi1 avx2 bmi2 erms adx sha_ni vaes vpclmulqdq".split())


def test_a_build_for_avx512_is_caught_on_an_avx2_cpu():
    assert set(missing(cpu_features(ZEN4_BUILD), ZEN3)) == {"AVX512", "AVX512_VBMI", "AVX512_VNNI",
                                                             "AVX512_BF16"}
    assert missing(cpu_features(ZEN4_BUILD), ZEN3 | {"avx512f", "avx512cd", "avx512vl", "avx512dq",
                                                     "avx512bw", "avx512vbmi", "avx512_vnni",
                                                     "avx512_bf16"}) == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/cpuinfo")
def test_the_loaded_llama_cpp_uses_only_what_this_cpu_has():
    probe = "import llama_cpp.llama_cpp as l; print(l.llama_print_system_info().decode())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, f"loading llama.cpp: exit {done.returncode}\n{done.stderr[-2000:]}"
    features = cpu_features(done.stdout)
    assert features, f"no CPU features in llama_print_system_info(): {done.stdout!r}"
    lacking = missing(features, cpu_flags())
    assert not lacking, (f"llama.cpp was built for another CPU: this {platform.machine()} CPU lacks "
                         f"{lacking}; rebuild it here (make clean install)")
