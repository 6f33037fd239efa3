"""What a resolved model is, where models live on disk, and the errors every models module raises.

Kept apart from ``resolve`` so that ``default``, ``registry`` and ``download`` can share these without
importing each other in a circle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import constants

# The engine that serves each on-disk format.
FORMAT_ENGINE: dict[str, str] = {"safetensors": "mlx", "gguf": "llama"}


class ModelNotFound(Exception):
    """Nothing matches a model reference; the message says what was looked for, where, and what to run."""


class BadModel(Exception):
    """A reference points at something that is not a model mesh-llm can serve (no weights, wrong file)."""


@dataclass(frozen=True)
class ModelSpec:
    """A model found on disk, ready to hand to an engine.

    ``alternates`` holds the same model in other formats (format -> path). For the embedded default the
    MLX folder is listed there before it is imported: :func:`mesh_llm.models.resolve.model_path`
    imports it on first use.
    """

    name: str  # the id it is served under unless the user picks another
    path: Path  # a safetensors folder or a .gguf file (the first shard of a split GGUF)
    format: str  # "safetensors" | "gguf"
    source: str  # short human text: "embedded default", "HF cache org/name@abc1234", "path"
    alternates: dict[str, Path] = field(default_factory=dict)

    @property
    def formats(self) -> tuple[str, ...]:
        return (self.format, *self.alternates)

    @property
    def engines(self) -> tuple[str, ...]:
        """Engines that can serve this model, in order of its formats."""
        return tuple(FORMAT_ENGINE[f] for f in self.formats)


def home_dir() -> Path:
    """mesh-llm's own cache: ``$MESH_LLM_HOME``, else ``~/.cache/mesh-llm``. Read per call, never created here."""
    return Path(os.environ.get("MESH_LLM_HOME") or Path.home() / ".cache" / "mesh-llm").expanduser()


def models_dir() -> Path:
    """Where mesh-llm keeps models it made itself (imported MLX folders, GGUF files put there by hand)."""
    return home_dir() / "models"


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache. huggingface_hub reads its environment once at import; reading it per
    call lets HF_HUB_CACHE / HF_HOME set later (tests, embedding programs) take effect."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def hf_offline() -> bool:
    """True when HF_HUB_OFFLINE is set now or was set when huggingface_hub was imported."""
    value = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return constants.HF_HUB_OFFLINE or value in {"1", "ON", "YES", "TRUE"}
