"""Rotary position embedding applied from vLLM's ``cos_sin_cache``.

``cos_sin_cache`` is ``[max_positions, rotary_dim]``: the cos half then the
sin half, one value per rotated pair. Every scaling variant of vLLM's
``RotaryEmbedding`` (linear, dynamic NTK, NTK, Llama 3, YaRN, Gemma 4
proportional) only overrides ``_compute_inv_freq`` / ``_compute_cos_sin_cache``
and inherits ``forward_native``/``forward_static`` unchanged, so this one op
serves all of them (YaRN's mscale is folded into the cache; linear scaling
stacks one cache block per scaling factor). DeepSeek's YaRN differs only in
taking ``offsets``, which its layer adds to ``positions`` before calling.

Same semantics as ``RotaryEmbedding.forward_static``: only the first
``rotary_dim`` channels of each head rotate; neox style pairs channel ``i``
with ``i + rotary_dim / 2``, GPT-J style pairs ``2i`` with ``2i + 1``. Query
and key are ``[num_tokens, num_heads * head_size]`` or
``[num_tokens, num_heads, head_size]``; the results keep those shapes and the
inputs are not modified. ``key`` may be None (cross-layer KV sharing).
"""

from __future__ import annotations

import torch

from vllm_br.ops.registry import register_op


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool
) -> torch.Tensor:
    # x: [T, H, rotary_dim]; cos, sin: [T, 1, rotary_dim // 2] in x's dtype
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def _apply(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_tokens: int,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(num_tokens, -1, head_size)
    if rotary_dim == head_size:
        return _rotate(x, cos, sin, is_neox_style).reshape(shape)
    x_rot = _rotate(x[..., :rotary_dim], cos, sin, is_neox_style)
    return torch.cat((x_rot, x[..., rotary_dim:]), dim=-1).reshape(shape)


@register_op("rotary_embedding")
def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    rotary_dim: int,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos_c, sin_c = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos_c, sin_c = cos_c.unsqueeze(-2), sin_c.unsqueeze(-2)
    cos, sin = cos_c.to(query.dtype), sin_c.to(query.dtype)
    query = _apply(query, cos, sin, num_tokens, head_size, rotary_dim, is_neox_style)
    if key is not None:
        if key.dtype != query.dtype:
            cos, sin = cos_c.to(key.dtype), sin_c.to(key.dtype)
        key = _apply(key, cos, sin, num_tokens, head_size, rotary_dim, is_neox_style)
    return query, key


def _mrope_stream_of_channel(
    half: int, mrope_section: list[int], interleaved: bool, device: torch.device
) -> torch.Tensor:
    """For each of the ``rotary_dim // 2`` frequencies, which position stream
    (0 temporal, 1 height, 2 width) rotates it. Sectioned (Qwen2-VL): the
    first ``mrope_section[0]`` frequencies follow t, the next h, then w.
    Interleaved (Qwen3-VL): t h w t h w ..., h and w only within
    ``3 * mrope_section[1]`` / ``3 * mrope_section[2]`` channels."""
    channel = torch.arange(half, device=device)
    if interleaved:
        stream = torch.zeros(half, dtype=torch.long, device=device)
        stream[(channel % 3 == 1) & (channel < 3 * mrope_section[1])] = 1
        stream[(channel % 3 == 2) & (channel < 3 * mrope_section[2])] = 2
        return stream
    bounds = torch.tensor(mrope_section, device=device).cumsum(0)
    return torch.bucketize(channel, bounds, right=True)


@register_op("mrope_rotary_embedding")
def mrope_rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
    mrope_section: list[int],
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary (M-RoPE) as vLLM's ``MRotaryEmbedding``: positions
    ``[3, T]`` (temporal, height, width per token) each rotate their own
    frequencies of every head (:func:`_mrope_stream_of_channel`); positions
    ``[T]`` (text only) are plain rotary."""
    if positions.ndim == 1:
        return rotary_embedding(
            positions, query, key, head_size, rotary_dim, cos_sin_cache, is_neox_style
        )
    num_tokens = positions.shape[-1]
    half = rotary_dim // 2
    assert sum(mrope_section) == half, (mrope_section, rotary_dim)
    cos_c, sin_c = cos_sin_cache[positions].chunk(2, dim=-1)  # [3, T, half]
    stream = _mrope_stream_of_channel(
        half, mrope_section, mrope_interleaved, positions.device
    )
    index = stream.view(1, 1, half).expand(1, num_tokens, half)
    cos_c = cos_c.gather(0, index)[0].unsqueeze(-2)  # [T, 1, half]
    sin_c = sin_c.gather(0, index)[0].unsqueeze(-2)
    cos, sin = cos_c.to(query.dtype), sin_c.to(query.dtype)
    query = _apply(query, cos, sin, num_tokens, head_size, rotary_dim, is_neox_style)
    if key.dtype != query.dtype:
        cos, sin = cos_c.to(key.dtype), sin_c.to(key.dtype)
    key = _apply(key, cos, sin, num_tokens, head_size, rotary_dim, is_neox_style)
    return query, key


@register_op("apply_rotary_emb")
def apply_rotary_emb(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    is_neox_style: bool,
    fp32_compute: bool = False,
) -> torch.Tensor:
    """Rotary with per-token angles given directly (vLLM's ``ApplyRotaryEmb``:
    the vision towers' 2-D rotary, whose cos/sin come from each patch's
    (row, column)). ``x`` ``[..., S, H, D]``; ``cos``/``sin`` ``[S, D // 2]``
    (or ``[..., S, D // 2]``). ``fp32_compute`` rotates in float32 and casts
    back, as vLLM's ``enable_fp32_compute``."""
    dtype = torch.float32 if fp32_compute else x.dtype
    cos = cos.unsqueeze(-2).to(dtype)
    sin = sin.unsqueeze(-2).to(dtype)
    return _rotate(x.to(dtype), cos, sin, is_neox_style).to(x.dtype)
