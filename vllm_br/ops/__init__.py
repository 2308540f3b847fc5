"""Kernel registry: every operation once, as device-agnostic PyTorch.

``get_op(name)`` returns the device backend's fused kernel for ``name`` when
it binds one, else the reference implementation registered here. Layers
(``vllm_br.layers``) call ops only through ``get_op``.
"""

from vllm_br.ops import activation, embedding, layernorm, linear, rotary  # noqa: F401
from vllm_br.ops.registry import (
    clear_cache,
    get_op,
    reference_op,
    register_op,
    registered_ops,
)

__all__ = ["clear_cache", "get_op", "reference_op", "register_op", "registered_ops"]
