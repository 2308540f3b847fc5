"""vLLM's online int8 MoE (``--quantization experts_int8``, and the same
computation as ``--quantization int8_per_channel_weight_only``) on SUPA.

With ``experts_int8`` vLLM loads a bf16 / fp16 checkpoint and quantizes each
MoE layer's experts to int8 per output channel while loading
(``Int8OnlineMoEMethod``: w13 rows over the hidden size, w2 rows over the
intermediate size with their maximum shared across the tensor-parallel
ranks); linear layers stay unquantized. Its compute then asks vLLM's int8
MoE oracle for a kernel, which offers Triton and CPU only. So
:class:`SUPAExpertsInt8Config`, registered under the same name with vLLM's
``register_quantization_config`` (it replaces the config on this platform),
gives routed experts :class:`SUPAInt8OnlineMoEMethod`: vLLM's loading and
quantization, then the plugin's routing and ``fused_experts`` with the
scales and per-token activation quantization, as for W8A8-INT8 checkpoints
(``vllm_br.quantization.moe``). It also computes in float32.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.experts_int8 import ExpertsInt8Config
from vllm.model_executor.layers.quantization.online.int8 import Int8OnlineMoEMethod
from vllm.model_executor.layers.quantization.online.moe_base import (
    OnlineMoEMethodBase,
)

from vllm_br.compat import online_moe_methods
from vllm_br.ops.moe_layer import check_supported
from vllm_br.quantization import scheme
from vllm_br.quantization.moe import SUPAInt8MoEComputeMixin


class SUPAInt8OnlineMoEMethod(SUPAInt8MoEComputeMixin, Int8OnlineMoEMethod):
    w13_scale_name = "w13_scale"  # Int8OnlineMoEMethod's [E, N] scales
    w2_scale_name = "w2_scale"

    def __init__(self, *, moe) -> None:
        # vLLM's __init__ adds the int8 MoE oracle's kernel choice.
        OnlineMoEMethodBase.__init__(self, moe)
        self.int8_backend = self.experts_cls = None
        check_supported(moe)
        scheme.stored_weight_bits(8)

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        w13, w2 = self.get_weights_for_quantization(layer)
        self._quantize_weights(layer, w13, w2)  # int8 weights, [E, N] scales
        self.release_requantization_source_weights(layer)
        layer._already_called_process_weights_after_loading = True

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None  # fused_experts takes the scales itself


class SUPAExpertsInt8Config(ExpertsInt8Config):
    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.half, torch.float32]

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, RoutedExperts):
            return SUPAInt8OnlineMoEMethod(moe=layer.moe_config)
        return super().get_quant_method(layer, prefix)


def serve_online_int8_shorthand() -> None:
    """``--quantization int8_per_channel_weight_only`` resolves through vLLM's
    online table to ``Int8OnlineMoEMethod``, whose kernel choice has no
    out-of-tree entry; on SUPA the table names :class:`SUPAInt8OnlineMoEMethod`
    (patch ledger: online-int8-moe-method)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kInt8StaticChannelSym,
    )

    online_moe_methods()[kInt8StaticChannelSym] = SUPAInt8OnlineMoEMethod


def register() -> None:
    register_quantization_config("experts_int8")(SUPAExpertsInt8Config)
    serve_online_int8_shorthand()
