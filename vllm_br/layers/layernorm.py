"""RMSNorm layers on ``vllm_br.ops`` (``rms_norm`` / ``fused_add_rms_norm``)."""

from __future__ import annotations

import torch
from vllm.model_executor import custom_op
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

from vllm_br.layers._oot import register_oot
from vllm_br.ops import get_op


class _RMSNormOOT:
    def forward_oot(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            weight = self.weight.data if self.pass_weight else None
            return get_op("rms_norm")(
                x, weight, self.variance_epsilon, self.variance_size_override
            )
        weight = self.weight.data if self.pass_weight_add else None
        return get_op("fused_add_rms_norm")(
            x, residual, weight, self.variance_epsilon, self.variance_size_override
        )


class SUPARMSNorm(_RMSNormOOT, RMSNorm):
    """vLLM's RMSNorm; ``forward(x, residual)`` returns ``(out, x + residual)``."""


class SUPAGemmaRMSNorm(GemmaRMSNorm):
    """Gemma's ``x * (1 + w)`` RMSNorm: the same op with the weight offset."""

    def forward_oot(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        weight = self.weight.float() + 1.0
        if residual is None:
            return get_op("rms_norm")(x, weight, self.variance_epsilon)
        return get_op("fused_add_rms_norm")(x, residual, weight, self.variance_epsilon)


# vLLM's hw-agnostic RMSNorm (VLLM_USE_HW_AGNOSTIC, Transformers backend) has
# its own CustomOp base and its own OOT registry.
try:
    from vllm.model_executor.hw_agnostic import custom_op as _hw_custom_op
    from vllm.model_executor.hw_agnostic.layers.layernorm import RMSNorm as _HwRMSNorm
except ImportError:  # not in every vLLM
    _hw_custom_op = _HwRMSNorm = None

if _HwRMSNorm is not None:

    class SUPAHwAgnosticRMSNorm(_RMSNormOOT, _HwRMSNorm):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.pass_weight = self.pass_weight_add = self.has_weight


def register() -> list[str]:
    entries = [
        (RMSNorm, SUPARMSNorm, custom_op.op_registry_oot),
        (GemmaRMSNorm, SUPAGemmaRMSNorm, custom_op.op_registry_oot),
    ]
    if _HwRMSNorm is not None:
        entries.append(
            (_HwRMSNorm, SUPAHwAgnosticRMSNorm, _hw_custom_op.op_registry_oot)
        )
    return [
        f"{base.__module__}.{base.__name__}"
        for base, cls, reg in entries
        if register_oot(base, cls, reg)
    ]
