"""The ``linear`` op (unquantized GEMMs of the linear layers) and the
``prepare_gemm_weight`` hook a device uses to prepare GEMM weights once.

A weight may be stored in the device's layout (``layout``: a
``vllm_br.ops.weight_layout.DeviceLayout``, the per-die NUMA order of a
two-die card), and a device whose matmul is slow in the model dtype may keep
a wider copy of it (``matmul_weight``, ``vllm_br.layers.matmul_weights``).
The references here define what every kernel computes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vllm_br.ops.registry import register_op


def gemm_in_copy(
    x: torch.Tensor,
    matmul_weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ W.T + b`` multiplied in ``matmul_weight``'s (wider) dtype and
    rounded to ``x``'s: what a GEMM in ``x``'s dtype with float32
    accumulation gives, up to summation order."""
    dt = matmul_weight.dtype
    b = None if bias is None else bias.to(dt)
    return F.linear(x.to(dt), matmul_weight, b).to(x.dtype)


@register_op("linear")
def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    layout: Any = None,
    matmul_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + b`` for ``W`` stored in ``layout``; ``bias`` is logical.

    Each output channel is the same dot product as with the plain weight, so
    the result equals ``F.linear(x, W_logical, b)`` exactly. ``matmul_weight``
    is ``weight`` in a wider dtype; the reference multiplies it (a device
    kernel may choose per call which of the two to multiply).
    """
    if layout is not None:
        to_device, from_device = layout.to_device, layout.from_device
        if to_device.device != weight.device:
            to_device, from_device = (
                to_device.to(weight.device),
                from_device.to(weight.device),
            )
        if bias is not None:
            bias = bias.index_select(0, to_device)
    if matmul_weight is None:
        out = F.linear(x, weight, bias)
    else:
        out = gemm_in_copy(x, matmul_weight, bias)
    return out if layout is None else out.index_select(-1, from_device)


@register_op("prepare_gemm_weight")
def prepare_gemm_weight(weight: torch.Tensor, lm_head: bool = False) -> int:
    """Prepare a GEMM weight (``[out, in]``) once after loading for the
    device's ``linear`` / ``compute_logits`` kernels (e.g. pack it into the
    matmul's blocked format, kept beside the weight); returns the bytes added.
    The reference kernels multiply the weight as it is: nothing to do."""
    return 0
