#!/usr/bin/env bash
# Set up if needed, then run the default test suite (what CI runs).
# Extra arguments go to pytest, e.g. scripts/test.sh tests/unit -k envs
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_BR_DEVICE=${VLLM_BR_DEVICE:-cpu}
exec .venv/bin/python -m pytest "${@:-tests}" -ra
