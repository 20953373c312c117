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

.PHONY: install up test lint protos clean

$(STAMP): pyproject.toml
	@echo "Installing into $(VENV): about 500 MB of wheels on first use, quiet unless it fails"
	$(PY) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) '$(TORCH_SPEC)' $(if $(TORCH_INDEX),--index-url '$(TORCH_INDEX)')
	$(PIP) -e '.[dev]'
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
