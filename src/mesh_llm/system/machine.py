"""What this machine offers the engines and the bench: one count of physical cores, so that every
engine, BLAS and benchmark defaults to the same number of threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def physical_cores() -> int:
    """Physical cores this process may run on: matmuls gain nothing from SMT siblings, and a
    container's CPU set can be smaller than the machine."""
    if hasattr(os, "sched_getaffinity"):
        cpus = os.sched_getaffinity(0)
        cores = set()
        for cpu in cpus:
            try:
                topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
                cores.add((topology / "physical_package_id").read_text().strip()
                          + ":" + (topology / "core_id").read_text().strip())
            except OSError:
                return len(cpus)
        return max(1, len(cores))
    if sys.platform == "darwin":  # performance cores: efficiency cores slow every step to their pace
        for key in ("hw.perflevel0.physicalcpu", "hw.physicalcpu"):
            out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, check=False).stdout
            if out.strip().isdigit():
                return int(out)
    return os.cpu_count() or 1
