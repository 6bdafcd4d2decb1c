# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/narwhal demo

lint: $(STAMP)
	$(BIN)/ruff check extproc tests integration bench

test: $(STAMP) lint
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python -m bench.datapath

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
