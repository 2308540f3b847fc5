"""End-to-end tests start real vLLM engines through the plugin."""

from __future__ import annotations

import os

# The cpu emulation backend (CI has no SUPA card), a small emulated device so
# KV-cache allocation stays quick, and pickled collective_rpc callables so the
# tests can look inside their LLM engines' workers (tests only: the servers
# they start run without it, tests/fixtures/server.py).
os.environ.setdefault("VLLM_BR_DEVICE", "cpu")
os.environ.setdefault("VLLM_BR_CPU_MEMORY_GIB", "2")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
