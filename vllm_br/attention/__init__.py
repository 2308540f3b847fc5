"""SUPA attention backends for vLLM.

``register_attention_backends()`` adds ``SUPA_FLASH_ATTN``,
``SUPA_FLASH_MLA``, ``SUPA_FLASH_MLA_SPARSE`` and ``SUPA_SPARSE_INDEXER`` to vLLM's ``AttentionBackendEnum`` (vLLM's attention
layers resolve a backend's ``get_name()`` through that enum, so the names
must be registered in every process that builds a model). The general plugin
calls it; it is idempotent. Importing this package imports no vLLM attention
code.
"""

from __future__ import annotations

#: The KV-cache block size of SUPA's paged-attention kernels (paged and MLA).
SUPA_BLOCK_SIZE = 128

SUPA_FLASH_ATTN = "SUPA_FLASH_ATTN"
SUPA_FLASH_ATTN_PATH = "vllm_br.attention.backend.SUPAFlashAttentionBackend"
SUPA_FLASH_MLA = "SUPA_FLASH_MLA"
SUPA_FLASH_MLA_PATH = "vllm_br.attention.mla.SupaFlashMLABackend"
SUPA_FLASH_MLA_SPARSE = "SUPA_FLASH_MLA_SPARSE"
SUPA_FLASH_MLA_SPARSE_PATH = "vllm_br.attention.sparse_mla.SupaFlashMLASparseBackend"
SUPA_SPARSE_INDEXER = "SUPA_SPARSE_INDEXER"
SUPA_SPARSE_INDEXER_PATH = "vllm_br.attention.sparse_mla.SupaSparseIndexerBackend"

#: The torch op of the SUPA lightning indexer; a graph splitting op.
SUPA_SPARSE_INDEXER_OP = "vllm_br::sparse_attn_indexer"
#: The largest ``index_topk`` the SUPA sparse MLA kernels hold per token
#: (DeepSeek V3.2 selects 2048).
SUPA_SPARSE_MLA_MAX_TOPK = 2048

#: Every backend the plugin registers: enum member name -> class path.
BACKENDS = {
    SUPA_FLASH_ATTN: SUPA_FLASH_ATTN_PATH,
    SUPA_FLASH_MLA: SUPA_FLASH_MLA_PATH,
    SUPA_FLASH_MLA_SPARSE: SUPA_FLASH_MLA_SPARSE_PATH,
    SUPA_SPARSE_INDEXER: SUPA_SPARSE_INDEXER_PATH,
}

__all__ = [
    "BACKENDS",
    "SUPA_BLOCK_SIZE",
    "SUPA_FLASH_ATTN",
    "SUPA_FLASH_ATTN_PATH",
    "SUPA_FLASH_MLA",
    "SUPA_FLASH_MLA_PATH",
    "SUPA_FLASH_MLA_SPARSE",
    "SUPA_FLASH_MLA_SPARSE_PATH",
    "SUPA_SPARSE_INDEXER",
    "SUPA_SPARSE_INDEXER_OP",
    "SUPA_SPARSE_MLA_MAX_TOPK",
    "SUPA_SPARSE_INDEXER_PATH",
    "register_attention_backends",
]


def register_attention_backends() -> None:
    """Register each of :data:`BACKENDS` with vLLM.

    Safe to call any number of times: an existing member keeps (or is pointed
    back at) our class path.
    """
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    for name, path in BACKENDS.items():
        if name in AttentionBackendEnum.__members__:
            member = AttentionBackendEnum[name]
            if member.get_path() != path:
                register_backend(member, path)
            continue
        register_backend(name, path)
