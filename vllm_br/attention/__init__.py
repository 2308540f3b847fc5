"""SUPA attention backends for vLLM.

``register_attention_backends()`` adds ``SUPA_FLASH_ATTN`` and
``SUPA_FLASH_MLA`` to vLLM's ``AttentionBackendEnum`` (vLLM's attention
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

#: Every backend the plugin registers: enum member name -> class path.
BACKENDS = {
    SUPA_FLASH_ATTN: SUPA_FLASH_ATTN_PATH,
    SUPA_FLASH_MLA: SUPA_FLASH_MLA_PATH,
}

__all__ = [
    "BACKENDS",
    "SUPA_BLOCK_SIZE",
    "SUPA_FLASH_ATTN",
    "SUPA_FLASH_ATTN_PATH",
    "SUPA_FLASH_MLA",
    "SUPA_FLASH_MLA_PATH",
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
