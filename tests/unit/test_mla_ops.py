"""Numeric tests of vllm_br.ops.mla (MLA decode, prefill, cache write,
context gather, LSE merge) against plain-PyTorch references written here.

The reference never sees the latent trick: it expands each sequence's latent
``kv_c`` into per-head keys ``[kv_c @ W_UK | k_pe]`` and values ``kv_c @
W_UV`` and runs plain ``softmax(q K^T * scale) V`` per sequence in float64.
The ops are driven as SupaFlashMLABackend drives them: decode absorbs
``W_UK`` into the query and ``W_UV`` into the output around ``mla_decode``
over the paged latent cache; prefill up-projects the new tokens' latent for
causal attention and each context chunk's gathered latent for non-causal
attention, and merges the two by their LSEs.

Sequences cross the 128-token block boundary (1, 127, 128, 129, 300, ...);
block tables are shuffled (block 0, vLLM's null block, unused) and the cache
is filled with garbage first, so reading an unwritten or masked slot shows.

Tolerances: float32 atol/rtol 1e-5 against the float64 reference. bfloat16
atol/rtol 2e-2: inputs and weights are bf16 values for op and reference
alike, the ops compute in float32 and round the outputs (and, in the
absorbed decode, the absorbed query, as the model's bf16 bmm does) to bf16.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_br.ops import registry
from vllm_br.ops.mla import (
    concat_and_cache_mla,
    gather_mla_context,
    make_ragged_attention_plan,
    merge_attn_states,
    mla_decode,
    mla_prefill_attention,
)

BLOCK = 128
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]

# DeepSeek-shaped but small: heads, latent rank, rope, nope and value dims.
N, L, R, P, V = 4, 32, 16, 24, 20


class Latent:
    """Per-sequence latent ``kv_c`` / ``k_pe``, the up-projections and a
    shuffled paged cache holding every sequence's latent."""

    def __init__(self, seq_lens, dtype, seed=0, stale=None):
        g = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.seq_lens = list(seq_lens)
        self.kv_c = [torch.randn(s, L, generator=g).to(dtype) for s in seq_lens]
        self.k_pe = [torch.randn(s, R, generator=g).to(dtype) for s in seq_lens]
        self.w_uk = (torch.randn(L, N, P, generator=g) / math.sqrt(L)).to(dtype)
        self.w_uv = (torch.randn(L, N, V, generator=g) / math.sqrt(L)).to(dtype)
        self.scale = 1.0 / math.sqrt(P + R)
        need = [math.ceil(s / BLOCK) for s in seq_lens]
        num_blocks = sum(need) + 5
        # Garbage everywhere: a kernel reading past a sequence would see it.
        self.cache = (10 * torch.randn(num_blocks, BLOCK, L + R, generator=g)).to(dtype)
        if stale is not None:  # what unwritten device memory may hold
            self.cache.fill_(stale)
        perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        width = max(need) + 2
        bt = torch.randint(1, num_blocks, (len(seq_lens), width), generator=g)
        it = iter(perm)
        for r, n in enumerate(need):
            for b in range(n):
                bt[r, b] = next(it)
        self.block_table = bt.to(torch.int32)
        # Write every token through the op (padding slots mixed in).
        slots, kvs, pes = [], [], []
        for r, s in enumerate(seq_lens):
            pos = torch.arange(s)
            slots.append(bt[r, pos // BLOCK].long() * BLOCK + pos % BLOCK)
            kvs.append(self.kv_c[r])
            pes.append(self.k_pe[r])
        slots.append(torch.full((3,), -1))
        kvs.append(torch.randn(3, L).to(dtype))
        pes.append(torch.randn(3, R).to(dtype))
        concat_and_cache_mla(
            torch.cat(kvs), torch.cat(pes)[:, None], self.cache, torch.cat(slots)
        )

    def keys_values(self, r, lo=0, hi=None):
        """Expanded per-head K ``[S, N, P+R]`` and V ``[S, N, V]`` (float64)."""
        kv_c = self.kv_c[r][lo:hi].double()
        k_nope = torch.einsum("sl,lnp->snp", kv_c, self.w_uk.double())
        k_pe = self.k_pe[r][lo:hi].double()[:, None].expand(-1, N, R)
        v = torch.einsum("sl,lnv->snv", kv_c, self.w_uv.double())
        return torch.cat((k_nope, k_pe), dim=-1), v


def reference_attention(q, k, v, scale, causal_offset=None):
    """softmax(q k^T * scale) v per head in float64; ``causal_offset`` c:
    query i sees keys j <= i + c. q [Lq, N, D], k [S, N, D], v [S, N, Dv]."""
    s = torch.einsum("qnd,snd->nqs", q.double(), k.double()) * scale
    if causal_offset is not None:
        i = torch.arange(q.shape[0])[:, None]
        j = torch.arange(k.shape[0])[None, :]
        s = s.masked_fill(j > i + causal_offset, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("nqs,snv->qnv", p, v.double()), torch.logsumexp(s, dim=-1)


def _close(got, ref, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), ref.double(), atol=tol, rtol=tol)


def test_ops_are_registered():
    for name in (
        "concat_and_cache_mla",
        "gather_mla_context",
        "mla_decode",
        "mla_prefill_attention",
        "merge_attn_states",
    ):
        assert name in registry.registered_ops()


# --------------------------------------------------------------------------- #
# Decode
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", DTYPES)
def test_absorbed_decode_matches_expanded_attention(dtype):
    """The backend's decode (absorb W_UK, mla_decode, apply W_UV) equals
    attention over the expanded K/V of each whole sequence."""
    seq_lens = [1, 127, 128, 129, 300, 5, 256]
    lat = Latent(seq_lens, dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    q_nope = torch.randn(len(seq_lens), N, P, generator=g).to(dtype)
    q_pe = torch.randn(len(seq_lens), N, R, generator=g).to(dtype)
    # Absorbed query, in the model dtype as vLLM's bmm leaves it.
    ql_nope = torch.einsum("bnp,lnp->bnl", q_nope.float(), lat.w_uk.float()).to(dtype)
    latent_out, lse = mla_decode(
        (ql_nope, q_pe),
        lat.cache,
        lat.block_table,
        torch.tensor(seq_lens, dtype=torch.int32),
        lat.scale,
        L,
        max_seq_len=max(seq_lens),
        return_lse=True,
    )
    assert latent_out.shape == (len(seq_lens), N, L) and latent_out.dtype == dtype
    out = torch.einsum("bnl,lnv->bnv", latent_out.double(), lat.w_uv.double())
    for r in range(len(seq_lens)):
        k, v = lat.keys_values(r)
        q = torch.cat((q_nope[r], q_pe[r]), dim=-1)[None]
        ref, ref_lse = reference_attention(q, k, v, lat.scale)
        _close(out[r], ref[0], dtype)
        _close(lse[r], ref_lse[:, 0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_plain_latent_attention(dtype, monkeypatch):
    """mla_decode alone: softmax over [kv_c | k_pe] keys, kv_c values; one
    padding request (seq_len 0) gives zeros; a gather wider than needed
    (graph capture's max_seq_len) changes nothing; request chunking too."""
    seq_lens = [129, 1, 0, 128, 300]
    lat = Latent([max(s, 1) for s in seq_lens], dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(len(seq_lens), N, L + R, generator=g).to(dtype)
    sl = torch.tensor(seq_lens)
    width = lat.block_table.shape[1] * BLOCK
    out, _ = mla_decode(q, lat.cache, lat.block_table, sl, 0.1, L, max_seq_len=300)
    wide, _ = mla_decode(q, lat.cache, lat.block_table, sl, 0.1, L, max_seq_len=width)
    monkeypatch.setattr("vllm_br.ops.mla.SCORE_BUDGET_ELEMS", 1)  # one per chunk
    chunked, _ = mla_decode(q, lat.cache, lat.block_table, sl, 0.1, L, max_seq_len=300)
    for r, s in enumerate(seq_lens):
        if s == 0:
            assert torch.equal(out[r], torch.zeros_like(out[r]))
            continue
        keys = torch.cat((lat.kv_c[r], lat.k_pe[r]), dim=-1)[:, None].expand(-1, N, -1)
        ref, _ = reference_attention(q[r][None], keys, keys[..., :L], 0.1)
        _close(out[r], ref[0], dtype)
    torch.testing.assert_close(wide, out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked, out, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- #
# Prefill
# --------------------------------------------------------------------------- #


# New tokens (keys = queries, causal), causal over more keys than queries
# (bottom-right aligned, as flash-attention's varlen), a context chunk
# (other keys, non-causal).
RAGGED = {
    "self": ([1, 7, 129, 300, 128], None, True),
    "causal": ([1, 7, 129, 300, 128], [3, 7, 140, 300, 256], True),
    "context": ([1, 7, 129, 300, 128], [5, 130, 128, 1, 257], False),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(RAGGED))
def test_ragged_prefill_matches_per_sequence_attention(dtype, kind, monkeypatch):
    q_lens, k_lens, causal = RAGGED[kind]
    plan = make_ragged_attention_plan(
        torch.tensor(q_lens),
        None if k_lens is None else torch.tensor(k_lens),
        causal=causal,
    )
    k_lens = q_lens if k_lens is None else k_lens
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(q_lens), N, P + R, generator=g).to(dtype)
    k = torch.randn(sum(k_lens), N, P + R, generator=g).to(dtype)
    v = torch.randn(sum(k_lens), N, V, generator=g).to(dtype)
    out, lse = mla_prefill_attention(q, k, v, 0.15, plan, return_lse=True)
    assert out.shape == (sum(q_lens), N, V) and out.dtype == dtype
    assert lse.shape == (N, sum(q_lens)) and lse.dtype == torch.float32
    # Query-row chunking and a caller-provided output give the same result.
    monkeypatch.setattr("vllm_br.ops.mla.SCORE_BUDGET_ELEMS", 100_000)
    into = torch.full_like(out, float("nan"))
    assert mla_prefill_attention(q, k, v, 0.15, plan, out=into) is into
    same = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding step
    torch.testing.assert_close(into, out, atol=same, rtol=same)
    qo = ko = 0
    for ql, kl in zip(q_lens, k_lens, strict=True):
        ref, ref_lse = reference_attention(
            q[qo : qo + ql], k[ko : ko + kl], v[ko : ko + kl], 0.15,
            causal_offset=kl - ql if causal else None,
        )  # fmt: skip
        _close(out[qo : qo + ql], ref, dtype)
        _close(lse[:, qo : qo + ql], ref_lse, dtype)
        qo, ko = qo + ql, ko + kl


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_cached_context_matches_full_causal_attention(dtype):
    """Chunked prefill / prefix hit, as the backend runs it: the new tokens
    attend each other causally, the cached context (gathered from the paged
    latent cache in two workspace chunks, the second continuing a split
    request) non-causally, and the merged result equals causal attention
    over the whole expanded sequence."""
    seq_lens = [300, 129, 200, 40]
    q_lens = [45, 1, 72, 40]  # request 3: no context (a fresh prefill)
    ctx = [s - q for s, q in zip(seq_lens, q_lens, strict=True)]
    lat = Latent(seq_lens, dtype, seed=6)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(sum(q_lens), N, P + R, generator=g).to(dtype)
    qsl = [0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()]

    def up(kv_c, k_pe):
        k_nope = torch.einsum("sl,lnp->snp", kv_c.float(), lat.w_uk.float())
        v = torch.einsum("sl,lnv->snv", kv_c.float(), lat.w_uv.float())
        k = torch.cat((k_nope, k_pe.float()[:, None].expand(-1, N, R)), dim=-1)
        return k.to(dtype), v.to(dtype)

    # New tokens: their latent comes from the model, not the cache.
    new_kv = torch.cat([lat.kv_c[r][ctx[r] :] for r in range(4)])
    new_pe = torch.cat([lat.k_pe[r][ctx[r] :] for r in range(4)])
    k_new, v_new = up(new_kv, new_pe)
    plan = make_ragged_attention_plan(torch.tensor(q_lens), causal=True)
    suffix, suffix_lse = mla_prefill_attention(
        q, k_new, v_new, lat.scale, plan, return_lse=True
    )

    # Context in two chunks (as vLLM plans them for a 256-row workspace):
    # request 0 rows [0, 128); then request 0 rows [128, 255), requests 1, 2.
    chunks = [
        (slice(0, 1), [0], [128]),
        (slice(0, 3), [128, 0, 0], [ctx[0] - 128, ctx[1], ctx[2]]),
    ]
    prefix = torch.zeros(sum(q_lens), N, V, dtype=torch.float32)
    prefix_lse = torch.full((N, sum(q_lens)), float("-inf"))
    workspace = torch.empty(512, L + R, dtype=dtype)
    for reqs, starts, lens in chunks:
        cu = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()])
        tok_seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        toks = int(cu[-1])
        gather_mla_context(
            lat.cache, lat.block_table[reqs], torch.tensor(starts), cu, tok_seq,
            workspace,
        )  # fmt: skip
        k_ctx, v_ctx = up(workspace[:toks, :L], workspace[:toks, L:])
        t0, t1 = qsl[reqs.start], qsl[reqs.stop]
        cplan = make_ragged_attention_plan(
            torch.tensor(q_lens[reqs]), torch.tensor(lens), causal=False
        )
        o, o_lse = mla_prefill_attention(
            q[t0:t1], k_ctx, v_ctx, lat.scale, cplan, return_lse=True
        )
        merge_attn_states(
            prefix[t0:t1], prefix[t0:t1], prefix_lse[:, t0:t1], o, o_lse,
            output_lse=prefix_lse[:, t0:t1],
        )  # fmt: skip
    out = torch.empty(sum(q_lens), N, V, dtype=dtype)
    merge_attn_states(out, prefix, prefix_lse, suffix, suffix_lse)

    for r in range(4):
        k, v = lat.keys_values(r)
        ref, _ = reference_attention(
            q[qsl[r] : qsl[r + 1]], k, v, lat.scale, causal_offset=ctx[r]
        )
        _close(out[qsl[r] : qsl[r + 1]], ref, dtype)


# --------------------------------------------------------------------------- #
# Cache write, gather, merge
# --------------------------------------------------------------------------- #


def test_cache_write_roundtrip_and_padding_slots_go_to_the_null_block():
    lat = Latent([129, 3], torch.float32, seed=8)
    before = lat.cache.clone()
    out = torch.empty(132, L + R)
    cu = torch.tensor([0, 129, 132])
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor([129, 3]))
    gather_mla_context(lat.cache, lat.block_table, torch.zeros(2), cu, seq, out)
    expect = torch.cat([torch.cat((lat.kv_c[r], lat.k_pe[r]), -1) for r in range(2)])
    assert torch.equal(out, expect)
    # -1 slots (padding) land in vLLM's null block 0, never a request's, with
    # no host sync (graph capture); every other block is untouched.
    assert 0 not in lat.block_table.flatten().tolist()
    concat_and_cache_mla(
        torch.ones(2, L), torch.ones(2, R), lat.cache, torch.tensor([-1, -1])
    )
    assert torch.equal(lat.cache[1:], before[1:])
    # ...as zeros (their rows come from unwritten inputs: NaN on a card).
    concat_and_cache_mla(
        torch.full((1, L), float("nan")), torch.ones(1, R), lat.cache,
        torch.tensor([-1]),
    )  # fmt: skip
    assert torch.count_nonzero(lat.cache[0, 0]) == 0


def test_merge_attn_states_weights_by_lse_and_handles_empty_parts():
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(5, N, V, generator=g), torch.randn(5, N, V, generator=g)
    la, lb = torch.randn(N, 5, generator=g), torch.randn(N, 5, generator=g)
    la[:, 3] = float("-inf")  # token 3: only the suffix
    la[:, 4] = lb[:, 4] = float("-inf")  # token 4: nothing at all
    out, out_lse = torch.empty(5, N, V), torch.empty(N, 5)
    merge_attn_states(out, a, la, b, lb, output_lse=out_lse)
    wa = torch.exp(la[:, :3]) / (torch.exp(la[:, :3]) + torch.exp(lb[:, :3]))
    ref = a[:3] * wa.T[..., None] + b[:3] * (1 - wa.T[..., None])
    torch.testing.assert_close(out[:3], ref)
    torch.testing.assert_close(out[3], b[3])
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    torch.testing.assert_close(out_lse[:, :3], torch.logaddexp(la[:, :3], lb[:, :3]))
    assert torch.isneginf(out_lse[:, 4]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_ignores_stale_nan_in_unwritten_slots(dtype):
    """Unwritten cache slots may hold NaN (device memory is not zeroed for
    attention-only models); mla_decode's output must not depend on them."""
    seq_lens = [129, 1, 128, 300]
    clean = Latent(seq_lens, dtype, seed=3)
    stale = Latent(seq_lens, dtype, seed=3, stale=float("nan"))
    assert torch.isnan(stale.cache).any()
    g = torch.Generator().manual_seed(4)
    q = torch.randn(len(seq_lens), N, L + R, generator=g).to(dtype)
    sl = torch.tensor(seq_lens)
    want, _ = mla_decode(q, clean.cache, clean.block_table, sl, 0.1, L, max_seq_len=300)
    got, _ = mla_decode(q, stale.cache, stale.block_table, sl, 0.1, L, max_seq_len=300)
    assert torch.equal(got, want)
