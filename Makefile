# Two entry points for a fresh machine: `make serve` and `make test` (each installs what it needs).
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
# Empty: pip's configured index (here, the wheel on disk). On a CPU-only machine that reaches the public
# index, pass PyTorch's CPU wheel index, else pip takes the CUDA build and its nvidia packages (GBs):
#   make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
VENV ?= .venv
BIN := $(VENV)/bin
CHECKPOINT ?= checkpoints/shakespeare-small
HOST ?= 127.0.0.1
PORT ?= 8000
DOCS_ADDR ?= 127.0.0.1:8001

.PHONY: install install-test install-browser serve generate lint format docs docs-serve test bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(BIN)/pip install --quiet -e .

install-test: install
	$(BIN)/pip install --quiet -e ".[test,cluster]"

serve: install
	$(BIN)/python -m server --checkpoint $(CHECKPOINT) --host $(HOST) --port $(PORT)

generate: install
	$(BIN)/python -m model.generate --checkpoint $(CHECKPOINT) --prompt "ROMEO:" --max-new-tokens 100

# The playground's browser test drives Debian's Chromium; without it that one test is skipped.
install-browser:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  echo "chromium not installed: the browser test will be skipped"; }

# ruff (lint and format) over the Python, clang-format over the C++ kernels; `make format` fixes both.
CSRC := $(wildcard model/kernels/csrc/*.cpp model/kernels/csrc/*.h)
lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/clang-format --dry-run --Werror $(CSRC)

format: install-test
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
	$(BIN)/clang-format -i $(CSRC)

# The documentation site (mkdocs.yml, docs/): the flags page regenerated from the parsers, then a strict
# build (a broken link or a stale nav fails it) into site/. `make docs-serve` previews it with live reload.
docs: install
	$(BIN)/pip install --quiet -r docs/requirements.txt
	$(BIN)/python docs/gen_flags.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

docs-serve: docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve -a $(DOCS_ADDR)

test: lint docs install-browser
	$(BIN)/python -m pytest -q

bench: install-test
	$(BIN)/python -m bench.run_all
