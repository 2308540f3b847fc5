"""The ``attention`` group, MLA part (DeepSeek V2/V3): the latent-cache
write and context gather, the absorbed decode over the paged latent, the
ragged prefill attention with its log-sum-exp, and the LSE merge, through
``get_op`` on the device in float32 and bfloat16.

DeepSeek's shapes: latent rank 512, rope 64 (a cache entry is
``[kv_c | k_pe]``, 576 values), 16 heads, prefill heads of 128 + 64 with
values of 128. The latent cache is ``[num_blocks, 128, 576]``, filled with
garbage, shuffled block tables, sequences of 127, 128, 129 and 300 tokens.
References are float64 softmax attention with the natural-log LSE; an empty
row is zeros with an LSE of ``-inf``. Tolerances: float32 ``1e-5``;
bfloat16 ``1.6e-2`` (the ops compute in float32 from bfloat16 inputs and
round their outputs once).
"""

from __future__ import annotations

import math

import torch

from vllm_br.attention import SUPA_BLOCK_SIZE as BLOCK
from vllm_br.check.attention import block_table
from vllm_br.check.base import (
    BFLOAT16,
    FLOAT32,
    OpCheck,
    d64,
    generator,
    op_measure,
)
from vllm_br.ops.mla import make_ragged_attention_plan
from vllm_br.ops.registry import get_op

TOL = {FLOAT32: 1e-5, BFLOAT16: 1.6e-2}
RANK, ROPE, HEADS, NOPE, VDIM = 512, 64, 16, 128, 128
_SEQS = [127, 128, 129, 300]


def _softmax_lse(s: torch.Tensor, mask: torch.Tensor, v: torch.Tensor):
    """float64 masked softmax(s) @ v and the LSE per row; empty rows: 0, -inf."""
    s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None].masked_fill(torch.isinf(lse[..., None]), 0.0))
    p = torch.where(mask, p, torch.zeros_like(p))
    return p @ v, lse


def _latent_cache(g, dtype, seq_lens):
    need = [math.ceil(s / BLOCK) for s in seq_lens]
    num_blocks = sum(need) + 3
    phys = (torch.randn(num_blocks, BLOCK, RANK + ROPE, generator=g) * 10).to(dtype)
    bt = block_table(g, need, num_blocks)
    entries = []
    for r, s in enumerate(seq_lens):
        e = torch.randn(s, RANK + ROPE, generator=g).to(dtype)
        pos = torch.arange(s)
        phys[bt[r, pos // BLOCK].long(), pos % BLOCK] = e
        entries.append(e)
    return phys, bt, entries


def _check_concat_and_cache_mla(ctx, dtype, tol):
    m = op_measure(tol, "concat_and_cache_mla")
    g = generator(30)
    phys = (torch.randn(5, BLOCK, RANK + ROPE, generator=g) * 10).to(dtype)
    n = 260
    kv_c = torch.randn(n + 2, RANK, generator=g).to(dtype)
    k_pe = torch.randn(n + 2, 1, ROPE, generator=g).to(dtype)
    pos = torch.arange(n)
    slots = torch.tensor([2, 4, 1])[pos // BLOCK] * BLOCK + pos % BLOCK
    slots[3::5] = -1
    expected = phys.clone()
    keep = slots >= 0
    s = slots[keep]
    expected[s // BLOCK, s % BLOCK] = torch.cat((kv_c[:n], k_pe[:n, 0]), -1)[keep]
    cache = phys.to(ctx.device)
    dev = ctx.device
    get_op("concat_and_cache_mla")(kv_c.to(dev), k_pe.to(dev), cache, slots.to(dev))
    # Block 0 is vLLM's null block: padding may land there, nothing reads it.
    m.exact("cache blocks 1.. after the write", cache[1:], expected[1:])
    return m.outcome()


def _check_gather_mla_context(ctx, dtype, tol):
    m = op_measure(tol, "gather_mla_context")
    g = generator(31)
    seq_lens = [130, 300]
    phys, bt, entries = _latent_cache(g, dtype, seq_lens)
    # Context chunks: tokens 0..129 of sequence 0, 100..256 of sequence 1.
    starts, lens = [0, 100], [130, 157]
    cu = torch.tensor([0, 130, 287], dtype=torch.int32)
    token_to_seq = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    dev = ctx.device
    out = torch.full((300, RANK + ROPE), 7.0, dtype=dtype, device=dev)
    get_op("gather_mla_context")(
        phys.to(dev),
        bt.to(dev),
        torch.tensor(starts, dtype=torch.int32, device=dev),
        cu.to(dev),
        token_to_seq.to(torch.int32).to(dev),
        out,
    )
    expected = torch.full((300, RANK + ROPE), 7.0, dtype=dtype)
    expected[:130] = entries[0][0:130]
    expected[130:287] = entries[1][100:257]
    m.exact("gathered rows and untouched tail", out, expected)
    return m.outcome()


def _check_mla_decode(ctx, dtype, tol):
    m = op_measure(tol, "mla_decode")
    g = generator(32)
    seq_lens = [*_SEQS, 0]  # the last request is padding
    phys, bt, entries = _latent_cache(g, dtype, _SEQS)
    bt = torch.cat((bt, torch.zeros(1, bt.shape[1], dtype=bt.dtype)))
    b = len(seq_lens)
    q = torch.randn(b, HEADS, RANK + ROPE, generator=g).to(dtype)
    scale = 1.0 / math.sqrt(NOPE + ROPE)
    dev = ctx.device
    args = (
        phys.to(dev),
        bt.to(dev),
        torch.tensor(seq_lens, dtype=torch.int32, device=dev),
    )
    ref_out = torch.zeros(b, HEADS, RANK, dtype=torch.float64)
    ref_lse = torch.full((b, HEADS), -math.inf, dtype=torch.float64)
    for r in range(len(_SEQS)):
        kv = entries[r].double()
        scores = q[r].double() @ kv.T * scale
        mask = torch.ones_like(scores, dtype=torch.bool)
        ref_out[r], ref_lse[r] = _softmax_lse(scores, mask, kv[:, :RANK])
    op = get_op("mla_decode")
    out, lse = op(
        q.to(dev), *args, scale, RANK, max_seq_len=max(_SEQS), return_lse=True
    )
    m.close("output", out, ref_out)
    m.close("lse", lse, ref_lse)
    split = (q[..., :RANK].to(dev), q[..., RANK:].to(dev))
    out2, _ = op(split, *args, scale, RANK, max_seq_len=max(_SEQS))
    m.close("output, query as (nope, rope)", out2, ref_out)
    return m.outcome()


def _ragged_ref(q, k, v, q_lens, k_lens, scale, causal):
    """Per sequence float64 attention, causal bottom-right aligned."""
    outs, lses = [], []
    qa = ka = 0
    for ql, kl in zip(q_lens, k_lens, strict=True):
        qs, ks, vs = q[qa : qa + ql], k[ka : ka + kl], v[ka : ka + kl]
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        mask = torch.ones(ql, kl, dtype=torch.bool)
        if causal:
            mask = torch.arange(kl)[None, :] <= torch.arange(ql)[:, None] + (kl - ql)
        o, lse = _softmax_lse(s, mask[None].expand_as(s), vs.transpose(0, 1))
        outs.append(o.transpose(0, 1))
        lses.append(lse)
        qa, ka = qa + ql, ka + kl
    return torch.cat(outs), torch.cat(lses, dim=1)


def _check_mla_prefill_attention(ctx, dtype, tol):
    m = op_measure(tol, "mla_prefill_attention")
    g = generator(33)
    d = NOPE + ROPE
    scale = 1.0 / math.sqrt(d)
    dev = ctx.device
    for label, q_lens, k_lens, causal in (
        ("new tokens, causal", _SEQS, _SEQS, True),
        ("chunk after context, causal", [2, 129], [130, 257], True),
        ("context chunk, non-causal", [5, 3], [128, 300], False),
    ):
        q = torch.randn(sum(q_lens), HEADS, d, generator=g).to(dtype)
        k = torch.randn(sum(k_lens), HEADS, d, generator=g).to(dtype)
        v = torch.randn(sum(k_lens), HEADS, VDIM, generator=g).to(dtype)
        plan = make_ragged_attention_plan(
            torch.tensor(q_lens), torch.tensor(k_lens), causal=causal, device=dev
        )
        out, lse = get_op("mla_prefill_attention")(
            q.to(dev), k.to(dev), v.to(dev), scale, plan, return_lse=True
        )
        ref_out, ref_lse = _ragged_ref(
            q.double(), k.double(), v.double(), q_lens, k_lens, scale, causal
        )
        m.close(f"{label} output", out, ref_out)
        m.close(f"{label} lse", lse, ref_lse)
    return m.outcome()


def _check_merge_attn_states(ctx, dtype, tol):
    m = op_measure(tol, "merge_attn_states")
    g = generator(34)
    t, n, d = 7, 4, 32
    dev = ctx.device
    p_out = torch.randn(t, n, d, generator=g).to(dtype)
    s_out = torch.randn(t, n, d, generator=g).to(dtype)
    p_lse = torch.randn(n, t, generator=g) * 3
    s_lse = torch.randn(n, t, generator=g) * 3
    p_lse[:, 0] = -math.inf  # prefix empty
    s_lse[:, 1] = -math.inf  # suffix empty
    p_lse[:, 2] = s_lse[:, 2] = -math.inf  # both empty: zeros
    p_lse[:, 3] = math.inf  # some kernels' "empty"
    pl, sl = d64(p_lse), d64(s_lse)
    pl = pl.masked_fill(torch.isposinf(pl), -math.inf)
    mx = torch.maximum(pl, sl)
    empty = torch.isinf(mx)
    mx = mx.masked_fill(empty, 0.0)
    pw, sw = torch.exp(pl - mx), torch.exp(sl - mx)
    total = (pw + sw).masked_fill(empty, 1.0)
    ref = (
        d64(p_out) * (pw / total).T[..., None] + d64(s_out) * (sw / total).T[..., None]
    )
    ref_lse = (torch.log(total) + mx).masked_fill(empty, -math.inf)
    out = torch.full((t, n, d), math.nan, dtype=dtype, device=dev)
    out_lse = torch.full((n, t), math.nan, dtype=torch.float32, device=dev)
    op = get_op("merge_attn_states")
    args = (p_lse.to(dev), s_out.to(dev), s_lse.to(dev))
    op(out, p_out.to(dev), *args, out_lse)
    m.close("output", out, ref)
    m.close("lse", out_lse, ref_lse)
    aliased = p_out.to(dev)
    op(aliased, aliased, *args)
    m.close("output aliasing the prefix", aliased, ref)
    return m.outcome()


CHECKS: list[OpCheck] = [
    OpCheck(
        "concat_and_cache_mla",
        ("concat_and_cache_mla",),
        _check_concat_and_cache_mla,
        TOL,
    ),
    OpCheck(
        "gather_mla_context", ("gather_mla_context",), _check_gather_mla_context, TOL
    ),
    OpCheck("mla_decode", ("mla_decode",), _check_mla_decode, TOL),
    OpCheck(
        "mla_prefill_attention",
        ("mla_prefill_attention",),
        _check_mla_prefill_attention,
        TOL,
    ),
    OpCheck("merge_attn_states", ("merge_attn_states",), _check_merge_attn_states, TOL),
]
