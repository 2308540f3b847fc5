"""Vision-encoder attention on ``vllm_br.ops``.

vLLM's vision towers (Qwen2-VL and its successors, GLM-4V, InternViT...)
attend through ``MMEncoderAttention``: non-causal self-attention over each
image's (or video frame group's) patches, packed into one sequence with
``cu_seqlens`` boundaries, no KV cache. The platform reports the
``TORCH_SDPA`` layout for it (cu_seqlens only, no max_seqlen or FlashInfer
padding: ``SUPAPlatform.get_vit_attn_backend``) and this layer runs it on
the plugin's ``attention_varlen`` op, the one encoder-only models use.
"""

from __future__ import annotations

import torch
from vllm.model_executor import custom_op
from vllm.model_executor.layers.attention.mm_encoder_attention import (
    MMEncoderAttention,
)

from vllm_br.layers._oot import register_oot
from vllm_br.ops import get_op


class SUPAMMEncoderAttention(MMEncoderAttention):
    def forward_oot(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: torch.Tensor | None = None,  # flash attention's; unused
        sequence_lengths: torch.Tensor | None = None,  # FlashInfer's; unused
    ) -> torch.Tensor:
        """query/key/value ``[B, S, H * D]`` or ``[B, S, H, D]``; the output
        has query's shape. Without ``cu_seqlens`` each of the B rows is one
        sequence of S tokens."""
        bsz, q_len = query.shape[:2]
        kv_len = key.shape[1]
        if kv_len != q_len:
            # Cross-length attention (query pooling) is not a packed
            # self-attention; vLLM's plain-torch path serves it.
            return self.forward_native(query, key, value, cu_seqlens)
        if cu_seqlens is None:
            cu_seqlens = torch.arange(
                0, (bsz + 1) * q_len, q_len, dtype=torch.int32, device=query.device
            )
        total = bsz * q_len
        q = query.reshape(total, self.num_heads, self.head_size)
        k = key.reshape(total, self.num_kv_heads, self.head_size)
        v = value.reshape(total, self.num_kv_heads, self.head_size)
        out = get_op("attention_varlen")(q, k, v, cu_seqlens, self.scale, causal=False)
        return out.reshape(query.shape)


def register() -> list[str]:
    if register_oot(
        MMEncoderAttention, SUPAMMEncoderAttention, custom_op.op_registry_oot
    ):
        return [f"{MMEncoderAttention.__module__}.{MMEncoderAttention.__name__}"]
    return []
