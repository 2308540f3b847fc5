"""DeepSeek Sparse Attention (DeepSeek V3.2): reference kernels.

Plain, device-agnostic PyTorch, vectorised over the batch (token chunks
under a fixed score budget, no Python loop per request), registered with the
op registry so a device backend can bind its own kernels under the same
names and signatures:

* ``indexer_k_cache_write`` writes each new token's index key into the
  lightning indexer's paged key cache;
* ``sparse_attn_indexer`` scores every visible cached token for each query
  token (``sum_h w_h * relu(scale * q_h . k)``) and selects the ``topk``
  highest, as request-local token positions;
* ``sparse_mla_attention`` is the absorbed-weight MLA of each query token
  restricted to its selected tokens, over the dense MLA latent cache.

Index key cache
---------------
``[num_blocks, block_size, index_head_dim]`` in the model's dtype (vLLM's
CUDA path keeps FP8 values plus a float32 scale per 128; SUPA keeps the keys
as the model computes them, so the selection matches the model's own
arithmetic). A slot is ``block_id * block_size + offset``; block size 128.

Selection
---------
Scores are float32. Token ``t`` sees ``key_lens[t]`` keys (positions
``0 .. key_lens[t] - 1`` of its request: its context and itself). The top-k
are ordered by score, highest first; equal scores are taken lowest position
first (a stable descending sort). Rows with fewer visible keys than ``topk``
select them all and pad with ``-1``.
"""

from __future__ import annotations

import math

import torch

from vllm_br.ops.mla import SCORE_BUDGET_ELEMS, _softmax_pv
from vllm_br.ops.paged_attention import padding_to_null_block
from vllm_br.ops.registry import register_op

__all__ = [
    "indexer_k_cache_write",
    "sparse_attn_indexer",
    "sparse_mla_attention",
]


def _rows_per_chunk(span: int, per_row: int) -> int:
    return max(1, SCORE_BUDGET_ELEMS // max(1, span * per_row))


@register_op("indexer_k_cache_write")
def indexer_k_cache_write(
    k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``k[i]`` (``[num_tokens, D]``) at flat slot ``slot_mapping[i]``
    of ``k_cache`` (``[num_blocks, block_size, D]``, any strides); rows
    beyond ``len(slot_mapping)`` are padding, negative slots go to the null
    block."""
    n = slot_mapping.shape[0]
    if n == 0 or k_cache.numel() == 0:
        return
    assert k.shape[-1] == k_cache.shape[-1], (k.shape, k_cache.shape)
    slots, rows = padding_to_null_block(
        slot_mapping.to(torch.long), k[:n].to(k_cache.dtype)
    )
    block_size = k_cache.shape[1]
    block = torch.div(slots, block_size, rounding_mode="floor")
    k_cache[block, slots - block * block_size] = rows


@register_op("sparse_attn_indexer")
def sparse_attn_indexer(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    key_lens: torch.Tensor,
    softmax_scale: float,
    topk: int,
    *,
    max_key_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The lightning indexer's top-k selection.

    Args:
        q: ``[T, H, D]`` index queries (rope applied).
        weights: ``[T, H]`` per-head weights (float32 recommended).
        k_cache: ``[num_blocks, block_size, D]`` index key cache, this step's
            keys already written.
        block_table: ``[num_reqs, max_blocks]``.
        token_to_req: ``[T]`` the request (block-table row) of each token.
        key_lens: ``[T]`` keys each token sees (``0``: padding, all ``-1``).
        softmax_scale: applied to ``q . k`` before the ReLU.
        topk: indices per token.
        max_key_len: host-side upper bound of ``key_lens`` (sizes the
            gather).
        out: ``[>= T, >= topk]`` int32 (allocated when None); columns
            ``topk:`` are left as they are.

    Returns:
        ``out[:T, :topk]``: request-local positions, highest score first,
        ``-1`` padded.

    """
    num_tokens, num_heads, dim = q.shape
    if out is None:
        out = torch.empty((num_tokens, topk), dtype=torch.int32, device=q.device)
    result = out[:num_tokens, :topk]
    if num_tokens == 0:
        return result
    block_size = k_cache.shape[1]
    width = block_table.shape[1]
    num_blocks = max(1, min(width, math.ceil(max(int(max_key_len), 1) / block_size)))
    span = num_blocks * block_size
    take = min(topk, span)
    positions = torch.arange(span, device=q.device)
    token_to_req = token_to_req[:num_tokens].to(torch.long)
    key_lens = key_lens[:num_tokens].to(torch.long)
    rows = _rows_per_chunk(span, num_heads + dim)
    for t0 in range(0, num_tokens, rows):
        t1 = min(num_tokens, t0 + rows)
        ids = block_table.index_select(0, token_to_req[t0:t1])[:, :num_blocks]
        keys = k_cache.index_select(0, ids.to(torch.long).flatten())
        keys = keys.reshape(t1 - t0, span, dim).float()
        # [t, H, D] @ [t, D, S] -> [t, H, S]; ReLU; weighted sum over heads.
        scores = torch.matmul(q[t0:t1].float(), keys.transpose(1, 2))
        scores = torch.relu(scores.mul_(softmax_scale))
        index = torch.matmul(weights[t0:t1].float().unsqueeze(1), scores).squeeze(1)
        visible = positions[None, :] < key_lens[t0:t1, None]
        index.masked_fill_(~visible, float("-inf"))
        order = torch.sort(index, dim=-1, descending=True, stable=True).indices
        picked = order[:, :take]
        picked = torch.where(
            visible.gather(1, picked), picked, torch.full_like(picked, -1)
        )
        result[t0:t1, :take] = picked.to(torch.int32)
    if take < topk:
        result[:, take:] = -1
    return result


@register_op("sparse_mla_attention")
def sparse_mla_attention(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    topk_indices: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA of each query token over its selected cached tokens.

    Args:
        q: ``[T, N, L + R]`` or ``(ql_nope [T, N, L], q_pe [T, N, R])``.
        kv_cache: ``[num_blocks, block_size, L + R]`` latent cache.
        block_table: ``[num_reqs, max_blocks]`` of the latent cache.
        token_to_req: ``[T]`` block-table row of each token.
        topk_indices: ``[>= T, K]`` request-local positions, ``-1`` = none.
        scale: softmax scale.
        kv_lora_rank: ``L``; values are ``kv_cache[..., :L]``.
        out: ``[T, N, L]`` (allocated in q's dtype when None).

    Returns:
        ``out``; a token with no selected position gets zeros.

    """
    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    num_tokens, num_heads, dim = q.shape
    _, block_size, content = kv_cache.shape
    assert dim == content, (q.shape, kv_cache.shape)
    if out is None:
        out = q.new_empty((num_tokens, num_heads, kv_lora_rank))
    if num_tokens == 0:
        return out
    topk = topk_indices.shape[1]
    token_to_req = token_to_req[:num_tokens].to(torch.long)
    rows = _rows_per_chunk(topk, num_heads + content)
    for t0 in range(0, num_tokens, rows):
        t1 = min(num_tokens, t0 + rows)
        idx = topk_indices[t0:t1].to(torch.long)
        valid = idx >= 0
        pos = idx.clamp(min=0)
        col = torch.div(pos, block_size, rounding_mode="floor")
        block = block_table[token_to_req[t0:t1, None], col].to(torch.long)
        kv = kv_cache[block, pos - col * block_size].float()  # [t, K, C]
        scores = torch.matmul(q[t0:t1].float(), kv.transpose(1, 2)).mul_(scale)
        o, _ = _softmax_pv(scores, valid[:, None, :], kv[..., :kv_lora_rank])
        out[t0:t1] = o.to(out.dtype)
    return out
