"""`mesh-llm models download`: the one place mesh-llm reaches the Hugging Face Hub, and only when asked.

Files land in the standard Hugging Face cache, so ``resolve("org/name")`` finds them afterwards and other
tools share them. huggingface_hub resumes interrupted downloads and skips files already cached.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

from mesh_llm.models.spec import ModelNotFound, hf_cache_dir, hf_offline


class DownloadError(Exception):
    """The Hub could not deliver a repo that may well exist (gated, unreachable, interrupted)."""


def download(
    repo_id: str, revision: str | None = None, include: list[str] | None = None, progress: bool = True
) -> Path:
    """Fetch ``repo_id`` (optionally only the files matching the ``include`` glob patterns) into the
    Hugging Face cache and return its snapshot folder. With HF_HUB_OFFLINE set, only the cache is
    consulted: the call then checks that the repo is already there."""
    cache = hf_cache_dir()
    offline = hf_offline()
    at = f" at revision '{revision}'" if revision else ""
    bars_were_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        path = snapshot_download(
            repo_id, revision=revision, cache_dir=cache, allow_patterns=include, local_files_only=offline
        )
    except HFValidationError as e:
        raise ModelNotFound(f"'{repo_id}' is not a Hugging Face repo id (expected org/name): {e}") from e
    except GatedRepoError as e:
        raise DownloadError(
            f"'{repo_id}' is gated: accept its terms at https://huggingface.co/{repo_id}, "
            "then log in with `hf auth login`"
        ) from e
    except RepositoryNotFoundError as e:
        raise ModelNotFound(
            f"no repo '{repo_id}' on the Hugging Face Hub (a private one needs `hf auth login`)"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelNotFound(f"no revision '{revision}' of '{repo_id}' on the Hugging Face Hub") from e
    except IncompleteSnapshotError as e:
        raise DownloadError(
            f"the cached '{repo_id}'{at} is incomplete and the Hub cannot be reached to finish it; "
            f"rerun `mesh-llm models download {repo_id}` online"
        ) from e
    except LocalEntryNotFoundError as e:
        if offline:
            raise ModelNotFound(
                f"no model '{repo_id}'{at} in the Hugging Face cache at {cache}, and HF_HUB_OFFLINE is set; "
                "unset it to download"
            ) from e
        raise DownloadError(
            f"cannot reach the Hugging Face Hub to download '{repo_id}'{at}, and it is not in the cache at {cache}"
        ) from e
    finally:
        if not progress and not bars_were_disabled:
            enable_progress_bars()
    return Path(path)
