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


class _GemmaRMSNormOOT:
    def forward_oot(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        weight = self.weight.float() + 1.0
        if residual is None:
            return get_op("rms_norm")(x, weight, self.variance_epsilon)
        return get_op("fused_add_rms_norm")(x, residual, weight, self.variance_epsilon)


class SUPAGemmaRMSNorm(_GemmaRMSNormOOT, GemmaRMSNorm):
    """Gemma's ``x * (1 + w)`` RMSNorm: the same op with the weight offset."""


# The Transformers modeling backend (models vLLM serves through HF's modules,
# e.g. GlmForCausalLM) swaps each HF RMSNorm for a subclass of its own,
# TPAwareRMSNorm / TPAwareGemmaRMSNorm (RMSNorm plus an all-gather of a
# TP-sharded input in ``forward``). vLLM replaces a class by its exact name,
# so those need their own registrations; unregistered they run vLLM's native
# norm. Only when they derive from vLLM's RMSNorm / GemmaRMSNorm (not with
# VLLM_USE_HW_AGNOSTIC, where they derive from the hw-agnostic RMSNorm).
try:
    from vllm.model_executor.models.transformers.fusers import rms_norm as _tf_norm
except ImportError:  # not in every vLLM
    _tf_norm = None

_TF_NORMS: list[tuple[type, type]] = []
if _tf_norm is not None and issubclass(
    getattr(_tf_norm, "TPAwareRMSNorm", type), RMSNorm
):

    class SUPATPAwareRMSNorm(_RMSNormOOT, _tf_norm.TPAwareRMSNorm):
        pass

    _TF_NORMS.append((_tf_norm.TPAwareRMSNorm, SUPATPAwareRMSNorm))

if _tf_norm is not None and issubclass(
    getattr(_tf_norm, "TPAwareGemmaRMSNorm", type), GemmaRMSNorm
):

    class SUPATPAwareGemmaRMSNorm(_GemmaRMSNormOOT, _tf_norm.TPAwareGemmaRMSNorm):
        pass

    _TF_NORMS.append((_tf_norm.TPAwareGemmaRMSNorm, SUPATPAwareGemmaRMSNorm))


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
    entries += [(base, cls, custom_op.op_registry_oot) for base, cls in _TF_NORMS]
    if _HwRMSNorm is not None:
        entries.append(
            (_HwRMSNorm, SUPAHwAgnosticRMSNorm, _hw_custom_op.op_registry_oot)
        )
    return [
        f"{base.__module__}.{base.__name__}"
        for base, cls, reg in entries
        if register_oot(base, cls, reg)
    ]
