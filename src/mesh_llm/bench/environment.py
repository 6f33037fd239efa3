"""What the results were measured on: machine, accelerator, package versions, thread count default."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from mesh_llm.system.machine import physical_cores

_PACKAGES = ["mesh-llm", "mlx", "mlx-cpu", "mlx-cuda-13", "mlx-metal", "mlx-lm", "llama_cpp_python", "tokenizers"]


def describe(llama_server: Path | None) -> dict:
    """Machine, accelerator and versions, for summary.json and report.md."""
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if llama_server is not None:
        lines = _lines([str(llama_server), "--version"])
        versions["llama-server"] = next((x for x in lines if x.startswith("version")), "; ".join(lines[:2]))
    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": physical_cores(),
        "gpu": "; ".join(_lines(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])) or None,
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "versions": versions,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _lines(argv: list[str]) -> list[str]:
    """The non-empty lines a tool prints (none when it is not there)."""
    if shutil.which(argv[0]) is None and not Path(argv[0]).is_file():
        return []
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip()]
