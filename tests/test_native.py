"""Load order for llama.cpp builds that carry their own libstdc++ (mesh_llm/system/native.py): the check on real
ELF files, and what `import mesh_llm` does with such a build before and after another C++ library.

The crash itself needs the CUDA build on the GPU machine (tests/engines/test_llama_gpu.py). Here a
library built like it (C++ code linked with a static libstdc++, so it defines and exports the locale
facet ids) sits beside the real CPU llama.cpp libraries in LLAMA_CPP_LIB_PATH, which makes the build
look like the CUDA one to the check."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mesh_llm import children
from mesh_llm.system import native
from support import free_port, start_server

SOURCE = '#include <sstream>\nextern "C" int describe(long v) { std::ostringstream s; s << v; return s.str().size(); }\n'


def build(tmp: Path, name: str, static: bool, hash_style: str = "gnu") -> Path:
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build a test library")
    src = tmp / "lib.cpp"
    src.write_text(SOURCE)
    out = tmp / name
    flags = ["-static-libstdc++"] if static else []
    subprocess.run(["g++", "-shared", "-fPIC", f"-Wl,--hash-style={hash_style}", *flags, "-o", str(out),
                    str(src)], check=True)
    return out


@pytest.mark.parametrize("hash_style", ["gnu", "sysv"])  # the symbol hash tables the check looks in
def test_a_library_with_a_static_libstdcxx_is_recognised(tmp_path, hash_style):
    assert native.carries_cxx_runtime(build(tmp_path, "libstatic.so", static=True, hash_style=hash_style))
    assert not native.carries_cxx_runtime(build(tmp_path, "libshared.so", static=False, hash_style=hash_style))
    (tmp_path / "notelf.so").write_text("not an ELF file")
    assert not native.carries_cxx_runtime(tmp_path / "notelf.so")


def test_without_pyelftools_a_cuda_library_counts_as_carrying_it(tmp_path, monkeypatch):
    """On the H200 a CUDA build loaded late without pyelftools died with SIGSEGV: unable to look,
    the check loads CUDA libraries first and leaves the others alone."""
    for name in ("elftools", "elftools.common.exceptions", "elftools.elf.elffile"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.warns(UserWarning, match="pyelftools is not installed"):
        assert native.carries_cxx_runtime(tmp_path / "libggml-cuda.so")
    with pytest.warns(UserWarning):
        assert not native.carries_cxx_runtime(tmp_path / "libggml-cpu.so")


def test_the_installed_llama_cpp_build_keeps_libstdcxx_to_itself():
    folder = native.library_dir()
    libs = [p for p in folder.glob("lib*.so*") if not p.is_symlink()]
    assert libs, folder
    assert not any(native.carries_cxx_runtime(p) for p in libs)


@pytest.fixture
def risky_build(tmp_path) -> Path:
    """The installed llama.cpp libraries plus one that carries libstdc++, in a folder of their own."""
    folder = tmp_path / "lib"
    folder.mkdir()
    for lib in native.library_dir().iterdir():
        (folder / lib.name).symlink_to(lib.resolve())
    build(tmp_path, "libggml-carrier.so", static=True).rename(folder / "libggml-carrier.so")
    return folder


def python(code: str, lib: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib)}
    env.pop("MESH_LLM_LLAMA_FIRST", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_import_mesh_llm_loads_such_a_build_before_any_cxx_library(risky_build):
    """Its libraries, not llama-cpp-python's Python modules: those import numpy and jinja2, which
    made the early load 0.44 s on the GPU host, and a restart for MLX pays it for nothing."""
    done = python("import mesh_llm, sys\n"
                  "from pathlib import Path\n"
                  "from mesh_llm.system import native\n"
                  "maps = Path('/proc/self/maps').read_text()\n"
                  "print(native._state, 'libllama.so' in maps, 'llama_cpp' in sys.modules, 'numpy' in sys.modules)\n"
                  "from mesh_llm.engines.llama.engine import LlamaEngine\n"
                  "print('engine ok')", risky_build)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["first True False False", "engine ok"]


@pytest.mark.parametrize("first, call, hint", [
    # the llama engine after another C++ library
    ("import numpy, mesh_llm", "engine_class('llama')", "import mesh_llm before"),
    # MLX after the early load (on an H100 its safetensors reader died with SIGSEGV)
    ("import mesh_llm", "engine_class('mlx').load(Path('no-such-model'), EngineOptions())", "MESH_LLM_LLAMA_FIRST=0"),
])
def test_an_engine_that_would_crash_in_this_order_refuses_with_the_reason(risky_build, first, call, hint):
    done = python(f"{first}\n"
                  "from pathlib import Path\n"
                  "from mesh_llm.engines import engine_class\n"
                  "from mesh_llm.engines.base import EngineError, EngineOptions\n"
                  "try:\n"
                  f"    {call}\n"
                  "except EngineError as e:\n"
                  "    print('refused:', e)\n", risky_build)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "libggml-carrier.so" in done.stdout
    assert hint in done.stdout


def test_the_early_load_can_be_turned_off(risky_build):
    done = subprocess.run([sys.executable, "-c", "import mesh_llm, sys; from mesh_llm.system import native; "
                           "print(native._state, 'llama_cpp' in sys.modules)"], capture_output=True, text=True,
                          env={**os.environ, "LLAMA_CPP_LIB_PATH": str(risky_build), "MESH_LLM_LLAMA_FIRST": "0"},
                          timeout=120)
    assert done.stdout.split() == ["off", "False"], done.stderr


def mapped(pid: int) -> str:
    """The files a process has mapped (llama.cpp's libllama once llama_cpp is imported)."""
    return Path(f"/proc/{pid}/maps").read_text()


def test_serve_starts_again_without_the_early_load_to_run_mlx(risky_build, tmp_path, monkeypatch):
    """MLX crashed after a CUDA llama.cpp build loaded first (SIGSEGV in ``mx.load``, H100): a server
    whose models all go to MLX replaces itself with a process that never loads llama.cpp."""
    monkeypatch.delenv("MESH_LLM_LLAMA_FIRST", raising=False)
    server = start_server(["--engine", "mlx"], tmp_path / "server.log", env={"LLAMA_CPP_LIB_PATH": str(risky_build)})
    try:
        assert "starting again without llama.cpp loaded first" in server.output()
        assert "libggml-carrier.so" in server.output()  # the reason names the library
        assert "/libllama" not in mapped(server.proc.pid)
        reply = httpx.post(server.url + "/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
                           "max_tokens": 3, "temperature": 0}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()


@pytest.mark.parametrize("engine, not_yet", [
    # every model goes to MLX: nothing to resolve first
    ("mlx", {"mesh_llm.serve", "mesh_llm.models", "numpy", "uvicorn"}),
    # a safetensors folder goes to MLX: resolved and planned first, the server's modules not imported
    ("auto", {"uvicorn", "fastapi", "mesh_llm.runtime.worker", "mesh_llm.api.app"}),
])
def test_serve_starts_again_before_importing_the_server(risky_build, engine, not_yet):
    """The restart for MLX costs what the first process imports before it (0.54 s on the GPU host,
    0.38-0.42 of it the CLI's and the server's modules). Here the fresh process finds the port taken,
    so the test needs no model load."""
    from mesh_llm.models import default_mlx_folder

    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(risky_build)}
    env.pop("MESH_LLM_LLAMA_FIRST", None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = children.run([sys.executable, "-X", "importtime", "-m", "mesh_llm", "serve", "--engine", engine,
                             "--model", str(default_mlx_folder()), "--port", str(taken.getsockname()[1])],
                            capture_output=True, text=True, timeout=120, check=False, env=env)
    assert done.returncode == 2, done.stderr
    first, restart, second = done.stderr.partition("starting again without llama.cpp loaded first")
    assert restart, done.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in first.splitlines() if "import time:" in line}
    assert "mesh_llm.cli" in imported
    assert not imported & not_yet
    assert "cannot listen" in second  # the fresh process went on to serve


def test_serve_keeps_the_early_load_for_gguf_models(risky_build, tmp_path, monkeypatch):
    monkeypatch.delenv("MESH_LLM_LLAMA_FIRST", raising=False)
    server = start_server(["--engine", "llama"], tmp_path / "server.log", env={"LLAMA_CPP_LIB_PATH": str(risky_build)})
    try:
        assert "starting again" not in server.output()
        assert "/libllama" in mapped(server.proc.pid)
    finally:
        server.stop()


def test_serve_refuses_both_engines_in_one_process_with_such_a_build(risky_build):
    from mesh_llm.models import default_mlx_folder

    folder = default_mlx_folder()  # served by the MLX engine; the default model by the llama engine
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(risky_build)}
    env.pop("MESH_LLM_LLAMA_FIRST", None)
    done = children.run([sys.executable, "-m", "mesh_llm", "serve", "--model", "default", "--model", str(folder),
                         "--alias", "a", "--alias", "b", "--port", str(free_port())],
                        capture_output=True, text=True, timeout=120, check=False, env=env)
    assert done.returncode == 2, done.stderr
    assert "cannot share a process with MLX" in done.stderr
    assert "starting again" not in done.stderr


def test_import_gguf_starts_again_without_the_early_load(risky_build, tmp_path, default_gguf):
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(risky_build)}
    env.pop("MESH_LLM_LLAMA_FIRST", None)
    done = children.run([sys.executable, "-m", "mesh_llm", "models", "import-gguf", str(default_gguf),
                         str(tmp_path / "out")], capture_output=True, text=True, timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stderr
    assert "starting again without llama.cpp loaded first" in done.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_llama_build_that_cannot_load_stops_the_start_in_one_line(tmp_path):
    """A folder whose library carries libstdc++ but holds no libllama: `import mesh_llm` tried to
    load it first and raised FileNotFoundError, and the engine's import did the same, as tracebacks."""
    folder = tmp_path / "lib"
    folder.mkdir()
    build(tmp_path, "libggml-carrier.so", static=True).rename(folder / "libggml-carrier.so")
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(folder)}
    env.pop("MESH_LLM_LLAMA_FIRST", None)
    done = children.run([sys.executable, "-m", "mesh_llm", "serve", "--engine", "llama", "--port", str(free_port())],
                        capture_output=True, text=True, timeout=120, check=False, env=env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "the llama engine cannot be imported" in done.stderr
    assert f"LLAMA_CPP_LIB_PATH ({folder}) must name a folder" in done.stderr


def _spins_seen(env: dict) -> tuple[str, bool, bool]:
    code = ("import os\nbefore = 'libgomp' in open('/proc/self/maps').read()\nimport mesh_llm\n"
            "from mesh_llm.system import native\n"
            "print(os.environ.get('GOMP_SPINCOUNT'), before, 'GOMP_SPINCOUNT' in native.environ_as_given())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env, timeout=120).stdout.split()
    return out[0], out[1] == "True", out[2] == "True"


def test_openmp_threads_spin_briefly_unless_the_user_says_otherwise():
    """llama.cpp's CPU threads wait at OpenMP barriers; `import mesh_llm` sets libgomp's spin count
    before the library loads (its threads spun 300,000 times and collapsed on a busy CPU), keeps a
    value the user set, and does not hand its own to programs a benchmark compares it with."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert _spins_seen(env) == (native.OPENMP_SPINS, False, False)
    assert _spins_seen({**env, "GOMP_SPINCOUNT": "300000"}) == ("300000", False, True)


def test_the_installed_llama_cpp_build_waits_under_openmp():
    """What the spin count rests on: the CPU build links libgomp (a build on its own thread pool would
    need llama.cpp's threadpool settings instead)."""
    folder = native.library_dir()
    cpu = [lib for lib in folder.glob("libggml-cpu*.so*") if not lib.is_symlink()]
    assert cpu, f"no libggml-cpu in {folder}"
    needed = subprocess.run(["ldd", str(cpu[0])], capture_output=True, text=True, check=True).stdout
    assert "libgomp" in needed, needed
