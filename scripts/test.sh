#!/usr/bin/env bash
# Set up if needed, then run the default test suite: everything but the
# `slow` tier (about 15 min on a 2-core AMD EPYC host on 2026-12-04, about
# 25 min there before the worker froze its heap during start-up). Extra
# arguments go to pytest instead, e.g. scripts/test.sh tests/unit -k envs,
# or scripts/test.sh -m slow.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_BR_DEVICE=${VLLM_BR_DEVICE:-cpu}
if [ $# -eq 0 ]; then
  set -- tests -m "not slow"
fi
exec .venv/bin/python -m pytest "$@" -ra
