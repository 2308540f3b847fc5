"""``torch.accelerator`` for the cpu backend.

vLLM 0.33 calls ``torch.accelerator.*`` (synchronize, empty_cache,
current_device_index, get_memory_info, ...) on every non-CPU-enum platform;
with no accelerator PyTorch raises "Cannot access accelerator device when none
is available". On a card torch_br provides these natively. In emulation they
are routed to the cpu backend. Listed in the patch ledger (vllm_br/patches).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

_NAMES = (
    "synchronize",
    "empty_cache",
    "empty_host_cache",
    "current_device_index",
    "set_device_index",
    "device_index",
    "get_memory_info",
    "current_stream",
    "set_stream",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "memory_stats",
    "reset_peak_memory_stats",
)
_originals: dict[str, Any] = {}


def install(backend: Any) -> None:
    """Route torch.accelerator to ``backend`` (idempotent)."""
    if _originals:
        return
    acc = torch.accelerator

    @contextlib.contextmanager
    def device_index(index: Any):
        yield

    shims = {
        "synchronize": lambda device=None: backend.synchronize(),
        "empty_cache": lambda: backend.empty_cache(),
        "empty_host_cache": lambda: None,
        "current_device_index": lambda: backend.current_device(),
        "set_device_index": lambda device: None,
        "device_index": device_index,
        "get_memory_info": lambda device=None: backend.mem_get_info(),
        "current_stream": lambda device=None: backend.current_stream(),
        "set_stream": lambda stream: None,
        "memory_allocated": lambda device=None: backend.memory_allocated(),
        "max_memory_allocated": lambda device=None: backend.max_memory_allocated(),
        "memory_reserved": lambda device=None: backend.memory_allocated(),
        "memory_stats": lambda device=None: backend.memory_stats(),
        "reset_peak_memory_stats": lambda device=None: (
            backend.reset_peak_memory_stats()
        ),
    }
    for name in _NAMES:
        _originals[name] = getattr(acc, name, None)
        setattr(acc, name, shims[name])


def uninstall() -> None:
    for name, fn in _originals.items():
        if fn is None:
            delattr(torch.accelerator, name)
        else:
            setattr(torch.accelerator, name, fn)
    _originals.clear()
