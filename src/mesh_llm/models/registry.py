"""What models are on this machine: the embedded default, the Hugging Face cache, and mesh-llm's own cache.

Backs `mesh-llm models list` and lets ``resolve`` accept a listed name. Nothing here touches the network,
and nothing broken is listed: a repo with no servable weights or an interrupted download is left out
(``resolve`` on it explains why).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mesh_llm.models.default import default_llama_path, default_mlx_path, default_spec
from mesh_llm.models.files import (
    cached_repos,
    cached_revision,
    disk_size,
    folder_spec,
    gguf_candidates,
    gguf_spec,
    safetensors_spec,
)
from mesh_llm.models.spec import BadModel, ModelNotFound, ModelSpec, models_dir

OWN_CACHE_SOURCE = "mesh-llm cache"


@dataclass(frozen=True)
class LocalModel:
    """One servable model on disk. ``ref`` resolves to exactly this model (``resolve(ref) == spec``)."""

    ref: str
    spec: ModelSpec
    size_bytes: int  # all of its formats together

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def format(self) -> str:
        return self.spec.format

    @property
    def formats(self) -> tuple[str, ...]:
        return self.spec.formats

    @property
    def engines(self) -> tuple[str, ...]:
        return self.spec.engines

    @property
    def engine(self) -> str:
        """The engines as table text: "llama" or "llama, mlx"."""
        return ", ".join(self.engines)

    @property
    def path(self) -> Path:
        return self.spec.path

    @property
    def source(self) -> str:
        return self.spec.source


def list_models() -> list[LocalModel]:
    """Every servable model: the default first, then the HF cache and mesh-llm's cache, sorted by ref."""
    found = sorted([*_hf_cache_models(), *_own_cache_models()], key=lambda m: m.ref.lower())
    return [*_default_model(), *found]


def _default_model() -> list[LocalModel]:
    try:
        spec = default_spec()
    except ModelNotFound:
        return []  # not installed: `resolve("default")` says how to install it
    size = disk_size(spec)
    if default_mlx_path().is_dir():
        size += disk_size(ModelSpec(spec.name, default_mlx_path(), "safetensors", spec.source))
    if default_llama_path().is_file():
        size += default_llama_path().stat().st_size
    return [LocalModel(ref="default", spec=spec, size_bytes=size)]


def _folder_models(folder: Path, name: str, source: str, recursive: bool) -> Iterator[ModelSpec]:
    """Each model a folder holds: its safetensors model and every GGUF model."""
    makers: list[Callable[[], ModelSpec]] = []
    if any(folder.glob("*.safetensors")):
        makers.append(lambda: safetensors_spec(folder, name, source))
    for rel in gguf_candidates(folder, recursive):
        makers.append(lambda rel=rel: gguf_spec(folder / rel, source))
    return _valid(makers)


def _valid(makers: list[Callable[[], ModelSpec]]) -> Iterator[ModelSpec]:
    for make in makers:
        try:
            yield make()
        except (BadModel, ModelNotFound):
            continue


def _hf_cache_models() -> Iterator[LocalModel]:
    for repo in cached_repos():
        try:
            revision = cached_revision(repo, None)
        except ModelNotFound:
            continue  # several snapshots and no main: only an explicit @REVISION picks one
        snapshot = Path(revision.snapshot_path)
        source = f"HF cache {repo.repo_id}@{revision.commit_hash[:7]}"
        bare = _bare_ref_path(snapshot, repo.repo_id.rsplit("/", 1)[-1], source)
        for spec in _folder_models(snapshot, repo.repo_id.rsplit("/", 1)[-1], source, recursive=True):
            ref = repo.repo_id if spec.path == bare else f"{repo.repo_id}:{spec.path.relative_to(snapshot).as_posix()}"
            yield LocalModel(ref=ref, spec=spec, size_bytes=disk_size(spec))


def _bare_ref_path(snapshot: Path, name: str, source: str) -> Path | None:
    """The model that plain ``org/name`` resolves to, if any (the others need ``org/name:FILE``)."""
    try:
        return folder_spec(snapshot, name, source, recursive=True).path
    except (BadModel, ModelNotFound):
        return None


def _own_cache_models() -> Iterator[LocalModel]:
    """Model folders and GGUF files directly under ``models_dir()``, served by path."""
    root = models_dir()
    if not root.is_dir():
        return
    top_ggufs = set(gguf_candidates(root, recursive=False))
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") or entry in (default_mlx_path(), default_llama_path()):
            continue  # imports in progress, locks, and the default's own forms (listed with the default)
        if entry.is_dir():
            specs = _folder_models(entry, entry.name, OWN_CACHE_SOURCE, recursive=False)
        elif entry.name in top_ggufs:
            specs = _valid([lambda entry=entry: gguf_spec(entry, OWN_CACHE_SOURCE)])
        else:
            continue
        for spec in specs:
            yield LocalModel(ref=str(spec.path), spec=spec, size_bytes=disk_size(spec))
