"""Rotary embeddings on ``vllm_br.ops.rotary``.

vLLM's scaling variants are subclasses of ``RotaryEmbedding`` that only
change how ``cos_sin_cache`` is computed; they inherit ``forward_native`` and
``forward_static`` unchanged, so the same ``rotary_embedding`` op serves
them. But vLLM swaps in an out-of-tree class by the *exact* class name being
instantiated (``CustomOp.__new__`` looks up ``cls.__name__``), so registering
``RotaryEmbedding`` alone leaves ``Llama3RotaryEmbedding`` & co. on vLLM's
code. Each variant therefore gets its own OOT subclass (the mixin's
``forward_oot`` + the variant's cache), registered under its own name.
``register()`` first checks that the variant still inherits the base
forward; one that overrides it (a future vLLM) is left to vLLM with a warning
instead of being served the wrong semantics.

vLLM's multimodal rotary, ``MRotaryEmbedding`` (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL with ``mrope_interleaved``, GLM-4V), has its own forward over
``[3, T]`` positions and is served by the ``mrope_rotary_embedding`` op.

Not covered (their forward differs: per-head caches, chunked attention,
other multimodal layouts): MRotaryEmbedding's subclasses, FourierRotaryEmbedding,
DualChunkRotaryEmbedding, Llama4VisionRotaryEmbedding, Phi3LongRoPE,
DeepseekV4ScalingRotaryEmbedding; they keep vLLM's forward_native.
"""

from __future__ import annotations

import torch
from vllm.model_executor import custom_op
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
    DeepseekScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.dynamic_ntk_alpha_rope import (
    DynamicNTKAlphaRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.dynamic_ntk_scaling_rope import (
    DynamicNTKScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.gemma4_rope import (
    Gemma4RotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.linear_scaling_rope import (
    LinearScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.llama3_rope import (
    Llama3RotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.ntk_scaling_rope import (
    NTKScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.yarn_scaling_rope import (
    YaRNScalingRotaryEmbedding,
)

from vllm_br.layers._oot import logger, register_oot
from vllm_br.ops import get_op


class _RotaryOOT:
    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return get_op("rotary_embedding")(
            positions,
            query,
            key,
            self.head_size,
            self.rotary_dim,
            self._match_cos_sin_cache_dtype(query),
            self.is_neox_style,
        )


class SUPARotaryEmbedding(_RotaryOOT, RotaryEmbedding):
    pass


class SUPALinearScalingRotaryEmbedding(_RotaryOOT, LinearScalingRotaryEmbedding):
    pass


class SUPADynamicNTKScalingRotaryEmbedding(
    _RotaryOOT, DynamicNTKScalingRotaryEmbedding
):
    pass


class SUPADynamicNTKAlphaRotaryEmbedding(_RotaryOOT, DynamicNTKAlphaRotaryEmbedding):
    pass


class SUPANTKScalingRotaryEmbedding(_RotaryOOT, NTKScalingRotaryEmbedding):
    pass


class SUPALlama3RotaryEmbedding(_RotaryOOT, Llama3RotaryEmbedding):
    pass


class SUPAYaRNScalingRotaryEmbedding(_RotaryOOT, YaRNScalingRotaryEmbedding):
    pass


class SUPAGemma4RotaryEmbedding(_RotaryOOT, Gemma4RotaryEmbedding):
    pass


class SUPADeepseekScalingRotaryEmbedding(DeepseekScalingRotaryEmbedding):
    """DeepSeek YaRN: same rotation; ``offsets`` shift the positions."""

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert key is not None
        if offsets is not None:
            positions = positions + offsets
        return _RotaryOOT.forward_oot(self, positions, query, key)


class SUPAMRotaryEmbedding(MRotaryEmbedding):
    """M-RoPE: positions ``[3, T]`` with multimodal inputs, ``[T]`` without."""

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert key is not None
        if offsets is not None:
            positions = positions + offsets
        return get_op("mrope_rotary_embedding")(
            positions,
            query,
            key,
            self.head_size,
            self.rotary_dim,
            self._match_cos_sin_cache_dtype(query),
            self.is_neox_style,
            self.mrope_section,
            self.mrope_interleaved,
        )


#: (vLLM class, our class); variants whose forward must be RotaryEmbedding's
OOT_LAYERS: list[tuple[type, type]] = [
    (RotaryEmbedding, SUPARotaryEmbedding),
    (LinearScalingRotaryEmbedding, SUPALinearScalingRotaryEmbedding),
    (DynamicNTKScalingRotaryEmbedding, SUPADynamicNTKScalingRotaryEmbedding),
    (DynamicNTKAlphaRotaryEmbedding, SUPADynamicNTKAlphaRotaryEmbedding),
    (NTKScalingRotaryEmbedding, SUPANTKScalingRotaryEmbedding),
    (Llama3RotaryEmbedding, SUPALlama3RotaryEmbedding),
    (YaRNScalingRotaryEmbedding, SUPAYaRNScalingRotaryEmbedding),
    (Gemma4RotaryEmbedding, SUPAGemma4RotaryEmbedding),
]

_FORWARD_METHODS = ("forward_native", "forward_static", "forward_oot")


def inherits_base_forward(variant: type) -> bool:
    """True if ``variant`` computes forward exactly as RotaryEmbedding does."""
    return all(
        getattr(variant, m) is getattr(RotaryEmbedding, m) for m in _FORWARD_METHODS
    )


def register() -> list[str]:
    registered = []
    for base, cls in OOT_LAYERS:
        if not inherits_base_forward(base):
            logger.warning(
                "%s overrides RotaryEmbedding's forward in this vLLM; it keeps "
                "vLLM's implementation.",
                base.__name__,
            )
            continue
        if register_oot(base, cls, custom_op.op_registry_oot):
            registered.append(f"{base.__module__}.{base.__name__}")
    deepseek = DeepseekScalingRotaryEmbedding
    if register_oot(
        deepseek, SUPADeepseekScalingRotaryEmbedding, custom_op.op_registry_oot
    ):
        registered.append(f"{deepseek.__module__}.{deepseek.__name__}")
    if register_oot(MRotaryEmbedding, SUPAMRotaryEmbedding, custom_op.op_registry_oot):
        registered.append(f"{MRotaryEmbedding.__module__}.{MRotaryEmbedding.__name__}")
    return registered
