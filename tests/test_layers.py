"""The packages' import directions, read from the source: data flows HTTP → api → runtime → engines →
models → system, and no package reaches up (engines import only the scheduler of the runtime). The scheduler imports nothing of mesh_llm, so its policy
is read and tested alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mesh_llm"

# package -> the mesh_llm packages it may not import (directly or in a function)
FORBIDDEN = {
    "system": {"api", "runtime", "engines", "models", "mesh", "bench", "serve", "cli"},
    "models": {"api", "runtime", "engines", "mesh", "bench", "serve", "cli"},
    "engines": {"api", "runtime", "mesh", "bench", "serve", "cli"},
    "runtime": {"api", "mesh", "bench", "serve", "cli"},
    "api": {"mesh", "bench", "cli"},
}
ALLOWED = {"runtime.scheduler"}  # engines run the plans it makes; it imports nothing back


def imports(path: Path) -> set[str]:
    """The mesh_llm modules ``path`` imports, as dotted names below mesh_llm."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "mesh_llm":
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("mesh_llm."):
                found.add(node.module.removeprefix("mesh_llm."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("mesh_llm.") for a in node.names if a.name.startswith("mesh_llm.")}
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_one_above_it(package):
    wrong = []
    for path in sorted((SRC / package).rglob("*.py")):
        for module in imports(path):
            if module.split(".")[0] in FORBIDDEN[package] and module not in ALLOWED:
                wrong.append(f"{path.relative_to(SRC)} imports mesh_llm.{module}")
    assert not wrong, "\n".join(wrong)


def test_the_scheduler_imports_nothing_of_mesh_llm():
    assert imports(SRC / "runtime" / "scheduler.py") == set()
