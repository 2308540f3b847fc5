"""vllm_br.ops: each reference op against an independent formula (float64,
written here) and against vLLM's own native implementation.

Tolerances: float32 atol 1e-5 / rtol 1.3e-6 against the float64 formula;
bfloat16 atol 2e-2 / rtol 1.6e-2 (7-bit mantissa; vLLM's IR default rtol)
against the float64 formula. Against vLLM's native code, which does the same
arithmetic in the same order, results must be bit-identical in both dtypes.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_br import ops
from vllm_br.ops import activation, embedding, layernorm, registry, rotary

FP32_TOL = {"atol": 1e-5, "rtol": 1.3e-6}
BF16_TOL = {"atol": 2e-2, "rtol": 1.6e-2}
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(7, 13), (1, 64), (3, 5, 33)]


def tol(dtype: torch.dtype) -> dict[str, float]:
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype in DTYPES
    torch.testing.assert_close(
        actual, expected.to(actual.dtype), **tol(actual.dtype), equal_nan=False
    )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---- registry ------------------------------------------------------------


class _FakeBackend:
    name = "fake"

    def __init__(self, kernels):
        self.kernels = kernels
        self.calls = 0

    def fused_kernels(self):
        self.calls += 1
        return self.kernels


@pytest.fixture
def fake_backend(monkeypatch):
    import vllm_br.device

    def install(kernels):
        backend = _FakeBackend(kernels)
        monkeypatch.setattr(vllm_br.device, "get_backend", lambda: backend)
        registry.clear_cache()
        return backend

    yield install
    registry.clear_cache()


def test_get_op_returns_reference_without_fused_kernels(fake_backend):
    fake_backend({})
    assert ops.get_op("rms_norm") is layernorm.rms_norm
    assert ops.get_op("rotary_embedding") is rotary.rotary_embedding
    assert ops.reference_op("silu_and_mul") is activation.silu_and_mul


def test_get_op_prefers_fused_kernel_and_caches(fake_backend):
    def fused_rms_norm(x, weight, eps, variance_size=None):
        return x

    backend = fake_backend({"rms_norm": fused_rms_norm})
    op = ops.get_op("rms_norm")
    assert op.kernel is fused_rms_norm and op.reference is layernorm.rms_norm
    assert ops.get_op("rms_norm") is op  # resolved once
    assert ops.get_op("silu_and_mul") is activation.silu_and_mul
    assert backend.calls == 2  # once per op name, then cached
    ops.clear_cache()
    assert ops.get_op("rms_norm").kernel is fused_rms_norm
    assert backend.calls == 3


def test_a_declining_kernel_falls_back_to_the_reference(fake_backend):
    seen = []

    def picky_rms_norm(x, weight, eps, variance_size=None):
        seen.append(x.dtype)
        if x.dtype != torch.float32:
            return NotImplemented  # declined: nothing written
        return torch.full_like(x, 7.0)

    fake_backend({"rms_norm": picky_rms_norm})
    op = ops.get_op("rms_norm")
    x32 = torch.ones(2, 4)
    assert torch.equal(op(x32, torch.ones(4), 1e-6), torch.full_like(x32, 7.0))
    x16 = torch.randn(2, 4, dtype=torch.bfloat16)
    w = torch.ones(4, dtype=torch.bfloat16)
    assert torch.equal(op(x16, w, 1e-6), layernorm.rms_norm(x16, w, 1e-6))
    assert seen == [torch.float32, torch.bfloat16]


def test_cpu_backend_binds_only_its_host_kernels():
    from vllm_br.device import cpu
    from vllm_br.device.cpu_kernels import bf16_gemm, int8_gemm, packed_linear
    from vllm_br.device.cpu_kernels import paged_attention as cpu_pa
    from vllm_br.ops import paged_attention, quant, sampling  # noqa: F401  (register)

    host = {  # the C++ kernels, greedy sampling through max(), float32 copies
        "paged_attention_decode": cpu_pa.decode,
        "paged_attention_prefill": cpu_pa.prefill,
        "reshape_and_cache": cpu_pa.reshape_and_cache,
        "greedy_sample": cpu.greedy_sample,
        "linear": bf16_gemm.linear,
        "compute_logits": bf16_gemm.compute_logits,
        "int8_scaled_mm": int8_gemm.int8_scaled_mm,
        "weight_only_linear": int8_gemm.weight_only_linear,
    }
    if packed_linear.host_supported():  # GEMMs on oneDNN-prepacked weights
        host["linear"] = packed_linear.linear
        host["compute_logits"] = packed_linear.compute_logits
        host["prepare_gemm_weight"] = packed_linear.pack
    registry.clear_cache()
    for name in ops.registered_ops():
        op = ops.get_op(name)
        if name in host:
            assert op.kernel is host[name] and op.reference is ops.reference_op(name), (
                name
            )
        else:
            assert op is ops.reference_op(name), name
    assert set(host) <= set(ops.registered_ops())


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError):
        ops.register_op("rms_norm")(lambda x: x)
    # re-registering the same function is harmless
    assert ops.register_op("rms_norm")(layernorm.rms_norm) is layernorm.rms_norm


# ---- RMSNorm --------------------------------------------------------------


def ref_rms_norm(x, weight, eps, variance_size=None):
    x = x.double()
    var_x = x if variance_size is None else x[..., :variance_size]
    y = x / torch.sqrt(var_x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.double()


def vllm_native(op_name):
    from vllm import ir

    return getattr(ir.ops, op_name).impls["native"].impl_fn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("has_weight", [True, False])
def test_rms_norm(dtype, shape, has_weight):
    x = torch.randn(shape, dtype=dtype) * 3
    weight = torch.randn(shape[-1], dtype=dtype) if has_weight else None
    out = layernorm.rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    close(out, ref_rms_norm(x, weight, 1e-6))
    assert torch.equal(out, vllm_native("rms_norm")(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_variance_size_override(dtype):
    x = torch.randn(6, 24, dtype=dtype)
    weight = torch.randn(24, dtype=dtype)
    out = layernorm.rms_norm(x, weight, 1e-5, 16)
    close(out, ref_rms_norm(x, weight, 1e-5, 16))
    assert torch.equal(out, vllm_native("rms_norm")(x, weight, 1e-5, 16))


def test_rms_norm_float32_weight_on_bf16_input():
    # weight dtype differs from x: multiply in the weight's dtype, cast back
    x = torch.randn(5, 40, dtype=torch.bfloat16)
    weight = torch.randn(40, dtype=torch.float32)
    out = layernorm.rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, vllm_native("rms_norm")(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("variance_size", [None, 8])
def test_fused_add_rms_norm(dtype, shape, variance_size):
    x = torch.randn(shape, dtype=dtype)
    residual = torch.randn(shape, dtype=dtype)
    weight = torch.randn(shape[-1], dtype=dtype)
    x0, r0 = x.clone(), residual.clone()
    out, new_residual = layernorm.fused_add_rms_norm(
        x, residual, weight, 1e-6, variance_size
    )
    # inputs untouched, residual = x + residual (summed in float32)
    assert torch.equal(x, x0) and torch.equal(residual, r0)
    summed = x.double() + residual.double()
    close(new_residual, summed)
    close(out, ref_rms_norm(summed, weight, 1e-6, variance_size))
    ref_out, ref_res = vllm_native("fused_add_rms_norm")(
        x.clone(), residual.clone(), weight, 1e-6, variance_size
    )
    assert torch.equal(out, ref_out) and torch.equal(new_residual, ref_res)


def test_fused_add_rms_norm_without_weight():
    x, residual = torch.randn(4, 17), torch.randn(4, 17)
    out, new_residual = layernorm.fused_add_rms_norm(x, residual, None, 1e-6)
    close(out, ref_rms_norm(x.double() + residual.double(), None, 1e-6))
    close(new_residual, x.double() + residual.double())


# ---- activations --------------------------------------------------------------


def _erf_gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _tanh_gelu(x):
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    )


UNARY = [
    (activation.gelu, _erf_gelu),
    (activation.gelu_tanh, _tanh_gelu),
    (activation.gelu_new, _tanh_gelu),
    (activation.gelu_fast, _tanh_gelu),
    (activation.quick_gelu, lambda x: x / (1.0 + torch.exp(-1.702 * x))),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fn,ref", UNARY, ids=lambda v: getattr(v, "__name__", ""))
def test_gelu_family(dtype, shape, fn, ref):
    x = torch.randn(shape, dtype=dtype) * 3
    out = fn(x)
    assert out.dtype == dtype and out.shape == x.shape
    close(out, ref(x.double()))


GATED = [
    (activation.silu_and_mul, {}, lambda g: g / (1.0 + torch.exp(-g))),
    (activation.gelu_and_mul, {}, _erf_gelu),
    (activation.gelu_and_mul, {"approximate": "none"}, _erf_gelu),
    (activation.gelu_and_mul, {"approximate": "tanh"}, _tanh_gelu),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 26), (1, 2), (3, 5, 66)])
@pytest.mark.parametrize("fn,kwargs,act", GATED, ids=["silu", "gelu", "erf", "tanh"])
def test_gated_activations(dtype, shape, fn, kwargs, act):
    x = torch.randn(shape, dtype=dtype) * 2
    d = shape[-1] // 2
    out = fn(x, **kwargs)
    assert out.shape == (*shape[:-1], d) and out.dtype == dtype
    xd = x.double()
    close(out, act(xd[..., :d]) * xd[..., d:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul_sparse(dtype, approximate):
    x = torch.randn(9, 2 * 48, dtype=dtype)
    k = 1.6448536269514722  # icdf(0.95)
    out = activation.gelu_and_mul_sparse(x, k, approximate)
    xd = x.double()
    gate, up = xd[..., :48], xd[..., 48:]
    mean = gate.mean(-1, keepdim=True)
    std = ((gate - mean) ** 2).mean(-1, keepdim=True).sqrt()
    act = _erf_gelu if approximate == "none" else _tanh_gelu
    close(out, act(torch.relu(gate - (mean + std * k))) * up)
    assert torch.equal(out, vllm_native("gelu_and_mul_sparse")(x, k, approximate))


# ---- rotary ---------------------------------------------------------------------


def make_cos_sin_cache(rotary_dim, max_pos, base=10000.0, dtype=torch.float32):
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos).double(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def ref_rotary(positions, x, head_size, rotary_dim, cache, is_neox_style):
    """Rotation as complex multiplication, in float64."""
    shape = x.shape
    t = positions.numel()
    x = x.double().reshape(t, -1, head_size).clone()
    cos, sin = cache.double()[positions.flatten()].chunk(2, dim=-1)
    rot = torch.complex(cos, sin).unsqueeze(1)  # [T, 1, rot/2]
    half = rotary_dim // 2
    if is_neox_style:
        a_idx = torch.arange(half)
        b_idx = a_idx + half
    else:
        a_idx = torch.arange(0, rotary_dim, 2)
        b_idx = a_idx + 1
    z = torch.complex(x[..., a_idx], x[..., b_idx]) * rot
    x[..., a_idx] = z.real
    x[..., b_idx] = z.imag
    return x.reshape(shape)


ROPE_CASES = [
    # (num_tokens, num_heads, num_kv_heads, head_size, rotary_dim)
    (7, 3, 1, 16, 16),
    (5, 4, 2, 64, 32),  # partial rotary
    (1, 2, 2, 128, 128),
    (9, 5, 1, 80, 20),  # partial rotary, odd head count
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize("with_key", [True, False])
def test_rotary_embedding(dtype, is_neox_style, case, with_key):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    t, h, hk, head_size, rotary_dim = case
    cache = make_cos_sin_cache(rotary_dim, 64, dtype=dtype)
    positions = torch.randint(0, 64, (t,))
    query = torch.randn(t, h * head_size, dtype=dtype)
    key = torch.randn(t, hk * head_size, dtype=dtype) if with_key else None
    q0 = query.clone()
    q, k = rotary.rotary_embedding(
        positions, query, key, head_size, rotary_dim, cache, is_neox_style
    )
    assert torch.equal(query, q0)  # not in place
    assert q.shape == query.shape and q.dtype == dtype
    close(q, ref_rotary(positions, query, head_size, rotary_dim, cache, is_neox_style))
    # the channels past rotary_dim pass through untouched
    qh, q0h = q.view(t, h, head_size), q0.view(t, h, head_size)
    assert torch.equal(qh[..., rotary_dim:], q0h[..., rotary_dim:])
    vq, vk = RotaryEmbedding.forward_static(
        positions, query, key, head_size, rotary_dim, cache, is_neox_style
    )
    assert torch.equal(q, vq)
    if with_key:
        close(
            k, ref_rotary(positions, key, head_size, rotary_dim, cache, is_neox_style)
        )
        assert torch.equal(k, vk)
    else:
        assert k is None and vk is None


def test_rotary_embedding_3d_inputs_and_2d_positions():
    head_size, rotary_dim = 32, 32
    cache = make_cos_sin_cache(rotary_dim, 40)
    positions = torch.randint(0, 40, (2, 3))  # flattened to 6 tokens
    query = torch.randn(6, 4, head_size)
    key = torch.randn(6, 1, head_size)
    q, k = rotary.rotary_embedding(
        positions, query, key, head_size, rotary_dim, cache, True
    )
    assert q.shape == query.shape and k.shape == key.shape
    close(q, ref_rotary(positions, query, head_size, rotary_dim, cache, True))
    close(k, ref_rotary(positions, key, head_size, rotary_dim, cache, True))


MROPE_CASES = {
    # family: (transformers config class, rotary module, section, interleaved)
    "qwen2_vl": (
        "Qwen2VLTextConfig",
        "transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VLRotaryEmbedding",
        [4, 6, 6],
        False,
    ),
    "qwen3_vl": (
        "Qwen3VLTextConfig",
        "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding",
        [6, 5, 5],
        True,
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(MROPE_CASES))
def test_mrope_equals_transformers(family, dtype):
    """M-RoPE against the family's own transformers rotary (cos / sin per
    t, h, w position row, applied NeoX style), in float32 and bfloat16.
    Image tokens share t and differ in h / w; text tokens have t = h = w."""
    import importlib

    import transformers

    config_cls, module_path, section, interleaved = MROPE_CASES[family]
    head, heads, kv_heads, t, max_pos = 32, 4, 2, 11, 256
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    if interleaved:
        rope["mrope_interleaved"] = True
    config = getattr(transformers, config_cls)(
        hidden_size=heads * head, num_attention_heads=heads, head_dim=head,
        num_key_value_heads=kv_heads, rope_parameters=rope,
    )  # fmt: skip
    module_name, cls_name = module_path.rsplit(".", 1)
    hf_rope = getattr(importlib.import_module(module_name), cls_name)(config)
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, max_pos, (3, t), generator=gen)
    positions[:, 7:] = positions[0, 7:]
    query = torch.randn(t, heads * head, generator=gen).to(dtype)
    key = torch.randn(t, kv_heads * head, generator=gen).to(dtype)

    x = torch.zeros(1, dtype=torch.float64)
    cos, sin = hf_rope(x, positions[:, None, :])  # [1, T, head] float64
    cos, sin = cos[0, :, None, :], sin[0, :, None, :]

    def hf_apply(
        v,
    ):  # transformers' apply_rotary_pos_emb: v * cos + rotate_half(v) * sin
        v = v.double().view(t, -1, head)
        x1, x2 = v[..., : head // 2], v[..., head // 2 :]
        return (v * cos + torch.cat((-x2, x1), dim=-1) * sin).reshape(t, -1)

    cache = make_cos_sin_cache(head, max_pos, dtype=dtype)
    q, k = rotary.mrope_rotary_embedding(
        positions, query, key, head, head, cache, True, section, interleaved
    )
    close(q, hf_apply(query))
    close(k, hf_apply(key))
    # Text-only positions ([T]) are plain rotary.
    q1, k1 = rotary.mrope_rotary_embedding(
        positions[0], query, key, head, head, cache, True, section, interleaved
    )
    q2, k2 = rotary.rotary_embedding(positions[0], query, key, head, head, cache, True)
    assert torch.equal(q1, q2) and torch.equal(k1, k2)


def test_rotary_position_zero_is_identity():
    cache = make_cos_sin_cache(16, 8)
    query = torch.randn(3, 2 * 16)
    q, _ = rotary.rotary_embedding(
        torch.zeros(3, dtype=torch.long), query, None, 16, 16, cache, False
    )
    assert torch.equal(q, query)


# ---- the vision towers' ops --------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_equals_the_formula(dtype):
    """(x - mean) / sqrt(var + eps) * w + b in float64; also with float32
    weights on a bfloat16 input (vLLM's LayerNorm(dtype=float32)) and with
    no affine parameters."""
    x = (torch.randn(5, 3, 96) * 2 + 0.3).to(dtype)
    w = (torch.randn(96) * 0.1 + 1).to(dtype)
    b = (torch.randn(96) * 0.1).to(dtype)
    x64 = x.double()
    centred = x64 - x64.mean(-1, keepdim=True)
    normed = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = normed * w.double() + b.double()
    close(layernorm.layer_norm(x, w, b, 1e-6), want)
    close(layernorm.layer_norm(x, w.float(), b.float(), 1e-6), want)
    close(layernorm.layer_norm(x, None, None, 1e-6), normed)
    assert layernorm.layer_norm(x, w, b, 1e-6).dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_apply_rotary_emb_equals_transformers_vision_rotary(dtype, neox):
    """The vision towers' rotary against transformers' Qwen2-VL
    ``apply_rotary_pos_emb_vision`` (float32 rotation, cos / sin per patch
    over the whole head); GPT-J pairs against the float64 formula."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        apply_rotary_pos_emb_vision,
    )

    seq, heads, head = 21, 3, 16
    angles = torch.rand(seq, head // 2, dtype=torch.float64) * 30
    cos, sin = angles.cos().float(), angles.sin().float()
    q = torch.randn(2, seq, heads, head).to(dtype)
    k = torch.randn(seq, heads, head).to(dtype)  # 3-D, as vLLM also passes
    for x in (q, k):
        got = rotary.apply_rotary_emb(x, cos, sin, neox, fp32_compute=True)
        if neox:
            full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
            want, _ = apply_rotary_pos_emb_vision(x, x, full_cos, full_sin)
            # Both rotate in float32 and round once: equal in float32 up to
            # summation order, within one bfloat16 rounding.
            close(got, want.float())
        else:
            x64 = x.double()
            c, s_ = angles.cos()[:, None, :], angles.sin()[:, None, :]
            x1, x2 = x64[..., 0::2], x64[..., 1::2]
            want = torch.stack((x1 * c - x2 * s_, x2 * c + x1 * s_), -1).flatten(-2)
            close(got, want)
        assert got.dtype == dtype and got.shape == x.shape
        # Without fp32_compute the rotation runs in the input's dtype.
        close(rotary.apply_rotary_emb(x, cos, sin, neox), got.double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,kernel",
    [((4, 3, 2, 28, 14), (2, 14, 14)), ((2, 8, 12, 18), (2, 3))],
    ids=["conv3d", "conv2d"],
)
def test_patch_embedding_equals_torch_conv(dtype, shape, kernel):
    """A convolution with stride = kernel (the towers' patch embedding,
    GLM-4V's 2x2 downsample) against torch's conv in float64."""
    import torch.nn.functional as F

    from vllm_br.ops.patch_embedding import patch_embedding

    fan_in = shape[1] * math.prod(kernel)
    x = torch.randn(shape).to(dtype)
    w = (torch.randn(32, shape[1], *kernel) / math.sqrt(fan_in)).to(dtype)
    b = torch.randn(32).to(dtype)
    conv = F.conv3d if len(kernel) == 3 else F.conv2d
    for bias in (b, None):
        want = conv(
            x.double(), w.double(), None if bias is None else bias.double(),
            stride=kernel,
        )  # fmt: skip
        got = patch_embedding(x, w, bias)
        assert got.shape == want.shape and got.dtype == dtype
        close(got, want)


# ---- embedding and logits -------------------------------------------------


def _shards(num_embeddings, org_vocab_size, tp_size, padding=64):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
        pad_vocab_size,
    )

    org_padded = pad_vocab_size(org_vocab_size, padding)
    total_padded = pad_vocab_size(org_padded + num_embeddings - org_vocab_size, padding)
    return [
        VocabParallelEmbedding._get_indices(
            total_padded, org_padded, num_embeddings, org_vocab_size, rank, tp_size
        )
        for rank in range(tp_size)
    ], total_padded // tp_size


def _shard_weight(table, si, rows):
    """This rank's weight: base rows, padding, added (LoRA) rows, padding."""
    w = torch.randn(rows, table.shape[1], dtype=table.dtype) * 100  # padding junk
    n_org = si.org_vocab_end_index - si.org_vocab_start_index
    w[:n_org] = table[si.org_vocab_start_index : si.org_vocab_end_index]
    n_add = si.added_vocab_end_index - si.added_vocab_start_index
    start = si.num_org_elements_padded
    w[start : start + n_add] = table[
        si.added_vocab_start_index : si.added_vocab_end_index
    ]
    return w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("vocab", [(1010, 1010), (1026, 1010)], ids=["base", "lora"])
def test_vocab_parallel_embedding_shards_sum_to_full_lookup(dtype, tp_size, vocab):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        get_masked_input_and_mask,
    )

    num_embeddings, org_vocab_size = vocab
    table = torch.randn(num_embeddings, 24, dtype=dtype)
    ids = torch.randperm(num_embeddings)[: 2 * 300].reshape(2, 300)
    shards, rows = _shards(num_embeddings, org_vocab_size, tp_size)
    total = torch.zeros(2, 300, 24, dtype=dtype)
    masked_fn = get_masked_input_and_mask._torchdynamo_orig_callable
    for si in shards:
        w = _shard_weight(table, si, rows)
        args = (
            si.org_vocab_start_index,
            si.org_vocab_end_index,
            si.num_org_vocab_padding,
            si.added_vocab_start_index,
            si.added_vocab_end_index,
        )
        part = embedding.vocab_parallel_embedding(ids, w, *args)
        assert part.shape == (2, 300, 24) and part.dtype == dtype
        # same as vLLM's masking (its uncompiled function) + lookup + zeroing
        masked, mask = masked_fn(ids, *args)
        expected = torch.nn.functional.embedding(masked.long(), w)
        expected.masked_fill_(mask.unsqueeze(-1), 0)
        assert torch.equal(part, expected)
        total += part
    # every id lives on exactly one rank: the sum is the exact full lookup
    assert torch.equal(total, table[ids])


def test_embedding_unsharded():
    table = torch.randn(50, 8)
    ids = torch.tensor([[0, 49, 7], [3, 3, 1]], dtype=torch.int32)
    assert torch.equal(embedding.embedding(ids, table), table[ids.long()])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_compute_logits(dtype, with_bias):
    hidden = torch.randn(5, 3, 40, dtype=dtype)
    weight = torch.randn(67, 40, dtype=dtype) / 6
    bias = torch.randn(67, dtype=dtype) if with_bias else None
    out = embedding.compute_logits(hidden, weight, bias)
    expected = hidden.double() @ weight.double().T
    if with_bias:
        expected = expected + bias.double()
    assert out.shape == (5, 3, 67)
    torch.testing.assert_close(
        out,
        expected.to(dtype),
        **(FP32_TOL if dtype == torch.float32 else {"atol": 6e-2, "rtol": 1.6e-2}),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "soft_cap,scale", [(None, 1.0), (30.0, 1.0), (None, 0.5), (50.0, 2.0)]
)
def test_logits_soft_cap_and_scale(dtype, soft_cap, scale):
    logits = torch.randn(4, 99, dtype=dtype) * 60
    before = logits.clone()
    out = embedding.logits_soft_cap_and_scale(logits, soft_cap, scale)
    ld = logits.double()
    if soft_cap is not None:
        ld = soft_cap * torch.tanh(ld / soft_cap)
    close(out, ld * scale)
    assert torch.equal(logits, before)
    # vLLM's LogitsProcessor.forward order: /cap, tanh, *cap, then *= scale
    ref = logits.clone()
    if soft_cap is not None:
        ref = torch.tanh(ref / soft_cap) * soft_cap
    if scale != 1.0:
        ref *= scale
    assert torch.equal(out, ref)


def test_get_op_imports_op_modules_on_a_miss(fake_backend, monkeypatch):
    fake_backend({})
    registry._import_op_modules()  # the real one: idempotent, every module loads

    def dummy(x):
        return x

    def importer():
        monkeypatch.setitem(registry._REFERENCE, "dummy_op", dummy)

    monkeypatch.setattr(registry, "_import_op_modules", importer)
    assert ops.get_op("dummy_op") is dummy
    with pytest.raises(KeyError):
        ops.get_op("no_such_op")
