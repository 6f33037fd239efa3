"""Engine registry: each engine is imported only when asked for, so mesh-llm runs with either extra.

To add an engine, write ``engines/<name>/engine.py`` with an :class:`~mesh_llm.engines.base.Engine`
subclass (a runner of the scheduler's plans) and add one line to ``_ENGINES``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Collection

from mesh_llm.engines.base import Engine, EngineUnavailable

# name -> (module, class, the pip extra that installs its dependency, the module that extra provides,
# the environment variable that points the dependency at its native libraries, if it has one)
_ENGINES: dict[str, tuple[str, str, str, str, str | None]] = {
    "mlx": ("mesh_llm.engines.mlx.engine", "MLXEngine", "mlx", "mlx", None),
    "llama": ("mesh_llm.engines.llama.engine", "LlamaEngine", "llama", "llama_cpp", "LLAMA_CPP_LIB_PATH"),
}


def engine_names() -> list[str]:
    return list(_ENGINES)


def is_installed(name: str) -> bool:
    """True when the engine's dependency can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec(_ENGINES[name][3]) is not None
    except ImportError:
        return False


def require(name: str) -> None:
    """Raise :class:`EngineUnavailable`, naming the extra to install, unless ``name`` is a known
    engine whose dependency is installed (nothing is imported)."""
    if name not in _ENGINES:
        raise EngineUnavailable(f"unknown engine {name!r}; choose one of: {', '.join(_ENGINES)}")
    _, _, extra, dependency, _ = _ENGINES[name]
    if not is_installed(name):
        raise EngineUnavailable(
            f"the {name} engine needs the '{dependency}' package: pip install 'mesh-llm[{extra}]'"
        )


def engine_class(name: str) -> type[Engine]:
    """The engine class for ``name``; :class:`EngineUnavailable` names the extra to install."""
    require(name)
    module, cls, extra, _, library_env = _ENGINES[name]
    try:
        return getattr(importlib.import_module(module), cls)
    # installed but broken: llama-cpp-python raises FileNotFoundError or RuntimeError for a native
    # library it cannot find or load (a wrong LLAMA_CPP_LIB_PATH, a build for another CPU)
    except (ImportError, OSError, RuntimeError) as exc:
        where = os.environ.get(library_env) if library_env else None
        fix = (f"{library_env} ({where}) must name a folder holding the {name} engine's native libraries"
               if where else f"reinstall it: pip install --force-reinstall 'mesh-llm[{extra}]'")
        raise EngineUnavailable(f"the {name} engine cannot be imported ({exc}); {fix}") from None


def choose_engine(forms: Collection[str], requested: str = "auto") -> tuple[str, str, str]:
    """Pick (engine, format, why) for a model available in ``forms`` ("gguf", "safetensors"), from
    what is installed, importing no engine: the caller may yet have to start again before one can
    load (``mesh_llm/system/native.py``), and MLX's import alone took over a second on the GPU host.

    A model in both forms goes to the engine measured faster: llama.cpp, on this CPU (its quantized
    kernels; MLX has none on a CPU) and on the H200 up to about 32 streams (the Qwen2.5-0.5B shape
    through the servers, 2026-12-03: 550 against 191 tok/s for one stream, 831 against 525 for 8;
    MLX led only at 32, 1,751 against 736; docs/performance.md).
    """
    if requested == "llama":
        if "gguf" not in forms:
            raise EngineUnavailable(
                "the llama engine needs a GGUF file; convert this folder with llama.cpp's "
                "convert_hf_to_gguf.py (python convert_hf_to_gguf.py FOLDER --outfile model.gguf), "
                "or serve it with --engine mlx")
        require("llama")
        return "llama", "gguf", "asked for with --engine llama"
    if requested == "mlx":
        require("mlx")
        fmt = "safetensors" if "safetensors" in forms else "gguf"
        return "mlx", fmt, "asked for with --engine mlx"
    if requested != "auto":
        require(requested)  # raises: unknown engine
    if len(forms) > 1 and is_installed("llama") and "gguf" in forms:
        return "llama", "gguf", "available as GGUF and MLX; llama.cpp is the faster engine measured here"
    if "safetensors" in forms:
        require("mlx")
        return "mlx", "safetensors", "a safetensors model folder"
    if is_installed("llama") or not is_installed("mlx"):
        require("llama")
        return "llama", "gguf", "a GGUF file"
    return "mlx", "gguf", "a GGUF file, and only the mlx engine is installed"
