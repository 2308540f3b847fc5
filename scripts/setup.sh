#!/usr/bin/env bash
# Idempotent set-up: .venv with torch (CPU wheel), vLLM as a pure-Python build,
# the plugin (editable), test tools, and the default model converted once.
# Safe to run again: every step checks whether it is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
VENV="$ROOT/.venv"
# The supported vLLM version lives in vllm_br/_version.py only.
VLLM_VERSION=$(sed -n 's/^SUPPORTED_VLLM_VERSION = "\(.*\)"/\1/p' vllm_br/_version.py)
TORCH_VERSION=2.13.0

log() { echo "[setup] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
pipi() { "$VPY" -m pip install --disable-pip-version-check -q "$@"; }

have() { "$VPY" - "$@" <<'PYEOF'
import sys
from importlib import metadata
name, want = sys.argv[1], sys.argv[2]
try:
    v = metadata.version(name)
except metadata.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if (want == "*" or v.split("+")[0] == want) else 1)
PYEOF
}

if ! have torch "$TORCH_VERSION"; then
  log "installing torch $TORCH_VERSION (CPU wheel)"
  pipi "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
    || pipi "torch==$TORCH_VERSION"
fi

if ! have vllm "$VLLM_VERSION"; then
  log "building vLLM $VLLM_VERSION as pure Python (VLLM_TARGET_DEVICE=empty)"
  pipi "setuptools>=77.0.3,<81" "setuptools-scm>=8" "setuptools-rust>=1.9" wheel jinja2 packaging
  # Keep torch pinned so vLLM's metadata cannot pull the CUDA build.
  echo "torch==$TORCH_VERSION" > "$VENV/torch-pin.txt"
  VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1 \
    "$VPY" -m pip install --disable-pip-version-check -q --no-build-isolation \
    --no-binary vllm -c "$VENV/torch-pin.txt" "vllm==$VLLM_VERSION"
  # xgrammar pulls a GPU triton that cannot run here; without it vLLM uses
  # Model Runner V1 and plain-torch paths.
  "$VPY" -m pip uninstall -y -q triton 2>/dev/null || true
fi

if ! have vllm-br "*" || [ ! -f "$VENV/.vllm_br_editable" ]; then
  log "installing vllm-br (editable) and test tools"
  echo "torch==$TORCH_VERSION" > "$VENV/torch-pin.txt"
  echo "vllm==$VLLM_VERSION" >> "$VENV/torch-pin.txt"
  # --no-deps for the plugin: its metadata must never pull vllm from the index.
  "$VPY" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e "$ROOT"
  pipi -c "$VENV/torch-pin.txt" -r "$ROOT/requirements/test.txt"
  "$VPY" -m pip uninstall -y -q triton 2>/dev/null || true
  touch "$VENV/.vllm_br_editable"
fi

log "preparing the default model"
"$VPY" -m vllm_br.model_cache prepare
log "done"
