"""Engine registry: each engine is imported only when asked for, so mesh-llm runs with either extra.

To add an engine, write ``engines/<name>.py`` with an :class:`~mesh_llm.engines.base.Engine` subclass
and add one line to ``_ENGINES``.
"""

from __future__ import annotations

import importlib
import importlib.util

from mesh_llm.engines.base import Engine, EngineUnavailable

# name -> (module, class, the pip extra that installs its dependency, the module that extra provides)
_ENGINES: dict[str, tuple[str, str, str, str]] = {
    "mlx": ("mesh_llm.engines.mlx", "MLXEngine", "mlx", "mlx"),
    "llama": ("mesh_llm.engines.llama", "LlamaEngine", "llama", "llama_cpp"),
}


def engine_names() -> list[str]:
    return list(_ENGINES)


def is_installed(name: str) -> bool:
    """True when the engine's dependency can be imported (checked without importing it)."""
    return importlib.util.find_spec(_ENGINES[name][3]) is not None


def engine_class(name: str) -> type[Engine]:
    """The engine class for ``name``; :class:`EngineUnavailable` names the extra to install."""
    if name not in _ENGINES:
        raise EngineUnavailable(f"unknown engine {name!r}; choose one of: {', '.join(_ENGINES)}")
    module, cls, extra, dependency = _ENGINES[name]
    if not is_installed(name):
        raise EngineUnavailable(
            f"the {name} engine needs the '{dependency}' package: pip install 'mesh-llm[{extra}]'"
        )
    return getattr(importlib.import_module(module), cls)
