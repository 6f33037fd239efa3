"""`download` through the real huggingface_hub.snapshot_download, offline, against a real cache layout."""

from __future__ import annotations

import importlib

import pytest
from huggingface_hub import constants
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import are_progress_bars_disabled

from mesh_llm.models import ModelNotFound, resolve
from mesh_llm.models.download import DownloadError, download

download_module = importlib.import_module("mesh_llm.models.download")  # the package attribute is the function

SHA_A = "a" * 40
SHA_B = "b" * 40


@pytest.fixture
def cached(hf_repo, blobs):
    """org/Tiny at main (SHA_A) and at tag v1 (SHA_B)."""
    files = {"config.json": blobs.config, "model.safetensors": blobs.safetensors}
    main = hf_repo("org/Tiny", files, commit=SHA_A)
    v1 = hf_repo("org/Tiny", {**files, "README.md": b"#"}, commit=SHA_B, refs=("v1",))
    return main.resolve(), v1.resolve()


def test_offline_download_returns_the_cached_snapshot(cached):
    main, _ = cached
    path = download("org/Tiny", progress=False)
    assert path == main
    assert resolve("org/Tiny").path == path
    assert resolve(str(path)).name == "Tiny"  # the snapshot folder by path: named after the repo, not the commit


def test_offline_download_of_a_revision(cached):
    _, v1 = cached
    assert download("org/Tiny", revision="v1", progress=False) == v1
    assert download("org/Tiny", revision=SHA_B, progress=False) == v1
    assert resolve("org/Tiny@v1").path == v1


def test_include_patterns(cached):
    main, _ = cached
    assert download("org/Tiny", include=["*.json", "*.safetensors"], progress=False) == main


def test_offline_from_the_environment_alone(cached, monkeypatch):
    """HF_HUB_OFFLINE set after huggingface_hub was imported still keeps download off the network."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert download("org/Tiny", progress=False) == cached[0]


def test_missing_repo(hf_cache):
    with pytest.raises(ModelNotFound) as error:
        download("foo/bar", progress=False)
    assert str(error.value) == (
        f"no model 'foo/bar' in the Hugging Face cache at {hf_cache}, and HF_HUB_OFFLINE is set; unset it to download"
    )


def test_missing_revision(cached):
    with pytest.raises(ModelNotFound, match="no model 'org/Tiny' at revision 'v2' in the Hugging Face cache"):
        download("org/Tiny", revision="v2", progress=False)


def test_invalid_repo_id():
    with pytest.raises(ModelNotFound, match="'bad//id' is not a Hugging Face repo id"):
        download("bad//id", progress=False)


def test_progress_bars_are_restored(cached):
    before = are_progress_bars_disabled()
    download("org/Tiny", progress=False)
    assert are_progress_bars_disabled() == before


def _hub_error(cls, status: int):
    import httpx2

    request = httpx2.Request("GET", "https://huggingface.co/api/models/foo/bar")
    return cls(f"{status} from the Hub", response=httpx2.Response(status, request=request))


@pytest.mark.parametrize(("error", "kind", "message"), [
    (lambda: _hub_error(RepositoryNotFoundError, 404), ModelNotFound,
     r"^no repo 'foo/bar' on the Hugging Face Hub \(a private one needs `hf auth login`\)$"),
    (lambda: _hub_error(GatedRepoError, 403), DownloadError,
     r"^'foo/bar' is gated: accept its terms at https://huggingface.co/foo/bar, then log in with `hf auth login`$"),
    (lambda: _hub_error(RevisionNotFoundError, 404), ModelNotFound,
     r"^no revision 'v9' of 'foo/bar' on the Hugging Face Hub$"),
    (lambda: LocalEntryNotFoundError("Got: ConnectError\nmany lines"), DownloadError,
     r"^cannot reach the Hugging Face Hub to download 'foo/bar' at revision 'v9', and it is not in the cache at "),
])
def test_hub_errors_become_one_line_messages(error, kind, message, monkeypatch):
    """What the Hub answers online, simulated: each failure is one line naming the repo and the fix."""
    def fail(*args, **kwargs):
        raise error()

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(download_module, "snapshot_download", fail)
    with pytest.raises(kind, match=message):
        download("foo/bar", revision="v9", progress=False)
