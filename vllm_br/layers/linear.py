"""Linear layers that store unquantized weights in the device layout.

vLLM's linear layers are ``PluggableLayer``s; the OOT classes below replace
ReplicatedLinear, ColumnParallelLinear, MergedColumnParallelLinear,
QKVParallelLinear, RowParallelLinear and the MoE router's GateLinear (a
ReplicatedLinear; each by its own name: vLLM matches the exact class name).
GateLinear's own GEMM tiers are CUDA / ROCm kernels it switches off on any
other platform, so on SUPA it always takes its last tier, ReplicatedLinear's
forward (input cast to the gate's weight dtype, float32 logits where the
model asks for them), which then runs the ``linear`` op. Their only change:
an exactly-``UnquantizedLinearMethod`` quant method becomes
:class:`SUPAUnquantizedLinearMethod`, which

- after loading (``process_weights_after_loading``) rewrites the weight into
  the device layout (``weight_layout``: NUMA per-die split on a two-die card,
  plain otherwise) and records it as ``layer.br_weight_layout`` (None: plain);
- computes with the ``linear`` op, which takes that layout and returns
  outputs in logical order, so results are unchanged.

Quantized methods, and linear subclasses defined elsewhere, keep vLLM's
path. A layer whose raw weight other code reads (MLA's ``kv_b_proj``, marked
``_cpu_skip_gemm_dispatch`` by vLLM) keeps the plain layout. Code that needs
the logical weight of a converted layer calls ``logical_weight(layer)``.
As for every vLLM quant method, ``process_weights_after_loading`` expects
freshly loaded (logical) weights, except under vLLM's
``weights_already_processed()`` (weight-cache IPC loader), where the weights
are already in the device layout and only the layout record is rebuilt.
"""

from __future__ import annotations

import torch
from vllm.model_executor import custom_op
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.utils import is_weights_pre_processed

from vllm_br.layers._oot import logger, register_oot
from vllm_br.layers.matmul_weights import MATMUL_WEIGHT
from vllm_br.ops import get_op, weight_layout
from vllm_br.ops.weight_layout import DeviceLayout


class SUPAUnquantizedLinearMethod(UnquantizedLinearMethod):
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.br_weight_layout = None
        if getattr(layer, "_cpu_skip_gemm_dispatch", False):
            return  # its raw weight is read elsewhere
        kind, dies = weight_layout.current_layout()
        weight = layer.weight
        sizes = list(getattr(layer, "output_partition_sizes", [weight.shape[0]]))
        if weight.ndim != 2 or sum(sizes) != weight.shape[0]:
            return
        layout = DeviceLayout.make(kind, dies, sizes, weight.device)
        if layout is None:
            return
        if not is_weights_pre_processed():  # else already stored in device layout
            weight.data = weight_layout.to_device_layout(weight.data, kind, dies, sizes)
        layer.br_weight_layout = layout
        logger.debug("%s: weight in %s layout on %d dies", layer.prefix, kind, dies)

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return get_op("linear")(
            x,
            layer.weight,
            bias,
            layer.br_weight_layout,
            getattr(layer, MATMUL_WEIGHT, None),
        )


def logical_weight(layer: torch.nn.Module) -> torch.Tensor:
    """``layer.weight`` in vLLM's plain ``[out, in]`` layout."""
    layout: DeviceLayout | None = getattr(layer, "br_weight_layout", None)
    if layout is None:
        return layer.weight
    return weight_layout.from_device_layout(
        layer.weight, layout.layout, layout.dies, layout.partition_sizes
    )


class _DeviceLayoutLinear:
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.br_weight_layout: DeviceLayout | None = None
        if type(self.quant_method) is UnquantizedLinearMethod:
            self.quant_method = SUPAUnquantizedLinearMethod()


class SUPAReplicatedLinear(_DeviceLayoutLinear, ReplicatedLinear):
    pass


class SUPAColumnParallelLinear(_DeviceLayoutLinear, ColumnParallelLinear):
    pass


class SUPAMergedColumnParallelLinear(_DeviceLayoutLinear, MergedColumnParallelLinear):
    pass


class SUPAQKVParallelLinear(_DeviceLayoutLinear, QKVParallelLinear):
    pass


class SUPARowParallelLinear(_DeviceLayoutLinear, RowParallelLinear):
    pass


class SUPAGateLinear(_DeviceLayoutLinear, GateLinear):
    pass


OOT_LAYERS: list[tuple[type, type]] = [
    (ReplicatedLinear, SUPAReplicatedLinear),
    (ColumnParallelLinear, SUPAColumnParallelLinear),
    (MergedColumnParallelLinear, SUPAMergedColumnParallelLinear),
    (QKVParallelLinear, SUPAQKVParallelLinear),
    (RowParallelLinear, SUPARowParallelLinear),
    (GateLinear, SUPAGateLinear),
]


def register() -> list[str]:
    return [
        f"{base.__module__}.{base.__name__}"
        for base, cls in OOT_LAYERS
        if register_oot(base, cls, custom_op.op_registry_oot)
    ]
