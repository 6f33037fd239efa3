"""CUDA kernels compiled once per GPU architecture with NVRTC and kept on disk as device code.

MLX 0.32's ``mx.fast.cuda_kernel`` compiles a kernel afresh in every process, together with MLX's
device headers: 1.2-2.4 s for mesh-llm's decode attention (H200, 2026-12-04), most of a restarted
server's warm-up. A kernel written against no header compiles in a small
part of that, and its cubin, kept beside MLX's own compiled kernels (``MLX_PTX_CACHE_DIR``), loads
through ``mx.fast.precompiled_cuda_kernel`` with no compiler at all on the next start.

NVRTC is reached through ``ctypes``: MLX's CUDA build has already loaded the library to compile its
own kernels, so no package is needed beyond MLX's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import tempfile
import threading
from pathlib import Path

import mlx.core as mx

# A kernel's element type T and its conversions to and from float32, written by hand (16-bit floats
# through PTX) so that NVRTC needs no header: one per MLX float type.
TYPES = {
    "float32": "typedef float T;\n"
               "__device__ __forceinline__ float load(T x) { return x; }\n"
               "__device__ __forceinline__ T store(float x) { return x; }\n",
    "float16": "typedef unsigned short T;\n"
               "__device__ __forceinline__ float load(T x) {\n"
               "    float f; asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(x)); return f; }\n"
               "__device__ __forceinline__ T store(float x) {\n"
               "    T h; asm(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(h) : \"f\"(x)); return h; }\n",
    "bfloat16": "typedef unsigned short T;\n"
                "__device__ __forceinline__ float load(T x) { return __uint_as_float(((unsigned int)x) << 16); }\n"
                "__device__ __forceinline__ T store(float x) {  // round to nearest even, as MLX does\n"
                "    unsigned int u = __float_as_uint(x);\n"
                "    if ((u & 0x7fffffffu) > 0x7f800000u) return (T)((u >> 16) | 0x40u);\n"
                "    return (T)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }\n",
}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None


class CompileError(RuntimeError):
    pass


def cubin(name: str, source: str) -> bytes:
    """The device code of ``source`` for this process's GPU, from disk or compiled now (callers keep
    it per shape). ``name`` names the file, with a hash of the source, the architecture and NVRTC's
    version."""
    info = mx.device_info()
    arch = f"sm_{info['compute_capability_major']}{info['compute_capability_minor']}"
    nvrtc = _nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(nvrtc, nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    digest = hashlib.sha256(f"{arch}\0{major.value}.{minor.value}\0{source}".encode()).hexdigest()[:16]
    path = kernel_folder() / f"{name}-{arch}-{digest}.cubin"
    with _lock:  # engines loading on two threads compile a shared kernel once
        try:
            return path.read_bytes()
        except OSError:
            data = _compile(nvrtc, name, source, arch)
            _store(path, data)
            return data


def available() -> bool:
    """Whether an NVRTC library can be loaded here (MLX's CUDA build loads one itself)."""
    try:
        _nvrtc()
    except CompileError:
        return False
    return True


def kernel_folder() -> Path:
    """Where MLX keeps its compiled kernels in this process: ``MLX_PTX_CACHE_DIR`` (the engine sets
    it to mesh-llm's cache), else MLX's own default under the temp folder."""
    folder = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(folder) if folder else Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def _store(path: Path, data: bytes) -> None:
    """Written whole or not at all: servers started together may compile the same kernel."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.part")
        partial.write_bytes(data)
        os.replace(partial, path)
    except OSError:
        pass  # a read-only cache: compiled again next start


def _compile(nvrtc: ctypes.CDLL, name: str, source: str, arch: str) -> bytes:
    program = ctypes.c_void_p()
    _check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(),
                                           0, None, None), "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture={arch}".encode()]
        result = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        if result != 0:
            size = ctypes.c_size_t()
            _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            log = ctypes.create_string_buffer(size.value + 1)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise CompileError(f"NVRTC could not compile {name} for {arch}: "
                               f"{log.value.decode(errors='replace').strip()}")
        size = ctypes.c_size_t()
        _check(nvrtc, nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        data = ctypes.create_string_buffer(size.value)
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(program, data), "nvrtcGetCUBIN")
        return data.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def _check(nvrtc: ctypes.CDLL, result: int, call: str) -> None:
    if result != 0:
        raise CompileError(f"{call} failed: {nvrtc.nvrtcGetErrorString(result).decode(errors='replace')}")


def _nvrtc() -> ctypes.CDLL:
    """The NVRTC that MLX loaded (read from the process's mapped files), else one the loader finds."""
    global _library
    if _library is None:
        for candidate in _candidates():
            try:
                library = ctypes.CDLL(candidate)
            except OSError:
                continue
            library.nvrtcGetErrorString.restype = ctypes.c_char_p
            _library = library
            break
        else:
            raise CompileError("no NVRTC library (libnvrtc.so) in this process or on the loader's path")
    return _library


def _candidates() -> list[str]:
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith("libnvrtc.so") and path not in found:
                    found.append(path)
    except OSError:
        pass
    named = ctypes.util.find_library("nvrtc")
    return found + ([named] if named else []) + ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
