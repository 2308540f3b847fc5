"""Weight-only int8 / int4 linear layers on SUPA (W8A16, W4A16, GPTQ):
vLLM's ``MPLinearKernel`` for ``PlatformEnum.OOT`` (registered by
``vllm_br.quantization.register``).

Checkpoints pack their integers into int32 words, along the input dimension
(compressed-tensors ``[N, K / pack]``, GPTQ ``[K / pack, N]``), with scales
``[N, groups]`` or ``[groups, N]`` and, for asymmetric schemes, packed zero
points. After loading, each layer holds what the ``weight_only_linear`` op
takes (``vllm_br.ops.quant``): signed int8 ``[N, K]`` weights, or int4 packed
two per byte when ``VLLM_BR_QUANT_METHOD=INT4`` and the checkpoint is int4
(``vllm_br.quantization.scheme``); scales ``[N, groups]`` in the model dtype;
int8 zero points ``[N, groups]`` or none. Rows are in the device layout.
"""

from __future__ import annotations

import torch
from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
    MPLinearKernel,
    MPLinearLayerConfig,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    unpack_quantized_values_into_int32,
)
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform
from vllm.scalar_type import scalar_types

from vllm_br.ops import get_op
from vllm_br.ops.quant import check_group_size, pack_int4
from vllm_br.quantization import scheme
from vllm_br.quantization.layout import store_rows_in_device_layout

SUPPORTED_TYPES = (
    scalar_types.uint4b8,  # symmetric int4 (value + 8)
    scalar_types.uint8b128,  # symmetric int8 (value + 128)
    scalar_types.uint4,  # int4 with zero points
    scalar_types.uint8,  # int8 with zero points
)


class SUPAWeightOnlyLinearKernel(MPLinearKernel):
    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    @classmethod
    def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
        if not current_platform.is_out_of_tree():
            return False, "requires the SUPA platform"
        if c.weight_type not in SUPPORTED_TYPES:
            return False, f"weight type {c.weight_type} is not int4 or int8"
        if c.act_type not in (torch.float32, torch.bfloat16, torch.float16):
            return False, f"activation dtype {c.act_type} is not a float type"
        check_group_size(c.partition_weight_shape[0], c.group_size)
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        wtype = self.config.weight_type
        bits = wtype.size_bits
        stored_bits = scheme.stored_weight_bits(bits)
        # Symmetric types carry their offset in the type; asymmetric ones are
        # shifted by half their range so values and zero points fit in int8.
        offset = wtype.bias if wtype.has_bias() else 1 << (bits - 1)

        packed = getattr(layer, self.w_q_name)
        q = unpack_quantized_values_into_int32(packed.data, wtype, packed.packed_dim)
        if packed.input_dim == 0:  # GPTQ: [K, N]
            q = q.t()
        q = (q - offset).to(torch.int8).contiguous()
        n = q.shape[0]

        scales = getattr(layer, self.w_s_name)
        s = scales.data
        if getattr(scales, "output_dim", 0) == 1:  # GPTQ: [groups, N]
            s = s.t()
        replace_parameter(layer, self.w_s_name, s.reshape(n, -1).contiguous())

        names = [self.w_q_name, self.w_s_name]
        if self.config.zero_points:
            zp = getattr(layer, self.w_zp_name)
            z = unpack_quantized_values_into_int32(zp.data, wtype, zp.packed_dim)
            if getattr(zp, "output_dim", 0) == 1:
                z = z.t()
            replace_parameter(layer, self.w_zp_name, (z[:n] - offset).to(torch.int8))
            names.append(self.w_zp_name)
        elif self.w_zp_name is not None:
            setattr(layer, self.w_zp_name, None)

        replace_parameter(layer, self.w_q_name, pack_int4(q) if stored_bits == 4 else q)
        layer.br_weight_bits = stored_bits
        layer.br_weight_layout = store_rows_in_device_layout(layer, n, names)

    def apply_weights(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        w_q, w_s, w_zp = self._get_weight_params(layer)
        x2d = x.reshape(-1, x.shape[-1])
        out = get_op("weight_only_linear")(
            x2d, w_q, w_s, w_zp, layer.br_weight_bits, bias, layer.br_weight_layout
        )
        return out.reshape(*x.shape[:-1], out.shape[-1])
