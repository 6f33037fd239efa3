"""What a model reference means: turn what the user typed into a :class:`ModelSpec`, offline.

A reference is read as the first of these that fits:

1. nothing, or ``default``: the embedded default model (SmolLM2-135M-Instruct);
2. an existing path: a folder with config.json and ``*.safetensors``, a folder holding a single GGUF
   model, or a ``.gguf`` file (the first shard of a split GGUF); write ``./org/name`` for a folder
   whose relative path would otherwise read as a repo id that is also cached;
3. a Hugging Face repo id ``org/name[@REVISION][:FILE]``, looked up in the local HF cache only:
   REVISION is a branch, a tag or a commit hash (7+ hex digits), ``main`` when left out; FILE picks a
   GGUF when the repo holds several, by its path in the repo, its file name, or a fragment matching
   exactly one (``org/name:Q4_K_M``). A repo with safetensors weights serves those unless FILE is given;
4. a name shown by ``mesh-llm models list``.

Nothing is downloaded here: ``mesh-llm models download org/name`` does that, explicitly.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mesh_llm.models.default import (
    DEFAULT_SOURCE,
    default_llama_gguf,
    default_mlx_folder,
    default_mlx_path,
    default_spec,
)
from mesh_llm.models.files import cached_repo, cached_revision, folder_spec, gguf_spec, is_gguf_name
from mesh_llm.models.registry import OWN_CACHE_SOURCE, list_models
from mesh_llm.models.spec import BadModel, ModelNotFound, ModelSpec, models_dir

PATH_SOURCE = "path"
_REPO_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^:@]+))?(?::(?P<file>.+))?$")


def resolve(ref: str | os.PathLike | None = None) -> ModelSpec:
    """The model ``ref`` names (see the module docstring for the forms). Raises :class:`ModelNotFound`
    when nothing matches and :class:`BadModel` when what matches cannot be served."""
    ref = "" if ref is None else str(ref).strip()
    if ref in ("", "default"):
        return default_spec()
    path = Path(ref).expanduser()
    if path.exists():
        return _from_path(path)
    repo = _REPO_REF.match(ref)
    if repo and not (is_gguf_name(ref) and not repo["file"]):
        return _from_hf_cache(repo["repo"], repo["revision"], repo["file"])
    if _looks_like_path(ref):
        raise ModelNotFound(f"no file or folder at {path.absolute()}")
    return _from_listing(ref)


def model_path(spec: ModelSpec, fmt: str, progress=None, engine: str | None = None,
               deterministic: bool = False) -> Path:
    """The path of ``spec`` in format ``fmt`` ("safetensors" for MLX, "gguf" for llama.cpp) that
    ``engine`` loads. The default model's own forms are made on first use: its MLX folder
    (``progress(done, total)`` reports that import), and the Q8_0 copy the llama engine serves unless
    ``deterministic`` (``models/default.py``)."""
    if spec.source == DEFAULT_SOURCE and fmt == "gguf" and engine == "llama" and not deterministic:
        return default_llama_gguf()
    if fmt == spec.format:
        return spec.path
    if fmt not in spec.alternates:
        raise BadModel(f"{spec.name} is available as {' and '.join(spec.formats)} only, not {fmt}")
    if spec.alternates[fmt] == default_mlx_path():
        return default_mlx_folder(progress)
    return spec.alternates[fmt]


def _from_path(path: Path) -> ModelSpec:
    source = OWN_CACHE_SOURCE if path.resolve().parent == models_dir().resolve() else PATH_SOURCE
    if path.is_dir():
        return folder_spec(path, _folder_name(path), source)
    if not is_gguf_name(path):
        hint = (
            "; pass the folder that holds it and its config.json"
            if path.suffix == ".safetensors"
            else " (mesh-llm serves .gguf files and safetensors folders)"
        )
        raise BadModel(f"{path} is not a .gguf file{hint}")
    return gguf_spec(path, source)


def _folder_name(folder: Path) -> str:
    """The folder's name, or the repo's name for a Hugging Face snapshot folder (what `download` returns),
    whose own name is a commit hash."""
    folder = folder.resolve()
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.rsplit("--", 1)[-1]
    return folder.name


def _from_hf_cache(repo_id: str, revision: str | None, file: str | None) -> ModelSpec:
    repo = cached_repo(repo_id)
    snapshot = cached_revision(repo, revision)
    source = f"HF cache {repo.repo_id}@{snapshot.commit_hash[:7]}"
    return folder_spec(
        Path(snapshot.snapshot_path),
        repo.repo_id.rsplit("/", 1)[-1],
        source,
        selector=file,
        where=source,
        how_to_pick=f"pick one with `{repo.repo_id}:FILE`",
        recursive=True,
    )


def _looks_like_path(ref: str) -> bool:
    return ref.startswith((".", "~")) or "/" in ref or "\\" in ref or is_gguf_name(ref)


def _from_listing(name: str) -> ModelSpec:
    """A name from `mesh-llm models list`; case-insensitive when that is still unambiguous."""
    models = list_models()
    matches = [m for m in models if m.name == name] or [m for m in models if m.name.lower() == name.lower()]
    if len(matches) == 1:
        return matches[0].spec
    if matches:
        refs = ", ".join(m.ref for m in matches)
        raise ModelNotFound(f"'{name}' names {len(matches)} models ({refs}); pass one of those refs instead")
    raise ModelNotFound(
        f"no model '{name}': not a path, not an org/name repo id, and not a name in `mesh-llm models list`"
    )
