"""SiluAndMul and the GELU family on ``vllm_br.ops.activation``."""

from __future__ import annotations

import torch
from vllm.model_executor import custom_op
from vllm.model_executor.layers.activation import (
    GELU,
    FastGELU,
    GeluAndMul,
    GeluAndMulSparse,
    GELUTanh,
    NewGELU,
    QuickGELU,
    SiluAndMul,
)

from vllm_br.layers._oot import register_oot
from vllm_br.ops import get_op


class SUPASiluAndMul(SiluAndMul):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("silu_and_mul")(x)


class SUPAGeluAndMul(GeluAndMul):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("gelu_and_mul")(x, self.approximate)


class SUPAGeluAndMulSparse(GeluAndMulSparse):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("gelu_and_mul_sparse")(x, self.std_multiplier, self.approximate)


class SUPAGELU(GELU):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("gelu")(x)


class SUPAGELUTanh(GELUTanh):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("gelu_tanh")(x)


class SUPANewGELU(NewGELU):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("gelu_new")(x)


class SUPAFastGELU(FastGELU):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("gelu_fast")(x)


class SUPAQuickGELU(QuickGELU):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("quick_gelu")(x)


# The hw-agnostic SiluAndMul (VLLM_USE_HW_AGNOSTIC) has its own registry.
try:
    from vllm.model_executor.hw_agnostic import custom_op as _hw_custom_op
    from vllm.model_executor.hw_agnostic.layers.activation import (
        SiluAndMul as _HwSiluAndMul,
    )
except ImportError:  # not in every vLLM
    _hw_custom_op = _HwSiluAndMul = None

if _HwSiluAndMul is not None:

    class SUPAHwAgnosticSiluAndMul(_HwSiluAndMul):
        def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
            return get_op("silu_and_mul")(x)


OOT_LAYERS: list[tuple[type, type]] = [
    (SiluAndMul, SUPASiluAndMul),
    (GeluAndMul, SUPAGeluAndMul),
    (GeluAndMulSparse, SUPAGeluAndMulSparse),
    (GELU, SUPAGELU),
    (GELUTanh, SUPAGELUTanh),
    (NewGELU, SUPANewGELU),
    (FastGELU, SUPAFastGELU),
    (QuickGELU, SUPAQuickGELU),
]


def register() -> list[str]:
    entries = [(base, cls, custom_op.op_registry_oot) for base, cls in OOT_LAYERS]
    if _HwSiluAndMul is not None:
        entries.append(
            (_HwSiluAndMul, SUPAHwAgnosticSiluAndMul, _hw_custom_op.op_registry_oot)
        )
    return [
        f"{base.__module__}.{base.__name__}"
        for base, cls, reg in entries
        if register_oot(base, cls, reg)
    ]
