"""With one engine's package missing, mesh-llm serves what the other can and names the missing extra.

A ``sitecustomize`` on PYTHONPATH hides a package from the server process the way an uninstalled one
is hidden: importlib cannot find it and importing it fails."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from mesh_llm import children
from support import free_port, start_server

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

BLOCKER = '''
import importlib.abc, os, sys
class _Hide(importlib.abc.MetaPathFinder):
    hidden = set(os.environ["HIDE_PACKAGES"].split(","))
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Hide())
'''


def hiding(tmp_path, package: str) -> dict:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "HIDE_PACKAGES": package}


def serve(env: dict, *args: str) -> subprocess.CompletedProcess:
    return children.run([sys.executable, "-m", "mesh_llm", "serve", "--port", str(free_port()), *args],
                        capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def test_without_llama_cpp_the_default_model_is_served_by_mlx(tmp_path):
    server = start_server([], tmp_path / "log", env=hiding(tmp_path, "llama_cpp"))
    try:
        entry = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert entry["engine"] == "mlx" and entry["format"] == "safetensors"
    finally:
        server.stop()


def test_without_llama_cpp_asking_for_llama_names_the_extra(tmp_path):
    result = serve(hiding(tmp_path, "llama_cpp"), "--engine", "llama")
    assert result.returncode == 2
    assert "pip install 'mesh-llm[llama]'" in result.stderr


def test_without_mlx_a_safetensors_folder_names_the_extra(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    result = serve(hiding(tmp_path, "mlx"), "--model", str(model))
    assert result.returncode == 2
    assert "pip install 'mesh-llm[mlx]'" in result.stderr
