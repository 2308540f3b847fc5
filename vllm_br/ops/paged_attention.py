"""Paged attention and KV-cache write: reference kernels in plain PyTorch.

These are the SUPA attention kernels' reference implementations. They use only
device-agnostic PyTorch ops, so they run on CPU (tests) and on any torch device,
and they are vectorised over the batch: no Python loop runs per request.
Registered with the op registry as ``reshape_and_cache``,
``paged_attention_decode``, ``paged_attention_prefill`` and
``attention_varlen`` (callers use ``vllm_br.ops.get_op(name)``);
:func:`paged_attention` runs both parts of a step.

KV cache
--------
One layer's cache is the tensor vLLM hands to the attention backend: logical
shape ``[num_blocks, num_kv_heads, block_size, head_size + head_size_v]`` (vLLM's
``[B, H, N, C]`` layer view) with K in ``[..., :head_size]`` and V in
``[..., head_size:]``. Its strides follow the resolved ``KVCacheLayout``; the
SUPA backend prefers ``LBNHC`` (physical ``[num_blocks, block_size, num_kv_heads,
C]`` per layer), where a token's K/V for all heads is one contiguous run. Every
function here indexes the 4D view through its strides, so every layout is
handled correctly; ``LBNHC`` is simply the one where gathers are dense. Slots are
flat: ``slot = block_id * block_size + offset``; block size is read from the
cache (dim 2), the SUPA kernel's fixed size being 128.

Attention
---------
Request ``r`` owns query tokens ``query[query_start_loc[r]:query_start_loc[r+1]]``,
which are the LAST ``query_len`` tokens of its sequence of ``seq_lens[r]`` tokens,
all of which (context and new tokens) are already in the cache, so
``reshape_and_cache`` runs first. Requests are split, on the host and once per
step (:func:`make_paged_attention_plan`), into

* decodes (``query_len == 1``): one batched call over ``[num_decodes, H, 1, S]``;
* prefills (``query_len > 1``: prefill, chunked prefill, prefix-cache hits, spec
  verification): one padded batched call over ``[num_prefills, H, max_q, S]``,
  processed in query chunks so the score/mask working set stays under
  ``SCORE_BUDGET_ELEMS`` elements.

``S`` is the padded key length: the blocks of the longest sequence in the part,
or, for a sliding-window layer, only the blocks the window can reach (each
request gathers from its own first needed block), so long windowed decodes
stay cheap. K/V of each part are gathered once through the block table into a
padded ``[num_reqs, S, H_kv, D]`` tensor; the mask is built from key positions,
query positions and sequence lengths.

Numerics
--------
Without soft-cap the attention runs in ``torch.nn.functional.
scaled_dot_product_attention`` in the model dtype with a boolean mask (on CPU
the fused flash kernel keeps the QK^T scores, the softmax and the PV
accumulation in float32 and rounds the probabilities to bf16 for the PV matmul,
like flash-attention; fully masked padding rows come out as zeros). With soft-cap
(or ``use_sdpa=False``) an explicit path computes everything in float32
(scores, ``tanh(s / cap) * cap``, softmax, PV) and rounds once at the end.
GQA/MQA never materialises repeated K/V: the ``H_q / H_kv`` query heads that
share a KV head are folded into the query-row dimension.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm_br.logger import init_logger
from vllm_br.ops.registry import register_op

logger = init_logger(__name__)

__all__ = [
    "SCORE_BUDGET_ELEMS",
    "PagedAttentionPlan",
    "attention_varlen",
    "make_paged_attention_plan",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_prefill",
    "reshape_and_cache",
]

#: Upper bound on the elements of one materialised score (or mask) chunk,
#: ``batch * num_heads * query_rows * key_len``. 2**26 float32 elements is
#: 256 MiB; long prefills are processed in query chunks to stay below it.
SCORE_BUDGET_ELEMS = 1 << 26


# --------------------------------------------------------------------------- #
# KV-cache write
# --------------------------------------------------------------------------- #


#: most bytes of K/V one decode gather holds (the decodes are cut in groups)
DECODE_GATHER_BYTES = 64 << 20


def padding_to_null_block(
    slots: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padding slots (negative) -> slot 0, in vLLM's null block (block 0, which
    its block pool reserves and never gives a request), with their rows
    zeroed. The write then keeps a fixed shape with no host sync, as a graph
    capture requires. Zeros, because padding rows are computed from unwritten
    inputs (NaN or Inf on a card), and attention reads the null block where a
    block table is padded: masked, but 0 * NaN is NaN."""
    keep = slots >= 0
    rows = rows.masked_fill(~keep.view(-1, *([1] * (rows.dim() - 1))), 0)
    return slots.clamp(min=0), rows


@register_op("reshape_and_cache")
def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``i``'s K and V into ``kv_cache`` at flat slot ``slot_mapping[i]``.

    Args:
        key: ``[num_tokens, num_kv_heads, head_size]`` (may hold padding rows
            beyond ``len(slot_mapping)``; those are ignored).
        value: ``[num_tokens, num_kv_heads, head_size_v]``.
        kv_cache: one layer's ``[num_blocks, num_kv_heads, block_size,
            head_size + head_size_v]`` view (any strides).
        slot_mapping: ``[n]`` integer slots, ``block_id * block_size + offset``;
            negative slots (padding, ``-1``) go to the null block.

    """
    n = slot_mapping.shape[0]
    if n == 0 or kv_cache.numel() == 0:
        return
    head_size = key.shape[-1]
    num_blocks, num_kv_heads, block_size, content = kv_cache.shape
    assert key.shape[-2] == num_kv_heads, (key.shape, kv_cache.shape)
    assert head_size + value.shape[-1] == content, (key.shape, value.shape, content)

    slots = slot_mapping.to(torch.long)
    key = key[:n]
    value = value[:n]
    kv = torch.cat((key, value), dim=-1).to(kv_cache.dtype)
    slots, kv = padding_to_null_block(slots, kv)
    block_idx = torch.div(slots, block_size, rounding_mode="floor")
    offset = slots - block_idx * block_size
    # [B, N, H, C] view: adjacent advanced indices -> assigned rows [n, H, C].
    kv_cache.transpose(1, 2)[block_idx, offset] = kv


# --------------------------------------------------------------------------- #
# Host-side plan (once per step, shared by every layer)
# --------------------------------------------------------------------------- #


@dataclass
class PagedAttentionPlan:
    """Decode/prefill split and padding indices of one batch, built on the host.

    Build it once per step with :func:`make_paged_attention_plan` and pass it to
    every layer's kernel call; masks are cached in it per (window, causal) kind.
    All index tensors live on the compute device.
    """

    num_reqs: int
    num_tokens: int
    """Real query tokens: ``query_start_loc[-1]``."""

    # Decodes (query_len == 1).
    num_decodes: int
    decode_reqs: torch.Tensor | None
    """[num_decodes] request indices, or None when they are ``0..num_decodes-1``."""
    decode_tokens: torch.Tensor | None
    """[num_decodes] token indices, or None when they are ``0..num_decodes-1``."""
    decode_max_seq_len: int

    # Prefills (query_len > 1; with ``split_decodes=False`` every non-empty one).
    num_prefills: int
    num_prefill_tokens: int
    prefill_reqs: torch.Tensor | None
    """[num_prefills] request indices (long)."""
    prefill_query_lens: torch.Tensor | None
    """[num_prefills] query lengths (long)."""
    prefill_token_req: torch.Tensor | None
    """[num_prefill_tokens] row of each prefill token in the padded batch."""
    prefill_token_local: torch.Tensor | None
    """[num_prefill_tokens] position of each token inside its query."""
    prefill_tokens: torch.Tensor | None
    """[num_prefill_tokens] flat token indices, or None when contiguous."""
    prefill_token_start: int
    """First prefill token when ``prefill_tokens`` is None (contiguous run)."""
    prefill_max_query_len: int
    prefill_max_seq_len: int

    cache_masks: bool = True
    """Share positions and masks between layers. False for a plan captured
    into a graph: replay re-reads ``seq_lens``, so masks must be rebuilt from
    it rather than kept from capture time."""

    _cache: dict = field(default_factory=dict, repr=False, compare=False)


def make_paged_attention_plan(
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    device: torch.device | str | None = None,
    split_decodes: bool = True,
) -> PagedAttentionPlan:
    """Split a batch into decodes and prefills and precompute padding indices.

    Args:
        query_start_loc_cpu: ``[num_reqs + 1]`` host tensor (exact).
        seq_lens_cpu: ``[num_reqs]`` host sequence lengths, exact or an upper
            bound (only sizes buffers; masks use the device ``seq_lens``).
        max_seq_len: upper bound on every sequence length; used when
            ``seq_lens_cpu`` is None and to tighten it otherwise.
        device: where the index tensors go.
        split_decodes: False puts every non-empty request in the padded
            "prefill" part (encoder attention).

    """
    qsl = query_start_loc_cpu.detach().to("cpu", torch.long)
    num_reqs = qsl.numel() - 1
    qlens = qsl[1:] - qsl[:-1]
    if seq_lens_cpu is not None:
        sl_ub = seq_lens_cpu.detach().to("cpu", torch.long)[:num_reqs]
        if max_seq_len is not None:
            sl_ub = sl_ub.clamp(max=max(int(max_seq_len), 1))
    else:
        assert max_seq_len is not None, "need seq_lens_cpu or max_seq_len"
        sl_ub = torch.full((num_reqs,), int(max_seq_len), dtype=torch.long)
    sl_ub = torch.maximum(sl_ub, qlens)

    if split_decodes:
        is_decode = qlens == 1
        is_prefill = qlens > 1
    else:
        is_decode = torch.zeros_like(qlens, dtype=torch.bool)
        is_prefill = qlens > 0

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device) if device is not None else t

    # Decodes.
    decode_reqs = torch.nonzero(is_decode).flatten()
    num_decodes = decode_reqs.numel()
    decode_tokens = qsl[decode_reqs]
    decode_max_seq_len = int(sl_ub[decode_reqs].max()) if num_decodes else 0
    ar = torch.arange(num_decodes)
    decode_contiguous = bool(
        torch.equal(decode_reqs, ar) and torch.equal(decode_tokens, ar)
    )

    # Prefills.
    prefill_reqs = torch.nonzero(is_prefill).flatten()
    num_prefills = prefill_reqs.numel()
    pq = qlens[prefill_reqs]
    num_prefill_tokens = int(pq.sum()) if num_prefills else 0
    plan_prefill: dict = dict(
        prefill_reqs=None,
        prefill_query_lens=None,
        prefill_token_req=None,
        prefill_token_local=None,
        prefill_tokens=None,
        prefill_token_start=0,
        prefill_max_query_len=0,
        prefill_max_seq_len=0,
    )
    if num_prefills:
        token_req = torch.repeat_interleave(torch.arange(num_prefills), pq)
        starts = torch.cumsum(pq, 0) - pq
        token_local = torch.arange(num_prefill_tokens) - starts[token_req]
        tokens = qsl[prefill_reqs][token_req] + token_local
        first = int(tokens[0])
        contiguous = bool(
            torch.equal(tokens, torch.arange(first, first + num_prefill_tokens))
        )
        plan_prefill.update(
            prefill_reqs=dev(prefill_reqs),
            prefill_query_lens=dev(pq),
            prefill_token_req=dev(token_req),
            prefill_token_local=dev(token_local),
            prefill_tokens=None if contiguous else dev(tokens),
            prefill_token_start=first,
            prefill_max_query_len=int(pq.max()),
            prefill_max_seq_len=int(sl_ub[prefill_reqs].max()),
        )

    return PagedAttentionPlan(
        num_reqs=num_reqs,
        num_tokens=int(qsl[-1]),
        num_decodes=num_decodes,
        decode_reqs=None if decode_contiguous else dev(decode_reqs),
        decode_tokens=None if decode_contiguous else dev(decode_tokens),
        decode_max_seq_len=decode_max_seq_len,
        num_prefills=num_prefills,
        num_prefill_tokens=num_prefill_tokens,
        **plan_prefill,
    )


# --------------------------------------------------------------------------- #
# Core batched attention on padded tensors
# --------------------------------------------------------------------------- #


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    logits_soft_cap: float | None,
    use_sdpa: bool,
) -> torch.Tensor:
    """Masked attention on padded batches.

    q ``[B, Lq, Hq, D]``, k ``[B, S, Hkv, D]``, v ``[B, S, Hkv, Dv]``, mask
    ``[B, Lq, S]`` (True = attend) -> ``[B, Lq, Hq, Dv]`` in q's dtype. Rows
    with no True in the mask produce garbage (zeros or NaN) the caller drops.
    """
    B, Lq, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    Dv = v.shape[-1]
    G = Hq // Hkv
    out_dtype = q.dtype
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    # Keys no query attends include cache slots nothing wrote (past a
    # request's length in its last block): stale device memory, possibly
    # NaN or Inf, and a zero weight times NaN is NaN. vLLM zeroes new KV
    # blocks only for Mamba or mixed-precision caches, so zero them here.
    used = mask.any(dim=1)[:, :, None, None]  # [B, S, 1, 1]
    k = torch.where(used, k, 0)
    v = torch.where(used, v, 0)
    kt = k.permute(0, 2, 1, 3)  # [B, Hkv, S, D]
    vt = v.permute(0, 2, 1, 3)  # [B, Hkv, S, Dv]
    explicit = (logits_soft_cap is not None and logits_soft_cap > 0) or not use_sdpa
    if explicit:
        kt = kt.float()
        vt = vt.float()

    out = q.new_empty((B, Lq, Hq, Dv))
    rows = max(1, SCORE_BUDGET_ELEMS // max(1, B * Hq * S))
    for c0 in range(0, Lq, rows):  # loop over query chunks, never over requests
        c1 = min(Lq, c0 + rows)
        lc = c1 - c0
        # Fold the G query heads of each KV head into the row dimension:
        # [B, lc, Hkv, G, D] -> [B, Hkv, lc * G, D] (row = i * G + g).
        qc = q[:, c0:c1].reshape(B, lc, Hkv, G, D).permute(0, 2, 1, 3, 4)
        qc = qc.reshape(B, Hkv, lc * G, D)
        mc = mask[:, c0:c1, None, :]
        if G > 1:
            mc = mc.expand(B, lc, G, S)
        mc = mc.reshape(B, 1, lc * G, S)
        if explicit:
            s = torch.matmul(qc.float(), kt.transpose(-1, -2))
            s.mul_(scale)
            if logits_soft_cap is not None and logits_soft_cap > 0:
                s.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
            s.masked_fill_(~mc, float("-inf"))
            p = torch.softmax(s, dim=-1)
            oc = torch.matmul(p, vt)
        else:
            # An additive mask: PyTorch's CPU SDPA takes a much slower path for
            # a boolean mask in bf16 (measured 2x on the decode shape).
            bias = torch.zeros(mc.shape, dtype=qc.dtype, device=qc.device)
            bias.masked_fill_(~mc, float("-inf"))
            oc = F.scaled_dot_product_attention(qc, kt, vt, attn_mask=bias, scale=scale)
        oc = oc.reshape(B, Hkv, lc, G, Dv).permute(0, 2, 1, 3, 4)
        out[:, c0:c1] = oc.reshape(B, lc, Hq, Dv).to(out_dtype)
    return out


def _window(sliding_window: int | None) -> int | None:
    if sliding_window is None or sliding_window <= 0:
        return None
    return int(sliding_window)


def _gather_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    start_block: torch.Tensor | None,
    num_blocks: int,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather ``num_blocks`` blocks per row of ``block_table`` (from
    ``start_block``) into padded ``[R, num_blocks * block_size, H, D]`` K and V.
    Returns (k, v, key_positions [R, S])."""
    bs = kv_cache.shape[2]
    width = block_table.shape[1]
    ar = torch.arange(num_blocks, device=block_table.device)
    if start_block is None:
        blk_cols = ar.expand(block_table.shape[0], num_blocks)
    else:
        blk_cols = (start_block[:, None] + ar[None, :]).clamp_(max=width - 1)
    block_ids = torch.gather(block_table, 1, blk_cols).to(torch.long)
    r = block_ids.shape[0]
    # [NB, N, H, C] -> [R * nb, N, H, C] -> [R, nb * N, H, C]; a dense block
    # copy for LBNHC (index_select beats advanced indexing here).
    kv = kv_cache.transpose(1, 2).index_select(0, block_ids.flatten())
    kv = kv.reshape(r, num_blocks * bs, kv.shape[2], kv.shape[3])
    key_pos = _key_positions(start_block, r, num_blocks, bs, block_table.device)
    return kv[..., :head_size], kv[..., head_size:], key_pos


def _key_positions(
    start_block: torch.Tensor | None,
    rows: int,
    num_blocks: int,
    block_size: int,
    device: torch.device,
) -> torch.Tensor:
    """[R, num_blocks * block_size] positions of the keys _gather_kv gathers."""
    pos = torch.arange(num_blocks * block_size, device=device)
    if start_block is None:
        return pos.expand(rows, num_blocks * block_size)
    return start_block[:, None] * block_size + pos[None, :]


def _mask(
    key_pos: torch.Tensor,
    q_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    causal: bool | torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """key_pos [R, S], q_pos [R, Lq], seq_lens [R], causal bool or [R] bool
    -> [R, Lq, S] bool. vLLM semantics: causal: key <= query; window W:
    key > query - W (and key < query + W when non-causal)."""
    kp = key_pos[:, None, :]
    qp = q_pos[:, :, None]
    m = (kp < seq_lens[:, None, None]) & (kp >= 0)
    m = m.expand(kp.shape[0], qp.shape[1], kp.shape[2]).clone()
    if isinstance(causal, torch.Tensor):
        c = causal.to(torch.bool)[:, None, None]
        m &= (kp <= qp) | ~c
        if window is not None:
            m &= kp > qp - window
            m &= (kp < qp + window) | c
    else:
        if causal:
            m &= kp <= qp
        if window is not None:
            m &= kp > qp - window
            if not causal:
                m &= kp < qp + window
    return m


# --------------------------------------------------------------------------- #
# Paged attention
# --------------------------------------------------------------------------- #


def _attend_part(
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
    plan: PagedAttentionPlan,
    use_sdpa: bool,
) -> None:
    """The plan's decodes (``decodes``) or prefills, into ``output``."""
    num_tokens, num_heads, head_size = query.shape
    nb_total, hkv, block_size, content = kv_cache.shape
    assert hkv == num_kv_heads, (kv_cache.shape, num_kv_heads)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    head_size_v = content - head_size
    out3 = output.view(output.shape[0], num_heads, head_size_v)
    window = _window(sliding_window)
    dyn_causal = isinstance(causal, torch.Tensor)
    width = block_table.shape[1]

    def n_blocks(max_len: int, max_q: int) -> int:
        nb = math.ceil(max_len / block_size)
        if window is not None:
            nb = min(nb, math.ceil((max_q + window - 1) / block_size) + 1)
        return max(1, min(nb, width))

    def start_and_mask(key, positions, sl, c, nb):
        """The first gathered block per request (None: block 0) and the
        attention mask; computed once per step (kept in the plan and shared
        by all layers) unless causality varies per request."""
        share = plan.cache_masks and not dyn_causal
        cached = plan._cache.get(key) if share else None
        if cached is None:
            cached = positions()
            if share:
                plan._cache[key] = cached
        qpos, start = cached
        mkey = key + ("mask",)
        m = plan._cache.get(mkey) if share else None
        if m is None:
            kpos = _key_positions(start, sl.shape[0], nb, block_size, sl.device)
            m = _mask(kpos, qpos, sl, c, window)
            if share:
                plan._cache[mkey] = m
        return start, m

    def gather_with_mask(key, positions, bt, sl, c, nb):
        """K/V of the requests through their block tables, and the mask."""
        start, m = start_and_mask(key, positions, sl, c, nb)
        k, v, _ = _gather_kv(kv_cache, bt, start, nb, head_size)
        return k, v, m

    seq_lens = seq_lens.to(torch.long)  # for the index arithmetic
    if decodes:
        # ---- [num_decodes, H, 1, S] ------------------------------------------ #
        nd = plan.num_decodes
        if plan.decode_reqs is None:
            q = query[:nd]
            bt = block_table[:nd]
            sl = seq_lens[:nd]
            c = causal[:nd] if dyn_causal else causal
        else:
            q = query.index_select(0, plan.decode_tokens)
            bt = block_table.index_select(0, plan.decode_reqs)
            sl = seq_lens.index_select(0, plan.decode_reqs)
            c = causal.index_select(0, plan.decode_reqs) if dyn_causal else causal
        nb = n_blocks(plan.decode_max_seq_len, 1)
        key = ("decode", window, None if dyn_causal else bool(c), nb)

        def decode_positions():
            qpos = (sl - 1)[:, None]
            start = None
            if window is not None:
                start = torch.div(
                    (qpos[:, 0] - window + 1).clamp(min=0),
                    block_size,
                    rounding_mode="floor",
                )
            return qpos, start

        # Requests in groups whose gathered K/V stays under
        # DECODE_GATHER_BYTES: a captured decode graph gathers the longest
        # sequence's blocks for every request of its batch (512 requests x
        # 8192 tokens of SmolLM2 needed 1.5 GiB at once).
        start, m = start_and_mask(key, decode_positions, sl, c, nb)
        row_bytes = nb * block_size * hkv * content * kv_cache.element_size()
        group = max(1, DECODE_GATHER_BYTES // row_bytes)
        parts = []
        for g0 in range(0, nd, group):
            g1 = min(nd, g0 + group)
            k, v, _ = _gather_kv(
                kv_cache,
                bt[g0:g1],
                None if start is None else start[g0:g1],
                nb,
                head_size,
            )
            parts.append(
                _attend(
                    q[g0:g1, None], k, v, m[g0:g1], scale, logits_soft_cap, use_sdpa
                )[:, 0]
            )
        o = parts[0] if len(parts) == 1 else torch.cat(parts)
        if plan.decode_tokens is None:
            out3[:nd] = o
        else:
            out3.index_copy_(0, plan.decode_tokens, o.to(out3.dtype))
        return

    # ---- prefills: padded [num_prefills, H, max_q, S], query-chunked -------- #
    npf = plan.num_prefills
    preqs = plan.prefill_reqs
    tok_req = plan.prefill_token_req
    tok_local = plan.prefill_token_local
    max_q = plan.prefill_max_query_len
    bt = block_table.index_select(0, preqs)
    sl = seq_lens.index_select(0, preqs)
    c = causal.index_select(0, preqs) if dyn_causal else causal
    nb = n_blocks(plan.prefill_max_seq_len, max_q)
    key = ("prefill", window, None if dyn_causal else bool(c), nb)

    def prefill_positions():
        ctx = sl - plan.prefill_query_lens
        qpos = ctx[:, None] + torch.arange(max_q, device=query.device)[None, :]
        start = None
        if window is not None:
            start = torch.div(
                (ctx - window + 1).clamp(min=0), block_size, rounding_mode="floor"
            )
        return qpos, start

    k, v, m = gather_with_mask(key, prefill_positions, bt, sl, c, nb)
    if plan.prefill_tokens is None:
        t0 = plan.prefill_token_start
        qf = query[t0 : t0 + plan.num_prefill_tokens]
    else:
        qf = query.index_select(0, plan.prefill_tokens)
    q_pad = query.new_zeros((npf, max_q, num_heads, head_size))
    q_pad[tok_req, tok_local] = qf
    o_pad = _attend(q_pad, k, v, m, scale, logits_soft_cap, use_sdpa)
    o = o_pad[tok_req, tok_local].to(out3.dtype)
    if plan.prefill_tokens is None:
        t0 = plan.prefill_token_start
        out3[t0 : t0 + plan.num_prefill_tokens] = o
    else:
        out3.index_copy_(0, plan.prefill_tokens, o)


@register_op("paged_attention_decode")
def paged_attention_decode(
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
    plan: PagedAttentionPlan,
    use_sdpa: bool = True,
) -> None:
    """Attention of the plan's decodes (one new token each) over their paged
    K/V, into their rows of ``output``; other rows are left as they are.
    Arguments as :func:`paged_attention`'s; ``plan`` is required."""
    if plan.num_decodes:
        _attend_part(
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
            use_sdpa,
        )


@register_op("paged_attention_prefill")
def paged_attention_prefill(
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
    plan: PagedAttentionPlan,
    use_sdpa: bool = True,
) -> None:
    """Attention of the plan's prefills (several new tokens each: prefill,
    chunked prefill, prefix-cache hits) over their paged K/V, into their rows
    of ``output``; other rows are left as they are."""
    if plan.num_prefills:
        _attend_part(
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
            use_sdpa,
        )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    num_kv_heads: int,
    *,
    causal: bool | torch.Tensor = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    max_query_len: int,
    max_seq_len: int,
    output: torch.Tensor | None = None,
    plan: PagedAttentionPlan | None = None,
    use_sdpa: bool = True,
    decode: Callable[..., None] = paged_attention_decode,
    prefill: Callable[..., None] = paged_attention_prefill,
) -> torch.Tensor:
    """Attention of every request's new query tokens over its paged K/V: the
    decode part, then the prefill part, as the attention backend's
    ``forward`` runs them (``decode`` / ``prefill``: the references unless
    given, e.g. ``get_op("paged_attention_decode")``).

    Args:
        query: ``[num_tokens, num_heads, head_size]``.
        kv_cache: one layer's ``[num_blocks, num_kv_heads, block_size, 2 * D]``
            view (see module doc); the new tokens must already be written.
        block_table: ``[num_reqs, max_blocks]`` block ids.
        seq_lens: ``[num_reqs]`` total tokens (context + new) per request.
        query_start_loc: ``[num_reqs + 1]`` cumulative query lengths.
        scale: softmax scale.
        num_kv_heads: KV heads (``num_heads`` must be a multiple).
        causal: bool, or a per-request bool tensor.
        sliding_window: vLLM window (None / <= 0: off): a query at position p
            attends keys at positions > p - window.
        logits_soft_cap: ``tanh(s / cap) * cap`` on the scaled scores.
        max_query_len, max_seq_len: host-side upper bounds (used when no
            ``plan`` is given).
        output: ``[num_tokens, num_heads, head_size_v]`` or
            ``[num_tokens, num_heads * head_size_v]``; only real query rows
            (``< query_start_loc[-1]``) are written. Allocated when None.
        plan: the step's :class:`PagedAttentionPlan`; built here (one host
            sync) when None.
        use_sdpa: False forces the explicit float32 path.

    Returns:
        ``output``.

    """
    num_tokens, num_heads, head_size = query.shape
    head_size_v = kv_cache.shape[-1] - head_size
    if output is None:
        output = query.new_zeros((num_tokens, num_heads, head_size_v))
    if plan is None:
        plan = make_paged_attention_plan(
            query_start_loc.cpu(),
            None,
            max_seq_len=max(int(max_seq_len), int(max_query_len), 1),
            device=query.device,
        )
    for part, present in ((decode, plan.num_decodes), (prefill, plan.num_prefills)):
        if present:
            part(
                query,
                kv_cache,
                block_table,
                seq_lens,
                scale,
                num_kv_heads,
                causal=causal,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                output=output,
                plan=plan,
                use_sdpa=use_sdpa,
            )
    return output


# --------------------------------------------------------------------------- #
# Encoder (no KV cache) attention
# --------------------------------------------------------------------------- #


@register_op("attention_varlen")
def attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool = False,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    output: torch.Tensor | None = None,
    plan: PagedAttentionPlan | None = None,
    use_sdpa: bool = True,
) -> torch.Tensor:
    """Variable-length self-attention over packed sequences, no KV cache
    (ENCODER_ONLY layers, BERT-style). Sequence ``r`` is
    ``[query_start_loc[r], query_start_loc[r+1])`` of query, key and value.

    query ``[T, Hq, D]``, key ``[T, Hkv, D]``, value ``[T, Hkv, Dv]`` ->
    output ``[T, Hq, Dv]`` (only rows ``< query_start_loc[-1]`` written).
    ``sliding_window`` W is symmetric when non-causal (``|i - j| < W``).
    ``plan`` must come from ``make_paged_attention_plan(..., split_decodes=False)``.
    """
    num_tokens, num_heads, head_size = query.shape
    hkv = key.shape[1]
    dv = value.shape[-1]
    assert num_heads % hkv == 0, (num_heads, hkv)
    if output is None:
        output = query.new_zeros((num_tokens, num_heads, dv))
    out3 = output.view(output.shape[0], num_heads, dv)
    if plan is None:
        qsl_cpu = query_start_loc.cpu()
        lens = qsl_cpu[1:] - qsl_cpu[:-1]
        plan = make_paged_attention_plan(
            qsl_cpu,
            lens,
            max_seq_len=max(1, int(lens.max()) if lens.numel() else 1),
            device=query.device,
            split_decodes=False,
        )
    assert plan.num_decodes == 0, "encoder plan needs split_decodes=False"
    if not plan.num_prefills:
        return output
    npf = plan.num_prefills
    max_len = plan.prefill_max_query_len
    tok_req = plan.prefill_token_req
    tok_local = plan.prefill_token_local
    if plan.prefill_tokens is None:
        t0 = plan.prefill_token_start
        sel = slice(t0, t0 + plan.num_prefill_tokens)
        qf, kf, vf = query[sel], key[sel], value[sel]
    else:
        idx = plan.prefill_tokens
        qf, kf, vf = query[idx], key[idx], value[idx]
    q_pad = query.new_zeros((npf, max_len, num_heads, head_size))
    k_pad = key.new_zeros((npf, max_len, hkv, head_size))
    v_pad = value.new_zeros((npf, max_len, hkv, dv))
    q_pad[tok_req, tok_local] = qf
    k_pad[tok_req, tok_local] = kf
    v_pad[tok_req, tok_local] = vf
    window = _window(sliding_window)
    mkey = ("varlen", window, bool(causal), max_len)
    m = plan._cache.get(mkey)
    if m is None:
        pos = torch.arange(max_len, device=query.device)
        pos2 = pos.expand(npf, max_len)
        m = _mask(pos2, pos2, plan.prefill_query_lens, causal, window)
        plan._cache[mkey] = m
    o_pad = _attend(q_pad, k_pad, v_pad, m, scale, logits_soft_cap, use_sdpa)
    o = o_pad[tok_req, tok_local].to(out3.dtype)
    if plan.prefill_tokens is None:
        out3[sel] = o
    else:
        out3.index_copy_(0, plan.prefill_tokens, o)
    return output
