# Two commands on a fresh machine:  `make up` starts the stack, `make test` runs the tests.
# Both create .venv on first use (CPU torch 2.13.0 from the local wheel cache, never a CUDA
# build; on a GPU box install the `gpu` extra into an environment that already has CUDA torch).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install up test lint protos clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/tandem up $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

protos: $(STAMP)
	$(BIN)/python protos/generate.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
