"""RMSNorm, with and without the fused residual add, and LayerNorm.

Same arithmetic as vLLM's ``RMSNorm.forward_native`` (``vllm.ir.ops``
``rms_norm`` / ``fused_add_rms_norm``): statistics in float32, the residual
sum in float32 and stored back in the input dtype, the weight multiply in the
weight's dtype, the result cast to the input dtype. ``weight=None`` is the
``has_weight=False`` case; ``variance_size`` is vLLM's
``variance_size_override`` (statistics over the first ``variance_size``
channels only).
"""

from __future__ import annotations

import torch

from vllm_br.ops.registry import register_op


def _normalize(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    variance_size: int | None,
    orig_dtype: torch.dtype,
) -> torch.Tensor:
    x_var = x if variance_size is None else x[..., :variance_size]
    variance = x_var.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype)


@register_op("rms_norm")
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    variance_size: int | None = None,
) -> torch.Tensor:
    return _normalize(x.to(torch.float32), weight, eps, variance_size, x.dtype)


@register_op("fused_add_rms_norm")
def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    variance_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; inputs are not modified."""
    orig_dtype = x.dtype
    summed = x.to(torch.float32) + residual.to(torch.float32)
    new_residual = summed.to(orig_dtype)
    return _normalize(summed, weight, eps, variance_size, orig_dtype), new_residual


@register_op("layer_norm")
def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """Mean-centred LayerNorm over the last dimension (``torch.nn.LayerNorm``
    and vLLM's ``LayerNorm``; the vision towers' norm): statistics, scale and
    shift in float32, the result cast to ``x``'s dtype, as torch's own
    bfloat16 kernel and vLLM's widened ``LayerNorm`` compute it."""
    w = None if weight is None else weight.to(torch.float32)
    b = None if bias is None else bias.to(torch.float32)
    out = torch.nn.functional.layer_norm(x.to(torch.float32), (x.shape[-1],), w, b, eps)
    return out.to(x.dtype)
