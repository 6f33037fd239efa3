"""Child processes that never outlive this one: a test run killed with SIGKILL, or a crashed
``mesh-llm bench``, must not leave servers running.

Each child starts in its own session (a Ctrl-C at the terminal reaches only the parent, which stops
its children in order) and, on Linux, with ``PR_SET_PDEATHSIG`` = SIGKILL: the kernel kills it when
its parent dies, however that happens. The kernel ties that signal to the *thread* that forked, so
``popen`` forks from the main thread or from one helper thread that lives as long as the process;
``run`` waits for its child on the thread that forked it, so any thread may call it.

The signal reaches the direct child only. ``popen(..., whole_group=True)`` also covers what that child
starts (``make serve`` starts the server): a watcher process, blocked on a pipe from this one, kills
the child's process group when the pipe closes, that is when this process dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

_PR_SET_PDEATHSIG = 1
_forker: ThreadPoolExecutor | None = None
_forker_lock = threading.Lock()

# Kill the group when stdin closes (the parent died); leave once the group is gone on its own.
_WATCH = """
import os, select, signal, sys
group = int(sys.argv[1])
try:
    while True:
        if select.select([0], [], [], 1.0)[0] and not os.read(0, 1):
            os.killpg(group, signal.SIGKILL)
            break
        os.killpg(group, 0)
except ProcessLookupError:
    pass
"""


def popen(args, *, whole_group: bool = False, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)`` in a new session, killed with SIGKILL when this process
    dies; with ``whole_group``, so is every process in the child's group."""
    kwargs = _tied(kwargs)
    if threading.current_thread() is threading.main_thread():
        proc = subprocess.Popen(args, **kwargs)
    else:
        proc = _forker_thread().submit(subprocess.Popen, args, **kwargs).result()
    if whole_group:
        watcher = subprocess.Popen([sys.executable, "-c", _WATCH, str(proc.pid)], stdin=subprocess.PIPE,
                                   start_new_session=True)
        proc.group_watcher = watcher  # holds the pipe's write end for as long as ``proc`` lives
    return proc


def run(args, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args, **kwargs)`` whose child is killed with SIGKILL if this process dies."""
    return subprocess.run(args, **_tied(kwargs))


def _tied(kwargs: dict) -> dict:
    if "preexec_fn" in kwargs:
        raise ValueError("mesh_llm.children sets preexec_fn itself")
    kwargs.setdefault("start_new_session", True)
    if sys.platform.startswith("linux"):
        kwargs["preexec_fn"] = _die_with(os.getpid())
    return kwargs


def _die_with(parent: int):
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _forker_thread() -> ThreadPoolExecutor:
    global _forker
    with _forker_lock:
        if _forker is None:
            _forker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mesh-llm-forker")
        return _forker
