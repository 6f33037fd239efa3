"""Servers the tests (and `mesh-llm bench`) start die with the process that started them, however it
ends: killed with SIGKILL, or exiting without stopping them. Real `mesh-llm serve` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mesh_llm import children
from support import live_children

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
TESTS = Path(__file__).resolve().parent
SERVE = ["--engine", "llama", "--ctx-size", "512"]  # the embedded GGUF: the quickest real server

# A test process in miniature: starts a real server through tests/support.py, says its pid, then
# either waits to be killed or returns without stopping it.
PARENT = f"""
import sys, time
from pathlib import Path
from support import start_server
server = start_server({SERVE!r}, Path(sys.argv[1]))
print(server.proc.pid, flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not running(pid)


def start_parent(tmp_path, mode: str) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    parent = children.popen([sys.executable, "-c", PARENT, str(tmp_path / "server.log"), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = parent.stdout.readline()  # once the server answers /health
    if not line:
        parent.kill()
        pytest.fail(f"the parent exited with {parent.wait()}:\n{parent.stderr.read()}")
    server = int(line)
    assert running(server) and "mesh_llm serve" in live_children(parent.pid).get(server, "")
    return parent, server


def test_a_server_dies_with_its_killed_parent(tmp_path):
    parent, server = start_parent(tmp_path, "wait")
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert gone_within(server, 10), f"mesh-llm serve (pid {server}) outlived its killed parent"


def test_a_server_left_running_dies_when_its_parent_exits(tmp_path):
    parent, server = start_parent(tmp_path, "return")
    assert parent.wait(60) == 0
    assert gone_within(server, 10), f"mesh-llm serve (pid {server}) outlived its parent's exit"


def test_a_child_forked_from_a_short_lived_thread_outlives_the_thread():
    """The death signal follows the forking thread: popen forks from one that lives on."""
    started = []
    thread = threading.Thread(target=lambda: started.append(
        children.popen([sys.executable, "-c", "import time; time.sleep(60)"])))
    thread.start()
    thread.join()
    child = started[0]
    try:
        time.sleep(1)
        assert child.poll() is None, f"killed with its forking thread: {child.returncode}"
    finally:
        child.kill()
        child.wait()


def test_a_whole_group_dies_with_its_killed_parent(tmp_path):
    """whole_group: a child's own children (make serve's server) die too."""
    grandchild = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time\n"
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(grandchild)!r} + '.tmp', 'w').write(str(g.pid))\n"
            f"import os; os.replace({str(grandchild)!r} + '.tmp', {str(grandchild)!r})\n"
            "time.sleep(600)\n")
    # A parent that starts the child with whole_group, then waits to be killed.
    parent_code = ("import sys, time\nfrom mesh_llm import children\n"
                   f"children.popen([sys.executable, '-c', {code!r}], whole_group=True)\n"
                   "print('started', flush=True)\ntime.sleep(600)\n")
    parent = children.popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 30
    while not grandchild.exists():
        assert time.monotonic() < deadline, "the grandchild never started"
        time.sleep(0.1)
    pid = int(grandchild.read_text())
    assert running(pid)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert gone_within(pid, 10), f"the grandchild (pid {pid}) outlived the killed parent"
