"""How each backend is configured for N streams (`--concurrency`), checked against the flags the
installed servers really take; the single-stream command lines stay as they were."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mesh_llm.bench.backends import BACKENDS, Settings, mesh_takes_max_batch

SETTINGS = Settings(threads=2, ctx_size=1024, llama_server=Path("/opt/llama/llama-server"))


def argv(name: str, concurrency: int | None) -> list[str]:
    return BACKENDS[name].argv(Path("MODEL"), 8080, replace(SETTINGS, concurrency=concurrency))


def help_text(*module: str) -> str:
    done = subprocess.run([sys.executable, "-m", *module, "--help"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}, check=True)
    return done.stdout


def test_llama_server_gets_a_slot_and_a_full_context_per_stream():
    assert argv("llama-server", None)[-6:] == ["-c", "1024", "-np", "1", "-ngl", "999"]
    assert argv("llama-server", 1) == argv("llama-server", None)
    assert argv("llama-server", 8)[-6:] == ["-c", "8192", "-np", "8", "-ngl", "999"]
    assert BACKENDS["llama-server"].restarts_per_level(SETTINGS)


def test_mlx_lm_decodes_n_at_once():
    assert "--decode-concurrency" not in argv("mlx-lm", None)
    assert argv("mlx-lm", 4)[-4:] == ["--decode-concurrency", "4", "--prompt-concurrency", "4"]
    # its prompt batch (default 8) would raise the decode batch to 8: capped at N
    assert argv("mlx-lm-plain", 32)[-4:] == ["--decode-concurrency", "32", "--prompt-concurrency", "8"]
    assert BACKENDS["mlx-lm"].restarts_per_level(SETTINGS)
    text = help_text("mlx_lm.server")
    assert "--decode-concurrency" in text and "--prompt-concurrency" in text


def test_llama_cpp_server_has_no_batch_and_is_told_not_to_cut_streams_short():
    assert "--interrupt_requests" not in argv("llama-cpp-python", None)
    assert argv("llama-cpp-python", 4)[-2:] == ["--interrupt_requests", "false"]
    assert not BACKENDS["llama-cpp-python"].restarts_per_level(SETTINGS)
    assert "--interrupt_requests" in help_text("llama_cpp.server")


@pytest.mark.parametrize("name", ["mesh-llama", "mesh-mlx"])
def test_mesh_gets_max_batch_where_it_has_it(name):
    has_it = "--max-batch" in help_text("mesh_llm", "serve")
    assert mesh_takes_max_batch() == has_it
    assert "--max-batch" not in argv(name, None)
    assert ("--max-batch" in argv(name, 4)) == has_it
    if has_it:
        assert argv(name, 4)[-2:] == ["--max-batch", "4"]
    assert BACKENDS[name].restarts_per_level(SETTINGS) == has_it
