"""int8 x int8 GEMMs on the host (cpu backend): the ``int8_scaled_mm`` op.

``torch._int_mm`` multiplies int8 matrices with exact int32 accumulation
(oneDNN on the host), so its result is the reference's bit for bit before
the scales, and it reads half the bytes of a bf16 weight. Its speed against
the bf16 path has been probed on one host only, not yet measured by a
benchmark in ``benchmarks/``. Calls with an activation zero
point (asymmetric activations) are declined: the reference runs.
"""

from __future__ import annotations

from typing import Any

import torch


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
    if x_zero_point is not None or x_q.device.type != "cpu":
        return NotImplemented
    acc = torch._int_mm(x_q, weight.t())
    out = acc.to(torch.float32) * x_scale.float() * weight_scale.float().view(1, -1)
    if bias is not None:
        if layout is not None:
            bias = bias.index_select(0, layout.to_device)
        out = out + bias.float()
    out = out.to(out_dtype)
    return out if layout is None else out.index_select(-1, layout.from_device)
