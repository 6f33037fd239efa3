"""Every kind of model reference, against real files and a real Hugging Face cache layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh_llm.models import BadModel, ModelNotFound, home_dir, model_path, resolve

SHA_A = "a" * 40
SHA_B = "b" * 40


# --- the default -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ref", [None, "", "default", "  default "])
def test_no_ref_or_default_is_the_embedded_model(ref):
    spec = resolve(ref)
    assert (spec.name, spec.format, spec.source) == ("SmolLM2-135M-Instruct", "gguf", "embedded default")
    assert spec.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and spec.path.is_file()
    assert spec.alternates == {"safetensors": home_dir() / "models" / "SmolLM2-135M-Instruct-mlx"}
    assert spec.engines == ("llama", "mlx")


def test_default_by_its_listed_name():
    assert resolve("SmolLM2-135M-Instruct") == resolve("default")
    assert resolve("smollm2-135m-instruct") == resolve("default")


# --- paths -----------------------------------------------------------------------------------------


def test_safetensors_folder(st_folder):
    spec = resolve(str(st_folder))
    assert (spec.name, spec.path, spec.format, spec.source) == ("tiny-llama", st_folder, "safetensors", "path")
    assert spec.alternates == {} and spec.engines == ("mlx",)
    assert resolve(st_folder) == spec  # a Path works too


def test_relative_path_and_tilde(st_folder, monkeypatch):
    monkeypatch.chdir(st_folder.parent)
    assert resolve("tiny-llama").path == Path("tiny-llama")
    monkeypatch.setenv("HOME", str(st_folder.parent))
    assert resolve("~/tiny-llama").path == st_folder


def test_sharded_safetensors_needs_every_shard(files, blobs):
    index = b'{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    folder = files("sharded", {
        "config.json": blobs.config,
        "model.safetensors.index.json": index,
        "model-00001-of-00002.safetensors": blobs.safetensors,
    })
    with pytest.raises(BadModel, match="missing weight shards.*model-00002-of-00002.safetensors"):
        resolve(str(folder))
    (folder / "model-00002-of-00002.safetensors").write_bytes(blobs.safetensors)
    assert resolve(str(folder)).format == "safetensors"


def test_folder_without_config(files, blobs):
    folder = files("noconfig", {"model.safetensors": blobs.safetensors})
    with pytest.raises(BadModel, match="no config.json"):
        resolve(str(folder))


def test_folder_without_weights(files, blobs):
    folder = files("noweights", {"config.json": blobs.config, "pytorch_model.bin": b"x"})
    with pytest.raises(BadModel, match=r"no \*\.safetensors weights"):
        resolve(str(folder))


def test_empty_folder(files):
    folder = files("empty", {})
    folder.mkdir()
    with pytest.raises(BadModel, match="neither config.json"):
        resolve(str(folder))


def test_gguf_file(files, blobs):
    path = files("g", {"Tiny-Q8_0.gguf": blobs.gguf}) / "Tiny-Q8_0.gguf"
    spec = resolve(str(path))
    assert (spec.name, spec.path, spec.format, spec.source) == ("Tiny-Q8_0", path, "gguf", "path")
    assert spec.engines == ("llama",)


def test_split_gguf(files, blobs):
    folder = files("split", {f"Big-Q4_K_M-0000{i}-of-00003.gguf": blobs.gguf for i in (1, 2, 3)})
    first = folder / "Big-Q4_K_M-00001-of-00003.gguf"
    spec = resolve(str(first))
    assert (spec.name, spec.path) == ("Big-Q4_K_M", first)
    with pytest.raises(BadModel, match=f"shard 2 of a split GGUF; pass the first shard {first}"):
        resolve(str(folder / "Big-Q4_K_M-00002-of-00003.gguf"))
    assert resolve(str(folder)).path == first  # a folder holding one (split) GGUF model
    (folder / "Big-Q4_K_M-00003-of-00003.gguf").unlink()
    with pytest.raises(BadModel, match="missing shards: Big-Q4_K_M-00003-of-00003.gguf"):
        resolve(str(first))


def test_folder_with_several_ggufs_needs_a_file(files, blobs):
    folder = files("quants", {"m-Q4_0.gguf": blobs.gguf, "m-Q8_0.gguf": blobs.gguf})
    with pytest.raises(BadModel, match=r"holds 2 GGUF models \(m-Q4_0.gguf, m-Q8_0.gguf\); pass the path"):
        resolve(str(folder))
    assert resolve(str(folder / "m-Q8_0.gguf")).name == "m-Q8_0"


def test_not_a_gguf_file(files, blobs):
    folder = files("other", {"notes.txt": b"hi", "model.safetensors": blobs.safetensors})
    with pytest.raises(BadModel, match="notes.txt is not a .gguf file"):
        resolve(str(folder / "notes.txt"))
    with pytest.raises(BadModel, match="pass the folder that holds it"):
        resolve(str(folder / "model.safetensors"))


def test_gguf_name_but_not_gguf_content(files):
    folder = files("fake", {"lfs.gguf": b"version https://git-lfs.github.com/spec/v1\n", "junk.gguf": b"\0" * 8})
    with pytest.raises(BadModel, match="magic bytes.*Git LFS pointer"):
        resolve(str(folder / "lfs.gguf"))
    with pytest.raises(BadModel, match="does not start with the GGUF magic bytes$"):
        resolve(str(folder / "junk.gguf"))


@pytest.mark.parametrize("ref", ["./nope", "/no/such/dir", "nope.gguf", "~/nope", "a/b/c"])
def test_missing_path(ref):
    with pytest.raises(ModelNotFound, match="no file or folder at"):
        resolve(ref)


# --- the Hugging Face cache ------------------------------------------------------------------------


def test_hf_repo_with_safetensors(hf_repo, blobs):
    snapshot = hf_repo("org/Tiny-Instruct", {"config.json": blobs.config, "model.safetensors": blobs.safetensors},
                       commit=SHA_A)
    spec = resolve("org/Tiny-Instruct")
    assert (spec.name, spec.path, spec.format) == ("Tiny-Instruct", snapshot.resolve(), "safetensors")
    assert spec.source == "HF cache org/Tiny-Instruct@aaaaaaa"
    assert (spec.path / "model.safetensors").read_bytes() == blobs.safetensors  # through the blob symlink
    assert resolve("ORG/tiny-instruct") == spec  # Hub ids are case-insensitive


def test_hf_revisions(hf_repo, blobs):
    hf_repo("org/m", {"config.json": blobs.config, "model.safetensors": blobs.safetensors}, commit=SHA_A)
    old = hf_repo("org/m", {"config.json": blobs.config, "model.safetensors": blobs.safetensors, "x.txt": b""},
                  commit=SHA_B, refs=("v1.0",))
    assert resolve("org/m").path.name == SHA_A
    for ref in ("org/m@v1.0", f"org/m@{SHA_B}", "org/m@bbbbbbb", "org/m@BBBBBBBB"):
        spec = resolve(ref)
        assert spec.path == old.resolve() and spec.source == "HF cache org/m@bbbbbbb", ref
    with pytest.raises(ModelNotFound, match=r"no revision 'v2' of 'org/m' in the Hugging Face cache at .*"
                                            r"\(cached: main=aaaaaaa, v1.0=bbbbbbb\); run `mesh-llm models "
                                            r"download org/m@v2`"):
        resolve("org/m@v2")
    with pytest.raises(ModelNotFound, match="no revision 'abc'"):
        resolve("org/m@abc")  # too short to be a commit prefix


def test_hf_snapshot_without_main(hf_repo, blobs):
    files = {"config.json": blobs.config, "model.safetensors": blobs.safetensors}
    hf_repo("org/pinned", files, commit=SHA_A, refs=())
    assert resolve("org/pinned").path.name == SHA_A  # the only snapshot
    hf_repo("org/pinned", {**files, "y": b""}, commit=SHA_B, refs=())
    with pytest.raises(ModelNotFound, match=r"no 'main' snapshot .*\(cached: aaaaaaa, bbbbbbb\); pick one with "
                                            r"`org/pinned@REVISION`"):
        resolve("org/pinned")
    assert resolve("org/pinned@bbbbbbb").path.name == SHA_B


def test_hf_repo_with_one_gguf(hf_repo, blobs):
    snapshot = hf_repo("org/Tiny-GGUF", {"tiny-q8_0.gguf": blobs.gguf, "README.md": b"#"})
    spec = resolve("org/Tiny-GGUF")
    assert (spec.name, spec.path, spec.format) == ("tiny-q8_0", snapshot.resolve() / "tiny-q8_0.gguf", "gguf")
    assert spec.source.startswith("HF cache org/Tiny-GGUF@")


def test_hf_repo_with_several_ggufs(hf_repo, blobs):
    hf_repo("org/Big-GGUF", {
        "big-Q4_0.gguf": blobs.gguf,
        "big-Q8_0.gguf": blobs.gguf,
        "Q4_K_M/big-Q4_K_M-00001-of-00002.gguf": blobs.gguf,
        "Q4_K_M/big-Q4_K_M-00002-of-00002.gguf": blobs.gguf,
    }, commit=SHA_A)
    with pytest.raises(BadModel, match=r"holds 3 GGUF models \(Q4_K_M/big-Q4_K_M-00001-of-00002.gguf, "
                                       r"big-Q4_0.gguf, big-Q8_0.gguf\); pick one with `org/Big-GGUF:FILE`"):
        resolve("org/Big-GGUF")
    assert resolve("org/Big-GGUF:big-Q8_0.gguf").name == "big-Q8_0"  # file name
    assert resolve("org/Big-GGUF:q8_0").name == "big-Q8_0"  # a fragment, any case
    assert resolve("org/Big-GGUF@main:Q4_0").name == "big-Q4_0"  # with a revision
    split = resolve("org/Big-GGUF:Q4_K_M")  # the split set, by its first shard
    assert (split.name, split.path.name) == ("big-Q4_K_M", "big-Q4_K_M-00001-of-00002.gguf")
    assert resolve("org/Big-GGUF:Q4_K_M/big-Q4_K_M-00001-of-00002.gguf") == split  # its path in the repo
    with pytest.raises(BadModel, match="shard 2 of a split GGUF"):
        resolve("org/Big-GGUF:Q4_K_M/big-Q4_K_M-00002-of-00002.gguf")
    with pytest.raises(ModelNotFound, match=r"'Q4' matches 2 GGUF files in HF cache org/Big-GGUF@aaaaaaa \("
                                            r"Q4_K_M/big-Q4_K_M-00001-of-00002.gguf, big-Q4_0.gguf\); pick one with "
                                            r"`org/Big-GGUF:FILE`"):
        resolve("org/Big-GGUF:Q4")
    with pytest.raises(ModelNotFound, match=r"no GGUF matching 'F16' in HF cache org/Big-GGUF@aaaaaaa; it holds: "
                                            r"Q4_K_M/big-Q4_K_M-00001-of-00002.gguf, big-Q4_0.gguf, big-Q8_0.gguf$"):
        resolve("org/Big-GGUF:F16")


def test_hf_repo_with_safetensors_and_gguf(hf_repo, blobs):
    hf_repo("org/mixed", {"config.json": blobs.config, "model.safetensors": blobs.safetensors,
                          "mixed-f16.gguf": blobs.gguf})
    assert resolve("org/mixed").format == "safetensors"
    assert resolve("org/mixed:f16").format == "gguf"


def test_hf_selector_on_a_repo_without_gguf(hf_repo, blobs):
    hf_repo("org/st", {"config.json": blobs.config, "model.safetensors": blobs.safetensors})
    with pytest.raises(ModelNotFound, match="no GGUF matching 'Q4' .*it holds: no .gguf file"):
        resolve("org/st:Q4")


def test_hf_repo_without_weights(hf_repo, blobs):
    hf_repo("org/tokenizer-only", {"config.json": blobs.config, "tokenizer.json": b"{}"})
    with pytest.raises(BadModel, match="no \\*.safetensors weights"):
        resolve("org/tokenizer-only")


def test_unknown_repo(hf_repo, hf_cache, blobs):
    with pytest.raises(ModelNotFound) as no_cache:  # the cache folder does not even exist yet
        resolve("foo/bar")
    hf_repo("org/other", {"config.json": blobs.config, "model.safetensors": blobs.safetensors})
    with pytest.raises(ModelNotFound) as missing:
        resolve("foo/bar@v1:Q4")
    for error in (no_cache, missing):
        assert str(error.value) == (
            f"no model 'foo/bar' in the Hugging Face cache at {hf_cache}; run `mesh-llm models download foo/bar`"
        )


def test_hf_hub_cache_env_wins_over_hf_home(tmp_path, monkeypatch, hf_repo, blobs):
    elsewhere = tmp_path / "elsewhere"
    snapshot = hf_repo("org/moved", {"config.json": blobs.config, "model.safetensors": blobs.safetensors},
                       cache=elsewhere)
    with pytest.raises(ModelNotFound, match="hf-home/hub"):
        resolve("org/moved")
    monkeypatch.setenv("HF_HUB_CACHE", str(elsewhere))
    assert resolve("org/moved").path == snapshot.resolve()


def test_existing_relative_path_wins_over_repo_id(files, blobs, hf_repo, monkeypatch):
    hf_repo("org/name", {"config.json": blobs.config, "model.safetensors": blobs.safetensors})
    files("org/name", {"config.json": blobs.config, "model.safetensors": blobs.safetensors})
    monkeypatch.chdir(files("", {}))
    assert resolve("org/name").source == "path"
    monkeypatch.chdir("/")
    assert resolve("org/name").source.startswith("HF cache")


# --- names from `mesh-llm models list` -------------------------------------------------------------


def test_name_from_own_cache(files, blobs):
    folder = files("mesh-home/models/my-model", {"config.json": blobs.config, "model.safetensors": blobs.safetensors})
    spec = resolve("my-model")
    assert (spec.path, spec.format, spec.source) == (folder, "safetensors", "mesh-llm cache")


def test_ambiguous_name(files, blobs, hf_repo):
    files("mesh-home/models/twin", {"config.json": blobs.config, "model.safetensors": blobs.safetensors})
    hf_repo("org/twin", {"config.json": blobs.config, "model.safetensors": blobs.safetensors})
    with pytest.raises(ModelNotFound, match=r"'twin' names 2 models \(.*/mesh-home/models/twin, org/twin\)"):
        resolve("twin")


def test_unknown_name():
    with pytest.raises(ModelNotFound, match="no model 'nope': not a path, not an org/name repo id"):
        resolve("nope")


# --- model_path ------------------------------------------------------------------------------------


def test_model_path(st_folder):
    spec = resolve(str(st_folder))
    assert model_path(spec, "safetensors") == st_folder
    with pytest.raises(BadModel, match="tiny-llama is available as safetensors only, not gguf"):
        model_path(spec, "gguf")
    default = resolve("default")
    assert model_path(default, "gguf") == default.path
