#!/usr/bin/env bash
# Set up if needed, then run the default test suite: everything but the
# `slow` tier. Every run ends with its time and ten slowest tests against
# the tier's budget (tests/README.md); this default run fails when the tier
# is over it. Extra arguments go to pytest instead, e.g.
# scripts/test.sh tests/unit -k envs, or scripts/test.sh -m slow (add
# --enforce-budget to fail a whole tier that is over its budget).
# A leading `--device supa-standin` runs the tests on the stand-in SUPA device
# (scripts/device_switch.sh), e.g. scripts/test.sh --device supa-standin tests/e2e
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/device_switch.sh
set -- ${DEVICE_ARGS[@]+"${DEVICE_ARGS[@]}"}
export VLLM_BR_DEVICE=${VLLM_BR_DEVICE:-cpu}
if [ $# -eq 0 ]; then
  set -- tests -m "not slow" --enforce-budget
fi
exec .venv/bin/python -m pytest "$@" -ra
