"""Quantized weights in the device layout (``VLLM_BR_WEIGHT_TYPE=NUMA``).

The quantized kernels store their weights, scales and zero points row for
row like the plain linear weight (``vllm_br.ops.weight_layout``): on a two-die
card each die holds its share of every logical output partition. Every
per-output-channel tensor is permuted the same way, and the quant ops return
outputs in logical order, so results are unchanged.
"""

from __future__ import annotations

import torch
from vllm.model_executor.utils import is_weights_pre_processed

from vllm_br.ops import weight_layout
from vllm_br.ops.weight_layout import DeviceLayout


def store_rows_in_device_layout(
    layer: torch.nn.Module, rows: int, names: list[str]
) -> DeviceLayout | None:
    """Rewrite ``layer``'s tensors ``names`` (each ``[rows, ...]``) into the
    device layout; return the layout (None: plain)."""
    kind, dies = weight_layout.current_layout()
    sizes = list(getattr(layer, "output_partition_sizes", None) or [rows])
    if sum(sizes) != rows:
        return None
    layout = DeviceLayout.make(kind, dies, sizes, getattr(layer, names[0]).device)
    if layout is None or is_weights_pre_processed():  # else already stored so
        return layout
    for name in names:
        t = getattr(layer, name, None)
        if t is not None and t.ndim >= 1 and t.shape[0] == rows:
            t.data = weight_layout.to_device_layout(t.data, kind, dies, sizes)
    return layout
