"""GPTQ checkpoints on SUPA, through vLLM's own ``auto_gptq`` config.

vLLM detects a GPTQ checkpoint as ``auto_gptq``, whose linear method asks
Marlin (a CUDA kernel) whether the platform supports the weight type before
it picks a kernel from the mixed-precision registry. On SUPA that registry
gives ``SUPAWeightOnlyLinearKernel``, so :class:`SUPAAutoGPTQConfig`
(registered under the same name with vLLM's ``register_quantization_config``,
which replaces the config for this platform) skips that question, and also
computes in float32 (the SUPA kernel does; the Marlin path only in 16 bits).
GPTQ-quantized MoE experts get :class:`SUPAAutoGPTQMoEMethod` (vLLM's
parameters, the plugin's fused MoE) instead of vLLM's Marlin MoE method.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.auto_gptq import (
    AutoGPTQConfig,
    AutoGPTQLinearMethod,
    get_moe_quant_method,
)
from vllm.model_executor.layers.quantization.utils.gptq_utils import (
    get_linear_quant_method,
)

from vllm_br.quantization.weight_only_moe import SUPAAutoGPTQMoEMethod


class SUPAAutoGPTQLinearMethod(AutoGPTQLinearMethod):
    def __init__(self, quant_config: AutoGPTQConfig) -> None:
        # vLLM's __init__ only adds verify_marlin_supported (CUDA) to these.
        self.quant_config = quant_config
        self.input_dtype = None
        self.quant_type = quant_config.quant_type


class SUPAAutoGPTQConfig(AutoGPTQConfig):
    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.half, torch.bfloat16]

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, RoutedExperts):
            return get_moe_quant_method(self, layer, prefix, SUPAAutoGPTQMoEMethod)
        return get_linear_quant_method(self, layer, prefix, SUPAAutoGPTQLinearMethod)


def register() -> None:
    register_quantization_config(AutoGPTQConfig.get_name())(SUPAAutoGPTQConfig)
