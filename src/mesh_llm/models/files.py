"""Recognise models on disk: safetensors folders, GGUF files (split or not), Hugging Face cache snapshots.

Checks are cheap (file names, a 4-byte magic, the shard index) so that ``resolve`` and ``models list``
stay instant, yet catch the usual breakage early: an interrupted download (missing shards), a Git LFS
pointer instead of weights, a shard other than the first of a split GGUF.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from mesh_llm.models.spec import BadModel, ModelNotFound, ModelSpec, hf_cache_dir

if TYPE_CHECKING:
    from huggingface_hub import CachedRepoInfo, CachedRevisionInfo

GGUF_MAGIC = b"GGUF"
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_SAFETENSORS_INDEX = "model.safetensors.index.json"


def is_gguf_name(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def gguf_model_name(path: Path) -> str:
    """The served name of a GGUF: its file stem, without the ``-00001-of-0000N`` of a split file."""
    split = _SPLIT.match(path.name)
    return split["stem"] if split else path.name[: -len(".gguf")]


def gguf_shards(path: Path) -> list[Path]:
    """Every file of the GGUF model whose first (or only) file is ``path``."""
    split = _SPLIT.match(path.name)
    if not split:
        return [path]
    count = int(split["count"])
    return [path.with_name(f"{split['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def gguf_spec(path: Path, source: str) -> ModelSpec:
    """A GGUF file as a model; a split GGUF must be named by its first shard and have every shard."""
    if not path.is_file():
        raise ModelNotFound(f"no GGUF file at {path}")
    if not is_gguf_name(path):
        raise BadModel(f"{path} is not a GGUF file (mesh-llm serves .gguf files and safetensors folders)")
    split = _SPLIT.match(path.name)
    if split and int(split["index"]) != 1:
        first = gguf_shards(path)[0]
        raise BadModel(f"{path} is shard {int(split['index'])} of a split GGUF; pass the first shard {first}")
    missing = [shard.name for shard in gguf_shards(path) if not shard.is_file()]
    if missing:
        raise BadModel(f"split GGUF {path} is missing shards: {', '.join(missing)}")
    with path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        hint = " (a Git LFS pointer? fetch the real file)" if magic == b"vers" else ""
        raise BadModel(f"{path} does not start with the GGUF magic bytes{hint}")
    return ModelSpec(name=gguf_model_name(path), path=path, format="gguf", source=source)


def safetensors_spec(folder: Path, name: str, source: str) -> ModelSpec:
    """A Hugging Face style folder as a model: config.json plus every safetensors shard it declares."""
    if not (folder / "config.json").is_file():
        raise BadModel(f"{folder} has no config.json: not a Hugging Face model folder")
    if not any(p.is_file() for p in folder.glob("*.safetensors")):
        raise BadModel(f"{folder} has config.json but no *.safetensors weights")
    index = folder / _SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise BadModel(f"{folder} is missing weight shards listed in {index.name}: {', '.join(missing)}")
    return ModelSpec(name=name, path=folder, format="safetensors", source=source)


def gguf_candidates(folder: Path, recursive: bool) -> list[str]:
    """Paths (relative to ``folder``) of the GGUF models in it: single files and first shards."""
    files = folder.rglob("*") if recursive else folder.iterdir()
    found = []
    for path in files:
        split = _SPLIT.match(path.name)
        if is_gguf_name(path) and (not split or int(split["index"]) == 1):
            found.append(path.relative_to(folder).as_posix())
    return sorted(found)


def pick_gguf(folder: Path, selector: str | None, where: str, how_to_pick: str, recursive: bool) -> Path:
    """The one GGUF model in ``folder`` that ``selector`` names: a relative path, a file name, or a
    case-insensitive fragment such as a quantization (``Q4_K_M``) matching exactly one model."""
    candidates = gguf_candidates(folder, recursive)
    if selector is None:
        if len(candidates) == 1:
            return folder / candidates[0]
        raise BadModel(f"{where} holds {len(candidates)} GGUF models ({', '.join(candidates)}); {how_to_pick}")
    exact = [c for c in candidates if selector in (c, c.rsplit("/", 1)[-1])]
    if not exact and is_gguf_name(selector) and (folder / selector).is_file():
        return folder / selector  # a later shard: gguf_spec names the first one in its error
    fragment = [c for c in candidates if selector.lower() in c.lower()]
    matches = exact or fragment
    if len(matches) == 1:
        return folder / matches[0]
    available = ", ".join(candidates) or "no .gguf file"
    if not matches:
        raise ModelNotFound(f"no GGUF matching '{selector}' in {where}; it holds: {available}")
    raise ModelNotFound(
        f"'{selector}' matches {len(matches)} GGUF files in {where} ({', '.join(matches)}); {how_to_pick}"
    )


def folder_spec(
    folder: Path,
    name: str,
    source: str,
    selector: str | None = None,
    how_to_pick: str = "pass the path of one of them",
    recursive: bool = False,
    where: str | None = None,
) -> ModelSpec:
    """The model a folder holds. A safetensors model wins over GGUF files unless ``selector`` picks a GGUF.
    ``where`` names the folder in messages (default: its path)."""
    has_weights = any(folder.glob("*.safetensors"))
    has_config = (folder / "config.json").is_file()
    has_gguf = bool(gguf_candidates(folder, recursive))
    if selector is None and (has_weights or (has_config and not has_gguf)):
        return safetensors_spec(folder, name, source)
    if selector is None and not has_gguf:
        raise BadModel(f"{folder} holds neither config.json with *.safetensors weights nor a .gguf file")
    return gguf_spec(pick_gguf(folder, selector, where or str(folder), how_to_pick, recursive), source)


def cached_repos() -> list[CachedRepoInfo]:
    """Model repositories in the Hugging Face cache (none when the cache does not exist yet).
    huggingface_hub is imported here, not with the module: it brings httpx, 0.1-0.2 s of every
    start that names a path or the default model."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        info = scan_cache_dir(hf_cache_dir())
    except CacheNotFound:
        return []
    return [repo for repo in info.repos if repo.repo_type == "model"]


def cached_repo(repo_id: str) -> CachedRepoInfo:
    """The cached repo ``repo_id`` (Hub ids are case-insensitive, so a case-only difference is accepted)."""
    repos = cached_repos()
    exact = [r for r in repos if r.repo_id == repo_id]
    matches = exact or [r for r in repos if r.repo_id.lower() == repo_id.lower()]
    if len(matches) == 1:
        return matches[0]
    raise ModelNotFound(
        f"no model '{repo_id}' in the Hugging Face cache at {hf_cache_dir()}; run `mesh-llm models download {repo_id}`"
    )


def _describe(revision: CachedRevisionInfo) -> str:
    refs = ",".join(sorted(revision.refs))
    return f"{refs}={revision.commit_hash[:7]}" if refs else revision.commit_hash[:7]


def cached_revision(repo: CachedRepoInfo, revision: str | None) -> CachedRevisionInfo:
    """The cached snapshot for a branch/tag name or a commit hash (7+ hex digits); by default ``main``,
    or the only snapshot when the repo was downloaded at a fixed commit."""
    if revision is None:
        if "main" in repo.refs:
            return repo.refs["main"]
        if len(repo.revisions) == 1:
            return next(iter(repo.revisions))
    elif revision in repo.refs:
        return repo.refs[revision]
    elif re.fullmatch(r"[0-9a-fA-F]{7,40}", revision):
        matches = [r for r in repo.revisions if r.commit_hash.startswith(revision.lower())]
        if len(matches) == 1:
            return matches[0]
    where = f"in the Hugging Face cache at {hf_cache_dir()} (cached: "
    where += ", ".join(sorted(_describe(r) for r in repo.revisions)) + ")"
    if revision is None:
        raise ModelNotFound(
            f"'{repo.repo_id}' has no 'main' snapshot {where}; pick one with `{repo.repo_id}@REVISION`"
        )
    raise ModelNotFound(
        f"no revision '{revision}' of '{repo.repo_id}' {where}; "
        f"run `mesh-llm models download {repo.repo_id}@{revision}`"
    )


def disk_size(spec: ModelSpec) -> int:
    """Bytes the model's own files take (symlinks followed into the HF blob store; sibling GGUFs in a
    safetensors folder are not counted)."""
    if spec.format == "gguf":
        files = gguf_shards(spec.path)
    else:
        files = [p for p in spec.path.rglob("*") if not is_gguf_name(p)]
    total = 0
    for path in files:
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:
            continue
    return total

