"""The vision towers' patch embedding: a convolution whose kernel equals its
stride (no padding, no groups) cuts the image into disjoint patches, so it is
one GEMM of the flattened patches by the flattened kernel. vLLM's
``Conv2dLayer``/``Conv3dLayer`` take that path on CUDA too
(``_forward_mulmat``); here it is an op a device can bind to its kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_br.ops.registry import register_op


@register_op("patch_embedding")
def patch_embedding(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``conv{2,3}d(x, weight, bias, stride=kernel_size)`` for ``x``
    ``[B, C, *spatial]`` whose spatial sizes are multiples of the kernel's;
    the output is ``[B, O, *(spatial // kernel)]``."""
    kernel = weight.shape[2:]
    nd = len(kernel)
    batch = x.shape[0]
    for dim, k in enumerate(kernel):
        x = x.unfold(2 + dim, k, k)
    # [B, C, *grid, *kernel] -> [B, *grid, C, *kernel]
    grid = x.shape[2 : 2 + nd]
    order = [0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd)]
    patches = x.permute(order).reshape(-1, weight[0].numel())
    out = F.linear(patches, weight.reshape(weight.shape[0], -1), bias)
    out = out.view(batch, *grid, weight.shape[0])
    return out.permute(0, nd + 1, *range(1, nd + 1))
