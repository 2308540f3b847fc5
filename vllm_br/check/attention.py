"""The ``attention`` group, paged part: the KV-cache write, paged attention
(decode, prefill, a mixed batch, sliding window with soft cap) and the
encoder's variable-length attention, through ``get_op`` on the device in
float32 and bfloat16.

The cache is the plugin's: block size 128, one layer's physical
``[num_blocks, 128, H_kv, 2 * D]`` (``LBNHC``: K then V of every head of a
token together) handed to the ops as vLLM's logical
``[num_blocks, H_kv, 128, 2 * D]`` view. It is filled with large garbage
first and written here by plain indexing (not by ``reshape_and_cache``,
which has its own check), through shuffled block tables (block 0, vLLM's
null block, unused). Sequences of 127, 128, 129 and 300 tokens cross the
block boundary; heads are grouped (8 query heads on 2 KV heads, size 128).

The reference is float64 softmax attention per request over its unpaged
K/V (causal: a query at position p sees keys 0..p; window W: keys > p - W;
soft cap c: ``tanh(s / c) * c``). Tolerances: float32 ``1e-5``; bfloat16
``1.6e-2`` (the kernel may round the probabilities to bfloat16 for the PV
product, as flash attention does, and rounds its output).
"""

from __future__ import annotations

import math

import torch

from vllm_br.attention import SUPA_BLOCK_SIZE as BLOCK
from vllm_br.check.base import (
    BFLOAT16,
    FLOAT32,
    CheckContext,
    OpCheck,
    generator,
    op_measure,
)
from vllm_br.ops.paged_attention import make_paged_attention_plan
from vllm_br.ops.registry import get_op

TOL = {FLOAT32: 1e-5, BFLOAT16: 1.6e-2}
_GARBAGE = 10.0  # cache contents no request owns: a stray read shows


def block_table(g: torch.Generator, need: list[int], num_blocks: int) -> torch.Tensor:
    """Shuffled blocks 1.. for each request's ``need[r]`` blocks, 0 after."""
    perm = iter((torch.randperm(num_blocks - 1, generator=g) + 1).tolist())
    bt = torch.zeros(len(need), max(need) + 1, dtype=torch.int32)
    for r, n in enumerate(need):
        for b in range(n):
            bt[r, b] = next(perm)
    return bt


def attention_ref(q, k, v, scale, qpos, causal=True, window=None, cap=None):
    """float64 softmax attention of one sequence: q ``[Lq, Hq, D]`` at
    positions ``qpos``, k/v ``[S, Hkv, D]`` at positions 0..S-1."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    kpos = torch.arange(k.shape[0])[None, :]
    qp = qpos[:, None]
    mask = torch.ones(qp.shape[0], kpos.shape[1], dtype=torch.bool)
    if causal:
        mask &= kpos <= qp
    if window is not None:
        mask &= kpos > qp - window
        if not causal:
            mask &= kpos < qp + window
    s = s.masked_fill(~mask, -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


class PagedBatch:
    """One step's batch: request ``r`` has ``seq_lens[r]`` tokens in the
    cache, the last ``query_lens[r]`` of them new (its queries)."""

    def __init__(self, ctx, dtype, seq_lens, query_lens, *, seed, hq=8, hkv=2, d=128):
        g = generator(seed)
        self.seq_lens, self.query_lens = list(seq_lens), list(query_lens)
        self.hkv, self.d = hkv, d
        self.scale = 1.0 / math.sqrt(d)
        need = [math.ceil(s / BLOCK) for s in seq_lens]
        num_blocks = sum(need) + 3
        phys = torch.randn(num_blocks, BLOCK, hkv, 2 * d, generator=g) * _GARBAGE
        phys = phys.to(dtype)
        self.block_table_cpu = block_table(g, need, num_blocks)
        self.k, self.v, queries = [], [], []
        for r, (s, ql) in enumerate(zip(seq_lens, query_lens, strict=True)):
            k = torch.randn(s, hkv, d, generator=g).to(dtype)
            v = torch.randn(s, hkv, d, generator=g).to(dtype)
            pos = torch.arange(s)
            blocks = self.block_table_cpu[r, pos // BLOCK].long()
            phys[blocks, pos % BLOCK] = torch.cat((k, v), dim=-1)
            self.k.append(k)
            self.v.append(v)
            queries.append(torch.randn(ql, hq, d, generator=g).to(dtype))
        dev = ctx.device
        self.kv_cache = phys.to(dev).transpose(1, 2)  # logical [B, H, N, C]
        self.block_table = self.block_table_cpu.to(dev)
        self.query = torch.cat(queries).to(dev)
        self.queries = queries
        qlens = torch.tensor(query_lens)
        self.qsl_cpu = torch.cat((torch.zeros(1, dtype=torch.long), qlens.cumsum(0)))
        self.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        self.seq_lens_dev = self.seq_lens_cpu.to(dev)

    def run(self, window=None, cap=None) -> tuple[torch.Tensor, int, int]:
        """Both ops as the attention backend calls them; NaN where neither
        wrote. Returns (output, decodes, prefills)."""
        dev = self.query.device
        plan = make_paged_attention_plan(
            self.qsl_cpu.to(torch.int32),
            self.seq_lens_cpu,
            max_seq_len=max(self.seq_lens),
            device=dev,
        )
        out = torch.full_like(self.query, math.nan)
        for op, present in (
            ("paged_attention_decode", plan.num_decodes),
            ("paged_attention_prefill", plan.num_prefills),
        ):
            if present:
                get_op(op)(
                    self.query,
                    self.kv_cache,
                    self.block_table,
                    self.seq_lens_dev,
                    self.scale,
                    self.hkv,
                    causal=True,
                    sliding_window=window,
                    logits_soft_cap=cap,
                    output=out,
                    plan=plan,
                )
        return out, plan.num_decodes, plan.num_prefills

    def reference(self, r: int, window=None, cap=None) -> torch.Tensor:
        s, ql = self.seq_lens[r], self.query_lens[r]
        qpos = torch.arange(s - ql, s)
        return attention_ref(
            self.queries[r].double(),
            self.k[r].double(),
            self.v[r].double(),
            self.scale,
            qpos,
            window=window,
            cap=cap,
        )


def _paged_check(seq_lens, query_lens, *, window=None, cap=None, seed=0):
    def run(ctx: CheckContext, dtype: torch.dtype, tol: float):
        m = op_measure(tol, "paged_attention_decode", "paged_attention_prefill")
        batch = PagedBatch(ctx, dtype, seq_lens, query_lens, seed=seed)
        out, decodes, prefills = batch.run(window, cap)
        m.note(f"{decodes} decodes, {prefills} prefills")
        starts = batch.qsl_cpu.tolist()
        for r, (s, ql) in enumerate(zip(seq_lens, query_lens, strict=True)):
            got = out[starts[r] : starts[r + 1]]
            m.close(
                f"request {r} ({s} tokens, {ql} new)",
                got,
                batch.reference(r, window, cap),
            )
        return m.outcome()

    return run


_SEQS = [127, 128, 129, 300]
# Decodes first, then prefills, as vLLM orders a batch for this backend:
# decodes at 129 and 257 tokens, a fresh 127-token prompt, a 300-token
# sequence with a 128-token cached prefix, a 2-token chunk after 255.
_MIXED_SEQS = [129, 257, 127, 300, 257]
_MIXED_QUERIES = [1, 1, 127, 172, 2]


def _check_reshape_and_cache(ctx, dtype, tol):
    m = op_measure(tol, "reshape_and_cache")
    g = generator(20)
    hkv, d, num_blocks = 2, 128, 5
    phys = (torch.randn(num_blocks, BLOCK, hkv, 2 * d, generator=g) * _GARBAGE).to(
        dtype
    )
    n = 260
    key = torch.randn(n + 3, hkv, d, generator=g).to(dtype)  # 3 padding rows
    value = torch.randn(n + 3, hkv, d, generator=g).to(dtype)
    # Tokens 0..259 of a sequence in blocks 3, 1, 4 (crossing two block
    # boundaries), every 7th slot padding (-1: not written to a real block).
    bt = torch.tensor([3, 1, 4])
    pos = torch.arange(n)
    slots = bt[pos // BLOCK] * BLOCK + pos % BLOCK
    slots[::7] = -1
    expected = phys.clone()
    keep = slots >= 0
    s = slots[keep]
    expected[s // BLOCK, s % BLOCK] = torch.cat((key[:n][keep], value[:n][keep]), -1)
    cache = phys.to(ctx.device)
    get_op("reshape_and_cache")(
        key.to(ctx.device),
        value.to(ctx.device),
        cache.transpose(1, 2),
        slots.to(ctx.device),
    )
    # Block 0 is vLLM's null block: padding may land there, nothing reads it.
    m.exact("cache blocks 1.. after the write", cache[1:], expected[1:])
    return m.outcome()


def _check_attention_varlen(ctx, dtype, tol):
    m = op_measure(tol, "attention_varlen")
    g = generator(21)
    lens = [5, 128, 129, 1]
    hq, hkv, d = 4, 2, 64
    t = sum(lens)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    dev = ctx.device
    scale = 1.0 / math.sqrt(d)
    for label, causal, window in (
        ("bidirectional", False, None),
        ("bidirectional window 48", False, 48),
        ("causal", True, None),
    ):
        # The metadata builder's plan for an encoder-only layer.
        plan = make_paged_attention_plan(
            qsl, qsl[1:] - qsl[:-1], device=dev, split_decodes=False
        )
        out = torch.full((t, hq, d), math.nan, dtype=dtype, device=dev)
        get_op("attention_varlen")(
            q.to(dev), k.to(dev), v.to(dev), qsl.to(dev), scale, causal,
            sliding_window=window, output=out, plan=plan,
        )  # fmt: skip
        for r, n in enumerate(lens):
            a, b = int(qsl[r]), int(qsl[r + 1])
            ref = attention_ref(
                q[a:b].double(), k[a:b].double(), v[a:b].double(), scale,
                torch.arange(n), causal=causal, window=window,
            )  # fmt: skip
            m.close(f"{label} sequence {r} ({n} tokens)", out[a:b], ref)
    return m.outcome()


_PAGED = ("paged_attention_decode", "paged_attention_prefill")

CHECKS: list[OpCheck] = [
    OpCheck("reshape_and_cache", ("reshape_and_cache",), _check_reshape_and_cache, TOL),
    OpCheck(
        "paged_attention_decode",
        ("paged_attention_decode",),
        _paged_check(_SEQS, [1] * 4, seed=22),
        TOL,
    ),
    OpCheck(
        "paged_attention_prefill",
        ("paged_attention_prefill",),
        _paged_check(_SEQS, _SEQS, seed=23),
        TOL,
    ),
    OpCheck(
        "paged_attention_mixed",
        _PAGED,
        _paged_check(_MIXED_SEQS, _MIXED_QUERIES, seed=24),
        TOL,
    ),
    OpCheck(
        "paged_attention_window_softcap",
        _PAGED,
        _paged_check(_MIXED_SEQS, _MIXED_QUERIES, window=100, cap=30.0, seed=25),
        TOL,
    ),
    OpCheck("attention_varlen", ("attention_varlen",), _check_attention_varlen, TOL),
]
