"""Models: what a reference means (``resolve``), what is on disk (``list_models``), the explicit
download, and the embedded default model. Nothing here reaches the network except ``download``."""

from mesh_llm.models.default import default_gguf, default_mlx_folder, default_spec
from mesh_llm.models.download import DownloadError, download
from mesh_llm.models.registry import LocalModel, list_models
from mesh_llm.models.resolve import model_path, resolve
from mesh_llm.models.spec import FORMAT_ENGINE, BadModel, ModelNotFound, ModelSpec, hf_cache_dir, home_dir, models_dir

__all__ = [
    "FORMAT_ENGINE",
    "BadModel",
    "DownloadError",
    "LocalModel",
    "ModelNotFound",
    "ModelSpec",
    "default_gguf",
    "default_mlx_folder",
    "default_spec",
    "download",
    "hf_cache_dir",
    "home_dir",
    "list_models",
    "model_path",
    "models_dir",
    "resolve",
]
