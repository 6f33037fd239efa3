"""Print each file that appears under a folder, with the time it was first seen, until killed.

    python3 benchmarks/kernel_watch.py FOLDER > kernels.log &

Pointed at MLX's kernel folder (MLX_PTX_CACHE_DIR, mesh-llm's ``$MESH_LLM_HOME/mlx-kernels``) it shows
which CUDA kernels a run compiled and when, to set beside a server log's slow steps (lines are
``HH:MM:SS.mmm  epoch  path``; the server logs local time too).
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    folder, seen = sys.argv[1], set()
    while True:
        for root, _, files in os.walk(folder):
            for name in files:
                path = os.path.join(root, name)
                if path not in seen:
                    seen.add(path)
                    now = time.time()
                    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
                    print(f"{stamp}  {now:.3f}  {os.path.relpath(path, folder)}", flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
