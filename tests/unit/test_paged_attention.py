"""Numeric tests of vllm_br.ops.paged_attention against a per-request reference.

The reference is written independently here: for each request it takes the
request's contiguous K/V sequence, builds the mask from positions and runs plain
softmax(Q K^T * scale + mask) V in float64.

Tolerances: float32 atol/rtol 1e-5; bfloat16 atol 1.5e-2 (inputs are the same
bf16-rounded values for kernel and reference; the kernel rounds probabilities
and outputs to bf16).

Every test runs twice: on the PyTorch reference ops, and on the cpu backend's
``paged_attention`` (its C++ kernel for the decodes and causal prefills, the
reference for the rest), which must meet the same tolerances.
"""

from __future__ import annotations

import functools
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from vllm_br.device import cpu_kernels
from vllm_br.device.cpu_kernels import paged_attention as cpu_pa
from vllm_br.ops import paged_attention as pa
from vllm_br.ops.paged_attention import (
    attention_varlen,
    make_paged_attention_plan,
    paged_attention,
    reshape_and_cache,
)
from vllm_br.ops.registry import with_fallback

BLOCK_SIZE = 128
# The C++ kernels as the op registry binds them: a declined part runs the
# op's reference.
KERNELS = functools.partial(
    paged_attention,
    decode=with_fallback(cpu_pa.decode, pa.paged_attention_decode),
    prefill=with_fallback(cpu_pa.prefill, pa.paged_attention_prefill),
)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}

# vLLM KVCacheLayout stride orders over logical [L, B, H, N, C].
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def make_layer_cache(num_blocks, hkv, content, dtype, layout="LBNHC", num_layers=2):
    """One layer's logical [B, H, N, C] view of a multi-layer cache allocated in
    ``layout``'s physical order (layer 1 of ``num_layers``), filled with finite
    garbage so that unmasked reads of stale slots would show."""
    order = LAYOUTS[layout]
    logical = (num_layers, num_blocks, hkv, BLOCK_SIZE, content)
    phys = torch.randn([logical[d] for d in order]).to(dtype)
    inv = [order.index(d) for d in range(5)]
    view = phys.permute(inv)
    assert tuple(view.shape) == logical
    return view[num_layers - 1]


@pytest.fixture(autouse=True, params=["reference", "cpu_kernel", "cpu_kernel_no_amx"])
def impl(request, monkeypatch):
    """The reference ops, or the C++ kernel with (where the host has AMX) and
    without its AMX path for bf16 prefills."""
    if request.param.startswith("cpu_kernel"):
        assert cpu_kernels.load_library() is not None, "the C++ kernels must build"
        monkeypatch.setattr(Case, "impl", staticmethod(KERNELS))
        amx = "1" if request.param == "cpu_kernel" else "0"
        monkeypatch.setenv("VLLM_BR_CPU_ATTENTION_AMX", amx)
    return request.param


class Case:
    """A batch: random non-contiguous block tables, per-request K/V sequences
    written through reshape_and_cache (context first, then the new tokens
    with padding slots mixed in)."""

    def __init__(
        self,
        seq_lens,
        query_lens,
        hq=4,
        hkv=2,
        d=64,
        dtype=torch.float32,
        layout="LBNHC",
        seed=0,
        pad_tokens=3,
    ):
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.seq_lens = list(seq_lens)
        self.query_lens = list(query_lens)
        assert all(q <= s for q, s in zip(query_lens, seq_lens, strict=True))
        self.hq, self.hkv, self.d, self.dtype = hq, hkv, d, dtype
        self.scale = 1.0 / math.sqrt(d)
        nreq = len(seq_lens)
        need = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
        num_blocks = sum(need) + 7
        self.kv_cache = make_layer_cache(num_blocks, hkv, 2 * d, dtype, layout)
        width = max(max(need), 1) + 2
        # Block 0 stays unused (vLLM's null block); shuffle the rest.
        perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        bt = torch.randint(0, num_blocks, (nreq, width), generator=g)
        it = iter(perm)
        for r, n in enumerate(need):
            for b in range(n):
                bt[r, b] = next(it)
        self.block_table = bt.to(torch.int32)
        self.k_seq = [torch.randn(s, hkv, d, generator=g).to(dtype) for s in seq_lens]
        self.v_seq = [torch.randn(s, hkv, d, generator=g).to(dtype) for s in seq_lens]

        def slots(r, lo, hi):
            pos = torch.arange(lo, hi)
            return bt[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE

        # Earlier steps: the context tokens (prefix-cache hits / chunked prefill).
        ctx_k, ctx_v, ctx_s = [], [], []
        for r in range(nreq):
            c = seq_lens[r] - query_lens[r]
            ctx_k.append(self.k_seq[r][:c])
            ctx_v.append(self.v_seq[r][:c])
            ctx_s.append(slots(r, 0, c))
        self.ctx_key = torch.cat(ctx_k)
        self.ctx_value = torch.cat(ctx_v)
        self.ctx_slots = torch.cat(ctx_s)
        if self.ctx_slots.numel():
            reshape_and_cache(
                self.ctx_key, self.ctx_value, self.kv_cache, self.ctx_slots
            )
        # This step: new tokens packed by query_start_loc, plus padding.
        new_k = torch.cat(
            [self.k_seq[r][seq_lens[r] - query_lens[r] :] for r in range(nreq)]
        )
        new_v = torch.cat(
            [self.v_seq[r][seq_lens[r] - query_lens[r] :] for r in range(nreq)]
        )
        new_s = torch.cat(
            [slots(r, seq_lens[r] - query_lens[r], seq_lens[r]) for r in range(nreq)]
        )
        self.num_tokens = int(sum(query_lens))
        self.key = torch.cat([new_k, torch.randn(pad_tokens, hkv, d).to(dtype)])
        self.value = torch.cat([new_v, torch.randn(pad_tokens, hkv, d).to(dtype)])
        self.slot_mapping = torch.cat(
            [new_s, torch.full((pad_tokens,), -1, dtype=torch.long)]
        )
        reshape_and_cache(self.key, self.value, self.kv_cache, self.slot_mapping)
        self.query = torch.randn(self.num_tokens + pad_tokens, hq, d, generator=g).to(
            dtype
        )
        self.qsl = torch.tensor([0] + list(query_lens)).cumsum(0).to(torch.int32)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)

    impl = staticmethod(paged_attention)

    def run(self, output=None, plan=None, **kw):
        return self.impl(
            self.query,
            self.kv_cache,
            self.block_table,
            self.seq_lens_t,
            self.qsl,
            self.scale,
            self.hkv,
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens),
            output=output,
            plan=plan,
            **kw,
        )

    def reference(self, causal=True, sliding_window=None, logits_soft_cap=None):
        out = torch.zeros(self.num_tokens, self.hq, self.d, dtype=torch.float64)
        group = self.hq // self.hkv
        for r, (s, ql) in enumerate(zip(self.seq_lens, self.query_lens, strict=True)):
            if ql == 0:
                continue
            t0 = int(self.qsl[r])
            q = self.query[t0 : t0 + ql].double()
            k = self.k_seq[r].double().repeat_interleave(group, dim=1)
            v = self.v_seq[r].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            if logits_soft_cap:
                scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
            qpos = torch.arange(s - ql, s)[:, None]
            kpos = torch.arange(s)[None, :]
            c = bool(causal[r]) if isinstance(causal, torch.Tensor) else causal
            allowed = torch.ones(ql, s, dtype=torch.bool)
            if c:
                allowed &= kpos <= qpos
            if sliding_window:
                allowed &= kpos > qpos - sliding_window
                if not c:
                    allowed &= kpos < qpos + sliding_window
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[t0 : t0 + ql] = torch.einsum(
                "hqk,khd->qhd", torch.softmax(scores, dim=-1), v
            )
        return out


def check(case, out, ref):
    tol = TOL[case.dtype]
    got = out[: case.num_tokens].double()
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


SEQ_LENS = [1, 127, 128, 129, 255, 256, 257, 600]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_only(dtype):
    lens = [2, 127, 128, 129, 255, 257, 600]
    case = Case(lens, lens, hq=9, hkv=3, dtype=dtype)
    check(case, case.run(), case.reference())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_only(dtype):
    case = Case(SEQ_LENS, [1] * len(SEQ_LENS), hq=9, hkv=3, dtype=dtype, seed=1)
    plan = make_paged_attention_plan(case.qsl, case.seq_lens_t)
    assert plan.num_decodes == len(SEQ_LENS) and plan.num_prefills == 0
    check(case, case.run(plan=plan), case.reference())


@pytest.mark.parametrize("impl", ["reference"], indirect=True)
@pytest.mark.parametrize("window", [None, 200])
def test_decodes_in_bounded_groups_equal_one_gather(monkeypatch, window, impl):
    """A decode batch whose gathered K/V would exceed DECODE_GATHER_BYTES is
    attended in groups of requests (a captured decode graph gathers the
    longest sequence's blocks for every request): same result."""
    case = Case(SEQ_LENS, [1] * len(SEQ_LENS), hq=9, hkv=3, seed=4)
    plan = make_paged_attention_plan(case.qsl, case.seq_lens_t)
    whole = case.run(plan=plan, sliding_window=window)
    calls = []
    gather = pa._gather_kv
    monkeypatch.setattr(
        pa, "_gather_kv", lambda *a, **k: calls.append(a[1].shape[0]) or gather(*a, **k)
    )
    monkeypatch.setattr(pa, "DECODE_GATHER_BYTES", 1)  # one request per group
    plan = make_paged_attention_plan(case.qsl, case.seq_lens_t)
    grouped = case.run(plan=plan, sliding_window=window)
    assert calls == [1] * len(SEQ_LENS)
    # Same math on fewer rows: a GEMM over a smaller batch may take another
    # blocking and round the last bit differently (seen on AMD EPYC hosts).
    torch.testing.assert_close(grouped, whole, rtol=1e-6, atol=1e-6)
    check(case, grouped, case.reference(sliding_window=window))


def _mixed(dtype=torch.float32, **kw):
    # decode, prefill, chunked prefill (ctx 300), decode, prefix hit (ctx 256),
    # padding request (0 tokens), single-token prefill, decode at a block edge.
    seq_lens = [129, 255, 357, 600, 300, 0, 1, 256]
    query_lens = [1, 255, 57, 1, 44, 0, 1, 1]
    return Case(seq_lens, query_lens, dtype=dtype, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_chunked_prefill_prefix_hit(dtype):
    case = _mixed(dtype, hq=9, hkv=3, seed=2)
    plan = make_paged_attention_plan(case.qsl, case.seq_lens_t)
    assert plan.num_decodes == 4 and plan.num_prefills == 3
    check(case, case.run(plan=plan), case.reference())


def test_sorted_batch_uses_contiguous_fast_path():
    # decodes first then prefills, as vLLM's batch reorder produces.
    seq_lens = [5, 300, 129, 400, 128]
    query_lens = [1, 1, 1, 400, 70]
    case = Case(seq_lens, query_lens, hq=8, hkv=2, seed=3)
    plan = make_paged_attention_plan(case.qsl, case.seq_lens_t)
    assert plan.decode_reqs is None and plan.prefill_tokens is None
    check(case, case.run(plan=plan), case.reference())


@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 1), (4, 4)])
def test_gqa_mqa_mha(hq, hkv):
    case = _mixed(hq=hq, hkv=hkv, seed=4)
    check(case, case.run(), case.reference())


@pytest.mark.parametrize("window", [1, 100, 128, 300, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(window, dtype):
    case = _mixed(dtype, hq=6, hkv=2, seed=5)
    check(case, case.run(sliding_window=window), case.reference(sliding_window=window))


def test_sliding_window_disabled_values():
    case = _mixed(seed=6)
    ref = case.reference()
    check(case, case.run(sliding_window=None), ref)
    check(case, case.run(sliding_window=-1), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 200])
def test_soft_cap(dtype, window):
    case = _mixed(dtype, hq=4, hkv=2, seed=7)
    # Large query scale so the cap actually bites.
    case.query = case.query * 8
    out = case.run(logits_soft_cap=5.0, sliding_window=window)
    check(case, out, case.reference(logits_soft_cap=5.0, sliding_window=window))


@pytest.mark.parametrize("window", [None, 150])
def test_non_causal_decoder(window):
    case = _mixed(seed=8)
    out = case.run(causal=False, sliding_window=window)
    check(case, out, case.reference(causal=False, sliding_window=window))


def test_per_request_causal_tensor():
    case = _mixed(seed=9)
    causal = torch.tensor([True, False, True, False, False, True, True, False])
    check(case, case.run(causal=causal), case.reference(causal=causal))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_all_kv_cache_layouts(layout):
    case = _mixed(hq=4, hkv=2, layout=layout, seed=10)
    check(case, case.run(), case.reference())


def test_explicit_fp32_path_matches():
    case = _mixed(torch.bfloat16, hq=9, hkv=3, seed=11)
    check(case, case.run(use_sdpa=False), case.reference())


def test_query_chunking(monkeypatch):
    case = _mixed(hq=4, hkv=2, seed=12)
    ref = case.reference(sliding_window=90)
    # Force many query chunks in both the SDPA and the explicit path.
    monkeypatch.setattr(pa, "SCORE_BUDGET_ELEMS", 4 * 4 * 640 * 7)
    check(case, case.run(sliding_window=90), ref)
    check(
        case,
        case.run(sliding_window=90, logits_soft_cap=50.0),
        case.reference(sliding_window=90, logits_soft_cap=50.0),
    )


def test_plan_with_upper_bound_seq_lens_and_reuse_across_layers():
    case = _mixed(hq=4, hkv=2, seed=13)
    upper = case.seq_lens_t + 150  # optimistic host copy, as vLLM may give
    plan = make_paged_attention_plan(case.qsl, upper, max_seq_len=1000)
    ref = case.reference()
    check(case, case.run(plan=plan), ref)
    # Same plan again (next layer): cached masks must give the same result.
    check(case, case.run(plan=plan), ref)
    ref_w = case.reference(sliding_window=64)
    check(case, case.run(plan=plan, sliding_window=64), ref_w)


def test_padding_output_rows_untouched():
    case = _mixed(seed=14)
    total = case.query.shape[0]
    out = torch.full((total, case.hq * case.d), 7.0)  # 2D form
    res = case.run(output=out)
    assert res is out
    assert torch.all(out[case.num_tokens :] == 7.0)
    check(case, out.view(total, case.hq, case.d), case.reference())


def test_reshape_and_cache_skips_negative_slots():
    hkv, d = 2, 8
    cache = make_layer_cache(4, hkv, 2 * d, torch.float32, "LBNHC")
    before = cache.clone()
    key = torch.randn(5, hkv, d)
    value = torch.randn(5, hkv, d)
    slots = torch.tensor([3 * BLOCK_SIZE + 5, -1, 1 * BLOCK_SIZE + 127, -1, 0])
    reshape_and_cache(key, value, cache, slots)
    expect = before.clone()
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, BLOCK_SIZE)
        expect[b, :, o, :d] = key[i]
        expect[b, :, o, d:] = value[i]
    assert torch.equal(cache, expect)
    # Extra (padded) key rows beyond the slot mapping are ignored.
    reshape_and_cache(torch.randn(9, hkv, d), torch.randn(9, hkv, d), cache, slots[:0])
    assert torch.equal(cache, expect)


def test_reshape_and_cache_all_layouts_roundtrip():
    hkv, d = 3, 16
    for layout in LAYOUTS:
        cache = make_layer_cache(3, hkv, 2 * d, torch.bfloat16, layout)
        key = torch.randn(4, hkv, d).bfloat16()
        value = torch.randn(4, hkv, d).bfloat16()
        slots = torch.tensor([0, 130, 383, 255])
        reshape_and_cache(key, value, cache, slots)
        for i, s in enumerate(slots.tolist()):
            b, o = divmod(s, BLOCK_SIZE)
            assert torch.equal(cache[b, :, o, :d], key[i]), layout
            assert torch.equal(cache[b, :, o, d:], value[i]), layout


# ------------------------------ encoder path -------------------------------- #


def _sdpa_per_seq(q, k, v, qsl, scale, causal):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    g = q.shape[1] // k.shape[1]
    for a, b in zip(qsl[:-1].tolist(), qsl[1:].tolist(), strict=True):
        if a == b:
            continue
        qs = q[a:b].double().transpose(0, 1)
        ks = k[a:b].double().repeat_interleave(g, dim=1).transpose(0, 1)
        vs = v[a:b].double().repeat_interleave(g, dim=1).transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_encoder_varlen(dtype, hq, hkv, causal):
    torch.manual_seed(15)
    lens = [7, 1, 0, 130, 64]
    qsl = torch.tensor([0] + lens).cumsum(0)
    t = int(qsl[-1])
    d = 32
    q = torch.randn(t + 2, hq, d).to(dtype)
    k = torch.randn(t + 2, hkv, d).to(dtype)
    v = torch.randn(t + 2, hkv, d).to(dtype)
    out = torch.full((t + 2, hq, d), 3.0, dtype=dtype)
    attention_varlen(q, k, v, qsl, d**-0.5, causal=causal, output=out)
    ref = _sdpa_per_seq(q, k, v, qsl, d**-0.5, causal)
    tol = TOL[dtype]
    torch.testing.assert_close(out[:t].double(), ref[:t], atol=tol, rtol=tol)
    assert torch.all(out[t:] == 3.0)


def test_encoder_varlen_with_plan_and_window():
    torch.manual_seed(16)
    lens = [50, 9, 33]
    qsl = torch.tensor([0] + lens).cumsum(0)
    t = int(qsl[-1])
    q, k, v = (torch.randn(t, 4, 16) for _ in range(3))
    plan = make_paged_attention_plan(
        qsl, torch.tensor(lens), max_seq_len=50, split_decodes=False
    )
    w = 5
    out = attention_varlen(q, k, v, qsl, 0.25, plan=plan, sliding_window=w)
    ref = torch.zeros(t, 4, 16, dtype=torch.float64)
    for a, b in zip(qsl[:-1].tolist(), qsl[1:].tolist(), strict=True):
        i = torch.arange(b - a)
        allowed = (i[:, None] - i[None, :]).abs() < w
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].double()) * 0.25
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        ref[a:b] = torch.einsum("hqk,khd->qhd", p, v[a:b].double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_fp32_model_with_bf16_kv_cache():
    """kv_cache_dtype=bfloat16 under a float32 model: K/V are rounded on write."""
    case = _mixed(torch.bfloat16, hq=4, hkv=2, seed=17)
    ref = case.reference()  # K/V and queries are bf16-rounded values
    case.query = case.query.float()
    out = case.run()
    assert out.dtype == torch.float32
    torch.testing.assert_close(
        out[: case.num_tokens].double(), ref, atol=1e-5, rtol=1e-5
    )
    # The write path casts float32 K/V into the bf16 cache.
    cache = make_layer_cache(2, 2, 16, torch.bfloat16)
    k, v = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    reshape_and_cache(k, v, cache, torch.tensor([130]))
    assert torch.equal(cache[1, :, 2, :8], k[0].bfloat16())


# --------------------------------------------------------------------------- #
# The cpu backend's C++ kernels themselves
# --------------------------------------------------------------------------- #


# These call the kernel directly: with and without its AMX path.
KERNEL_ONLY = pytest.mark.parametrize(
    "impl", ["cpu_kernel", "cpu_kernel_no_amx"], indirect=True
)


def _with_kernel(case, causal=True, **kw):
    """Run the C++ decode and prefill kernels alone on case's batch; returns
    ((decodes done, prefills done), out): a part is done where the batch has
    it and the kernel did not decline it."""
    plan = make_paged_attention_plan(case.qsl, case.seq_lens_t)
    out = torch.zeros_like(case.query)
    done = []
    for kernel, present in (
        (cpu_pa.decode, plan.num_decodes),
        (cpu_pa.prefill, plan.num_prefills),
    ):
        ran = kernel(
            case.query,
            case.kv_cache,
            case.block_table,
            case.seq_lens_t,
            case.scale,
            case.hkv,
            causal=causal,
            sliding_window=kw.get("window"),
            logits_soft_cap=kw.get("soft_cap"),
            output=out,
            plan=plan,
        )
        done.append(bool(present) and ran is not NotImplemented)
    return tuple(done), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 64, 80, 128])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 1), (2, 2)])
@KERNEL_ONLY
def test_cpu_kernel_decodes_match_reference(dtype, d, hq, hkv, impl):
    case = Case(SEQ_LENS, [1] * len(SEQ_LENS), hq=hq, hkv=hkv, d=d, dtype=dtype)
    done, out = _with_kernel(case)
    assert done == (True, False), "the kernel must take this shape"
    check(case, out, case.reference())
    # Padding rows after the real tokens are not written.
    assert out[case.num_tokens :].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (32, 8, 1), (128, 2, 2), (48, 4, 2)])
@pytest.mark.parametrize("window", [None, 1, 20, 200])
@KERNEL_ONLY
def test_cpu_kernel_prefills_match_reference(dtype, d, hq, hkv, window, impl):
    """Decodes, whole prefills (one longer than a 16-token tile, ending on and
    across tile and block edges), a chunked prefill and a prefix hit, in one
    batch; each token attends only its own causal (windowed) keys."""
    case = _mixed(dtype, hq=hq, hkv=hkv, d=d, seed=18)
    done, out = _with_kernel(case, window=window)
    assert done == (True, True)
    check(case, out, case.reference(sliding_window=window))
    assert out[case.num_tokens :].abs().sum() == 0


@KERNEL_ONLY
def test_cpu_kernel_prefill_soft_cap(impl):
    case = _mixed(torch.bfloat16, hq=4, hkv=2, seed=19)
    case.query = case.query * 8
    done, out = _with_kernel(case, soft_cap=5.0, window=100)
    assert done == (True, True)
    check(case, out, case.reference(logits_soft_cap=5.0, sliding_window=100))


@KERNEL_ONLY
def test_cpu_kernel_leaves_non_causal_prefills_to_the_reference(impl):
    case = _mixed(hq=4, hkv=2, seed=20)
    done, out = _with_kernel(case, causal=False)
    assert done == (True, False)
    # Only the decode rows were written.
    qlens = [int(x) for x in case.qsl[1:] - case.qsl[:-1]]
    prefill_rows = [
        t
        for r, q in enumerate(qlens)
        if q > 1
        for t in range(int(case.qsl[r]), int(case.qsl[r]) + q)
    ]
    assert out[prefill_rows].abs().sum() == 0
    # paged_attention then runs those on the reference: the whole batch matches.
    case.impl = staticmethod(KERNELS)
    check(case, case.run(causal=False), case.reference(causal=False))


@KERNEL_ONLY
def test_cpu_kernel_declines_unsupported_head_size(impl):
    case = Case([40, 300], [1, 1], hq=4, hkv=2, d=24)
    done, out = _with_kernel(case)
    assert done == (False, False) and out.abs().sum() == 0
    # paged_attention then falls back to the reference decode.
    case.impl = staticmethod(KERNELS)
    check(case, case.run(), case.reference())


@KERNEL_ONLY
def test_cpu_kernel_clamps_stale_rows(impl):
    """A stale padding row of a graph replay may carry any seq_len and block
    ids; the kernel must stay inside the cache (no crash, finite output)."""
    case = Case([200, 5], [1, 1], hq=4, hkv=2)
    case.seq_lens_t = torch.tensor([10**6, 0], dtype=torch.int32)
    case.block_table[0, :] = torch.tensor(
        [-5, 10**6] + [3] * (case.block_table.shape[1] - 2)
    )
    done, out = _with_kernel(case)
    assert done == (True, False)
    assert torch.isfinite(out[:2]).all()
    assert out[1].abs().sum() == 0  # seq_len 0: zeros, like the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLHNC"])
@KERNEL_ONLY
def test_cpu_kernel_cache_write_equals_reference(dtype, layout, impl):
    hkv, d = 3, 64
    cache = make_layer_cache(4, hkv, 2 * d, dtype, layout)
    expect = cache.clone()
    # Strided key/value (views of a fused qkv, as the model hands them) and
    # padding rows and slots.
    qkv = torch.randn(7, 5 * hkv * d).to(dtype)
    key = qkv[:, : hkv * d].view(7, hkv, d)
    value = qkv[:, 2 * hkv * d : 3 * hkv * d].view(7, hkv, d)
    b = BLOCK_SIZE
    slots = torch.tensor([3 * b + 5, -1, b + 127, 2 * b, 2 * b + 1, -1])
    reshape_and_cache(key, value, expect, slots)
    cpu_pa.reshape_and_cache(key, value, cache, slots)
    # The reference sends padding rows to vLLM's null block (block 0, never a
    # request's); the kernel skips them. Every other block is the same.
    assert torch.equal(cache[1:], expect[1:])
    # A float32 key into a bf16 cache takes the reference (it rounds on write).
    if dtype == torch.bfloat16:
        k32, v32 = torch.randn(1, hkv, d), torch.randn(1, hkv, d)
        slots = torch.tensor([130])
        assert cpu_pa.reshape_and_cache(k32, v32, cache, slots) is NotImplemented
        reshape_and_cache(k32, v32, cache, slots)
        assert torch.equal(cache[1, :, 2, :d], k32[0].bfloat16())


@KERNEL_ONLY
def test_cpu_kernels_can_be_switched_off(monkeypatch, impl):
    monkeypatch.setenv("VLLM_BR_CPU_KERNELS", "0")
    cpu_kernels.load_library.cache_clear()
    try:
        # Only the GEMMs on float32 copies (no C++) stay bound.
        assert set(cpu_kernels.fused_kernels()) == {"linear", "compute_logits"}
    finally:
        monkeypatch.delenv("VLLM_BR_CPU_KERNELS")
        cpu_kernels.load_library.cache_clear()
    kernels = cpu_kernels.fused_kernels()
    assert kernels["paged_attention_decode"] is cpu_pa.decode
    assert kernels["paged_attention_prefill"] is cpu_pa.prefill
    assert kernels["reshape_and_cache"] is cpu_pa.reshape_and_cache


@pytest.mark.parametrize("impl", ["reference"], indirect=True)
@pytest.mark.parametrize("d", [64, 128])
def test_cpu_kernel_amx_path_takes_bf16_prefills_only(d, monkeypatch):
    """Where the host has AMX, bf16 prefill tiles take the AMX path (its
    bf16-rounded weights give different low bits from the float32 path, both
    within tolerance of the reference) and decodes never do (bit-identical).
    Without AMX (or under ONEDNN_MAX_CPU_ISA below AMX) the kernel is built
    without it and VLLM_BR_CPU_ATTENTION_AMX changes nothing."""
    from vllm_br.device import cpu_isa

    lib = cpu_kernels.load_library()
    has_amx = bool(lib.vllm_br_attention_has_amx())
    assert has_amx == cpu_isa.host_isa().amx_bf16
    case = _mixed(torch.bfloat16, hq=8, hkv=2, d=d, seed=5)
    outs = {}
    for use_amx in (True, False):
        monkeypatch.setenv("VLLM_BR_CPU_ATTENTION_AMX", str(int(use_amx)))
        done, outs[use_amx] = _with_kernel(case)
        assert done == (True, True)
        check(case, outs[use_amx], case.reference())
    plan = make_paged_attention_plan(case.qsl, case.seq_lens_t)
    rows = torch.zeros(case.num_tokens, dtype=torch.bool)
    toks = plan.decode_tokens
    rows[torch.arange(plan.num_decodes) if toks is None else toks.long()] = True
    amx, plain = outs[True][: case.num_tokens], outs[False][: case.num_tokens]
    assert torch.equal(amx[rows], plain[rows])
    assert torch.equal(amx[~rows], plain[~rows]) is not has_amx


@KERNEL_ONLY
def test_ctypes_args_match_the_cpp_struct(impl):
    """AttentionArgs and the C++ Args agree in size and in every field's
    offset, in declaration order (a field added on one side only, or moved,
    fails here rather than corrupting a call)."""
    import ctypes

    fields = cpu_pa.AttentionArgs._fields_
    out = (ctypes.c_int64 * (len(fields) + 8))()
    lib = cpu_kernels.load_library()
    count = lib.vllm_br_attention_args_layout(out, len(out))
    assert count == len(fields), "the C++ Args has a different number of fields"
    assert out[0] == ctypes.sizeof(cpu_pa.AttentionArgs)
    for i, (name, _) in enumerate(fields):
        assert out[1 + i] == getattr(cpu_pa.AttentionArgs, name).offset, name


def test_padding_rows_write_zeros_into_the_null_block():
    """Padding slots (-1) go to vLLM's null block without a host sync (graph
    capture), and as zeros: their rows come from unwritten inputs (NaN on a
    card), and attention reads the null block, masked, where a block table is
    padded, so a NaN there would poison every such sequence."""
    hkv, d = 2, 8
    cache = make_layer_cache(3, hkv, 2 * d, torch.float32)
    cache.zero_()
    key = torch.full((3, hkv, d), float("nan"))
    value = torch.full((3, hkv, d), float("inf"))
    key[1], value[1] = 1.0, 2.0
    reshape_and_cache(key, value, cache, torch.tensor([-1, BLOCK_SIZE + 3, -1]))
    assert torch.isfinite(cache).all()
    assert torch.count_nonzero(cache[0]) == 0  # the null block: zeros only
    live = cache[1].transpose(0, 1)[3]  # block 1, offset 3: [hkv, 2d]
    assert torch.equal(live, torch.cat((key[1], value[1]), -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stale_nan_in_unwritten_slots_is_never_read(dtype, monkeypatch):
    """Slots nothing wrote hold whatever the device memory held before
    (vLLM zeroes new KV blocks only for Mamba or mixed-precision caches); a
    NaN there, past a request's length in its last block or in the null
    block, must not reach any output (a zero weight times NaN is NaN)."""
    made = make_layer_cache

    def nan_cache(*args, **kwargs):
        cache = made(*args, **kwargs)
        return cache.fill_(float("nan"))

    monkeypatch.setattr(sys.modules[__name__], "make_layer_cache", nan_cache)
    case = _mixed(dtype, hq=9, hkv=3, seed=5)
    assert torch.isnan(case.kv_cache).any()
    out = case.run(plan=make_paged_attention_plan(case.qsl, case.seq_lens_t))
    check(case, out, case.reference())
