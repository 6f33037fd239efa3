"""Load order for llama.cpp builds that carry their own copy of libstdc++'s locale objects.

CUDA builds of llama.cpp compiled through nvcc can define and export libstdc++'s locale facet ids
(``std::numpunct<char>::id`` and 40 more) and the stream code that uses them inside
``libggml-cuda.so`` itself: seen with llama-cpp-python 0.3.36 built for CUDA 13 (H200, 2026-12-03; 1,538
``std::`` symbols defined there). Facet ids are STB_GNU_UNIQUE symbols, bound process-wide to the
first definition loaded. When ``libstdc++.so.6`` is loaded first (numpy, MLX and most C++
extensions load it), libggml-cuda's own locale code indexes facets with ids numbered by the other
copy, and its first ``ostream << long`` (``llama_model::print_info`` at model load) dies with SIGSEGV
(cuda-gdb: ``std::codecvt<char16_t>::do_unshift`` in libggml-cuda.so, from ``_M_insert<long>``);
``LD_DEBUG=bindings`` shows exactly these 85 symbols moving to libstdc++.so.6 when numpy comes first.
The other
order works for serving, but then another C++ library's locale code may be the one that crashes
(matplotlib did, in a benchmark harness that had loaded llama.cpp first).

So a process loads such a build before any C++ library: importing ``mesh_llm`` does it first thing
(CLI, ``python -m mesh_llm``, tests, a user's ``import mesh_llm`` made before numpy), and the llama
engine refuses with a clear message, instead of crashing, when it would be loaded too late. Builds
that keep libstdc++ to itself (CPU builds, Metal) are left alone and cost nothing but a symbol check.
``MESH_LLM_LLAMA_FIRST=0`` turns the early load off, for a process that will not serve GGUF models.

The early load has a price: MLX cannot run after such a build either. On an H100 (2026-12-06) with llama-cpp-python
0.3.36's CUDA build and MLX's CUDA build, ``mx.load`` of a safetensors file died with SIGSEGV in a
process that had loaded llama.cpp first (a matmul did not). So a process that is to run MLX must not
have loaded it: ``mesh-llm serve`` starts itself again without the early load when its models all go
to MLX, and refuses to put both engines in one process with such a build.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from typing import NoReturn

# libstdc++'s locale facet ids, in the new and old string ABI: defined by a library that carries a copy
FACET_IDS = frozenset({"_ZNSt7__cxx118numpunctIcE2idE", "_ZNSt8numpunctIcE2idE"})

_state: str | None = None  # "safe", "first", "late", or "off"
_carrier: Path | None = None  # the first library found that carries libstdc++


def library_dir() -> Path | None:
    """Where llama-cpp-python loads llama.cpp from (``LLAMA_CPP_LIB_PATH`` or its own lib/)."""
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return Path(os.environ["LLAMA_CPP_LIB_PATH"])
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent / "lib"


def carries_cxx_runtime(library: Path) -> bool:
    """Whether a shared library defines (not just uses) libstdc++'s locale facet ids. Without
    pyelftools (part of the llama extra) it cannot tell, says so once rather than break
    ``import mesh_llm``, and counts a CUDA library as carrying them: loading one first costs
    nothing, loading it late crashed (SIGSEGV on the H200 when pyelftools was missing)."""
    try:
        from elftools.common.exceptions import ELFError
        from elftools.elf.elffile import ELFFile
    except ImportError:
        warnings.warn("pyelftools is not installed, so mesh-llm cannot check whether llama.cpp's "
                      "libraries must load first (CUDA ones are loaded first); install "
                      "mesh-llm[llama]", stacklevel=2)
        return "cuda" in library.name

    try:
        with open(library, "rb") as f:
            elf = ELFFile(f)
            # the dynamic linker's own hash table: a lookup, where reading every symbol of
            # llama.cpp's libraries took 125 ms of each start
            table = elf.get_section_by_name(".gnu.hash") or elf.get_section_by_name(".hash")
            if table is not None:
                symbols = [table.get_symbol(name) for name in FACET_IDS]
            else:
                dynsym = elf.get_section_by_name(".dynsym")
                symbols = [] if dynsym is None else dynsym.iter_symbols()
            return any(sym is not None and sym.name in FACET_IDS and sym["st_shndx"] != "SHN_UNDEF"
                       for sym in symbols)
    except (OSError, ELFError):
        return False


def cxx_runtime_loaded() -> bool:
    """Whether libstdc++ is already mapped into this process."""
    try:
        return "libstdc++" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


# llama.cpp's CPU build runs its threads under OpenMP, whose barriers spin 300,000 times before they
# sleep. With every core busy elsewhere, spinning threads take the cores from the ones they wait for:
# four streams of the default model on 2 busy cores made 2.1 tok/s, a token every 3 s; with 10,000
# spins 42.7, and the same speed as before on an idle machine (docs/performance.md, "A CPU that
# other work shares"). Read once, when libgomp loads: a value the user set is kept.
OPENMP_SPINS = "10000"
_ADDED: set[str] = set()  # environment variables this process set for itself, not inherited


def environ_as_given() -> dict[str, str]:
    """The environment as this process was given it, for other programs it starts (the servers a
    benchmark compares run as their users run them)."""
    return {k: v for k, v in os.environ.items() if k not in _ADDED}


def prepare_llama() -> None:
    """Load a llama.cpp build that carries libstdc++ before anything else can (once per process)."""
    global _state, _carrier
    if _state is not None:
        return
    if "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = OPENMP_SPINS
        _ADDED.add("GOMP_SPINCOUNT")
    if os.environ.get("MESH_LLM_LLAMA_FIRST") == "0" or not sys.platform.startswith("linux"):
        _state = "off"
        return
    folder = library_dir()
    risky = [lib for lib in sorted(folder.glob("libggml*.so*")) if not lib.is_symlink()
             and carries_cxx_runtime(lib)] if folder is not None and folder.is_dir() else []
    _carrier = risky[0] if risky else None
    if not risky:
        _state = "safe"
    elif "llama_cpp.llama_cpp" in sys.modules:
        _state = "first"  # loaded by someone else: whether early enough, the load will tell
    elif cxx_runtime_loaded():
        _state = "late"
    else:
        # the library llama-cpp-python's import loads, loaded as it does: its C++ libraries before any
        # other, and none of its Python modules (numpy and jinja2 with them: 0.3 of 0.44 s on the GPU host)
        try:
            ctypes.CDLL(str(folder / "libllama.so"))
        except OSError:
            _state = "safe"  # nothing loaded; the llama engine's own import says what is wrong
            return
        _state = "first"


def loaded_first() -> bool:
    """Whether this process loaded a llama.cpp build that carries libstdc++ ahead of the rest."""
    return _state == "first"


def mlx_load_problem() -> str | None:
    """Why MLX must not run in this process, or None."""
    if not loaded_first():
        return None
    return (f"this process loaded {_carrier} first, which carries its own copy of libstdc++'s locale "
            "objects, and MLX's C++ code crashes after it; start the process with MESH_LLM_LLAMA_FIRST=0 "
            "to run MLX in it (mesh-llm serve does so by itself)")


def relaunch_without_llama() -> NoReturn:
    """Replace this process with a fresh run of its own command line that does not load llama.cpp
    first: the same pid, arguments and open files, so a supervisor sees one process."""
    sys.stdout.flush()
    print(f"starting again without llama.cpp loaded first: {_carrier} carries its own libstdc++, and "
          "MLX crashes after it", file=sys.stderr, flush=True)
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
              {**os.environ, "MESH_LLM_LLAMA_FIRST": "0"})


def llama_load_problem() -> str | None:
    """Why the llama engine must not load in this process, or None."""
    if _state != "late":
        return None
    return (f"{_carrier} carries its own copy of libstdc++'s locale objects and crashes when another "
            "C++ library (numpy, MLX) was loaded first; import mesh_llm before those (mesh-llm serve "
            "does), or rebuild llama-cpp-python so that its CUDA library keeps them hidden")
