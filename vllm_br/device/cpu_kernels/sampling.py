"""Greedy sampling's argmax on float32 logits (``argmax.cpp``).

vLLM's sampler turns the logits to float32 before its greedy step, so that is
the dtype served; each thread takes whole rows. Same result as
``torch.argmax(dim=-1)``: the first maximum, or the first NaN.
"""

from __future__ import annotations

import torch

from vllm_br.device.cpu_kernels import load_library


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """``[rows, vocab]`` float32 logits -> ``[rows]`` int64 ids; None where
    the kernel does not apply (other dtypes or strides, no kernel here)."""
    if (
        logits.dtype != torch.float32
        or logits.ndim != 2
        or logits.device.type != "cpu"
        or logits.stride(-1) != 1
        or logits.shape[0] == 0
        or logits.shape[1] == 0
    ):
        return None
    lib = load_library()
    if lib is None:
        return None
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    ran = lib.vllm_br_argmax_f32(
        logits.data_ptr(),
        rows,
        cols,
        logits.stride(0),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out if ran else None
