"""Versions in one place: the plugin's own and the vLLM release it supports."""

__version__ = "0.1.0"

# The only place the supported vLLM version is written. scripts/setup.sh and
# vllm_br.compat read it from here.
SUPPORTED_VLLM_VERSION = "0.33.0"
