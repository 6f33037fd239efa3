"""Real model files and a real Hugging Face cache layout, built in tmp_path; nothing reaches the network."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from huggingface_hub import constants
from safetensors.numpy import save_file


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """A fresh mesh-llm home and HF cache for every test, and HF offline however huggingface_hub was imported."""
    monkeypatch.setenv("MESH_LLM_HOME", str(tmp_path / "mesh-home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def hf_cache(tmp_path) -> Path:
    return tmp_path / "hf-home" / "hub"


@dataclass(frozen=True)
class Blobs:
    """Bytes of real, tiny model files: a config, safetensors weights, a GGUF."""

    config: bytes
    safetensors: bytes
    gguf: bytes


@pytest.fixture(scope="session")
def blobs(tmp_path_factory) -> Blobs:
    d = tmp_path_factory.mktemp("blobs")
    save_file({"w": np.arange(32, dtype=np.float32).reshape(4, 8)}, str(d / "x.safetensors"))
    writer = GGUFWriter(str(d / "x.gguf"), "llama")
    writer.add_tensor("w", np.ones((2, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = json.dumps({"model_type": "llama", "hidden_size": 8}).encode()
    return Blobs(config, (d / "x.safetensors").read_bytes(), (d / "x.gguf").read_bytes())


def write_files(folder: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


@pytest.fixture
def files(tmp_path):
    """Factory: ``files("folder", {name: bytes})`` writes them under tmp_path and returns the folder."""
    return lambda folder, contents: write_files(tmp_path / folder, contents)


@pytest.fixture
def st_folder(files, blobs) -> Path:
    """A minimal safetensors model folder."""
    return files("tiny-llama", {"config.json": blobs.config, "model.safetensors": blobs.safetensors})


def make_hf_repo(
    cache: Path, repo_id: str, files: dict[str, bytes], commit: str | None = None, refs: tuple[str, ...] = ("main",)
) -> Path:
    """One snapshot of ``repo_id`` in the exact Hugging Face cache layout: content-addressed blobs,
    snapshot files as relative symlinks to them, refs naming the commit. Returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = commit or hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hf_repo(hf_cache):
    """Factory: ``hf_repo("org/name", {file: bytes}, commit=..., refs=(...), cache=...)`` -> snapshot folder."""
    return lambda repo_id, files, cache=None, **kw: make_hf_repo(cache or hf_cache, repo_id, files, **kw)
