"""Models: what a reference means (``resolve``), what is on disk (``list_models``) and the embedded
default model. The explicit download is ``mesh_llm.models.download``, the only module that reaches
the network, imported by its command alone; the rest reads the hub's cache offline."""

from mesh_llm.models.default import default_gguf, default_llama_gguf, default_mlx_folder, default_spec
from mesh_llm.models.registry import LocalModel, list_models
from mesh_llm.models.resolve import model_path, resolve
from mesh_llm.models.spec import (
    FORMAT_ENGINE,
    BadModel,
    ModelNotFound,
    ModelSpec,
    hf_cache_dir,
    home_dir,
    models_dir,
)

__all__ = [
    "FORMAT_ENGINE",
    "BadModel",
    "LocalModel",
    "ModelNotFound",
    "ModelSpec",
    "default_gguf",
    "default_llama_gguf",
    "default_mlx_folder",
    "default_spec",
    "hf_cache_dir",
    "home_dir",
    "list_models",
    "model_path",
    "models_dir",
    "resolve",
]
