"""The ``attention`` group, sparse-MLA part (DeepSeek V3.2): the lightning
indexer's key-cache write and top-k selection, and MLA over each token's
selected positions, through ``get_op`` on the device in float32 and bfloat16.

Shapes: index heads of 128 (DeepSeek V3.2's), 16 of them, top-64; latent
rank 512 plus rope 64, 16 heads. Query tokens: a decode at 300, a chunk of 4
crossing the 128-token block boundary, a 129-token prefill. The selection is
compared exactly against a float64 reference on small-integer inputs, where
every score is exact and ties are common (equal scores: lowest position
first); the attention against float64 softmax over the selected positions
(float32 ``1e-5``, bfloat16 ``1.6e-2``).
"""

from __future__ import annotations

import math

import torch

from vllm_br.attention import SUPA_BLOCK_SIZE as BLOCK
from vllm_br.check.attention import block_table
from vllm_br.check.base import BFLOAT16, FLOAT32, OpCheck, generator, op_measure
from vllm_br.ops.registry import get_op

TOL = {FLOAT32: 1e-5, BFLOAT16: 1.6e-2}
INDEX_HEADS, INDEX_DIM, TOPK = 16, 128, 64
RANK, ROPE, HEADS = 512, 64, 16
# (context already cached, new tokens) per request
_REQUESTS = [(299, 1), (126, 4), (0, 129)]


def _tokens():
    """Per query token: its request and position."""
    req, pos = [], []
    for r, (ctx, new) in enumerate(_REQUESTS):
        req += [r] * new
        pos += list(range(ctx, ctx + new))
    return req, pos


def _paged(g, rows_per_req, dtype, width):
    """A paged cache (garbage in every slot) holding each request's rows."""
    need = [math.ceil(len(rows) / BLOCK) for rows in rows_per_req]
    num_blocks = sum(need) + 3
    cache = (torch.randn(num_blocks, BLOCK, width, generator=g) * 10).to(dtype)
    bt = block_table(g, need, num_blocks)
    for r, rows in enumerate(rows_per_req):
        p = torch.arange(len(rows))
        cache[bt[r, p // BLOCK].long(), p % BLOCK] = rows
    return cache, bt


def _check_indexer_k_cache_write(ctx, dtype, tol):
    m = op_measure(tol, "indexer_k_cache_write")
    g = generator(40)
    cache = (torch.randn(5, BLOCK, INDEX_DIM, generator=g) * 10).to(dtype)
    n = 260
    k = torch.randn(n + 2, INDEX_DIM, generator=g).to(dtype)
    pos = torch.arange(n)
    slots = torch.tensor([2, 4, 1])[pos // BLOCK] * BLOCK + pos % BLOCK
    slots[3::5] = -1
    expected = cache.clone()
    keep = slots >= 0
    s = slots[keep]
    expected[s // BLOCK, s % BLOCK] = k[:n][keep]
    dev = ctx.device
    cache = cache.to(dev)
    get_op("indexer_k_cache_write")(k.to(dev), cache, slots.to(dev))
    # Block 0 is vLLM's null block: padding may land there, nothing reads it.
    m.exact("cache blocks 1.. after the write", cache[1:], expected[1:])
    return m.outcome()


def _check_sparse_attn_indexer(ctx, dtype, tol):
    m = op_measure(tol, "sparse_attn_indexer")
    g = generator(41)
    req, pos = _tokens()
    keys = [
        torch.randint(-2, 3, (c + n, INDEX_DIM), generator=g).to(dtype)
        for c, n in _REQUESTS
    ]
    q = torch.randint(-2, 3, (len(req), INDEX_HEADS, INDEX_DIM), generator=g)
    q = q.to(dtype)
    w = torch.randint(-3, 4, (len(req), INDEX_HEADS), generator=g).float()
    cache, bt = _paged(g, keys, dtype, INDEX_DIM)
    scale = 1.0 / 16  # a power of two: every score exact
    expected = torch.full((len(req), TOPK), -1, dtype=torch.int32)
    for t, (r, p) in enumerate(zip(req, pos, strict=True)):
        s = torch.relu(scale * (q[t].double() @ keys[r][: p + 1].double().T))
        s = (w[t].double()[:, None] * s).sum(0)
        order = sorted(range(p + 1), key=lambda i, s=s: (-float(s[i]), i))[:TOPK]
        expected[t, : len(order)] = torch.tensor(order, dtype=torch.int32)
    dev = ctx.device
    out = get_op("sparse_attn_indexer")(
        q.to(dev),
        w.to(dev),
        cache.to(dev),
        bt.to(dev),
        torch.tensor(req, dtype=torch.int32, device=dev),
        torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=dev),
        scale,
        TOPK,
        max_key_len=max(c + n for c, n in _REQUESTS),
    )
    m.exact("top-k positions (ties: lowest first, -1 padded)", out, expected)
    return m.outcome()


def _check_sparse_mla_attention(ctx, dtype, tol):
    m = op_measure(tol, "sparse_mla_attention")
    g = generator(42)
    req, pos = _tokens()
    latent = [
        torch.randn(c + n, RANK + ROPE, generator=g).to(dtype) for c, n in _REQUESTS
    ]
    cache, bt = _paged(g, latent, dtype, RANK + ROPE)
    q = torch.randn(len(req), HEADS, RANK + ROPE, generator=g).to(dtype)
    idx = torch.full((len(req), TOPK), -1, dtype=torch.int32)
    for t, p in enumerate(pos):
        n = min(TOPK, p + 1) - t % 2  # some rows padded early
        idx[t, :n] = torch.randperm(p + 1, generator=g)[:n].to(torch.int32)
    scale = 1.0 / math.sqrt(128 + ROPE)
    ref = torch.zeros(len(req), HEADS, RANK, dtype=torch.float64)
    for t, r in enumerate(req):
        sel = idx[t][idx[t] >= 0].long()
        kv = latent[r][sel].double()
        p = torch.softmax(scale * (q[t].double() @ kv.T), dim=-1)
        ref[t] = p @ kv[:, :RANK]
    dev = ctx.device
    out = get_op("sparse_mla_attention")(
        q.to(dev),
        cache.to(dev),
        bt.to(dev),
        torch.tensor(req, dtype=torch.int32, device=dev),
        idx.to(dev),
        scale,
        RANK,
    )
    m.close("output", out, ref)
    return m.outcome()


CHECKS: list[OpCheck] = [
    OpCheck(
        "indexer_k_cache_write",
        ("indexer_k_cache_write",),
        _check_indexer_k_cache_write,
        TOL,
    ),
    OpCheck(
        "sparse_attn_indexer",
        ("sparse_attn_indexer",),
        _check_sparse_attn_indexer,
        TOL,
    ),
    OpCheck(
        "sparse_mla_attention",
        ("sparse_mla_attention",),
        _check_sparse_mla_attention,
        TOL,
    ),
]
