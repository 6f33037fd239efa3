"""Mesh nodes live for one test module: each module builds the mesh its scenario needs."""

from __future__ import annotations

import pytest
from mesh_nodes import Nodes


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    started = Nodes(tmp_path_factory.mktemp("mesh"))
    yield started
    started.stop_all()
