"""W8A8 int8 linear layers on SUPA: vLLM's ``Int8ScaledMMLinearKernel`` for
``PlatformEnum.OOT`` (registered by ``vllm_br.quantization.register``).

After loading, the int8 weight ``[N, K]`` keeps its shape (in the device
layout), per-tensor weight scales of fused layers (QKV, gate/up) become one
scale per output channel, and a static input scale becomes one float32
scalar. Each call quantizes the activations (``quantize_int8``: per token,
or with the static scale and zero point) and multiplies with
``int8_scaled_mm``, which accumulates exactly in int32.
"""

from __future__ import annotations

import torch
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
    Int8ScaledMMLinearKernel,
    Int8ScaledMMLinearLayerConfig,
)
from vllm.model_executor.layers.quantization.utils.w8a8_utils import (
    convert_to_channelwise,
)
from vllm.platforms import current_platform

from vllm_br.ops import get_op
from vllm_br.quantization import scheme
from vllm_br.quantization.layout import store_rows_in_device_layout


class SUPAInt8ScaledMMLinearKernel(Int8ScaledMMLinearKernel):
    @classmethod
    def is_supported(
        cls, compute_capability: int | None = None
    ) -> tuple[bool, str | None]:
        if not current_platform.is_out_of_tree():
            return False, "requires the SUPA platform"
        return True, None

    @classmethod
    def can_implement(cls, c: Int8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        scheme.stored_weight_bits(8)  # int8 weights need VLLM_BR_QUANT_METHOD=INT8
        w_name, ws_name, xs_name, xzp_name, _ = self.layer_param_names
        weight = getattr(layer, w_name)
        weight_scale = getattr(layer, ws_name).data
        widths = list(getattr(layer, "logical_widths", [weight.shape[0]]))
        if not self.config.is_channelwise:
            weight_scale = convert_to_channelwise(weight_scale, widths)
        layer.register_parameter(
            ws_name,
            torch.nn.Parameter(weight_scale.reshape(-1).float(), requires_grad=False),
        )
        layer.br_input_scale = None
        layer.br_input_zero_point = None
        if self.config.is_static_input_scheme:
            layer.br_input_scale = getattr(layer, xs_name).data.float().max().reshape(1)
            if not self.config.input_symmetric:
                zp = getattr(layer, xzp_name).data.to(torch.int32).reshape(1)
                layer.br_input_zero_point = zp
        layer.br_weight_layout = store_rows_in_device_layout(
            layer, weight.shape[0], [w_name, ws_name]
        )

    def apply_weights(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        w_name, ws_name = self.layer_param_names[:2]
        weight = getattr(layer, w_name)
        x2d = x.reshape(-1, x.shape[-1])
        x_q, x_scale, x_zp = get_op("quantize_int8")(
            x2d,
            layer.br_input_scale,
            layer.br_input_zero_point,
            self.config.input_symmetric,
        )
        out = get_op("int8_scaled_mm")(
            x_q,
            weight,
            x_scale,
            getattr(layer, ws_name),
            x.dtype,
            x_zp,
            bias,
            layer.br_weight_layout,
        )
        return out.reshape(*x.shape[:-1], weight.shape[0])
