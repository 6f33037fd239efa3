"""The maintained benchmarks in benchmarks/ run: every script answers --help, and the cheap ones run
for real on a tiny random-weight model (no network, no GPU)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
SHELL = sorted(BENCHMARKS.glob("*.sh"))


def run(argv: list, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=BENCHMARKS.parent,
    )


def test_the_benchmarks_folder_holds_its_maintained_scripts():
    names = {p.name for p in SCRIPTS + SHELL}
    assert {
        "engines.py",
        "prompt_cache.py",
        "mesh.py",
        "constrain.py",
        "startup.py",
        "contention.py",
        "blas.py",
        "history.py",
        "gpu.sh",
        "gpu_wheels.sh",
    } <= names
    readme = (BENCHMARKS / "README.md").read_text()
    for name in names:  # each one is in the README's table
        assert f"`{name}`" in readme, name


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_python_script_answers_help(script):
    done = run([sys.executable, script, "--help"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:"), done.stdout


@pytest.mark.parametrize("script", SHELL, ids=lambda p: p.name)
def test_every_shell_script_parses_and_answers_help(script):
    assert run(["bash", "-n", script]).returncode == 0
    done = run(["bash", script, "--help"])
    assert done.returncode == 0, done.stderr
    assert "benchmarks/" in done.stdout and "set -e" not in done.stdout


def test_gpu_runner_asks_for_its_wheels_and_benchmarks():
    done = run(["bash", BENCHMARKS / "gpu.sh"])
    assert done.returncode == 2 and "WHEELS_DIR" in done.stdout


def test_engines_on_a_tiny_model_then_into_the_history_table(tmp_path):
    """engines.py through the public engine interface (one stream, then a batch of two), its JSON
    read by history.py into a CSV of its own, and shown back."""
    from tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    one, batch = tmp_path / "one.json", tmp_path / "batch.json"
    done = run(
        [
            sys.executable,
            BENCHMARKS / "engines.py",
            "--engine",
            "llama",
            "--gguf",
            gguf,
            "--runs",
            "1",
            "--prompt-lengths",
            "16,64",
            "--decode-tokens",
            "8",
            "--ctx-size",
            "256",
            "--threads",
            "1",
            "--out",
            one,
        ]
    )
    assert done.returncode == 0, done.stderr
    assert "| llama |" in done.stdout
    result = json.loads(one.read_text())["results"][0]
    assert set(result["ttft_s"]) == {"16", "64"} and result["decode_tok_s"] > 0
    done = run(
        [
            sys.executable,
            BENCHMARKS / "engines.py",
            "--engine",
            "llama",
            "--gguf",
            gguf,
            "--runs",
            "1",
            "--batch",
            "2",
            "--prompt-tokens",
            "16",
            "--decode-tokens",
            "6",
            "--threads",
            "1",
            "--out",
            batch,
        ]
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(batch.read_text())["results"][0]["batches"][0]["batch"] == 2

    table = tmp_path / "history.csv"
    history = [sys.executable, BENCHMARKS / "history.py", "--csv", table]
    for _ in range(2):  # adding the same results twice changes nothing
        done = run([*history, "add", one, batch, "--machine", "test", "--date", "2026-01-02"])
        assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(table.open()))
    assert {r["benchmark"] for r in rows} == {"engine", "engine batch x2"}
    assert {r["metric"] for r in rows if r["benchmark"] == "engine"} == {
        "load_s",
        "decode_tok_s",
        "ttft_ms_16",
        "ttft_ms_64",
    }
    assert len(rows) == len({(r["benchmark"], r["metric"]) for r in rows})
    assert all(r["date"] == "2026-01-02" and r["machine"] == "test" and r["command"] for r in rows)
    shown = run([*history, "show", "--machine", "test", "--metric", "decode_tok_s"])
    assert shown.returncode == 0 and shown.stdout.count("decode_tok_s") == 2


def test_startup_of_a_tiny_model_into_the_history_table(tmp_path):
    """startup.py starts a real `mesh-llm serve`, times it to a first token and stops it."""
    from tiny_gguf import write_tiny_gguf

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", chat_template=template)
    out = tmp_path / "startup.jsonl"
    done = run(
        [
            sys.executable,
            BENCHMARKS / "startup.py",
            "--runs",
            "1",
            "--label",
            "tiny",
            "--out",
            out,
            "--",
            "--engine",
            "llama",
            "--model",
            gguf,
            "--ctx-size",
            "256",
            "--threads",
            "1",
        ],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    line = json.loads(out.read_text())
    assert line["label"] == "tiny" and 0 < line["listening_s"] <= line["ok_s"] <= line["first_done_s"]
    table = tmp_path / "history.csv"
    done = run([sys.executable, BENCHMARKS / "history.py", "--csv", table, "add", out, "--machine", "test"])
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(table.open()))
    assert {(r["benchmark"], r["model"], r["backend"]) for r in rows} == {("startup", "tiny.gguf", "tiny")}
    assert {r["metric"] for r in rows} == {"listening_s", "health_ok_s", "first_token_s"}


def test_constrained_decoding_cost_on_the_embedded_vocabulary(tmp_path, default_gguf):
    out = tmp_path / "constrain.json"
    done = run(
        [
            sys.executable,
            BENCHMARKS / "constrain.py",
            "--vocab",
            default_gguf,
            "--libraries",
            "llguidance",
            "--repeats",
            "1",
            "--out",
            out,
        ]
    )
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["library"] == "llguidance" and row["vocab_size"] == 49152 and row["mask_us_median"] > 0


def test_blas_through_mlx_with_a_small_product(tmp_path):
    pytest.importorskip("mlx.core")
    out = tmp_path / "blas.json"
    done = run(
        [
            sys.executable,
            BENCHMARKS / "blas.py",
            "--size",
            "128",
            "--rounds",
            "1",
            "--reps",
            "1",
            "--threads",
            "1",
            "--backends",
            "mesh-llm,reference",
            "--out",
            out,
        ]
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"mesh-llm", "reference"} and results["reference"]["median_gflops"] > 0


def test_the_history_table_reads_as_documented():
    rows = list(csv.DictReader((BENCHMARKS / "results" / "history.csv").open()))
    assert rows and list(rows[0]) == [
        "date",
        "machine",
        "benchmark",
        "model",
        "backend",
        "metric",
        "value",
        "command",
    ]
    assert {r["machine"] for r in rows} >= {"cpu", "h100", "h200"}
    for r in rows:
        float(r["value"])
        assert len(r["date"]) == 10 and r["command"], r
