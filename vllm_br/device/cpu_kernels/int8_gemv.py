"""int8-weight GEMMs of one to four rows on the plain weight (``int8_gemv.cpp``).

A decode step multiplies every weight by a few rows, so the GEMM is a pass
over the weight: int8 weights are half the bytes of bf16. The C++ kernels
stream each thread's share of weight rows front to back, on AVX2+FMA or
AVX-512 (every host the backend supports has AVX2):

- :func:`w8_bf16`: bf16 activations times int8 weights with scales per
  output row or per group of inputs (W8A16, GPTQ int8); float32 sums, one
  rounding to bf16;
- :func:`i8i8`: int8 activations times int8 weights summed exactly in int32
  (W8A8), on hosts without VNNI too (no saturating int16 pair sums).

Each returns None where it does not apply (rows, dtypes, strides, no
kernel on this host), and the caller runs another path.
"""

from __future__ import annotations

import functools

import torch

from vllm_br.device.cpu_kernels import load_library


@functools.cache
def max_rows() -> int:
    """Rows the built kernels take (0: none here); asked once, not per GEMM."""
    lib = load_library()
    return 0 if lib is None else lib.vllm_br_gemv_w8_max_rows()


@functools.cache
def group_multiple() -> int:
    """Group sizes of grouped scales must be multiples of this (0: no kernel)."""
    lib = load_library()
    return 0 if lib is None else lib.vllm_br_gemv_w8_group_multiple()


# Each check below costs about a microsecond in a decode step of ~120 GEMMs,
# so they are only what a call can vary: the ops' callers pass CPU tensors
# (the cpu backend binds these kernels) and 2-D activations.
_BF16, _F32, _I8 = torch.bfloat16, torch.float32, torch.int8


def _applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.shape[0] <= max_rows()
        and weight.dtype == _I8
        and weight.shape[1] == x.shape[1]
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.shape[0] > 0
    )


def w8_bf16(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """``x @ W.T + bias`` for bf16 ``x [m, k]`` and the int8 weight ``[n, k]``
    dequantized with ``scale`` (float32 or bf16, widened to float32 exactly):
    ``[n]`` or ``[n, 1]`` per channel, or ``[n, groups]`` for groups of
    ``k / groups`` inputs (a multiple of :func:`group_multiple`). None where
    it does not apply."""
    n = weight.shape[0]
    if (
        x.dtype != _BF16
        or not _applies(x, weight)
        or (scale.dtype != _F32 and scale.dtype != _BF16)
        or not scale.is_contiguous()
        or (bias is not None and (bias.dtype != _BF16 or not bias.is_contiguous()))
    ):
        return None
    rows, k = x.shape
    groups = scale.numel() // n
    if groups * n != scale.numel() or (
        groups > 1 and (k % groups or (k // groups) % group_multiple())
    ):
        return None
    lib = load_library()
    if lib is None:  # the library's setting changed after the first ask
        return None
    out = torch.empty(rows, n, dtype=_BF16)
    ran = lib.vllm_br_gemv_w8_bf16(
        x.data_ptr(), k, rows, weight.data_ptr(), k, n, k,
        scale.data_ptr(), scale.dtype == _BF16, groups,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return out if ran else None


def i8i8(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x_q @ weight.T`` summed exactly in int32 for int8 ``x_q [m, k]`` and
    ``weight [n, k]``; None where it does not apply."""
    if x_q.dtype != _I8 or not _applies(x_q, weight):
        return None
    lib = load_library()
    if lib is None:
        return None
    rows, k = x_q.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=torch.int32)
    lib.vllm_br_gemv_i8i8(
        x_q.data_ptr(), k, rows, weight.data_ptr(), k, n, k,
        out.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return out
