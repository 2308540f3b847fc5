"""Numeric tests of vllm_br.ops.sparse_mla (DeepSeek V3.2's lightning indexer
and sparse MLA) against plain-PyTorch references written here, one query
token at a time.

Batches mix a single-token prompt, a decode at position 300, a chunk that
crosses the 128-token block boundary (context 126, 4 new tokens) and a
129-token prefill; block tables are shuffled (block 0, vLLM's null block,
unused) and the caches are filled with NaN first, so reading an unwritten
slot shows.

Indexer: the reference scores each visible key in float64 as
``sum_h w_h * relu(scale * q_h . k)`` and orders positions by (score
descending, position ascending). With small-integer inputs (and a power-of-two
scale) every score is exact in float32, float64 and, for the inputs,
bfloat16, so the selected positions must be identical, ties included (the
inputs make many: every position whose heads are all clipped scores 0). With
random normal inputs, the scores of the selected positions must equal the
reference's top-k scores (float32 1e-5, bfloat16 2e-2 relative).

Sparse MLA: the reference attends each token's selected positions (``-1``
skipped) in float64 with keys ``[kv_c | k_pe]`` and values ``kv_c``.
Tolerances: float32 1e-5, bfloat16 2e-2 (inputs are bf16 values for op and
reference alike; the op computes in float32 and rounds once).
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_br.ops.mla import mla_decode
from vllm_br.ops.sparse_mla import (
    indexer_k_cache_write,
    sparse_attn_indexer,
    sparse_mla_attention,
)

BLOCK = 128
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Requests as (context tokens already cached, new tokens this step).
REQUESTS = [(0, 1), (300, 1), (126, 4), (0, 129)]
H, D = 4, 32  # index heads, index head dim
N, L, R = 4, 32, 16  # MLA heads, latent rank, rope dim


class Batch:
    """Token bookkeeping of REQUESTS and a shuffled block table."""

    def __init__(self, requests=REQUESTS, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.requests = requests
        self.seq_lens = [c + n for c, n in requests]
        blocks = [math.ceil(s / BLOCK) for s in self.seq_lens]
        width = max(blocks)
        ids = (torch.randperm(sum(blocks) + 3, generator=g) + 1).tolist()
        self.num_blocks = sum(blocks) + 4
        self.block_table = torch.zeros(len(requests), width, dtype=torch.int32)
        for r, b in enumerate(blocks):
            self.block_table[r, :b] = torch.tensor(ids[:b], dtype=torch.int32)
            ids = ids[b:]
        # Query tokens: their request and position.
        self.token_req, self.token_pos = [], []
        for r, (ctx, new) in enumerate(requests):
            for j in range(new):
                self.token_req.append(r)
                self.token_pos.append(ctx + j)
        self.num_tokens = len(self.token_req)

    def slot(self, r, pos):
        return int(self.block_table[r, pos // BLOCK]) * BLOCK + pos % BLOCK

    def all_slots(self):
        return torch.tensor(
            [self.slot(r, p) for r, s in enumerate(self.seq_lens) for p in range(s)]
        )

    def key_lens(self):
        return torch.tensor([p + 1 for p in self.token_pos], dtype=torch.int32)

    def token_to_req(self):
        return torch.tensor(self.token_req, dtype=torch.int32)


def _index_cache(batch, keys, dtype):
    cache = torch.full((batch.num_blocks, BLOCK, D), float("nan"), dtype=dtype)
    flat = torch.cat(keys)
    indexer_k_cache_write(flat, cache, batch.all_slots())
    return cache


def _reference_topk(batch, q, w, keys, scale, topk):
    out = torch.full((batch.num_tokens, topk), -1, dtype=torch.int32)
    scores = []
    for t, (r, p) in enumerate(zip(batch.token_req, batch.token_pos, strict=True)):
        k = keys[r][: p + 1].double()
        s = torch.relu(scale * (q[t].double() @ k.T))  # [H, p+1]
        s = (w[t].double()[:, None] * s).sum(0)
        order = sorted(range(p + 1), key=lambda i, s=s: (-float(s[i]), i))[:topk]
        out[t, : len(order)] = torch.tensor(order, dtype=torch.int32)
        scores.append(s)
    return out, scores


def _run_indexer(batch, q, w, cache, scale, topk, out=None):
    return sparse_attn_indexer(
        q,
        w,
        cache,
        batch.block_table,
        batch.token_to_req(),
        batch.key_lens(),
        scale,
        topk,
        max_key_len=max(batch.seq_lens),
        out=out,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("topk", [1, 16, 130, 512])
def test_indexer_topk_exact_on_integer_scores_with_ties(dtype, topk):
    g = torch.Generator().manual_seed(1)
    batch = Batch()
    keys = [torch.randint(-2, 3, (s, D), generator=g).to(dtype) for s in batch.seq_lens]
    q = torch.randint(-2, 3, (batch.num_tokens, H, D), generator=g).to(dtype)
    w = torch.randint(-3, 4, (batch.num_tokens, H), generator=g).float()
    cache = _index_cache(batch, keys, dtype)
    scale = 0.25
    got = _run_indexer(batch, q, w, cache, scale, topk)
    want, scores = _reference_topk(batch, q, w, keys, scale, topk)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    full = [t for t in range(batch.num_tokens) if want[t, topk - 1] >= 0]
    if topk > max(batch.seq_lens):
        # Every row selects all it sees.
        assert not full
        assert (got >= 0).sum(1).tolist() == [p + 1 for p in batch.token_pos]
    elif topk > 1:
        # The data has ties at the selection boundary (else this tests
        # nothing about them).
        assert any(
            int((scores[t] == scores[t][int(want[t, topk - 1])]).sum()) > 1
            for t in full
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_topk_scores_match_reference(dtype):
    g = torch.Generator().manual_seed(2)
    batch = Batch()
    topk = 64
    keys = [torch.randn(s, D, generator=g).to(dtype) for s in batch.seq_lens]
    q = torch.randn(batch.num_tokens, H, D, generator=g).to(dtype)
    w = torch.randn(batch.num_tokens, H, generator=g)
    cache = _index_cache(batch, keys, dtype)
    scale = D**-0.5
    got = _run_indexer(batch, q, w, cache, scale, topk)
    want, scores = _reference_topk(batch, q, w, keys, scale, topk)
    assert torch.equal(got < 0, want < 0)  # the same count per token
    for t, s in enumerate(scores):
        n = int((want[t] >= 0).sum())
        picked = s[got[t, :n].long()]
        assert len(set(got[t, :n].tolist())) == n
        torch.testing.assert_close(
            picked, s[want[t, :n].long()], rtol=TOL[dtype], atol=TOL[dtype]
        )
    # Sparsity: the long rows select topk of many more positions.
    assert (want[:, -1] >= 0).sum() > 60


def test_indexer_writes_only_its_columns_and_pads_short_rows():
    batch = Batch([(0, 3), (10, 1)])
    g = torch.Generator().manual_seed(3)
    keys = [torch.randn(s, D, generator=g) for s in batch.seq_lens]
    q = torch.randn(batch.num_tokens, H, D, generator=g)
    w = torch.rand(batch.num_tokens, H, generator=g)
    cache = _index_cache(batch, keys, torch.float32)
    buffer = torch.full((8, 20), 7, dtype=torch.int32)
    _run_indexer(batch, q, w, cache, 1.0, 8, out=buffer)
    assert (buffer[:, 8:] == 7).all() and (buffer[batch.num_tokens :] == 7).all()
    rows = buffer[: batch.num_tokens, :8]
    # Token j of the 3-token prompt sees j + 1 positions; the decode sees 11.
    assert [int((row >= 0).sum()) for row in rows] == [1, 2, 3, 8]
    assert sorted(rows[2, :3].tolist()) == [0, 1, 2]


def test_indexer_key_cache_write_skips_padding():
    cache = torch.zeros(3, BLOCK, D)
    k = torch.arange(4 * D, dtype=torch.float32).view(4, D) + 1
    indexer_k_cache_write(k, cache, torch.tensor([BLOCK + 5, -1, 2 * BLOCK]))
    assert torch.equal(cache[1, 5], k[0]) and torch.equal(cache[2, 0], k[2])
    # The padding row went to the null block, zeroed; row 3 (beyond the
    # slot mapping) was not written.
    assert cache[0].abs().sum() == 0 and int((cache != 0).any(-1).sum()) == 2


def _latent(batch, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    latent = [torch.randn(s, L + R, generator=g).to(dtype) for s in batch.seq_lens]
    cache = torch.full((batch.num_blocks, BLOCK, L + R), float("nan"), dtype=dtype)
    cache.view(-1, L + R)[batch.all_slots()] = torch.cat(latent)
    return latent, cache


def _random_selection(batch, topk, g):
    idx = torch.full((batch.num_tokens, topk), -1, dtype=torch.int32)
    for t, p in enumerate(batch.token_pos):
        n = min(topk, p + 1) - (t % 3 == 1)  # some rows shorter than they could be
        picked = torch.randperm(p + 1, generator=g)[: max(n, 0)]
        idx[t, : len(picked)] = picked.to(torch.int32)
        # Padding between valid entries is skipped as well.
        if len(picked) > 2 and t % 2:
            idx[t, 1] = -1
    return idx


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_mla_attention_matches_reference(dtype):
    g = torch.Generator().manual_seed(4)
    batch = Batch()
    topk = 48
    latent, cache = _latent(batch, dtype, 5)
    q = torch.randn(batch.num_tokens, N, L + R, generator=g).to(dtype)
    idx = _random_selection(batch, topk, g)
    idx[0] = -1  # a token with nothing selected gets zeros
    scale = (L + R) ** -0.5
    split = (q[..., :L], q[..., L:])  # the layer passes (ql_nope, q_pe)
    got = sparse_mla_attention(
        split, cache, batch.block_table, batch.token_to_req(), idx, scale, L
    )
    assert got.dtype == dtype and got.shape == (batch.num_tokens, N, L)
    want = torch.zeros(batch.num_tokens, N, L, dtype=torch.float64)
    for t, r in enumerate(batch.token_req):
        sel = idx[t][idx[t] >= 0].long()
        if len(sel) == 0:
            continue
        kv = latent[r][sel].double()
        p = torch.softmax(scale * (q[t].double() @ kv.T), dim=-1)
        want[t] = p @ kv[:, :L]
    torch.testing.assert_close(
        got.double(), want, rtol=TOL[dtype], atol=TOL[dtype], equal_nan=False
    )
    assert got[0].abs().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_mla_over_every_position_is_dense_mla_decode(dtype):
    # Decodes whose top-k holds every cached position: the dense decode op.
    batch = Batch([(0, 1), (140, 1), (299, 1)])
    latent, cache = _latent(batch, dtype, 6)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(batch.num_tokens, N, L + R, generator=g).to(dtype)
    topk = 320
    idx = torch.full((batch.num_tokens, topk), -1, dtype=torch.int32)
    for t, p in enumerate(batch.token_pos):
        idx[t, : p + 1] = torch.randperm(p + 1, generator=g).to(torch.int32)
    scale = 0.1
    sparse = sparse_mla_attention(
        q, cache, batch.block_table, batch.token_to_req(), idx, scale, L
    )
    dense, _ = mla_decode(
        q,
        cache,
        batch.block_table,
        torch.tensor(batch.seq_lens),
        scale,
        L,
        max_seq_len=max(batch.seq_lens),
    )
    torch.testing.assert_close(sparse, dense, rtol=TOL[dtype], atol=TOL[dtype])
