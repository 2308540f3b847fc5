"""int8 GEMMs on the host (cpu backend): the ``int8_scaled_mm`` and
``weight_only_linear`` ops.

W8A8 (``int8_scaled_mm``) sums int8 x int8 products exactly in int32, as the
reference does, so the result is the reference's bit for bit before the
scales. Up to four rows (decode) the C++ GEMV of ``int8_gemv`` runs; above,
``torch._int_mm`` (oneDNN) on hosts with AVX512-VNNI (``cpu_isa``): without
VNNI oneDNN sums pairs of products in saturating int16 and full-range int8
comes out wrong, so there a float32 GEMM over slices of at most
:data:`EXACT_FP32_K` input channels runs, whose sums are integers float32
holds exactly. Calls with an activation zero point (asymmetric activations)
are declined (the reference runs).

Weight-only int8 (``weight_only_linear``, W8A16) runs the C++ GEMV up to four
rows (scales per channel or per group); with per-channel scales torch's
``_weight_int8pack_mm`` up to :data:`INT8PACK_MAX_ROWS`; otherwise one GEMM
on the weight dequantized per call (in 16 bits where the host has fast bf16,
else in float32).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vllm_br.device import cpu_isa
from vllm_br.device.cpu_kernels import int8_gemv

# Slices of at most this many input channels keep every float32 partial sum
# of int8 x int8 products an integer of at most 1024 * 128 * 128 = 2**24 in
# magnitude, which float32 holds exactly, whatever the summation order.
EXACT_FP32_K = 1024


def _int8_mm_exact_fp32(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x_q @ weight.T`` in int32, exact, by float32 GEMMs over K slices."""
    acc = None
    for k0 in range(0, x_q.shape[1], EXACT_FP32_K):
        part = F.linear(
            x_q[:, k0 : k0 + EXACT_FP32_K].float(),
            weight[:, k0 : k0 + EXACT_FP32_K].float(),
        ).to(torch.int32)
        acc = part if acc is None else acc + part
    return acc


def _int8_mm(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    acc = int8_gemv.i8i8(x_q, weight)
    if acc is not None:
        return acc
    if cpu_isa.host_isa().avx512_vnni:
        return torch._int_mm(x_q, weight.t())
    return _int8_mm_exact_fp32(x_q, weight)


def _int8_mm_fake(x_q, weight):
    return x_q.new_empty((x_q.shape[0], weight.shape[0]), dtype=torch.int32)


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
    if x_zero_point is not None or x_q.device.type != "cpu" or x_q.ndim != 2:
        return NotImplemented
    if torch.compiler.is_compiling():
        acc = torch.ops.vllm_br.int8_mm(x_q, weight)
    else:
        acc = _int8_mm(x_q, weight)
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
    """``scale``: ``[N, groups]`` (one group: per channel)."""
    out = int8_gemv.w8_bf16(x, weight, scale, bias)
    if out is not None:
        return out
    n, groups = scale.shape
    if groups == 1 and x.shape[0] <= INT8PACK_MAX_ROWS:
        out = torch.ops.aten._weight_int8pack_mm(x, weight, scale.view(n).to(x.dtype))
    else:
        w = (
            weight.to(torch.float32).view(n, groups, -1) * scale.float()[:, :, None]
        ).view(n, -1)
        if cpu_isa.host_isa().fast_bf16:
            out = F.linear(x, w.to(x.dtype))  # the reference's rounding of w
        else:
            # torch's 16-bit GEMM without AVX512-BF16 / AMX is a slow generic
            # loop (~8 GFLOP/s, bf16_gemm.py); float32 with the unrounded
            # weight, rounded once to x's dtype, is ~20x faster.
            out = F.linear(x.float(), w).to(x.dtype)
    return out if bias is None else out + bias


def _weight_only_int8_fake(x, weight, scale, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


_LIB = torch.library.Library("vllm_br", "FRAGMENT")
if not hasattr(torch.ops.vllm_br, "weight_only_int8_linear"):
    # Opaque under torch.compile: the row count is dynamic there, and the
    # choices above are made when the ops run.
    _LIB.define("int8_mm(Tensor x_q, Tensor weight) -> Tensor")
    _LIB.impl("int8_mm", _int8_mm, "CompositeExplicitAutograd")
    torch.library.register_fake("vllm_br::int8_mm", _int8_mm_fake, lib=_LIB)
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
    """The ``weight_only_linear`` op for symmetric int8 weights with scales
    per channel or per group and bf16 / fp16 activations (W8A16, GPTQ int8
    in 16 bits); the reference for the rest (declined)."""
    if (
        bits != 8
        or zero_point is not None
        or x.dtype not in (torch.bfloat16, torch.float16)
        or x.device.type != "cpu"
        or x.ndim != 2
    ):
        return NotImplemented
    if bias is not None and layout is not None:
        bias = bias.index_select(0, layout.to_device)
    s = scale.reshape(scale.shape[0], -1)
    if torch.compiler.is_compiling():
        out = torch.ops.vllm_br.weight_only_int8_linear(x, weight, s, bias)
    else:
        out = _weight_only_int8(x, weight, s, bias)
    return out if layout is None else out.index_select(-1, layout.from_device)
