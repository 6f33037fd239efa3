"""Mesh nodes live for one test module: each module builds the mesh its scenario needs, in a home
of its own for mesh state (node keys, members' addresses), so that nodes of different modules (or
runs) with the same names and token never find each other; models and the BLAS copy stay shared."""

from __future__ import annotations

import os

import pytest
from mesh_nodes import Nodes

from mesh_llm.models.spec import home_dir

SHARED = ("models", "blas", "mlx-kernels")  # what a node makes once and every node may reuse


@pytest.fixture(scope="module", autouse=True)
def mesh_home(tmp_path_factory):
    real = home_dir()
    home = tmp_path_factory.mktemp("mesh-home")
    for name in SHARED:
        (real / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(real / name, target_is_directory=True)
    before = os.environ.get("MESH_LLM_HOME")
    os.environ["MESH_LLM_HOME"] = str(home)
    yield home
    if before is None:
        del os.environ["MESH_LLM_HOME"]
    else:
        os.environ["MESH_LLM_HOME"] = before


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, mesh_home):
    started = Nodes(tmp_path_factory.mktemp("mesh"))
    yield started
    started.stop_all()
