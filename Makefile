# Two entry points for a fresh machine: `make serve` and `make test` (each installs what it needs).
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
BIN := $(VENV)/bin
CHECKPOINT ?= checkpoints/shakespeare-small
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-test serve generate test bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/pip install --quiet -e .

install-test: install
	$(BIN)/pip install --quiet -e ".[test]"

serve: install
	$(BIN)/python -m server --checkpoint $(CHECKPOINT) --host $(HOST) --port $(PORT)

generate: install
	$(BIN)/python -m model.generate --checkpoint $(CHECKPOINT) --prompt "ROMEO:" --max-new-tokens 100

test: install-test
	$(BIN)/python -m pytest -q

bench: install-test
	$(BIN)/python -m bench.run_all
