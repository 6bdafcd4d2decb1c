# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HELM   := .tools/bin/helm

.PHONY: demo test lint bench bench-scheduling clean containers

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/narwhal demo

lint: $(STAMP)
	$(BIN)/ruff check extproc tests integration bench scripts

$(HELM):
	$(PYTHON) scripts/fetch_helm.py .tools/bin

containers:
	scripts/container-engine.sh

test: $(STAMP) $(HELM) lint containers
	PATH="$(CURDIR)/.tools/bin:$$PATH" $(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python -m bench.datapath

bench-scheduling: $(STAMP)
	$(BIN)/python -m bench.scheduling

clean:
	rm -rf $(VENV) .tools .pytest_cache .ruff_cache
