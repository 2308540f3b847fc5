"""Quantized MoE experts of compressed-tensors checkpoints on SUPA: W8A8-INT8
(here) and W8A16 / W4A16 (``vllm_br.quantization.weight_only_moe``) MoE
models (Qwen3-MoE, DeepSeek, GLM-4-MoE...) on the plugin's ``fused_experts``.

vLLM builds such a layer's method from the checkpoint's scheme
(``CompressedTensorsMoEMethod.get_moe_method``), and that method asks vLLM's
int8 MoE oracle for a kernel, which offers Triton and CPU only. So
:class:`SUPACompressedTensorsConfig`, registered under the same name with
vLLM's ``register_quantization_config`` (it replaces the config on this
platform), gives routed experts with a W8A8-INT8 scheme
:class:`SUPAW8A8Int8MoEMethod`, weight-only ones
:class:`SUPACompressedTensorsWNA16MoEMethod`, and leaves every other layer to
vLLM's config.

The method keeps vLLM's parameters (int8 ``w13_weight [E, 2I, H]`` /
``w2_weight [E, H, I]``, per-channel scales), and, like the unquantized
method (``vllm_br.layers.moe``), is monolithic: it routes with the plugin's
routing ops and runs ``fused_experts`` with the scales and per-token
activation quantization, so the static decode path serves int8 experts too.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E501
    CompressedTensorsConfig,
)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # noqa: E501
    CompressedTensorsMoEMethod,
)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_int8 import (  # noqa: E501
    CompressedTensorsW8A8Int8MoEMethod,
)
from vllm.model_executor.utils import replace_parameter

from vllm_br.errors import SUPAConfigError
from vllm_br.ops import get_op
from vllm_br.ops.moe_layer import check_supported, route
from vllm_br.quantization import scheme
from vllm_br.quantization.weight_only_moe import SUPACompressedTensorsWNA16MoEMethod


class SUPAInt8MoEComputeMixin:
    """Routing and compute of int8 experts with per-channel scales (the
    layer attributes named below) on the plugin's fused MoE."""

    w13_scale_name = "w13_weight_scale"
    w2_scale_name = "w2_weight_scale"

    @property
    def is_monolithic(self) -> bool:
        # Routing happens here, not in vLLM's router (its kernels are CUDA).
        return True

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        topk_weights, topk_ids = route(layer, x, router_logits)
        return get_op("fused_experts")(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
            layer.activation.value, layer.apply_router_weight_on_input,
            layer.expert_map, None, getattr(layer, self.w13_scale_name),
            getattr(layer, self.w2_scale_name), True,
        )  # fmt: skip


class SUPAW8A8Int8MoEMethod(
    SUPAInt8MoEComputeMixin, CompressedTensorsW8A8Int8MoEMethod
):
    def __init__(self, weight_quant, input_quant, moe) -> None:
        # vLLM's __init__ adds the int8 MoE oracle's kernel choice to these.
        CompressedTensorsMoEMethod.__init__(self, moe)
        self.weight_quant = weight_quant
        self.input_quant = input_quant
        self.static_input_scales = False
        self.int8_backend = self.experts_cls = None
        check_supported(moe)
        scheme.stored_weight_bits(8)

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        for name in ("w13_weight_scale", "w2_weight_scale"):  # [E, N, 1] -> [E, N]
            scale = getattr(layer, name)
            replace_parameter(layer, name, scale.data.reshape(scale.shape[0], -1))


def _moe_scheme(config: CompressedTensorsConfig, layer, prefix: str):
    """(weights, input activations) args of the experts' scheme, or None
    where the checkpoint leaves them unquantized (as vLLM's get_moe_method)."""
    config._add_fused_moe_to_target_scheme_map()
    names = [
        f"{prefix}.0.{proj}"
        for proj in (
            layer.ckpt_gate_proj_name,
            layer.ckpt_up_proj_name,
            layer.ckpt_down_proj_name,
        )
    ]
    dicts = [config.get_scheme_dict(layer, name) for name in names]
    if all(d is None for d in dicts):
        return None
    if any(d != dicts[0] for d in dicts):
        return None, None  # mixed: refused below
    return dicts[0].get("weights"), dicts[0].get("input_activations")


class SUPACompressedTensorsConfig(CompressedTensorsConfig):
    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, RoutedExperts):
            return super().get_quant_method(layer, prefix)
        found = _moe_scheme(self, layer, prefix)
        if found is None:
            return super().get_quant_method(layer, prefix)  # unquantized experts
        weights, inputs = found
        if (
            weights is not None
            and inputs is not None
            and weights.type == "int"
            and weights.num_bits == 8
            and weights.strategy == "channel"
            and weights.symmetric
            and inputs.num_bits == 8
            and inputs.strategy == "token"
            and inputs.dynamic
        ):
            return SUPAW8A8Int8MoEMethod(weights, inputs, layer.moe_config)
        if (
            weights is not None
            and inputs is None
            and weights.type == "int"
            and weights.num_bits in (4, 8)
            and weights.strategy in ("group", "channel")
        ):
            return SUPACompressedTensorsWNA16MoEMethod(weights, None, layer.moe_config)
        raise SUPAConfigError(
            f"The checkpoint quantizes the MoE experts of {prefix} with a scheme "
            "SUPA does not serve for experts; SUPA serves W8A8-INT8 experts "
            "(int8 per channel, dynamic per-token activations), W8A16 or W4A16 "
            "experts (per channel or grouped) or unquantized ones."
        )


def register() -> None:
    register_quantization_config("compressed-tensors")(SUPACompressedTensorsConfig)
