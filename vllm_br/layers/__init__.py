"""vLLM layers served by ``vllm_br.ops`` on the SUPA platform.

``register_all()`` registers every out-of-tree replacement with vLLM's
CustomOp / PluggableLayer registry (see ``_oot`` for how that works). It is
idempotent and imports vLLM's layer modules only when called; the general
plugin calls it in every process.
"""

from __future__ import annotations

import threading

from vllm_br.logger import init_logger

logger = init_logger(__name__)

_lock = threading.Lock()
_registered: list[str] | None = None


def register_all() -> list[str]:
    """Register all OOT layers; returns the vLLM classes now replaced."""
    global _registered
    with _lock:
        if _registered is not None:
            return list(_registered)
        from vllm_br.layers import (
            activation,
            embedding,
            layernorm,
            linear,
            mm_encoder,
            moe,
            rotary,
            vision,
        )

        names: list[str] = []
        for module in (
            layernorm,
            activation,
            rotary,
            embedding,
            linear,
            moe,
            mm_encoder,
            vision,
        ):
            names.extend(module.register())
        _registered = names
        logger.debug("Registered %d out-of-tree vLLM layers.", len(names))
        return list(names)
