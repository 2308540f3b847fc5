#!/usr/bin/env bash
# Set up if needed, then serve the default model (SmolLM2-135M-Instruct) with
# `vllm serve` on 127.0.0.1 through the SUPA platform. Extra arguments go to
# `vllm serve`, e.g. scripts/serve.sh --dtype float32. A leading
# `--device supa-standin` serves on the stand-in SUPA device
# (scripts/device_switch.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/device_switch.sh
set -- ${DEVICE_ARGS[@]+"${DEVICE_ARGS[@]}"}
MODEL=$(.venv/bin/python -m vllm_br.model_cache path)
PORT=${PORT:-8000}
cat <<MSG
[serve] model: $MODEL
[serve] once "Application startup complete" shows, query it from another shell:
  curl http://127.0.0.1:$PORT/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 16}'
  curl http://127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hello!"}]}'
MSG
exec .venv/bin/vllm serve "$MODEL" --served-model-name SmolLM2-135M-Instruct \
  --host 127.0.0.1 --port "$PORT" "$@"
