"""`mesh-llm models list`: what is found, its format, size on disk and engine, and that each ref resolves back."""

from __future__ import annotations

import pytest

from mesh_llm.models import home_dir, list_models, resolve
from mesh_llm.models.default import default_gguf

SHA_A = "a" * 40
SHA_B = "b" * 40


def test_fresh_machine_lists_only_the_default():
    [default] = list_models()
    assert (default.ref, default.name, default.format) == ("default", "SmolLM2-135M-Instruct", "gguf")
    assert default.formats == ("gguf", "safetensors")
    assert (default.engines, default.engine) == (("llama", "mlx"), "llama, mlx")
    assert default.size_bytes == 98_362_432 == default_gguf().stat().st_size
    assert (default.path, default.source) == (default_gguf(), "embedded default")


def test_default_size_counts_its_imported_mlx_folder(files):
    files("mesh-home/models/SmolLM2-135M-Instruct-mlx", {"config.json": b"{}", "model.safetensors": b"x" * 1000})
    [default] = list_models()  # the MLX folder is the default's alternate, not a model of its own
    assert default.size_bytes == 98_362_432 + 1002


def test_hf_cache_models(hf_repo, blobs):
    hf_repo("org/Tiny", {"config.json": blobs.config, "model.safetensors": blobs.safetensors, "README.md": b"#"})
    hf_repo("org/Q-GGUF", {"q-Q4_0.gguf": blobs.gguf, "sub/q-Q8_0-00001-of-00002.gguf": blobs.gguf,
                           "sub/q-Q8_0-00002-of-00002.gguf": blobs.gguf}, commit=SHA_A)
    hf_repo("org/One-GGUF", {"one.gguf": blobs.gguf})
    hf_repo("org/mixed", {"config.json": blobs.config, "model.safetensors": blobs.safetensors, "m.gguf": blobs.gguf})
    models = {m.ref: m for m in list_models()}
    assert list(models) == ["default", "org/mixed", "org/mixed:m.gguf", "org/One-GGUF", "org/Q-GGUF:q-Q4_0.gguf",
                            "org/Q-GGUF:sub/q-Q8_0-00001-of-00002.gguf", "org/Tiny"]  # default first, then by ref
    tiny = models["org/Tiny"]
    assert (tiny.name, tiny.format, tiny.engines) == ("Tiny", "safetensors", ("mlx",))
    assert tiny.size_bytes == len(blobs.config) + len(blobs.safetensors) + len(b"#")
    split = models["org/Q-GGUF:sub/q-Q8_0-00001-of-00002.gguf"]
    assert (split.name, split.format, split.engine) == ("q-Q8_0", "gguf", "llama")
    assert split.source == "HF cache org/Q-GGUF@aaaaaaa"
    assert split.size_bytes == 2 * len(blobs.gguf)
    assert models["org/mixed"].size_bytes == len(blobs.config) + len(blobs.safetensors)  # its GGUF is listed apart
    assert models["org/mixed:m.gguf"].size_bytes == len(blobs.gguf)
    assert models["org/One-GGUF"].name == "one"


def test_every_listed_ref_resolves_to_its_model(hf_repo, files, blobs):
    hf_repo("org/Tiny", {"config.json": blobs.config, "model.safetensors": blobs.safetensors})
    hf_repo("org/Q-GGUF", {"a-Q4_0.gguf": blobs.gguf, "a-Q8_0.gguf": blobs.gguf})
    hf_repo("org/mixed", {"config.json": blobs.config, "model.safetensors": blobs.safetensors, "m.gguf": blobs.gguf})
    files("mesh-home/models", {"loose.gguf": blobs.gguf, "folder/config.json": blobs.config,
                               "folder/model.safetensors": blobs.safetensors})
    models = list_models()
    assert len(models) == 8
    for model in models:
        assert resolve(model.ref) == model.spec, model.ref


def test_only_servable_models_are_listed(hf_repo, files, blobs):
    hf_repo("org/tokenizer-only", {"config.json": blobs.config, "tokenizer.json": b"{}"})
    hf_repo("org/bin-only", {"config.json": blobs.config, "pytorch_model.bin": b"x"})
    hf_repo("org/broken-split", {"b-00001-of-00002.gguf": blobs.gguf})
    hf_repo("org/lfs-pointer", {"p.gguf": b"version https://git-lfs.github.com/spec/v1\n"})
    for sha, weights in ((SHA_A, blobs.safetensors), (SHA_B, b"other")):
        hf_repo("org/two-pins", {"config.json": blobs.config, "model.safetensors": weights}, commit=sha, refs=())
    files("mesh-home/models", {".SmolLM2-135M-Instruct-mlx.123.abcd.tmp/config.json": blobs.config,
                               ".SmolLM2-135M-Instruct-mlx.lock": b"", "notes.txt": b"hi",
                               "empty-folder/README.md": b"#"})
    assert [m.ref for m in list_models()] == ["default"]


def test_dataset_repos_are_not_models(hf_cache, blobs):
    snapshot = hf_cache / "datasets--org--data" / "snapshots" / SHA_A
    snapshot.mkdir(parents=True)
    (snapshot / "d.gguf").write_bytes(blobs.gguf)
    (hf_cache / "datasets--org--data" / "refs").mkdir()
    (hf_cache / "datasets--org--data" / "refs" / "main").write_text(SHA_A)
    assert [m.ref for m in list_models()] == ["default"]


def test_own_cache_models(files, blobs):
    root = files("mesh-home/models", {
        "my-model/config.json": blobs.config,
        "my-model/model.safetensors": blobs.safetensors,
        "loose-Q4_0.gguf": blobs.gguf,
        "big-00001-of-00002.gguf": blobs.gguf,
        "big-00002-of-00002.gguf": blobs.gguf,
    })
    assert root == home_dir() / "models"
    models = {m.name: m for m in list_models()}
    assert sorted(models) == ["SmolLM2-135M-Instruct", "big", "loose-Q4_0", "my-model"]
    assert (models["my-model"].ref, models["my-model"].engines) == (str(root / "my-model"), ("mlx",))
    assert (models["big"].ref, models["big"].size_bytes) == (str(root / "big-00001-of-00002.gguf"), 2 * len(blobs.gguf))
    assert models["loose-Q4_0"].source == "mesh-llm cache"


@pytest.mark.parametrize("missing", ["hf", "home"])
def test_missing_caches_are_empty_not_errors(missing, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME" if missing == "hf" else "MESH_LLM_HOME", str(tmp_path / "nowhere"))
    assert [m.ref for m in list_models()] == ["default"]
