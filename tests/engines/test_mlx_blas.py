"""The BLAS mesh-llm interposes for MLX on Linux runs on every CPU, not just on the one it was tested on.

cmeel-openblas (a static SKYLAKEX build) passed every test on AVX-512 machines and killed the server
with SIGILL on an AVX2-only EPYC. These tests fail on such a library on any CPU: they force OpenBLAS
onto cores the CPU supports (``OPENBLAS_CORETYPE``, which only a DYNAMIC_ARCH build honours), check
that MLX really multiplies with it and that its products are right, and check the CPU test that
decides what may be interposed, with real config strings and real /proc/cpuinfo flag sets.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from mesh_llm.engines import is_installed
from mesh_llm.system.blas import cpu_cannot_run, cpu_flags

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not is_installed("mlx"),
                                reason="the BLAS fix is for MLX's Linux CPU wheel")

# /proc/cpuinfo "flags" of this 2-core AMD EPYC VM (Zen 4: family 25, model 17), and of the CI's Zen 3
# EPYC VM (family 25, model 1), which has the same line without Zen 4's AVX-512 family and GFNI.
ZEN4 = set("""fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr
sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc
cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt
tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse
3dnowprefetch osvw topoext vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq
rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves
avx512_bf16 clzero xsaveerptr arat avx512vbmi umip avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni
avx512_bitalg avx512_vpopcntdq rdpid fsrm""".split())
ZEN3 = {f for f in ZEN4 if not f.startswith("avx512") and f != "gfni"}
# "Features" of AWS Graviton2 (Neoverse N1, no SVE) and Graviton3 (Neoverse V1, SVE).
GRAVITON2 = set("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop "
                "asimddp ssbs".split())
GRAVITON3 = GRAVITON2 | set("jscvt fcma sha3 sm3 sm4 sha512 sve asimdfhm dit uscat ilrcpc flagm paca pacg "
                            "dcpodp svei8mm svebf16 i8mm bf16 dgh rng".split())

CMEEL = "OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX MAX_THREADS=4"  # cmeel-openblas 0.3.31, the SIGILL one
SCIPY = "OpenBLAS 0.3.34.481.3 DYNAMIC_ARCH NO_AFFINITY {} MAX_THREADS=64"  # scipy-openblas32, x86-64
SCIPY_ARM = "OpenBLAS 0.3.31.188.0 DYNAMIC_ARCH NO_AFFINITY {} MAX_THREADS=64"  # its aarch64 wheel
DEBIAN = "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Zen MAX_THREADS=64"  # libopenblas0-pthread, bookworm


@pytest.mark.parametrize("config, core, flags, machine, refused_for", [
    (CMEEL, "SKYLAKEX", ZEN3, "x86_64", "avx512"),  # the CI crash
    (CMEEL, "SKYLAKEX", ZEN4, "x86_64", None),  # built for one CPU, but this one has it all
    (SCIPY.format("Haswell"), "Haswell", ZEN3, "x86_64", None),
    (SCIPY.format("SkylakeX"), "SkylakeX", ZEN4, "x86_64", None),
    (SCIPY.format("SkylakeX"), "SkylakeX", ZEN3, "x86_64", "avx512"),  # OPENBLAS_CORETYPE=SkylakeX on Zen 3
    (SCIPY.format("SapphireRapids"), "SapphireRapids", ZEN4, "x86_64", "amx"),
    (SCIPY.format("Katmai"), "Katmai", ZEN3, "x86_64", None),  # what OPENBLAS_CORETYPE=Prescott reports
    (DEBIAN, "Zen", ZEN3, "x86_64", None),
    ("OpenBLAS 0.3.31 NO_AFFINITY HASWELL MAX_THREADS=64", "SKYLAKEX", ZEN4, "x86_64", "built for one CPU"),
    (SCIPY.format("Zen6"), "Zen6", ZEN4, "x86_64", "not one mesh-llm knows"),
    (SCIPY_ARM.format("neoversen1"), "neoversen1", GRAVITON2, "aarch64", None),
    (SCIPY_ARM.format("neoversev1"), "neoversev1", GRAVITON2, "aarch64", "sve"),
    (SCIPY_ARM.format("neoversev1"), "neoversev1", GRAVITON3, "aarch64", None),
    (SCIPY_ARM.format("armv9sme"), "armv9sme", GRAVITON3, "aarch64", "sme"),
    (SCIPY.format("Haswell"), "Haswell", ZEN3, "riscv64", "riscv64"),
])
def test_cpu_check(config, core, flags, machine, refused_for):
    reason = cpu_cannot_run(config, core, flags, machine)
    if refused_for is None:
        assert reason is None
    else:
        assert reason is not None and refused_for in reason, reason


# In a fresh process, as the engine does it: interpose, then multiply through MLX. The global symbol
# scope names the OpenBLAS MLX binds to; LD_DEBUG=bindings shows the dynamic linker binding MLX's
# cblas_sgemm to it (not to the wheel's reference libblas).
PROBE = """
import ctypes, itertools, json, sys
from mesh_llm.system.blas import ensure_fast_blas
blas = ensure_fast_blas()
scope = ctypes.CDLL(None)
names = {"config": "openblas_get_config", "core": "openblas_get_corename"}
found = {key: getattr(scope, name, None) for key, name in names.items()}
for function in filter(None, found.values()):
    function.restype = ctypes.c_char_p
import mlx.core as mx
import numpy as np

rng = np.random.default_rng(0)
worst = 0.0
# (M, N, K): small ones take OpenBLAS' small-matrix kernels, odd ones the edge paths, the last the
# blocked multithreaded one; every pair of transposes.
for (m, n, k), ta, tb in itertools.product(
        [(1, 1, 1), (2, 3, 4), (8, 8, 8), (7, 13, 5), (16, 1, 32), (1, 64, 64), (33, 65, 17),
         (100, 100, 100), (127, 255, 300), (512, 384, 640)], (False, True), (False, True)):
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    x, y = mx.array(a), mx.array(b)
    got = np.array((x.T if ta else x) @ (y.T if tb else y))
    a64, b64 = (a.T if ta else a).astype(np.float64), (b.T if tb else b).astype(np.float64)
    bound = np.abs(a64) @ np.abs(b64) * k * np.finfo(np.float32).eps  # float32 rounding, worst case
    worst = max(worst, float(np.max(np.abs(got - a64 @ b64) / bound)))
# MLX also imports cblas_dgemm and LAPACK routines (here sgetrf_/sgetri_): they come from OpenBLAS too.
a = rng.standard_normal((96, 96))
x = mx.array(a, dtype=mx.float64)
dgemm = float(np.max(np.abs(np.array(mx.matmul(x, x, stream=mx.cpu)) - a @ a)))
inverse = np.array(mx.linalg.inv(mx.array(a.astype(np.float32)), stream=mx.cpu)).astype(np.float64)
inverse = float(np.max(np.abs(inverse @ a - np.eye(96))))
print(json.dumps({"blas": blas, **{key: f().decode() if f else "" for key, f in found.items()},
                  "worst": worst, "dgemm": dgemm, "inverse": inverse}))
"""

CORES = {"x86_64": ["Haswell", "Sandybridge"], "aarch64": ["armv8", "neoversen1"]}.get(platform.machine(), [])


def run_probe(tmp_path, coretype: str | None) -> tuple[dict, str]:
    env = {**os.environ, "MESH_LLM_HOME": str(tmp_path / "home"), "LD_DEBUG": "bindings",
           "LD_DEBUG_OUTPUT": str(tmp_path / "ld")}
    env.pop("OPENBLAS_CORETYPE", None)
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    bindings = "".join(p.read_text(errors="replace") for p in tmp_path.glob("ld.*"))
    return json.loads(done.stdout.splitlines()[-1]), bindings


@pytest.mark.parametrize("coretype", [None, *CORES])
def test_mlx_multiplies_right_with_a_blas_this_cpu_runs(tmp_path, coretype):
    """Unforced, and forced onto cores every CPU of its kind runs (Haswell: the AVX2 kernels of an
    AVX2-only EPYC), MLX's float32 products agree with float64 numpy within float32 rounding."""
    if coretype == "Haswell" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2")
    result, bindings = run_probe(tmp_path, coretype)
    if result["blas"] == "cuda":
        pytest.skip("MLX's CUDA build")
    assert result["blas"].startswith("openblas"), result
    assert "DYNAMIC_ARCH" in result["config"].split(), result  # picks kernels for the CPU it runs on
    if coretype:  # a static build ignores OPENBLAS_CORETYPE: cmeel's SKYLAKEX fails here on any CPU
        assert result["core"].lower() == coretype.lower(), result
    assert cpu_cannot_run(result["config"], result["core"], cpu_flags(), platform.machine()) is None
    assert result["worst"] < 1.0, result  # within the float32 rounding bound
    assert result["dgemm"] < 1e-9 and result["inverse"] < 1e-3, result
    bound = {line.split("`")[1].rstrip("'"): line for line in bindings.splitlines()
             if "libmlx" in line.split(" to ")[0] and "normal symbol `" in line}
    for symbol in ["cblas_sgemm", "cblas_dgemm", "sgetrf_", "sgetri_"]:
        assert symbol in bound and "libopenblas" in bound[symbol].split(" to ")[1], bound.get(symbol)


def test_a_core_the_cpu_lacks_is_refused_not_run(tmp_path):
    """OPENBLAS_CORETYPE forced onto a core this CPU lacks: one warning and the bundled BLAS, no SIGILL."""
    lacking = {"x86_64": ("SkylakeX", "avx512f"), "aarch64": ("neoversev1", "sve")}.get(platform.machine())
    if lacking is None or lacking[1] in cpu_flags():
        pytest.skip(f"this CPU runs every core OpenBLAS lets us force ({platform.machine()})")
    env = {**os.environ, "MESH_LLM_HOME": str(tmp_path), "OPENBLAS_CORETYPE": lacking[0]}
    code = "from mesh_llm.system.blas import ensure_fast_blas; print(ensure_fast_blas())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "reference (slow)"
    assert done.stderr.count("reference BLAS") == 1 and lacking[0] in done.stderr, done.stderr
