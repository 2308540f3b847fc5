"""``paged_attention_decode``, ``paged_attention_prefill`` and
``reshape_and_cache`` on the cpu backend: the C++ kernels
(``paged_attention.cpp``). Each declines (returns ``NotImplemented``, having
written nothing) what it does not handle, and the op's reference runs.

The attention kernel takes every decode and, for causal attention, every
prefill (chunked prefill and prefix-cache hits included) of a step. Its work
list is a table of tiles: up to :data:`TILE_TOKENS` consecutive query tokens
of one request, built once per step from the step's plan and kept in it, so
the layers share it. A tile names its request, first token row, the
request's query length and the tile's offset in that query; the kernel reads
each token's position from the device ``seq_lens`` when it runs, so a plan
kept by a graph replay stays valid.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from vllm_br import envs
from vllm_br.device.cpu_kernels import load_library

_DTYPES = (torch.bfloat16, torch.float32)
#: Query tokens per prefill tile: their rows share each K row the kernel reads.
TILE_TOKENS = 16

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class AttentionArgs(ctypes.Structure):
    """The C++ kernel's ``Args`` (paged_attention.cpp), field for field; a
    unit test checks the two layouts agree."""

    _fields_ = [
        ("q", _ptr),
        ("q_st", _i64),
        ("q_sh", _i64),
        ("cache", _ptr),
        ("c_sb", _i64),
        ("c_sh", _i64),
        ("c_sn", _i64),
        ("bt", _ptr),
        ("bt_st", _i64),
        ("bt_width", _i32),
        ("num_blocks", _i32),
        ("seq_lens", _ptr),
        ("tiles", _ptr),
        ("num_tiles", _i32),
        ("num_heads", _i32),
        ("num_kv_heads", _i32),
        ("head_size", _i32),
        ("block_size", _i32),
        ("scale", _f32),
        ("soft_cap", _f32),
        ("window", _i32),
        ("out", _ptr),
        ("o_st", _i64),
        ("o_sh", _i64),
        ("num_threads", _i32),
        ("use_amx", _i32),
        ("dtype_is_bf16", _i32),
        ("head_size_v", _i32),
        ("max_tile_tokens", _i32),
    ]


def _tiles(plan: Any, decodes: bool) -> torch.Tensor:
    """int32 ``[num_tiles, 5]``: (request, first token row, query length,
    offset in the query, tokens) for the plan's decodes, or its prefills
    split into tiles of at most ``TILE_TOKENS`` tokens. ``plan`` is the
    step's ``vllm_br.ops.paged_attention.PagedAttentionPlan``; the table is
    kept in it, so the layers share it."""
    key = ("cpu_kernel_tiles", decodes)
    cached = plan._cache.get(key)
    if cached is not None:
        return cached
    if decodes:
        nd = plan.num_decodes
        reqs = torch.arange(nd) if plan.decode_reqs is None else plan.decode_reqs
        toks = torch.arange(nd) if plan.decode_tokens is None else plan.decode_tokens
        ones = torch.ones(nd, dtype=torch.long)
        zeros = torch.zeros(nd, dtype=torch.long)
        tiles = torch.stack([reqs.cpu(), toks.cpu(), ones, zeros, ones], 1)
    else:
        qlens = plan.prefill_query_lens.cpu()
        starts = torch.cumsum(qlens, 0) - qlens  # in the packed prefill tokens
        if plan.prefill_tokens is None:
            first_rows = starts + plan.prefill_token_start
        else:
            first_rows = plan.prefill_tokens.cpu()[starts]
        per_req = (qlens + TILE_TOKENS - 1) // TILE_TOKENS
        req_of_tile = torch.repeat_interleave(torch.arange(qlens.numel()), per_req)
        tile_starts = torch.cumsum(per_req, 0) - per_req
        offset = (torch.arange(int(per_req.sum())) - tile_starts[req_of_tile]) * (
            TILE_TOKENS
        )
        qlen = qlens[req_of_tile]
        tiles = torch.stack(
            [
                plan.prefill_reqs.cpu()[req_of_tile],
                first_rows[req_of_tile] + offset,
                qlen,
                offset,
                (qlen - offset).clamp(max=TILE_TOKENS),
            ],
            1,
        )
    tiles = tiles.to(torch.int32).contiguous()
    plan._cache[key] = tiles
    return tiles


def _attention(
    decodes: bool,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_heads: int,
    causal: bool | torch.Tensor,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    output: torch.Tensor,
    plan: Any,
) -> bool:
    """The plan's decodes or (causal) prefills into ``output``; False where
    the kernel does not take them (nothing written)."""
    dtype = query.dtype
    lib = load_library()
    # A decode's query is its sequence's last token, so causality does not
    # change it; prefills are causal-only here.
    if (
        lib is None
        or (not decodes and causal is not True)
        or dtype not in _DTYPES
        or query.device.type != "cpu"
        or kv_cache.dtype != dtype
        or output.dtype != dtype
        or query.stride(-1) != 1
        or kv_cache.stride(-1) != 1
        or output.stride(-1) != 1
    ):
        return False
    num_blocks, _, block_size, content = kv_cache.shape
    _, num_heads, head_size = query.shape
    out = output.view(output.shape[0], num_heads, content - head_size)
    tiles = _tiles(plan, decodes)
    if tiles.numel() == 0:
        return False
    bt = block_table.to(torch.int32)
    if bt.stride(-1) != 1:
        bt = bt.contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
    # Prefill tiles take the AMX path where it exists; decodes, with few
    # query rows per KV head, measured slower there (benchmarks/ANALYSIS.md).
    amx = (
        not decodes
        and envs.VLLM_BR_CPU_ATTENTION_AMX
        and dtype == torch.bfloat16
        and lib.vllm_br_attention_has_amx()
    )
    args = AttentionArgs(
        q=query.data_ptr(),
        q_st=query.stride(0),
        q_sh=query.stride(1),
        cache=kv_cache.data_ptr(),
        c_sb=kv_cache.stride(0),
        c_sh=kv_cache.stride(1),
        c_sn=kv_cache.stride(2),
        bt=bt.data_ptr(),
        bt_st=bt.stride(0),
        bt_width=bt.shape[1],
        num_blocks=num_blocks,
        seq_lens=sl.data_ptr(),
        tiles=tiles.data_ptr(),
        num_tiles=tiles.shape[0],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        scale=scale,
        soft_cap=logits_soft_cap or 0.0,
        window=int(window),
        out=out.data_ptr(),
        o_st=out.stride(0),
        o_sh=out.stride(1),
        num_threads=torch.get_num_threads(),
        use_amx=int(bool(amx)),
        dtype_is_bf16=dtype == torch.bfloat16,
        head_size_v=content - head_size,
        max_tile_tokens=TILE_TOKENS,
    )
    return bool(lib.vllm_br_paged_attention(ctypes.byref(args)))


def decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_heads: int,
    *,
    causal: bool | torch.Tensor = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    output: torch.Tensor,
    plan: Any,
    use_sdpa: bool = True,
) -> None:
    """The ``paged_attention_decode`` kernel (arguments as the op's)."""
    if not plan.num_decodes:
        return None
    ran = _attention(
        True,
        query,
        kv_cache,
        block_table,
        seq_lens,
        scale,
        num_kv_heads,
        causal,
        sliding_window,
        logits_soft_cap,
        output,
        plan,
    )
    return None if ran else NotImplemented


def prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_heads: int,
    *,
    causal: bool | torch.Tensor = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    output: torch.Tensor,
    plan: Any,
    use_sdpa: bool = True,
) -> None:
    """The ``paged_attention_prefill`` kernel: causal prefills only."""
    if not plan.num_prefills:
        return None
    ran = _attention(
        False,
        query,
        kv_cache,
        block_table,
        seq_lens,
        scale,
        num_kv_heads,
        causal,
        sliding_window,
        logits_soft_cap,
        output,
        plan,
    )
    return None if ran else NotImplemented


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The ``reshape_and_cache`` kernel: the reference's cache write (same
    arguments) as one C++ loop, no host sync, no temporary tensors."""
    lib = load_library()
    n = slot_mapping.shape[0]
    if (
        lib is None
        or key.dtype != kv_cache.dtype
        or value.dtype != kv_cache.dtype
        or kv_cache.dtype not in _DTYPES
        or key.device.type != "cpu"
        or key.stride(-1) != 1
        or value.stride(-1) != 1
        or kv_cache.stride(-1) != 1
        or key.shape[0] < n
        or value.shape[0] < n
    ):
        return NotImplemented
    if n == 0 or kv_cache.numel() == 0:
        return None
    num_blocks, num_kv_heads, block_size, content = kv_cache.shape
    head_size = key.shape[-1]
    assert key.shape[-2] == num_kv_heads, (key.shape, kv_cache.shape)
    assert head_size + value.shape[-1] == content, (key.shape, value.shape, content)
    slots = slot_mapping.to(torch.int64).contiguous()
    lib.vllm_br_reshape_and_cache(
        kv_cache.element_size(),
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        value.data_ptr(),
        value.stride(0),
        value.stride(1),
        slots.data_ptr(),
        n,
        kv_cache.data_ptr(),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        num_kv_heads,
        head_size,
        value.shape[-1],
        block_size,
        num_blocks,
    )
    return None
