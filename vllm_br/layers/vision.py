"""The vision towers' own layers on ``vllm_br.ops``.

- ``Conv2dLayer``/``Conv3dLayer`` (patch embedding, GLM-4V's downsample):
  when the kernel equals the stride, the ``patch_embedding`` op (one GEMM
  over the patches); any other convolution stays torch's.
- ``ApplyRotaryEmb`` (the towers' 2-D rotary): the ``apply_rotary_emb`` op.
- LayerNorm: vLLM's ``LayerNorm`` layer, and the plain ``torch.nn.LayerNorm``
  that vLLM's towers build (Qwen-VL, GLM-4V, InternViT), on the
  ``layer_norm`` op. The latter is no CustomOp, so there is no registry
  entry for it: :func:`adopt_torch_layer_norms` re-classes those modules of
  a loaded model (patch ledger: ``torch-layer-norms``).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor import custom_op
from vllm.model_executor.layers.conv import Conv2dLayer, Conv3dLayer
from vllm.model_executor.layers.layernorm import LayerNorm
from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb

from vllm_br.layers._oot import register_oot
from vllm_br.ops import get_op


class _ConvOOT:
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enable_linear:
            return self.forward_native(x)  # torch's convolution
        return get_op("patch_embedding")(x, self.weight, self.bias)


class SUPAConv2dLayer(_ConvOOT, Conv2dLayer):
    pass


class SUPAConv3dLayer(_ConvOOT, Conv3dLayer):
    pass


class SUPAApplyRotaryEmb(ApplyRotaryEmb):
    def forward_oot(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        return get_op("apply_rotary_emb")(
            x, cos, sin, self.is_neox_style, self.enable_fp32_compute
        )


class SUPALayerNorm(LayerNorm):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and self.weight.dtype == torch.float64:
            return self.forward_native(x)  # wider than the op's float32
        return get_op("layer_norm")(x, self.weight, self.bias, self.eps)


class SUPATorchLayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` over the last dimension on the ``layer_norm``
    op; its state (weight, bias, eps) is the module's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("layer_norm")(x, self.weight, self.bias, self.eps)


def adopt_torch_layer_norms(model: nn.Module) -> int:
    """Re-class each plain ``nn.LayerNorm`` of ``model`` over one trailing
    dimension in float32 or narrower to :class:`SUPATorchLayerNorm`;
    returns how many."""
    count = 0
    for module in model.modules():
        if (
            type(module) is nn.LayerNorm
            and len(module.normalized_shape) == 1
            and (module.weight is None or module.weight.dtype != torch.float64)
        ):
            module.__class__ = SUPATorchLayerNorm
            count += 1
    return count


def register() -> list[str]:
    entries = [
        (Conv2dLayer, SUPAConv2dLayer),
        (Conv3dLayer, SUPAConv3dLayer),
        (ApplyRotaryEmb, SUPAApplyRotaryEmb),
        (LayerNorm, SUPALayerNorm),
    ]
    return [
        f"{base.__module__}.{base.__name__}"
        for base, cls in entries
        if register_oot(base, cls, custom_op.op_registry_oot)
    ]
