"""SUPA attention backends for vLLM.

``register_attention_backends()`` adds ``SUPA_FLASH_ATTN`` to vLLM's
``AttentionBackendEnum`` (vLLM's Attention layer resolves a backend's
``get_name()`` through that enum, so the name must be registered in every
process that builds a model). The general plugin calls it; it is idempotent.
Importing this package imports no vLLM attention code.
"""

from __future__ import annotations

SUPA_FLASH_ATTN = "SUPA_FLASH_ATTN"
SUPA_FLASH_ATTN_PATH = "vllm_br.attention.backend.SUPAFlashAttentionBackend"

__all__ = ["SUPA_FLASH_ATTN", "SUPA_FLASH_ATTN_PATH", "register_attention_backends"]


def register_attention_backends() -> None:
    """Register ``SUPA_FLASH_ATTN`` -> ``SUPAFlashAttentionBackend`` with vLLM.

    Safe to call any number of times: an existing member keeps (or is pointed
    back at) our class path.
    """
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    if SUPA_FLASH_ATTN in AttentionBackendEnum.__members__:
        member = AttentionBackendEnum[SUPA_FLASH_ATTN]
        if member.get_path() != SUPA_FLASH_ATTN_PATH:
            register_backend(member, SUPA_FLASH_ATTN_PATH)
        return
    register_backend(SUPA_FLASH_ATTN, SUPA_FLASH_ATTN_PATH)
