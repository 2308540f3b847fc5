"""bf16 GEMMs of one or two rows on the plain weight (``gemv.cpp``).

A decode step of one sequence multiplies every weight by a single row, so
the GEMM is a pass over the weight and its speed is memory bandwidth. The C++
kernel streams each thread's share of weight rows front to back with
prefetching, and beats oneDNN's packed weights (``packed_linear.py``) at one
and two rows on every SmolLM2 GEMM shape; from four rows the packed kernel
catches up (``benchmarks/kernels/gemv_rows.py``), so it serves rows up to
:data:`MAX_ROWS`. Built only for hosts with AVX512-BF16; float32 sums and one
rounding to bf16, like oneDNN (results agree to summation order).
"""

from __future__ import annotations

import functools

import torch

from vllm_br.device.cpu_kernels import load_library

# Measured by ``benchmarks/kernels/gemv_rows.py --json-out
# benchmarks/results/gemv_rows.json`` on the 2-core AMX host, cold weights, 2
# threads; gemv / packed time over SmolLM2's five GEMM shapes: 1 row
# 0.72-0.88, 2 rows 0.81-0.94, 4 rows 0.92-1.17 (gate_up and the LM head lose).
MAX_ROWS = 2


@functools.cache
def _kernel_max_rows() -> int:
    """Rows the built kernel takes (0: none here); asked once, not per GEMM."""
    lib = load_library()
    return 0 if lib is None else lib.vllm_br_gemv_max_rows()


def available() -> bool:
    return _kernel_max_rows() >= max(MAX_ROWS, 1)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for bf16 CPU tensors of at most
    :data:`MAX_ROWS` rows; None where the kernel does not apply (other
    rows, dtypes or strides, no kernel on this host)."""
    k = x.shape[-1]
    rows = x.numel() // max(1, k)
    if (
        not 0 < rows <= MAX_ROWS
        or x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or weight.ndim != 2
        or weight.shape[1] != k
        or weight.stride(1) != 1
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or (
            bias is not None
            and (bias.dtype != torch.bfloat16 or not bias.is_contiguous())
        )
        or not available()
    ):
        return None
    x2 = x.reshape(rows, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    lib = load_library()
    if lib is None:  # the library's setting changed after the first ask
        return None
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=torch.bfloat16)
    ran = lib.vllm_br_gemv_bf16(
        x2.data_ptr(),
        x2.stride(0),
        rows,
        weight.data_ptr(),
        weight.stride(0),
        n,
        k,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if not ran:
        return None
    return out.view(*x.shape[:-1], n)
