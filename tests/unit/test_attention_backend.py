"""Unit tests of the SUPA_FLASH_ATTN backend: registration, declared
capabilities, and builder + impl end to end on a synthetic
CommonAttentionMetadata against the kernel and the float64 reference."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("vllm")

from test_paged_attention import TOL, Case, make_layer_cache  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import (  # noqa: E402
    AttentionCGSupport,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.utils import (  # noqa: E402
    get_supported_kv_cache_layouts,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheTensor,
    create_kv_cache_views,
)

from vllm_br.attention import (  # noqa: E402
    SUPA_FLASH_ATTN,
    SUPA_FLASH_ATTN_PATH,
    register_attention_backends,
)
from vllm_br.attention.backend import (  # noqa: E402
    SUPAFlashAttentionBackend,
    SUPAFlashAttentionImpl,
    SUPAFlashAttentionMetadata,
    SUPAFlashAttentionMetadataBuilder,
)
from vllm_br.ops.paged_attention import (  # noqa: E402
    attention_varlen,
    paged_attention,
    reshape_and_cache,
)
from vllm_br.ops.registry import get_op


class _Layer:
    """Stand-in for vLLM's Attention layer (the impl reads nothing from it)."""


@pytest.fixture(scope="module")
def vllm_config():
    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        yield cfg


# ------------------------------ registration -------------------------------- #


def test_name_resolves_through_vllm_registry():
    register_attention_backends()
    register_attention_backends()  # idempotent
    assert SUPAFlashAttentionBackend.get_name() == SUPA_FLASH_ATTN
    member = AttentionBackendEnum[SUPAFlashAttentionBackend.get_name()]
    assert member.name == SUPA_FLASH_ATTN
    assert member.get_path() == SUPA_FLASH_ATTN_PATH
    assert member.get_class() is SUPAFlashAttentionBackend
    # The config parser path (--attention-backend SUPA_FLASH_ATTN) too.
    assert AttentionBackendEnum["SUPA_FLASH_ATTN"] is member


def test_block_sizes():
    b = SUPAFlashAttentionBackend
    assert b.get_supported_kernel_block_sizes() == [128]
    assert b.supports_block_size(128) and b.supports_block_size(256)
    assert not b.supports_block_size(64) and not b.supports_block_size(16)
    assert b.get_preferred_block_size(16) == 128


def test_dtypes():
    b = SUPAFlashAttentionBackend
    assert b.supports_dtype(torch.bfloat16)
    assert b.supports_dtype(torch.float32)
    assert not b.supports_dtype(torch.float16)
    assert b.supports_kv_cache_dtype("auto")
    assert not b.supports_kv_cache_dtype("fp8")
    assert not b.supports_kv_cache_dtype("float16")


def test_validate_configuration(vllm_config):
    from vllm.platforms.interface import DeviceCapability

    b = SUPAFlashAttentionBackend
    cap = DeviceCapability(0, 0)
    common = dict(
        head_size=64,
        kv_cache_dtype="auto",
        block_size=128,
        use_mla=False,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=cap,
    )
    ok = b.validate_configuration(
        dtype=torch.bfloat16,
        attn_type=AttentionType.DECODER,
        has_sliding_window=True,
        use_non_causal=True,
        **common,
    )
    assert ok == []
    assert (
        b.validate_configuration(
            dtype=torch.float32, attn_type=AttentionType.ENCODER_ONLY, **common
        )
        == []
    )
    bad = b.validate_configuration(
        dtype=torch.float16, attn_type=AttentionType.DECODER, **common
    )
    assert "dtype not supported" in bad
    bad = b.validate_configuration(
        dtype=torch.bfloat16, attn_type=AttentionType.ENCODER_DECODER, **common
    )
    assert any("attention type" in r for r in bad)


def test_layouts_and_features():
    b = SUPAFlashAttentionBackend
    assert b.supported_kv_cache_layouts()[0] is KVCacheLayout.LBNHC
    assert get_supported_kv_cache_layouts([b])[0] is KVCacheLayout.LBNHC
    assert b.forward_includes_kv_cache_update is False
    assert b.supports_sliding_window() and b.supports_non_causal()
    assert not b.is_mla()
    assert (
        SUPAFlashAttentionMetadataBuilder.get_cudagraph_support(None, None)
        is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )


def test_impl_rejects_unsupported():
    with pytest.raises(NotImplementedError):
        SUPAFlashAttentionImpl(4, 64, 0.125, 2, [0.1] * 4, None, "auto")
    with pytest.raises(NotImplementedError):
        SUPAFlashAttentionImpl(4, 64, 0.125, 2, None, None, "fp8")


# ------------------------------ end to end ---------------------------------- #


def _vllm_layer_cache(spec, num_blocks, layout, kernel_block_size=None, num_layers=2):
    """The per-layer tensor vLLM's allocator hands to the backend."""
    page = spec.page_size_bytes
    if layout.is_layer_compact:
        layer_stride, block_stride = page * num_blocks, page
    else:
        layer_stride, block_stride = page, page * num_layers
    size = page * num_blocks * num_layers
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=size,
        layers=[f"l{i}" for i in range(num_layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    views = create_kv_cache_views(
        raw, spec, num_blocks, layout, tensor, kernel_block_size=kernel_block_size
    )
    return views[1]


def _common_metadata(case, num_tokens_padded, block_table=None):
    nreq = len(case.seq_lens)
    return CommonAttentionMetadata(
        query_start_loc=case.qsl,
        query_start_loc_cpu=case.qsl.clone(),
        seq_lens=case.seq_lens_t,
        num_reqs=nreq,
        num_actual_tokens=num_tokens_padded,
        max_query_len=max(case.query_lens),
        max_seq_len=max(case.seq_lens),
        block_table_tensor=case.block_table if block_table is None else block_table,
        slot_mapping=case.slot_mapping,
        causal=True,
        seq_lens_cpu_upper_bound=case.seq_lens_t.clone(),
    )


# Reordered as vLLM does (decodes first), plus an unsorted variant.
SORTED = ([129, 600, 256, 357, 300, 255], [1, 1, 1, 57, 44, 255])
UNSORTED = ([255, 129, 357, 600, 0, 300, 1], [255, 1, 57, 1, 0, 44, 1])


F32, BF16 = torch.float32, torch.bfloat16
LBNHC, BLHNC = KVCacheLayout.LBNHC, KVCacheLayout.BLHNC


@pytest.mark.parametrize(
    "batch,dtype,layout,window,softcap",
    [
        (SORTED, F32, LBNHC, None, None),
        (UNSORTED, BF16, LBNHC, None, None),
        (UNSORTED, F32, BLHNC, 200, None),
        (SORTED, F32, LBNHC, 200, None),
        (SORTED, BF16, LBNHC, None, 20.0),
        (UNSORTED, F32, LBNHC, 200, 20.0),
    ],
    ids=["sorted-f32", "unsorted-bf16", "blhnc-swa", "swa", "bf16-cap", "swa-cap"],
)
def test_builder_impl_end_to_end(vllm_config, batch, dtype, layout, window, softcap):
    seq_lens, query_lens = batch
    hq, hkv, d = 9, 3, 64  # SmolLM2-135M geometry
    case = Case(seq_lens, query_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=21)
    spec = FullAttentionSpec(block_size=128, num_kv_heads=hkv, head_size=d, dtype=dtype)
    num_blocks = case.kv_cache.shape[0]
    kv_cache = _vllm_layer_cache(spec, num_blocks, layout)
    # The tensor forward() receives: logical [B, H, N, 2D] in the layout's strides.
    assert tuple(kv_cache.shape) == (num_blocks, hkv, 128, 2 * d)
    if layout is KVCacheLayout.LBNHC:
        assert kv_cache.transpose(1, 2).is_contiguous()

    builder = SUPAFlashAttentionMetadataBuilder(spec, ["l1"], vllm_config, "cpu")
    assert builder.reorder_batch_threshold == 1
    num_padded = case.query.shape[0]  # includes padding tokens
    md = builder.build(0, _common_metadata(case, num_padded))
    assert isinstance(md, SUPAFlashAttentionMetadata)
    assert md.num_decodes == sum(1 for q in query_lens if q == 1)

    impl = SUPAFlashAttentionImpl(
        hq, d, case.scale, hkv, None, window, "auto", softcap, AttentionType.DECODER
    )
    layer = _Layer()
    # Earlier steps' context, then this step's K/V through the impl.
    reshape_and_cache(case.ctx_key, case.ctx_value, kv_cache, case.ctx_slots)
    impl.do_kv_cache_update(layer, case.key, case.value, kv_cache, case.slot_mapping)

    output = torch.full((num_padded, hq, d), 5.0, dtype=dtype)
    out = impl.forward(layer, case.query, case.key, case.value, kv_cache, md, output)
    assert out is output
    n = case.num_tokens
    assert torch.all(output[n:] == 5.0), "padding rows must stay untouched"

    # Same as the op the backend resolves, called directly on the test's
    # own cache...
    case.impl = staticmethod(
        functools.partial(
            paged_attention,
            decode=get_op("paged_attention_decode"),
            prefill=get_op("paged_attention_prefill"),
        )
    )
    direct = case.run(sliding_window=window, logits_soft_cap=softcap)
    torch.testing.assert_close(output[:n], direct[:n], atol=1e-6, rtol=1e-6)
    # ...and as the float64 reference.
    ref = case.reference(sliding_window=window, logits_soft_cap=softcap)
    tol = TOL[dtype]
    torch.testing.assert_close(output[:n].double(), ref, atol=tol, rtol=tol)


def test_kernel_block_split_manager_block_256(vllm_config):
    """--block-size 256: vLLM splits each manager block into two kernel blocks
    of 128 and hands the backend kernel-block ids."""
    hq, hkv, d = 4, 2, 32
    case = Case(SORTED[0], SORTED[1], hq=hq, hkv=hkv, d=d, seed=22)
    spec = FullAttentionSpec(
        block_size=256, num_kv_heads=hkv, head_size=d, dtype=torch.float32
    )
    num_kernel_blocks = case.kv_cache.shape[0] + case.kv_cache.shape[0] % 2
    kv_cache = _vllm_layer_cache(
        spec, num_kernel_blocks // 2, KVCacheLayout.LBNHC, kernel_block_size=128
    )
    assert tuple(kv_cache.shape) == (num_kernel_blocks, hkv, 128, 2 * d)
    builder = SUPAFlashAttentionMetadataBuilder(spec, ["l1"], vllm_config, "cpu")
    md = builder.build(0, _common_metadata(case, case.query.shape[0]))
    impl = SUPAFlashAttentionImpl(hq, d, case.scale, hkv, None, None, "auto")
    reshape_and_cache(case.ctx_key, case.ctx_value, kv_cache, case.ctx_slots)
    impl.do_kv_cache_update(_Layer(), case.key, case.value, kv_cache, case.slot_mapping)
    out = torch.zeros(case.query.shape[0], hq * d)  # 2D output form
    impl.forward(
        _Layer(), case.query, case.key, case.value, kv_cache, md, out.view(-1, hq, d)
    )
    n = case.num_tokens
    torch.testing.assert_close(
        out[:n].view(n, hq, d).double(), case.reference(), atol=1e-5, rtol=1e-5
    )


def test_profiling_run_returns_output(vllm_config):
    impl = SUPAFlashAttentionImpl(4, 16, 0.25, 2, None, None, "auto")
    q = torch.randn(3, 4, 16)
    kv = torch.randn(3, 2, 16)
    output = torch.full((3, 4, 16), 2.0)
    assert impl.forward(_Layer(), q, kv, kv, torch.tensor([]), None, output) is output
    assert torch.all(output == 2.0)
    impl.do_kv_cache_update(_Layer(), kv, kv, torch.tensor([]), torch.zeros(3).long())


def test_encoder_only_end_to_end(vllm_config):
    torch.manual_seed(23)
    hq, hkv, d = 6, 2, 32
    lens = [5, 130, 1, 64]
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    t = int(qsl[-1])
    pad = 2
    q = torch.randn(t + pad, hq, d)
    k = torch.randn(t + pad, hkv, d)
    v = torch.randn(t + pad, hkv, d)
    spec = EncoderOnlyAttentionSpec(
        block_size=128, num_kv_heads=hkv, head_size=d, dtype=torch.float32
    )
    builder = SUPAFlashAttentionMetadataBuilder(spec, ["enc"], vllm_config, "cpu")
    cm = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        num_reqs=len(lens),
        num_actual_tokens=t + pad,
        max_query_len=max(lens),
        max_seq_len=max(lens),
        block_table_tensor=torch.zeros(len(lens), 2, dtype=torch.int32),
        slot_mapping=torch.full((t + pad,), -1, dtype=torch.long),
    )
    md = builder.build(0, cm)
    assert md.is_encoder_only and md.num_decodes == 0
    impl = SUPAFlashAttentionImpl(
        hq, d, d**-0.5, hkv, None, None, "auto", None, AttentionType.ENCODER_ONLY
    )
    impl.do_kv_cache_update(_Layer(), k, v, torch.tensor([]), cm.slot_mapping)
    output = torch.full((t + pad, hq, d), 9.0)
    impl.forward(_Layer(), q, k, v, torch.tensor([]), md, output)
    assert torch.all(output[t:] == 9.0)
    expect = attention_varlen(q[:t], k[:t], v[:t], qsl, d**-0.5)
    torch.testing.assert_close(output[:t], expect, atol=1e-6, rtol=1e-6)
    # Independent check with SDPA per sequence.
    for a, b in zip(qsl[:-1].tolist(), qsl[1:].tolist(), strict=True):
        ks = k[a:b].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        vs = v[a:b].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), ks, vs, scale=d**-0.5
        ).transpose(0, 1)
        torch.testing.assert_close(output[a:b], ref, atol=1e-5, rtol=1e-5)


def _sdpa_non_causal(q, k, v, qsl, scale):
    """Plain torch SDPA (is_causal=False) per sequence in float32, K/V heads
    repeated for GQA: ``[T, Hq, D]``."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1])
    g = q.shape[1] // k.shape[1]
    for a, b in zip(qsl[:-1].tolist(), qsl[1:].tolist(), strict=True):
        qs = q[a:b].float().transpose(0, 1)
        ks = k[a:b].float().repeat_interleave(g, 1).transpose(0, 1)
        vs = v[a:b].float().repeat_interleave(g, 1).transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=False, scale=scale
        )
        out[a:b] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capture", [False, True])
def test_encoder_only_as_vllm_builds_it(vllm_config, dtype, capture):
    """The backend as vLLM 0.33 serves an EncoderOnlyAttention layer: wrapped
    by create_encoder_only_attention_backend (its builder turns the runner's
    causal=True into False), on the runner's zero block table and slot
    mapping, with padded token rows; equals plain SDPA with is_causal=False.
    ``capture``: the metadata a FULL graph capture would build."""
    from vllm.model_executor.layers.attention.encoder_only_attention import (
        create_encoder_only_attention_backend,
    )

    torch.manual_seed(29)
    backend = create_encoder_only_attention_backend(SUPAFlashAttentionBackend)
    assert issubclass(backend, SUPAFlashAttentionBackend)
    assert backend.get_name() == SUPA_FLASH_ATTN
    assert backend.get_impl_cls() is SUPAFlashAttentionImpl
    hq, hkv, d = 8, 2, 16
    lens = [1, 130, 7, 1, 64]
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    t, pad = int(qsl[-1]), 3
    q, k, v = (torch.randn(t + pad, h, d).to(dtype) for h in (hq, hkv, hkv))
    spec = EncoderOnlyAttentionSpec(
        block_size=128, num_kv_heads=hkv, head_size=d, dtype=dtype
    )
    builder = backend.get_builder_cls()(spec, ["enc"], vllm_config, "cpu")
    assert isinstance(builder, SUPAFlashAttentionMetadataBuilder)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        num_reqs=len(lens),
        num_actual_tokens=t + pad,
        max_query_len=max(lens),
        max_seq_len=max(lens),
        block_table_tensor=torch.zeros(len(lens), 1, dtype=torch.int32),
        slot_mapping=torch.zeros(t + pad, dtype=torch.long),
        causal=True,
    )
    if capture:
        md = builder.build_for_cudagraph_capture(cm)
    else:
        md = builder.build(0, cm)
    assert md.is_encoder_only and md.causal is False
    assert md.num_decodes == 0 and md.num_prefills == len(lens)
    impl = backend.get_impl_cls()(
        hq, d, d**-0.5, hkv, None, None, "auto", None, AttentionType.ENCODER_ONLY
    )
    empty = torch.tensor([])
    impl.do_kv_cache_update(_Layer(), k, v, empty, cm.slot_mapping)
    output = torch.full((t + pad, hq, d), 7.0, dtype=dtype)
    impl.forward(_Layer(), q, k, v, empty, md, output)
    assert torch.all(output[t:] == 7.0)
    ref = _sdpa_non_causal(q[:t], k[:t], v[:t], qsl, d**-0.5)
    tol = TOL[dtype]
    torch.testing.assert_close(output[:t].float(), ref, atol=tol, rtol=tol)
    # Non-causal indeed: a causal reference differs.
    causal = attention_varlen(q[:t], k[:t], v[:t], qsl, d**-0.5, causal=True)
    assert (causal.float() - ref).abs().max() > 10 * tol


def test_impl_rejects_cross_attention_in_one_sentence():
    with pytest.raises(NotImplementedError, match="encoder-only") as e:
        SUPAFlashAttentionImpl(
            4, 64, 0.125, 4, None, None, "auto", None, AttentionType.ENCODER_DECODER
        )
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")


def test_metadata_plan_shared_across_layers(vllm_config):
    """Two layers with different windows on one metadata object (one plan)."""
    hq, hkv, d = 4, 2, 32
    case = Case(UNSORTED[0], UNSORTED[1], hq=hq, hkv=hkv, d=d, seed=24)
    spec = FullAttentionSpec(
        block_size=128, num_kv_heads=hkv, head_size=d, dtype=torch.float32
    )
    builder = SUPAFlashAttentionMetadataBuilder(spec, ["a", "b"], vllm_config, "cpu")
    md = builder.build(0, _common_metadata(case, case.query.shape[0]))
    outs = {}
    for window in (None, 64, None, 64):
        impl = SUPAFlashAttentionImpl(hq, d, case.scale, hkv, None, window, "auto")
        out = torch.zeros(case.query.shape[0], hq, d)
        impl.forward(_Layer(), case.query, None, None, case.kv_cache, md, out)
        n = case.num_tokens
        torch.testing.assert_close(
            out[:n].double(),
            case.reference(sliding_window=window),
            atol=1e-5,
            rtol=1e-5,
        )
        outs[window] = out
    # Direct kernel call without a plan agrees as well.
    out2 = paged_attention(
        case.query,
        case.kv_cache,
        case.block_table,
        case.seq_lens_t,
        case.qsl,
        case.scale,
        hkv,
        max_query_len=max(case.query_lens),
        max_seq_len=max(case.seq_lens),
    )
    n = case.num_tokens
    torch.testing.assert_close(out2[:n], outs[None][:n], atol=1e-6, rtol=1e-6)


def test_layer_cache_helper_matches_vllm_views():
    """The ops tests' layout helper produces the same strides pattern as vLLM."""
    spec = FullAttentionSpec(
        block_size=128, num_kv_heads=3, head_size=16, dtype=torch.float32
    )
    for layout in (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC):
        ours = make_layer_cache(5, 3, 32, torch.float32, layout.name)
        theirs = _vllm_layer_cache(spec, 5, layout)
        assert ours.shape == theirs.shape
        assert ours.stride() == theirs.stride()
