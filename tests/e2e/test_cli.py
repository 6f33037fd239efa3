"""Startup errors are one clear line and exit code 2; `mesh-llm models` works offline."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from mesh_llm import children
from support import free_port

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out


def mesh(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return children.run([sys.executable, "-m", "mesh_llm", *args], capture_output=True, text=True,
                        timeout=timeout)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return errors[0]


def test_missing_model_path(tmp_path):
    result = mesh("serve", "--model", str(tmp_path / "nope.gguf"), "--port", str(free_port()))
    assert result.returncode == 2
    assert "nope.gguf" in one_error_line(result)


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    result = mesh("serve", "--model", str(tmp_path), "--port", str(free_port()))
    assert result.returncode == 2
    assert str(tmp_path) in one_error_line(result)


def test_corrupt_gguf_is_reported_at_load(tmp_path, default_gguf):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(default_gguf.read_bytes()[:1_000_000])  # truncated
    result = mesh("serve", "--model", str(bad), "--port", str(free_port()))
    assert result.returncode == 2
    assert "broken.gguf" in one_error_line(result)


def test_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = mesh("serve", "--engine", "llama", "--port", str(port))
    assert result.returncode == 2
    assert str(port) in one_error_line(result)


def test_llama_engine_on_safetensors_says_how_to_convert(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    result = mesh("serve", "--model", str(tmp_path), "--engine", "llama", "--port", str(free_port()))
    assert result.returncode == 2
    assert "convert" in one_error_line(result)


@pytest.mark.parametrize("flag", [["--engine", "tensorrt"], ["--quantize", "3"], ["--max-batch", "0"],
                                  ["--prefill-step", "8"], ["--ctx-size", "-5"], ["--threads", "0"],
                                  ["--max-queue", "-1"], ["--cache-entries", "-1"]])
def test_bad_flag_values(flag):
    result = mesh("serve", *flag, "--port", str(free_port()))
    assert result.returncode == 2
    assert flag[0] in one_error_line(result)


def test_the_command_imports_the_benchmark_runners_only_to_run_them():
    """Every `mesh-llm` command imports the CLI, and a restart for MLX (mesh_llm/system/native.py) imports it
    only to start again: the bench's runners (httpx, numpy, its tokenizer) wait for `mesh-llm bench`."""
    code = ("import sys, mesh_llm.cli\n"
            "print([m for m in ('httpx', 'numpy', 'mesh_llm.bench.runner', 'mesh_llm.bench.concurrency') "
            "if m in sys.modules])")
    done = children.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_cache_that_cannot_be_written_stops_the_start_in_one_line(tmp_path):
    """The default model's engine forms are made in mesh-llm's cache on first use (models/default.py)."""
    (tmp_path / "a-file").write_text("")
    env = {**os.environ, "MESH_LLM_HOME": str(tmp_path / "a-file" / "home")}
    result = children.run([sys.executable, "-m", "mesh_llm", "serve", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert "MESH_LLM_HOME" in one_error_line(result)


def test_models_list_shows_the_default():
    result = mesh("models", "list")
    assert result.returncode == 0, result.stderr
    assert "SmolLM2-135M-Instruct" in result.stdout and "gguf" in result.stdout


def test_import_gguf_writes_a_folder_mlx_lm_loads(tmp_path, default_gguf):
    out = tmp_path / "smol-mlx"
    result = mesh("models", "import-gguf", str(default_gguf), str(out), timeout=600)
    assert result.returncode == 0, result.stderr
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                "tokenizer_config.json"}
    probe = ("import sys; from mesh_llm.system.blas import ensure_fast_blas; ensure_fast_blas(); "
             "import mlx_lm; m, t = mlx_lm.load(sys.argv[1]); print(type(m).__module__)")
    loaded = subprocess.run([sys.executable, "-c", probe, str(out)], capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0 and "llama" in loaded.stdout, loaded.stderr
    again = mesh("models", "import-gguf", str(default_gguf), str(out))
    assert again.returncode == 2 and "exists" in one_error_line(again)


def test_import_gguf_of_a_bad_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    result = mesh("models", "import-gguf", str(bad), str(tmp_path / "out"))
    assert result.returncode == 2
    assert "bad.gguf" in one_error_line(result)
    assert not (tmp_path / "out").exists()
