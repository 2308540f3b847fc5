"""``paged_attention`` on the cpu backend: the C++ decode kernel for every
decode (query length 1) and the reference for the rest of the batch."""

from __future__ import annotations

import ctypes
import functools

import torch

from vllm_br.device.cpu_kernels import load_library
from vllm_br.ops.paged_attention import PagedAttentionPlan
from vllm_br.ops.paged_attention import paged_attention as reference

_DTYPES = (torch.bfloat16, torch.float32)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _index(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.int64).contiguous()


def decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_heads: int,
    window: int | None,
    logits_soft_cap: float | None,
    out: torch.Tensor,
    plan: PagedAttentionPlan,
) -> bool:
    """Attention of the plan's decodes into ``out`` ``[T, H, Dv]``; False
    (nothing written) where the kernel does not apply."""
    dtype = query.dtype
    lib = load_library()
    if (
        lib is None
        or dtype not in _DTYPES
        or query.device.type != "cpu"
        or kv_cache.dtype != dtype
        or out.dtype != dtype
        or query.stride(-1) != 1
        or kv_cache.stride(-1) != 1
        or out.stride(-1) != 1
    ):
        return False
    num_blocks, _, block_size, content = kv_cache.shape
    _, num_heads, head_size = query.shape
    bt = block_table.to(torch.int32)
    if bt.stride(-1) != 1:
        bt = bt.contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    req = _index(plan.decode_reqs)
    tok = _index(plan.decode_tokens)
    ran = lib.vllm_br_paged_attention_decode(
        dtype == torch.bfloat16,
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        kv_cache.data_ptr(),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        bt.data_ptr(),
        bt.stride(0),
        bt.shape[1],
        num_blocks,
        sl.data_ptr(),
        _ptr(req),
        _ptr(tok),
        plan.num_decodes,
        num_heads,
        num_kv_heads,
        head_size,
        content - head_size,
        block_size,
        ctypes.c_float(scale),
        ctypes.c_float(logits_soft_cap or 0.0),
        window or 0,
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        torch.get_num_threads(),
    )
    return bool(ran)


paged_attention = functools.update_wrapper(
    functools.partial(reference, decode_kernel=decode), reference
)
