"""Multi-head latent attention (MLA, DeepSeek V2/V3): reference kernels.

Plain, device-agnostic PyTorch, vectorised over the batch (no Python loop per
request), registered with the op registry (callers use
``vllm_br.ops.get_op(name)``) so a device backend can bind a fused kernel (for
example Biren's ``flash_mla``) under the same name and signature:

* ``concat_and_cache_mla`` writes each new token's latent ``kv_c`` and rope
  key ``k_pe`` into the paged latent cache;
* ``mla_decode`` is the absorbed-weight decode: multi-query attention of the
  ``N`` query heads (already multiplied by ``W_UK``) over the paged latent
  cache through the block table, values being the latent itself;
* ``gather_mla_context`` copies the cached latent of prefills' context (prefix
  hits, earlier chunks of a chunked prefill) out of the paged cache into a
  dense workspace, to be up-projected for the prefill;
* ``mla_prefill_attention`` is ragged (variable-length) multi-head attention
  with the log-sum-exp of each row, causal for the new tokens, non-causal for
  a context chunk;
* ``merge_attn_states`` merges two partial attention results by their LSE.

Latent cache
------------
One layer's cache is ``[num_blocks, block_size, kv_lora_rank + rope_dim]``
(vLLM's ``[B, 1, N, C]`` layer view with its head dimension squeezed, any
strides): one "KV head" per token holding ``[kv_c | k_pe]``. A slot is
``block_id * block_size + offset``; the SUPA block size is 128.

Numerics
--------
Scores, softmax and the value sums run in float32 from the (possibly bf16)
inputs, rounded once to the output dtype; LSEs are float32 (natural log),
shaped ``[num_heads, num_tokens]`` as vLLM's MLA code expects. Rows that attend
to nothing (padding) produce zeros and an LSE of ``-inf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vllm_br.ops.paged_attention import padding_to_null_block
from vllm_br.ops.registry import register_op

__all__ = [
    "SCORE_BUDGET_ELEMS",
    "RaggedAttentionPlan",
    "concat_and_cache_mla",
    "gather_mla_context",
    "make_ragged_attention_plan",
    "merge_attn_states",
    "mla_decode",
    "mla_prefill_attention",
]

#: Upper bound on the float32 elements of one materialised score chunk.
SCORE_BUDGET_ELEMS = 1 << 26


# --------------------------------------------------------------------------- #
# Latent cache write and context gather
# --------------------------------------------------------------------------- #


@register_op("concat_and_cache_mla")
def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``[kv_c[i] | k_pe[i]]`` at flat slot ``slot_mapping[i]``.

    Args:
        kv_c: ``[num_tokens, kv_lora_rank]`` normalised latent (rows beyond
            ``len(slot_mapping)`` are padding and ignored).
        k_pe: ``[num_tokens, rope_dim]`` or ``[num_tokens, 1, rope_dim]``.
        kv_cache: one layer's ``[num_blocks, block_size, kv_lora_rank +
            rope_dim]`` latent cache (any strides).
        slot_mapping: ``[n]`` slots; negative ones (padding) go to the null
            block.

    """
    n = slot_mapping.shape[0]
    if n == 0 or kv_cache.numel() == 0:
        return
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    rank = kv_c.shape[-1]
    assert rank + k_pe.shape[-1] == kv_cache.shape[-1], (kv_c.shape, kv_cache.shape)
    slots = slot_mapping.to(torch.long)
    kv_c, k_pe = kv_c[:n], k_pe[:n]
    rows = torch.cat((kv_c, k_pe), dim=-1).to(kv_cache.dtype)
    slots, rows = padding_to_null_block(slots, rows)
    block_size = kv_cache.shape[1]
    block = torch.div(slots, block_size, rounding_mode="floor")
    offset = slots - block * block_size
    kv_cache[block, offset] = rows


@register_op("gather_mla_context")
def gather_mla_context(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    starts: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Copy cached latent rows into a dense workspace.

    Sequence ``r`` contributes ``cu_seq_lens[r + 1] - cu_seq_lens[r]`` rows,
    its cached positions ``starts[r], starts[r] + 1, ...``, read through
    ``block_table[r]``; they land at ``out[cu_seq_lens[r]:cu_seq_lens[r+1]]``.
    ``token_to_seq[i]`` is the sequence of output row ``i`` (vLLM's chunk
    metadata carries it), so no host sync is needed. Returns ``out``
    (``[>= len(token_to_seq), C]``).
    """
    toks = token_to_seq.shape[0]
    if toks == 0:
        return out
    seq = token_to_seq.to(torch.long)
    local = torch.arange(toks, device=seq.device) - cu_seq_lens.to(torch.long)[seq]
    pos = starts.to(torch.long)[seq] + local
    block_size = kv_cache.shape[1]
    col = torch.div(pos, block_size, rounding_mode="floor")
    block = block_table.to(torch.long)[seq, col]
    out[:toks] = kv_cache[block, pos - col * block_size].to(out.dtype)
    return out


# --------------------------------------------------------------------------- #
# Softmax with LSE on padded scores
# --------------------------------------------------------------------------- #


def _softmax_pv(
    scores: torch.Tensor, mask: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax(scores) @ values in float32 and the LSE per row.

    ``scores`` ``[..., Lq, S]`` float32 (modified), ``mask`` broadcastable to
    it (True = attend), ``values`` ``[..., S, Dv]`` float32. Rows with no
    key give zeros and ``-inf``. Values of keys no row attends are taken as
    zero: they may be cache slots nothing wrote (stale memory, possibly NaN,
    and a zero weight times NaN is NaN)."""
    values = torch.where(mask.any(dim=-2).unsqueeze(-1), values, 0)
    scores.masked_fill_(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    empty = torch.isinf(row_max)
    row_max = row_max.masked_fill(empty, 0.0)
    p = torch.exp(scores.sub_(row_max))
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, values) / denom.clamp(min=torch.finfo(torch.float32).tiny)
    lse = (torch.log(denom) + row_max).squeeze(-1)
    return out, lse


# --------------------------------------------------------------------------- #
# Decode: absorbed-weight MQA over the paged latent cache
# --------------------------------------------------------------------------- #


@register_op("mla_decode")
def mla_decode(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    *,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One new token per request attends its whole cached sequence.

    Args:
        q: ``[B, N, L + R]``, or the pair ``(ql_nope [B, N, L], q_pe [B, N,
            R])``: query heads already absorbed into the latent space
            (``q_nope @ W_UK``) and their rope part.
        kv_cache: ``[num_blocks, block_size, L + R]`` latent cache (the new
            tokens already written).
        block_table: ``[>= B, max_blocks]`` (row ``b`` is request ``b``).
        seq_lens: ``[>= B]`` tokens per request, the new one included;
            ``0`` marks a padding request (zeros out).
        scale: softmax scale.
        kv_lora_rank: ``L``; the values are ``kv_cache[..., :L]``.
        max_seq_len: host-side upper bound of ``seq_lens[:B]`` (sizes the
            gather; a captured graph passes the block table's full width).
        out: ``[B, N, L]`` output (allocated in q's dtype when None).
        return_lse: also return the float32 LSE ``[B, N]``.

    Returns:
        ``(out, lse or None)``.

    """
    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    batch, num_heads, dim = q.shape
    _, block_size, content = kv_cache.shape
    assert dim == content, (q.shape, kv_cache.shape)
    if out is None:
        out = q.new_empty((batch, num_heads, kv_lora_rank))
    lse = (
        torch.empty((batch, num_heads), dtype=torch.float32, device=q.device)
        if return_lse
        else None
    )
    if batch == 0:
        return out, lse
    width = block_table.shape[1]
    num_blocks = max(1, min(width, math.ceil(max(int(max_seq_len), 1) / block_size)))
    span = num_blocks * block_size
    positions = torch.arange(span, device=q.device)
    seq_lens = seq_lens[:batch].to(torch.long)
    # Requests per chunk: the float32 scores [b, N, S] and the gathered
    # latent [b, S, C] stay under the budget.
    rows = max(1, SCORE_BUDGET_ELEMS // (span * (num_heads + content)))
    for b0 in range(0, batch, rows):  # chunks of requests, never one by one
        b1 = min(batch, b0 + rows)
        ids = block_table[b0:b1, :num_blocks].to(torch.long).flatten()
        kv = kv_cache.index_select(0, ids).reshape(b1 - b0, span, content).float()
        scores = torch.matmul(q[b0:b1].float(), kv.transpose(1, 2)).mul_(scale)
        mask = (positions[None, :] < seq_lens[b0:b1, None])[:, None, :]
        o, row_lse = _softmax_pv(scores, mask, kv[..., :kv_lora_rank])
        out[b0:b1] = o.to(out.dtype)
        if lse is not None:
            lse[b0:b1] = row_lse
    return out, lse


# --------------------------------------------------------------------------- #
# Prefill: ragged multi-head attention with LSE
# --------------------------------------------------------------------------- #


@dataclass
class RaggedAttentionPlan:
    """Padding indices of one ragged batch (sequence ``r``: ``q_lens[r]``
    query rows, ``k_lens[r]`` key rows, each packed in order), built on the
    host once and shared by every layer (the mask is cached in it)."""

    num_seqs: int
    num_q_tokens: int
    num_k_tokens: int
    max_q: int
    max_k: int
    causal: bool
    q_lens: torch.Tensor
    k_lens: torch.Tensor
    q_token_seq: torch.Tensor
    q_token_local: torch.Tensor
    k_token_seq: torch.Tensor
    k_token_local: torch.Tensor
    _mask: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def mask(self) -> torch.Tensor:
        """``[R, max_q, max_k]`` True where a query row attends a key row;
        causal is bottom-right aligned (query ``i`` of a sequence sees keys
        ``<= i + k_len - q_len``), as flash-attention's varlen kernels."""
        if self._mask is None:
            dev = self.q_lens.device
            qi = torch.arange(self.max_q, device=dev)[None, :, None]
            kj = torch.arange(self.max_k, device=dev)[None, None, :]
            ql = self.q_lens[:, None, None]
            kl = self.k_lens[:, None, None]
            m = (qi < ql) & (kj < kl)
            if self.causal:
                m &= kj <= qi + (kl - ql)
            self._mask = m
        return self._mask


def make_ragged_attention_plan(
    q_lens_cpu: torch.Tensor,
    k_lens_cpu: torch.Tensor | None = None,
    *,
    causal: bool,
    device: torch.device | str | None = None,
) -> RaggedAttentionPlan:
    """Plan for sequences of ``q_lens_cpu`` queries over ``k_lens_cpu`` keys
    (host tensors; ``k_lens_cpu`` None: self-attention, keys = queries)."""
    q_lens = q_lens_cpu.detach().to("cpu", torch.long).flatten()
    k_lens = q_lens if k_lens_cpu is None else k_lens_cpu.detach().to("cpu", torch.long)
    k_lens = k_lens.flatten()
    assert q_lens.numel() == k_lens.numel(), (q_lens, k_lens)

    def local(lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(lens.sum())
        seq = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        starts = torch.cumsum(lens, 0) - lens
        return seq, torch.arange(n) - starts[seq]

    qs, ql = local(q_lens)
    ks, kl = local(k_lens)
    to = (lambda t: t.to(device)) if device is not None else (lambda t: t)
    return RaggedAttentionPlan(
        num_seqs=q_lens.numel(),
        num_q_tokens=int(q_lens.sum()),
        num_k_tokens=int(k_lens.sum()),
        max_q=int(q_lens.max()) if q_lens.numel() else 0,
        max_k=int(k_lens.max()) if k_lens.numel() else 0,
        causal=causal,
        q_lens=to(q_lens),
        k_lens=to(k_lens),
        q_token_seq=to(qs),
        q_token_local=to(ql),
        k_token_seq=to(ks),
        k_token_local=to(kl),
    )


@register_op("mla_prefill_attention")
def mla_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    plan: RaggedAttentionPlan,
    *,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Ragged multi-head attention (the MLA prefill's compute-friendly path).

    Args:
        q: ``[Tq, N, D]`` query rows, packed per sequence as in ``plan``.
        k: ``[Tk, N, D]`` keys (up-projected latent with the rope part).
        v: ``[Tk, N, Dv]`` values.
        scale: softmax scale.
        plan: :func:`make_ragged_attention_plan` of the batch (causal or not).
        return_lse: also return the float32 LSE ``[N, Tq]``.
        out: ``[Tq, N, Dv]`` output (allocated in q's dtype when None).

    Returns:
        ``out``, or ``(out, lse)``.

    """
    tq, num_heads, d = q.shape
    dv = v.shape[-1]
    assert tq == plan.num_q_tokens and k.shape[0] == plan.num_k_tokens
    if out is None:
        out = q.new_empty((tq, num_heads, dv))
    lse = torch.empty((num_heads, tq), dtype=torch.float32, device=q.device)
    if tq == 0:
        return (out, lse) if return_lse else out
    r, max_q, max_k = plan.num_seqs, plan.max_q, plan.max_k
    qs, ql, ks, kl = (
        plan.q_token_seq,
        plan.q_token_local,
        plan.k_token_seq,
        plan.k_token_local,
    )
    # Padded per-sequence tensors, heads first: [R, N, L, D] in float32.
    q_pad = q.new_zeros((r, max_q, num_heads, d), dtype=torch.float32)
    k_pad = k.new_zeros((r, max_k, num_heads, d), dtype=torch.float32)
    v_pad = v.new_zeros((r, max_k, num_heads, dv), dtype=torch.float32)
    q_pad[qs, ql] = q.float()
    k_pad[ks, kl] = k.float()
    v_pad[ks, kl] = v.float()
    q_pad, k_pad, v_pad = (
        t.transpose(1, 2).contiguous() for t in (q_pad, k_pad, v_pad)
    )
    mask = plan.mask()[:, None]  # [R, 1, max_q, max_k]
    o_pad = q_pad.new_empty((r, num_heads, max_q, dv))
    lse_pad = q_pad.new_empty((r, num_heads, max_q))
    rows = max(1, SCORE_BUDGET_ELEMS // max(1, r * num_heads * max_k))
    for c0 in range(0, max_q, rows):  # query-row chunks, never per sequence
        c1 = min(max_q, c0 + rows)
        s = torch.matmul(q_pad[:, :, c0:c1], k_pad.transpose(-1, -2)).mul_(scale)
        o, row_lse = _softmax_pv(s, mask[:, :, c0:c1], v_pad)
        o_pad[:, :, c0:c1] = o
        lse_pad[:, :, c0:c1] = row_lse
    out[:tq] = o_pad[qs, :, ql].to(out.dtype)
    if not return_lse:
        return out
    lse[:] = lse_pad[qs, :, ql].transpose(0, 1)
    return out, lse


@register_op("merge_attn_states")
def merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None = None,
) -> None:
    """Merge two partial softmax attentions over disjoint key sets.

    Outputs ``[T, N, D]``, LSEs ``[N, T]`` (float32, ``-inf`` for an empty
    part). Writes ``output`` (and ``output_lse``); ``output`` may alias either
    input. Where both parts are empty the output is zero."""
    p_lse = prefix_lse.float()
    s_lse = suffix_lse.float()
    # A +inf LSE (some kernels' "empty") counts as empty.
    p_lse = p_lse.masked_fill(torch.isposinf(p_lse), float("-inf"))
    s_lse = s_lse.masked_fill(torch.isposinf(s_lse), float("-inf"))
    m = torch.maximum(p_lse, s_lse)
    empty = torch.isinf(m)
    m = m.masked_fill(empty, 0.0)
    p_w = torch.exp(p_lse - m)
    s_w = torch.exp(s_lse - m)
    total = p_w + s_w
    safe = total.masked_fill(empty, 1.0)
    p_scale = (p_w / safe).transpose(0, 1).unsqueeze(-1)
    s_scale = (s_w / safe).transpose(0, 1).unsqueeze(-1)
    merged = prefix_output.float() * p_scale + suffix_output.float() * s_scale
    if output_lse is not None:
        new_lse = (torch.log(safe) + m).masked_fill(empty, float("-inf"))
        output_lse.copy_(new_lse)
    output.copy_(merged.to(output.dtype))
