"""Gated and GELU-family activations, as vLLM's activation CustomOps compute
them (``vllm/model_executor/layers/activation.py``, ``forward_native``).

Gated ops take ``x`` of shape ``[..., 2 * d]`` and return ``[..., d]``:
``act(x[..., :d]) * x[..., d:]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vllm_br.ops.registry import register_op

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@register_op("silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@register_op("gelu_and_mul")
def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeGLU; ``approximate`` is ``"none"`` (erf) or ``"tanh"``."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]


@register_op("gelu_and_mul_sparse")
def gelu_and_mul_sparse(
    x: torch.Tensor, std_multiplier: float, approximate: str = "none"
) -> torch.Tensor:
    """Gemma3n: gate sparsified to ``relu(gate - (mean + std * k))`` first
    (statistics per row of this shard), then GeGLU."""
    d = x.shape[-1] // 2
    gate = x[..., :d]
    mean = torch.mean(gate, dim=-1, keepdim=True)
    std = torch.std(gate, dim=-1, keepdim=True, unbiased=False)
    sparse_gate = F.relu(gate - (mean + std * std_multiplier))
    return F.gelu(sparse_gate, approximate=approximate) * x[..., d:]


@register_op("gelu")
def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="none")


@register_op("gelu_tanh")
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@register_op("gelu_new")
def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, written out (``NewGELU``)."""
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))
    return 0.5 * x * (1.0 + torch.tanh(inner))


@register_op("gelu_fast")
def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


@register_op("quick_gelu")
def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)
