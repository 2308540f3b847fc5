"""Integer GEMMs of quantized linear layers: W8A8 (``int8_scaled_mm`` after
``quantize_int8``) and weight-only int8 / int4 (``weight_only_linear``).

Weights are stored as the SUPA quant kernels prepare them after loading
(``vllm_br.quantization``): int8 weights ``[N, K]``; int4 weights two per
byte, ``[N, K // 2]`` uint8, the low nibble the even input channel, each
value offset by 8 (stored ``q + 8``); scales ``[N]`` (per channel) or
``[N, K // group_size]``; zero points (asymmetric only) in the same shape as
the scales, as int8. A weight ``w[n, k] = (q[n, k] - zero[n, g]) *
scale[n, g]`` with ``g = k // group_size``. Like ``linear``, each op takes the
device ``layout`` the rows are stored in and returns outputs in logical order.
The references here define what every kernel computes: the int8 x int8
products accumulate exactly in int32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vllm_br.ops.registry import register_op

INT8_MIN, INT8_MAX = -128, 127


def _logical_rows(out: torch.Tensor, layout: Any) -> torch.Tensor:
    if layout is None:
        return out
    return out.index_select(-1, layout.from_device.to(out.device))


def _device_bias(bias: torch.Tensor | None, layout: Any) -> torch.Tensor | None:
    if bias is None or layout is None:
        return bias
    return bias.index_select(0, layout.to_device.to(bias.device))


@register_op("quantize_int8")
def quantize_int8(
    x: torch.Tensor,
    scale: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
    symmetric: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x [M, K]`` -> (int8 ``[M, K]``, float32 scales ``[M, 1]`` or the
    given per-tensor scale, int32 zero points or None).

    With ``scale`` (static): ``q = round(x / scale) + zero_point``. Without
    (dynamic, per token): symmetric takes ``scale = max|x| / 127``;
    asymmetric maps ``[min, max]`` of the row onto ``[-128, 127]``."""
    xf = x.float()
    if scale is not None:
        q = torch.round(xf / scale.float())
        zp = None
        if zero_point is not None:
            zp = zero_point.to(torch.int32)
            q = q + zp
        return q.clamp(INT8_MIN, INT8_MAX).to(torch.int8), scale.float(), zp
    if symmetric:
        s = (xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=1e-10)
        q = torch.round(xf / s).clamp(INT8_MIN, INT8_MAX)
        return q.to(torch.int8), s, None
    lo = xf.amin(dim=-1, keepdim=True).clamp(max=0.0)
    hi = xf.amax(dim=-1, keepdim=True).clamp(min=0.0)
    s = ((hi - lo) / (INT8_MAX - INT8_MIN)).clamp(min=1e-10)
    zp = (INT8_MIN - torch.round(lo / s)).to(torch.int32)
    q = (torch.round(xf / s) + zp).clamp(INT8_MIN, INT8_MAX)
    return q.to(torch.int8), s, zp


@register_op("int8_scaled_mm")
def int8_scaled_mm(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    x_zero_point: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    layout: Any = None,
) -> torch.Tensor:
    """``(x_q - x_zp) @ W_q.T`` accumulated in int32, times ``x_scale [M, 1]
    (or scalar) * weight_scale [N]``, plus ``bias``, in ``out_dtype``."""
    acc = x_q.to(torch.int32) @ weight.to(torch.int32).t()
    if x_zero_point is not None:
        acc = acc - x_zero_point.to(torch.int32) * weight.to(torch.int32).sum(dim=1)
    out = acc.to(torch.float32) * x_scale.float() * weight_scale.float().view(1, -1)
    bias = _device_bias(bias, layout)
    if bias is not None:
        out = out + bias.float()
    return _logical_rows(out.to(out_dtype), layout)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., N, K // 2]`` (low nibble first, offset 8) -> int8
    ``[..., N, K]``."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 ``[..., N, K]`` in ``[-8, 7]`` -> uint8 ``[..., N, K // 2]``
    (inverse of :func:`unpack_int4`)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8).reshape(*q.shape[:-1], -1, 2)
    return u[..., 0] | (u[..., 1] << 4)


def check_group_size(in_features: int, group_size: int) -> None:
    if group_size != -1 and (group_size <= 0 or in_features % group_size):
        raise ValueError(
            f"A weight-only quantized layer with {in_features} input channels "
            f"cannot use group size {group_size}: the group size must divide the "
            "input channels (or be -1 for one group per output channel)."
        )


def dequantize_weight(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bits: int,
) -> torch.Tensor:
    """The float32 ``[N, K]`` weight of a weight-only quantized layer."""
    q = unpack_int4(weight) if bits == 4 else weight
    n, k = q.shape
    groups = scale.reshape(n, -1).shape[1]
    if k % groups:
        raise ValueError(
            f"A weight-only quantized layer with {k} input channels has {groups} "
            "scale groups per output channel, which do not divide them evenly."
        )
    w = q.to(torch.float32).view(n, groups, k // groups)
    if zero_point is not None:
        w = w - zero_point.to(torch.float32).view(n, groups, 1)
    return (w * scale.to(torch.float32).view(n, groups, 1)).view(n, k)


@register_op("weight_only_linear")
def weight_only_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    bits: int = 8,
    bias: torch.Tensor | None = None,
    layout: Any = None,
) -> torch.Tensor:
    """``x @ W.T + b`` for a weight-only quantized ``W`` (see the module
    docstring), the weight dequantized in float32 and rounded once to ``x``'s
    dtype, as a GEMM that dequantizes its tiles would compute."""
    w = dequantize_weight(weight, scale, zero_point, bits).to(x.dtype)
    return _logical_rows(F.linear(x, w, _device_bias(bias, layout)), layout)
