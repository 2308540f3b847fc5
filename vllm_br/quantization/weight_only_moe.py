"""Weight-only int8 / int4 MoE experts on SUPA: compressed-tensors W8A16 /
W4A16 (``llmcompressor``) and GPTQ int8 / int4 (``gptqmodel``, AutoGPTQ)
checkpoints of MoE models, on the plugin's ``fused_experts``.

vLLM builds these layers' methods (``CompressedTensorsWNA16MoEMethod``,
``AutoGPTQMoEMethod``) around its WNA16 MoE oracle, which offers Marlin,
Triton and CPU kernels only. The SUPA subclasses keep vLLM's parameters and
weight loading (tensor-parallel sharding of weights, group scales and zero
points included), skip the oracle, and after loading rewrite the
checkpoint's packing into what ``fused_experts`` takes (``vllm_br.ops.moe``):
``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]`` as int8 (or int4 two
per byte under ``VLLM_BR_QUANT_METHOD=INT4``), scales ``[E, rows, groups]``
and int8 zero points of the same shape or none. Like the int8 experts
(``vllm_br.quantization.moe``) they are monolithic: routed by the plugin's
routing ops, so the static decode path serves them too.
"""

from __future__ import annotations

from fractions import Fraction

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, RoutedExperts
from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQMoEMethod
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # noqa: E501
    CompressedTensorsMoEMethod,
)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16 import (  # noqa: E501
    CompressedTensorsWNA16MoEMethod,
)
from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 import (  # noqa: E501
    WNA16_SUPPORTED_TYPES_MAP,
    WNA16_ZP_SUPPORTED_TYPES_MAP,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    unpack_quantized_values_into_int32,
)
from vllm.model_executor.utils import replace_parameter
from vllm.scalar_type import ScalarType

from vllm_br.compat import loaded_expert_biases
from vllm_br.errors import SUPAConfigError
from vllm_br.ops import get_op
from vllm_br.ops.moe_layer import check_supported, route
from vllm_br.ops.quant import pack_int4
from vllm_br.quantization import scheme


def signed_values(packed: torch.Tensor, wtype: ScalarType, packed_dim: int):
    """int32 words of a checkpoint -> the signed int32 values they hold.
    Symmetric types carry their offset in the type; asymmetric ones (and
    their zero points) are shifted by half their range so both fit in int8."""
    offset = wtype.bias if wtype.has_bias() else 1 << (wtype.size_bits - 1)
    return unpack_quantized_values_into_int32(packed, wtype, packed_dim) - offset


class SUPAWeightOnlyMoEComputeMixin:
    """Routing and compute of weight-only experts stored by :meth:`_store`."""

    @property
    def is_monolithic(self) -> bool:
        # Routing happens here, not in vLLM's router (its kernels are CUDA).
        return True

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None  # fused_experts takes the scales itself

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        topk_weights, topk_ids = route(layer, x, router_logits)
        return get_op("fused_experts")(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
            layer.activation.value, layer.apply_router_weight_on_input,
            layer.expert_map, None, layer.w13_weight_scale,
            layer.w2_weight_scale, False, layer.w13_weight_zero_point,
            layer.w2_weight_zero_point, layer.br_weight_bits,
        )  # fmt: skip

    @staticmethod
    def _store(layer: RoutedExperts, checkpoint_bits: int, **experts) -> None:
        """``experts``: ``w13`` / ``w2`` as ``(signed values [E, rows, cols],
        scales [E, rows, groups], signed zero points or None)``."""
        bits = scheme.stored_weight_bits(checkpoint_bits)
        for prefix, (q, s, z) in experts.items():
            q = q.to(torch.int8).contiguous()
            replace_parameter(
                layer, f"{prefix}_weight", pack_int4(q) if bits == 4 else q
            )
            replace_parameter(layer, f"{prefix}_weight_scale", s.contiguous())
            if z is None:
                layer.register_parameter(f"{prefix}_weight_zero_point", None)
            else:
                zero = z.to(torch.int8).contiguous()
                replace_parameter(layer, f"{prefix}_weight_zero_point", zero)
        layer.br_weight_bits = bits


class SUPACompressedTensorsWNA16MoEMethod(
    SUPAWeightOnlyMoEComputeMixin, CompressedTensorsWNA16MoEMethod
):
    def __init__(self, weight_quant, input_quant, moe) -> None:
        # vLLM's __init__ adds the WNA16 MoE oracle's kernel choice to these.
        CompressedTensorsMoEMethod.__init__(self, moe)
        self.weight_quant, self.input_quant = weight_quant, input_quant
        self.symmetric = weight_quant.symmetric
        self.num_bits = weight_quant.num_bits
        self.packed_factor = Fraction(32, self.num_bits)
        self.strategy = weight_quant.strategy
        group = weight_quant.group_size
        self.group_size = -1 if group is None else group
        types = (
            WNA16_SUPPORTED_TYPES_MAP
            if self.symmetric
            else WNA16_ZP_SUPPORTED_TYPES_MAP
        )
        self.quant_type = types[self.num_bits]
        self.wna16_backend = self.experts_cls = None
        self.is_marlin = self.is_transposed = False
        self.input_dtype = None
        check_supported(moe)
        scheme.stored_weight_bits(self.num_bits)

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        wtype = self.quant_type
        stores = {}
        for prefix in ("w13", "w2"):
            packed = getattr(layer, f"{prefix}_weight_packed")  # [E, rows, cols/pack]
            zero = None
            if not self.symmetric:  # [E, rows/pack, groups]
                zero = signed_values(
                    getattr(layer, f"{prefix}_weight_zero_point").data, wtype, 1
                )
            scale = getattr(layer, f"{prefix}_weight_scale").data
            stores[prefix] = (signed_values(packed.data, wtype, 2), scale, zero)
            delattr(layer, f"{prefix}_weight_packed")
            delattr(layer, f"{prefix}_weight_shape")
        self._store(layer, self.num_bits, **stores)


class SUPAAutoGPTQMoEMethod(SUPAWeightOnlyMoEComputeMixin, AutoGPTQMoEMethod):
    def __init__(self, quant_config, moe) -> None:
        # vLLM's __init__ adds the WNA16 MoE oracle's kernel choice to these.
        FusedMoEMethodBase.__init__(self, moe)
        self.quant_config = quant_config
        self.input_dtype = None
        self.use_marlin = False
        self.wna16_moe_backend = self.experts_cls = None
        check_supported(moe)
        scheme.stored_weight_bits(quant_config.quant_type.size_bits)

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        if loaded_expert_biases(layer):
            raise SUPAConfigError(
                "This GPTQ checkpoint carries MoE expert biases, which SUPA does "
                "not serve yet; serve a checkpoint without them."
            )
        wtype = self.quant_config.quant_type  # symmetric: zero points in the type
        stores = {}
        for prefix in ("w13", "w2"):
            # GPTQ is K-first: qweight [E, cols/pack, rows], scales [E, groups, rows].
            q = signed_values(getattr(layer, f"{prefix}_qweight").data, wtype, 1)
            scale = getattr(layer, f"{prefix}_scales").data.transpose(1, 2)
            stores[prefix] = (q.transpose(1, 2), scale, None)
            for name in ("qweight", "scales", "qzeros", "bias"):
                delattr(layer, f"{prefix}_{name}")
        self._store(layer, self.quant_config.quant_type.size_bits, **stores)
