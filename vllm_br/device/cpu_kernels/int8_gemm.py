"""int8 GEMMs on the host (cpu backend): the ``int8_scaled_mm`` and
``weight_only_linear`` ops.

``torch._int_mm`` multiplies int8 matrices with exact int32 accumulation
(oneDNN on the host), so its result is the reference's bit for bit before
the scales, and it reads half the bytes of a bf16 weight; only on hosts with
AVX512-VNNI (``cpu_isa``): without VNNI oneDNN sums pairs of products in
saturating int16 and full-range int8 comes out wrong, so there the reference
(an int32 matmul) runs. Calls with an activation zero point (asymmetric
activations) are declined too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vllm_br.device import cpu_isa


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
    if (
        x_zero_point is not None
        or x_q.device.type != "cpu"
        or not cpu_isa.host_isa().avx512_vnni
    ):
        return NotImplemented
    acc = torch._int_mm(x_q, weight.t())
    out = acc.to(torch.float32) * x_scale.float() * weight_scale.float().view(1, -1)
    if bias is not None:
        if layout is not None:
            bias = bias.index_select(0, layout.to_device)
        out = out + bias.float()
    out = out.to(out_dtype)
    return out if layout is None else out.index_select(-1, layout.from_device)


# Up to this many rows torch's ``_weight_int8pack_mm`` (bf16 activations
# times int8 weights, scales applied to the float32 sums) beats dequantizing
# the weight once per call and one bf16 GEMM; above it the latter wins.
# Measured on the 2-core EPYC (AVX512-BF16) for SmolLM2's layer GEMMs with
# cold weights by ``benchmarks/kernels/int8_gemm_rows.py``, time / packed bf16
# GEMM: int8pack 0.54-0.82x at 1-2 rows, 0.7-1.04x at 4, 1.6-2.2x at 32,
# 2.2-2.6x at 128; dequantize + GEMM 1.8-3.4x at 1-2 rows, 1.8-2.9x at 32,
# 1.5-1.9x at 128.
INT8PACK_MAX_ROWS = 32


def _weight_only_int8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    if x.shape[0] <= INT8PACK_MAX_ROWS:
        out = torch.ops.aten._weight_int8pack_mm(x, weight, scale.to(x.dtype))
    else:
        w = (weight.to(torch.float32) * scale.to(torch.float32)[:, None]).to(x.dtype)
        out = F.linear(x, w)  # the reference's rounding of w
    return out if bias is None else out + bias


def _weight_only_int8_fake(x, weight, scale, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


_LIB = torch.library.Library("vllm_br", "FRAGMENT")
if not hasattr(torch.ops.vllm_br, "weight_only_int8_linear"):
    # Opaque under torch.compile: the row count is dynamic there, and the
    # choice above is made when the op runs.
    _LIB.define(
        "weight_only_int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias)"
        " -> Tensor"
    )
    _LIB.impl("weight_only_int8_linear", _weight_only_int8, "CompositeExplicitAutograd")
    torch.library.register_fake(
        "vllm_br::weight_only_int8_linear", _weight_only_int8_fake, lib=_LIB
    )


def weight_only_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    bits: int = 8,
    bias: torch.Tensor | None = None,
    layout: Any = None,
) -> torch.Tensor:
    """The ``weight_only_linear`` op for symmetric per-channel int8 weights
    and bf16 / fp16 activations (W8A16, GPTQ int8 in 16 bits); the reference
    for the rest (declined)."""
    if (
        bits != 8
        or zero_point is not None
        or scale.reshape(scale.shape[0], -1).shape[1] != 1
        or x.dtype not in (torch.bfloat16, torch.float16)
        or x.device.type != "cpu"
        or x.ndim != 2
    ):
        return NotImplemented
    if bias is not None and layout is not None:
        bias = bias.index_select(0, layout.to_device)
    s = scale.reshape(-1)
    if torch.compiler.is_compiling():
        out = torch.ops.vllm_br.weight_only_int8_linear(x, weight, s, bias)
    else:
        out = _weight_only_int8(x, weight, s, bias)
    return out if layout is None else out.index_select(-1, layout.from_device)
