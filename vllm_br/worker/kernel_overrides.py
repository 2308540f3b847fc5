"""Plain-torch implementations of the Triton kernels vLLM core launches each
step (SUPA has no Triton), installed through vLLM's official
``vllm.triton_utils.dispatcher.register_kernels``: the slot mapping here, the
speculative-decoding kernels from ``vllm_br.spec_decode.kernels``."""

from __future__ import annotations

import sys
import warnings

import torch

from vllm_br import compat
from vllm_br.spec_decode.kernels import kernel_overrides as spec_decode_overrides

_installed = False


def compute_slot_mapping(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    block_table_stride: int,
    slot_mapping: torch.Tensor,
    KV_CACHE_BLOCK_SIZE: int,  # noqa: N803 (the Triton kernel's names)
    TOTAL_CP_WORLD_SIZE: int = 1,  # noqa: N803
    TOTAL_CP_RANK: int = 0,  # noqa: N803
    CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,  # noqa: N803
    PAD_ID: int = -1,  # noqa: N803
    BLOCK_SIZE: int = 1024,  # noqa: N803
) -> None:
    """slot = block_table[req, pos // block_size] * block_size + pos % block_size
    for every scheduled token; the rest of the buffer is padding."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("Context parallelism is not supported on SUPA.")
    num_tokens = int(num_tokens)
    if num_tokens > 0:
        token_idx = torch.arange(num_tokens, device=positions.device, dtype=torch.int64)
        req_idx = (
            torch.searchsorted(query_start_loc.to(torch.int64), token_idx, right=True)
            - 1
        )
        pos = positions[:num_tokens].to(torch.int64)
        block_idx = pos // KV_CACHE_BLOCK_SIZE
        blocks = block_table[req_idx, block_idx].to(torch.int64)
        slot_mapping[:num_tokens] = (
            blocks * KV_CACHE_BLOCK_SIZE + pos % KV_CACHE_BLOCK_SIZE
        )
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID


def register_kernel_overrides() -> None:
    global _installed
    if _installed:
        return
    from vllm.triton_utils.dispatcher import register_kernels

    # Registered even where a Triton package is installed: it targets another
    # device, never SUPA. register_kernels scans every module's attributes
    # with hasattr (vllm/triton_utils/dispatcher.py:137), which touches
    # torch.distributed's deprecated ``reduce_op`` and makes torch warn about
    # an API no one here uses; that one warning is silenced, nothing else.
    # Modules that break the scan (compat.KERNEL_SCAN_UNSAFE_MODULES) are
    # out of sys.modules while it runs, so importing numba before a SUPA
    # engine starts does not stop it.
    hidden = {
        name: sys.modules.pop(name)
        for name in compat.KERNEL_SCAN_UNSAFE_MODULES
        if name in sys.modules
    }
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=compat.TORCH_REDUCE_OP_WARNING, category=FutureWarning
        )
        try:
            register_kernels(
                {
                    compat.SLOT_MAPPING_KERNEL: compute_slot_mapping,
                    **spec_decode_overrides(),
                }
            )
        finally:
            sys.modules.update(hidden)
    _installed = True
