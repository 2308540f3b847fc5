"""DeepSeek V3.2 on SUPA: vLLM's model with the lightning indexer kept in the
model's dtype.

Why the structure differs from vLLM's generic model (``deepseek_v2.py``,
which vLLM uses for DeepSeek V3.2 off CUDA and ROCm): its ``Indexer``
quantizes the index queries to FP8 (``per_token_group_quant_fp8``) and keeps
the index keys as FP8 values plus a float32 scale in a ``uint8`` cache read by
FP8 kernels. SUPA has no FP8 path; the indexer here runs the same projections,
norm and rotary as vLLM's, keeps queries and keys in the model's dtype, and
calls the plugin's indexer op (``torch.ops.vllm_br.sparse_attn_indexer``, see
``vllm_br/attention/sparse_mla.py``). This is also the arithmetic of HF
transformers' ``DeepseekV32Indexer``.

Everything else (MLA, MoE, loading, MTP) is vLLM's model unchanged. The
indexers are converted right after vLLM builds the model: their class (for
``forward``) and their key cache's dtype and width (read when vLLM asks each
layer for its KV-cache spec, after loading).
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV3ForCausalLM,
    DeepseekV32IndexerCache,
    Indexer,
)

__all__ = ["SupaDeepseekV32ForCausalLM", "SupaIndexer", "SupaIndexerCache"]

#: The plugin's indexer cache backend, resolved through vLLM's registry.
_INDEXER_BACKEND = "SUPA_SPARSE_INDEXER"


class SupaIndexerCache(DeepseekV32IndexerCache):
    """The index key cache: ``index_head_dim`` values per token in the model's
    dtype, on the plugin's indexer backend."""

    def get_attn_backend(self):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        return AttentionBackendEnum[_INDEXER_BACKEND].get_class()


class SupaIndexer(Indexer):
    """vLLM's ``Indexer`` without FP8: scores ``sum_h w_h * relu(scale *
    q_h . k)`` with ``w = weights_proj(x) * n_heads ** -0.5``."""

    def forward(
        self, hidden_states: torch.Tensor, qr: torch.Tensor, positions, rotary_emb
    ) -> torch.Tensor:
        q, _ = self.wq_b(qr)
        q = q.view(-1, self.n_head, self.head_dim)
        q_pe, q_nope = torch.split(
            q, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1
        )
        kw, _ = self.wk_weights_proj(hidden_states)
        k = self.k_norm(kw[:, : self.head_dim])
        weights = kw[:, self.head_dim :]
        k_pe, k_nope = torch.split(
            k, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1
        )
        q_pe, k_pe = rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        q = torch.cat([q_pe.reshape(-1, self.n_head, self.rope_dim), q_nope], dim=-1)
        k = torch.cat([k_pe.reshape(-1, self.rope_dim).to(k_nope.dtype), k_nope], -1)
        weights = weights.float() * self.n_head_scale
        torch.ops.vllm_br.sparse_attn_indexer(
            q,
            k,
            weights,
            self.topk_indices_buffer,
            self.k_cache.prefix,
            self.softmax_scale,
            self.topk_tokens,
        )
        return self.topk_indices_buffer


def to_supa_indexer(indexer: Indexer, dtype: torch.dtype) -> None:
    """Convert one of vLLM's indexers in place (it is registered in the
    forward context by name, so it is kept, not rebuilt)."""
    indexer.__class__ = SupaIndexer
    cache = indexer.k_cache
    cache.__class__ = SupaIndexerCache
    cache.head_dim = indexer.head_dim
    cache.dtype = dtype


class SupaDeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        dtype = vllm_config.model_config.dtype
        for module in self.modules():
            if isinstance(module, Indexer):
                to_supa_indexer(module, dtype)
