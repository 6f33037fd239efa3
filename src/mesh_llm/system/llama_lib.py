"""llama.cpp as a process-wide library, and what a context needs to know before it is made: llama.cpp's
log routed to Python logging, the cores and GPU memory this process may use, whether AMX must be
avoided, and how many bytes one KV cell of a model takes."""

from __future__ import annotations

import ctypes
import logging
import re
import sys
from collections import deque
from pathlib import Path

import llama_cpp.llama_cpp as ll

log = logging.getLogger("mesh_llm.engines.llama.engine")


class _NativeLog:
    """Routes llama.cpp's log lines to Python logging at debug and keeps the last errors, so a failed
    load can say why (llama.cpp itself only returns NULL)."""

    _ERROR, _CONTINUE = 4, 5  # ggml.h's ggml_log_level (llama-cpp-python's _logger.py has the old values)

    def __init__(self) -> None:
        self.errors: deque[str] = deque(maxlen=8)
        self._parts: list[str] = []
        self._level = 0
        self._callback = ll.llama_log_callback(self._on_log)  # referenced here so it is never freed
        ll.llama_log_set(self._callback, None)

    def _on_log(self, level: int, text: bytes | None, _user: ctypes.c_void_p) -> None:
        if level != self._CONTINUE:
            self._level = level
        self._parts.append((text or b"").decode("utf-8", errors="replace"))
        if self._parts[-1].endswith("\n"):
            line = "".join(self._parts).strip()
            self._parts.clear()
            if self._level == self._ERROR:
                self.errors.append(line)
            log.debug("llama.cpp: %s", line)


ll.llama_backend_init()
NATIVE_LOG = _NativeLog()


def requantize_q8_0(src: Path, dst: Path) -> None:
    """Write ``src``'s weights as Q8_0 to ``dst`` (llama.cpp's own quantizer; its log to debug)."""
    params = ll.llama_model_quantize_default_params()
    params.ftype = ll.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    if ll.llama_model_quantize(bytes(src), bytes(dst), ctypes.byref(params)) != 0:
        why = "; ".join(NATIVE_LOG.errors) or "no reason given"
        raise RuntimeError(f"llama.cpp could not requantize {src}: {why}")


def amx_in_use() -> bool:
    """Whether ggml would run matmuls on AMX tiles: built with AMX (``-march=native`` on a Xeon turns it
    on) and the CPU has them. Its AMX kernel (llama-cpp-python 0.3.36) dies with SIGSEGV on ``ldtilecfg``
    on our Sapphire Rapids machines; AMX is one of llama.cpp's "extra" CPU buffer types, so there the
    engine loads without them (also losing weight repacking). Builds without AMX keep them."""
    if "AMX_INT8 = 1" not in ll.llama_print_system_info().decode(errors="replace"):
        return False
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def backend_name() -> str:
    """'cpu' unless this build offloads; then the GPU backend's name from llama.cpp's system info."""
    if not ll.llama_supports_gpu_offload():
        return "cpu"
    names = re.findall(r"(\w+) : ", ll.llama_print_system_info().decode(errors="replace"))
    gpus = [n.lower() for n in names if n.upper() not in ("CPU", "BLAS", "RPC")]
    if gpus:
        return {"mtl": "metal", "hip": "rocm"}.get(gpus[0], gpus[0])
    return "metal" if sys.platform == "darwin" else "gpu"



def gpu_free_memory() -> int | None:
    """Free bytes of the emptiest GPU ggml sees (read after the weights are on it), or None."""
    try:
        folder = Path(ll._lib._name).parent
        suffix = Path(ll._lib._name).suffix
        ggml = ctypes.CDLL(str(folder / f"libggml{suffix}"))
        base = ctypes.CDLL(str(folder / f"libggml-base{suffix}"))
        ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
        ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
        ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        base.ggml_backend_dev_type.restype = ctypes.c_int
        base.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        base.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                                 ctypes.POINTER(ctypes.c_size_t)]
        free = []
        for i in range(ggml.ggml_backend_dev_count()):
            device = ggml.ggml_backend_dev_get(i)
            if base.ggml_backend_dev_type(device) in (1, 2):  # GGML_BACKEND_DEVICE_TYPE_GPU, _IGPU
                available, total = ctypes.c_size_t(), ctypes.c_size_t()
                base.ggml_backend_dev_memory(device, ctypes.byref(available), ctypes.byref(total))
                free.append(available.value)
        return min(free) if free else None
    except (OSError, AttributeError):
        return None


def kv_cell_bytes(model: ll.llama_model_p, meta: dict) -> int:
    """Bytes one KV cell takes over all layers (float16 K and V); per-layer head counts (hybrids:
    0 for their recurrent layers) from the GGUF header when it has them."""
    arch = meta.get("general.architecture")
    n_head = max(1, ll.llama_model_n_head(model))
    key = meta.get(f"{arch}.attention.key_length") or ll.llama_model_n_embd(model) // n_head
    value = meta.get(f"{arch}.attention.value_length") or key
    heads = meta.get(f"{arch}.attention.head_count_kv")
    if isinstance(heads, tuple):
        kv_heads = sum(heads)
    else:
        kv_heads = ll.llama_model_n_layer(model) * (heads or ll.llama_model_n_head_kv(model))
    return int(kv_heads * (key + value) * 2)
