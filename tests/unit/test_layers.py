"""vllm_br.layers: OOT registration makes vLLM build our classes, whose
forward_oot runs vllm_br.ops with the results of vLLM's forward_native; the
device weight layout round-trips and leaves linear outputs unchanged."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor import custom_op
from vllm.platforms import current_platform

from vllm_br import layers as br_layers
from vllm_br.ops import linear as linear_op
from vllm_br.ops import weight_layout as wl
from vllm_br.ops.weight_layout import NUMA, UMA, DeviceLayout

br_layers.register_all()

from vllm_br.layers import activation as br_act  # noqa: E402
from vllm_br.layers import embedding as br_emb  # noqa: E402
from vllm_br.layers import layernorm as br_norm  # noqa: E402
from vllm_br.layers import linear as br_linear  # noqa: E402
from vllm_br.layers import mm_encoder as br_mm  # noqa: E402
from vllm_br.layers import rotary as br_rope  # noqa: E402
from vllm_br.layers import vision as br_vision  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def vllm_config():
    return VllmConfig()


@pytest.fixture(autouse=True)
def vllm_env(monkeypatch, vllm_config):
    """A default VllmConfig and a one-rank TP world, as layer construction needs."""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe
    import vllm.model_executor.parameter as parameter

    for mod in (parameter, linear, vpe):
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: 1)
    torch.manual_seed(0)
    with set_current_vllm_config(vllm_config):
        yield


def assert_dispatches_to_oot(layer) -> None:
    if current_platform.is_out_of_tree() and layer.enabled():
        assert layer._forward_method.__func__ is type(layer).forward_oot


@contextlib.contextmanager
def count_calls(*names: str):
    """Counts the calls of the plugin ops ``names`` inside the block."""
    from vllm_br.ops import registry

    calls = dict.fromkeys(names, 0)
    saved = {name: registry.get_op(name) for name in names}

    def counted(name):
        def op(*args, **kwargs):
            calls[name] += 1
            return saved[name](*args, **kwargs)

        return op

    registry._RESOLVED.update({name: counted(name) for name in names})
    try:
        yield calls
    finally:
        registry._RESOLVED.update(saved)


def same(a, b) -> None:
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    elif a is None:
        assert b is None
    else:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


# ---- registration ----------------------------------------------------------------


def all_oot_pairs():
    pairs = [(base, cls) for base, cls in br_act.OOT_LAYERS]
    pairs += [(base, cls) for base, cls in br_rope.OOT_LAYERS]
    pairs += br_emb.OOT_LAYERS + br_linear.OOT_LAYERS
    pairs += br_norm._TF_NORMS  # the Transformers backend's TP-aware norms
    pairs += [
        (br_norm.RMSNorm, br_norm.SUPARMSNorm),
        (br_norm.GemmaRMSNorm, br_norm.SUPAGemmaRMSNorm),
        (
            br_rope.DeepseekScalingRotaryEmbedding,
            br_rope.SUPADeepseekScalingRotaryEmbedding,
        ),
        (br_rope.MRotaryEmbedding, br_rope.SUPAMRotaryEmbedding),
        (br_mm.MMEncoderAttention, br_mm.SUPAMMEncoderAttention),
        (br_vision.Conv2dLayer, br_vision.SUPAConv2dLayer),
        (br_vision.Conv3dLayer, br_vision.SUPAConv3dLayer),
        (br_vision.ApplyRotaryEmb, br_vision.SUPAApplyRotaryEmb),
        (br_vision.LayerNorm, br_vision.SUPALayerNorm),
    ]
    return pairs


@pytest.mark.parametrize("base,cls", all_oot_pairs(), ids=lambda c: c.__name__)
def test_registered_out_of_tree(base, cls):
    assert custom_op.op_registry_oot[base.__name__] is cls
    assert issubclass(cls, base)
    # the in-tree op name is kept, so custom_ops "+name"/"-name" still apply
    assert cls.name == base.name


def test_transformers_backend_norms_are_replaced():
    # vLLM 0.33 serves e.g. GlmForCausalLM through its Transformers backend,
    # whose norms are these classes; unregistered they would run vLLM's own.
    names = {base.__name__ for base, _ in br_norm._TF_NORMS}
    assert names == {"TPAwareRMSNorm", "TPAwareGemmaRMSNorm"}


def test_register_all_is_idempotent():
    before = dict(custom_op.op_registry_oot)
    first = br_layers.register_all()
    assert br_layers.register_all() == first
    assert custom_op.op_registry_oot == before
    for qualname in (
        "vllm.model_executor.layers.layernorm.RMSNorm",
        "vllm.model_executor.layers.rotary_embedding.llama3_rope.Llama3RotaryEmbedding",
        "vllm.model_executor.layers.linear.QKVParallelLinear",
        "vllm.model_executor.layers.logits_processor.LogitsProcessor",
    ):
        assert qualname in first


def test_foreign_registration_is_left_alone():
    from vllm.model_executor.layers.layernorm import RMSNorm

    from vllm_br.layers._oot import register_oot

    class Other(RMSNorm):
        pass

    registry = {"RMSNorm": Other}
    assert register_oot(RMSNorm, br_norm.SUPARMSNorm, registry) is False
    assert registry == {"RMSNorm": Other}


class _OOTPlatform:
    def is_rocm(self):
        return False

    is_cpu = is_tpu = is_xpu = is_rocm

    def is_out_of_tree(self):
        return True


@pytest.mark.parametrize(
    "custom_ops,expect_oot",
    [
        (["all"], True),
        (["none"], False),
        (["none", "+rms_norm"], True),
        (["all", "-rms_norm"], False),
    ],
)
def test_dispatch_follows_custom_ops(monkeypatch, custom_ops, expect_oot):
    from vllm.model_executor.layers.layernorm import RMSNorm

    monkeypatch.setattr(custom_op, "current_platform", _OOTPlatform())
    config = VllmConfig()
    config.compilation_config.custom_ops = custom_ops
    with set_current_vllm_config(config):
        norm = RMSNorm(8)
    assert type(norm) is br_norm.SUPARMSNorm
    # a disabled op runs vLLM's forward_native even on an OOT platform
    expected = br_norm.SUPARMSNorm.forward_oot if expect_oot else RMSNorm.forward_native
    assert norm._forward_method.__func__ is expected


def test_hw_agnostic_layers_registered():
    hw = pytest.importorskip("vllm.model_executor.hw_agnostic.custom_op")
    from vllm.model_executor.hw_agnostic.layers.activation import SiluAndMul
    from vllm.model_executor.hw_agnostic.layers.layernorm import RMSNorm

    assert hw.op_registry_oot["RMSNorm"] is br_norm.SUPAHwAgnosticRMSNorm
    assert hw.op_registry_oot["SiluAndMul"] is br_act.SUPAHwAgnosticSiluAndMul
    norm = RMSNorm(24, eps=1e-5)
    assert type(norm) is br_norm.SUPAHwAgnosticRMSNorm
    norm.weight.data.normal_()
    x, r = torch.randn(3, 24), torch.randn(3, 24)
    same(norm.forward_oot(x), norm.forward_native(x))
    same(norm.forward_oot(x, r), norm.forward_native(x, r))
    act = SiluAndMul()
    assert type(act) is br_act.SUPAHwAgnosticSiluAndMul
    x = torch.randn(4, 30)
    same(act.forward_oot(x), act.forward_native(x))


# ---- RMSNorm ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"has_weight": False}, {"var_hidden_size": 16}],
    ids=["weight", "no_weight", "variance_override"],
)
def test_rms_norm_layer(dtype, kwargs):
    from vllm.model_executor.layers.layernorm import RMSNorm

    norm = RMSNorm(40, eps=1e-6, dtype=dtype, **kwargs)
    assert type(norm) is br_norm.SUPARMSNorm
    assert_dispatches_to_oot(norm)
    if norm.has_weight:
        norm.weight.data.normal_()
    x = torch.randn(7, 40, dtype=dtype)
    residual = torch.randn(7, 40, dtype=dtype)
    same(norm.forward_oot(x), norm.forward_native(x))
    out = norm.forward_oot(x, residual)
    ref = norm.forward_native(x.clone(), residual.clone())
    same(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_layer(dtype):
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    norm = GemmaRMSNorm(33, eps=1e-6)
    assert type(norm) is br_norm.SUPAGemmaRMSNorm
    norm.weight.data.normal_()
    x, r = torch.randn(5, 33, dtype=dtype), torch.randn(5, 33, dtype=dtype)
    same(norm.forward_oot(x), norm.forward_native(x))
    same(norm.forward_oot(x, r), norm.forward_native(x.clone(), r.clone()))


# ---- activations ------------------------------------------------------------------


def activation_layers():
    from vllm.model_executor.layers import activation as A

    return [
        ("silu_and_mul", lambda: A.SiluAndMul(), True),
        ("gelu_and_mul", lambda: A.GeluAndMul(), True),
        ("gelu_tanh_and_mul", lambda: A.GeluAndMul(approximate="tanh"), True),
        ("gelu_and_mul_sparse", lambda: A.GeluAndMulSparse(0.95, "tanh"), True),
        ("gelu", lambda: A.GELU(), False),
        ("gelu_tanh", lambda: A.GELUTanh(), False),
        ("gelu_new", lambda: A.NewGELU(), False),
        ("gelu_fast", lambda: A.FastGELU(), False),
        ("quick_gelu", lambda: A.QuickGELU(), False),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "name,make,gated",
    activation_layers(),
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_activation_layers(dtype, name, make, gated):
    layer = make()
    assert type(layer).__name__.startswith("SUPA"), type(layer)
    assert type(layer) in dict(br_act.OOT_LAYERS).values()
    assert_dispatches_to_oot(layer)
    x = torch.randn(9, 2 * 21 if gated else 21, dtype=dtype) * 3
    out = layer.forward_oot(x)
    assert out.shape == (9, 21)
    same(out, layer.forward_native(x))


# ---- rotary ---------------------------------------------------------------------

ROPE_PARAMS = {
    "default": {"rope_theta": 10000.0},
    "partial": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic_ntk": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic_alpha": {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1.5},
    "ntk": {"rope_type": "ntk", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {  # as Qwen2.5/Qwen3 long-context configs use it
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "proportional": {
        "rope_type": "proportional",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
}

EXPECTED_ROPE_CLASS = {
    "default": br_rope.SUPARotaryEmbedding,
    "partial": br_rope.SUPARotaryEmbedding,
    "linear": br_rope.SUPALinearScalingRotaryEmbedding,
    "dynamic_ntk": br_rope.SUPADynamicNTKScalingRotaryEmbedding,
    "dynamic_alpha": br_rope.SUPADynamicNTKAlphaRotaryEmbedding,
    "ntk": br_rope.SUPANTKScalingRotaryEmbedding,
    "llama3": br_rope.SUPALlama3RotaryEmbedding,
    "yarn": br_rope.SUPAYaRNScalingRotaryEmbedding,
    "proportional": br_rope.SUPAGemma4RotaryEmbedding,
}


@pytest.fixture
def get_rope(monkeypatch):
    import vllm.model_executor.layers.rotary_embedding as rope_mod

    monkeypatch.setattr(rope_mod, "_ROPE_DICT", {})
    return rope_mod.get_rope


def test_rope_variants_share_the_base_forward():
    for base, _ in br_rope.OOT_LAYERS:
        assert br_rope.inherits_base_forward(base), base


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("variant", list(ROPE_PARAMS))
def test_rotary_layers(get_rope, dtype, is_neox_style, variant):
    head_size, max_pos, t = 32, 256, 11
    rope = get_rope(head_size, max_pos, is_neox_style, ROPE_PARAMS[variant], dtype)
    assert type(rope) is EXPECTED_ROPE_CLASS[variant]
    assert_dispatches_to_oot(rope)
    positions = torch.randint(0, max_pos, (t,))
    query = torch.randn(t, 4 * head_size, dtype=dtype)
    key = torch.randn(t, 2 * head_size, dtype=dtype)
    same(
        rope.forward_oot(positions, query, key),
        rope.forward_native(positions, query.clone(), key.clone()),
    )
    same(
        rope.forward_oot(positions, query, None),
        rope.forward_native(positions, query.clone(), None),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_offsets", [False, True])
def test_deepseek_rotary_layer(get_rope, dtype, with_offsets):
    params = {
        "rope_type": "deepseek_yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    }
    rope = get_rope(64, 256, False, params, dtype)
    assert type(rope) is br_rope.SUPADeepseekScalingRotaryEmbedding
    t = 6
    positions = torch.randint(0, 128, (t,))
    offsets = torch.randint(0, 64, (t,)) if with_offsets else None
    q = torch.randn(t, 3, 64, dtype=dtype)
    k = torch.randn(t, 1, 64, dtype=dtype)
    same(
        rope.forward_oot(positions, q, k, offsets),
        rope.forward_native(positions, q.clone(), k.clone(), offsets),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["sectioned", "interleaved"])
def test_mrope_layer(get_rope, dtype, interleaved):
    params = {"rope_type": "default", "mrope_section": [4, 6, 6]}
    if interleaved:
        params["mrope_interleaved"] = True
    rope = get_rope(32, 256, True, params, dtype)
    assert type(rope) is br_rope.SUPAMRotaryEmbedding
    assert_dispatches_to_oot(rope)
    t = 9
    positions = torch.randint(0, 256, (3, t))
    q = torch.randn(t, 4 * 32, dtype=dtype)
    k = torch.randn(t, 2 * 32, dtype=dtype)
    for pos in (positions, positions[0]):  # multimodal and text-only steps
        got = rope.forward_oot(pos, q, k)
        want = rope.forward_native(pos, q.clone(), k.clone())
        tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("four_d", [False, True], ids=["BSHD-flat", "BSHD"])
def test_mm_encoder_attention_layer(dtype, four_d):
    """The vision encoder's attention: per-image (cu_seqlens) non-causal,
    GQA 4:2, as vLLM's own SDPA path computes it; without cu_seqlens each
    batch row is one sequence."""
    from vllm.model_executor.layers.attention import MMEncoderAttention

    heads, kv_heads, head = 4, 2, 16
    layer = MMEncoderAttention(heads, head, scale=0.3, num_kv_heads=kv_heads)
    assert type(layer) is br_mm.SUPAMMEncoderAttention
    assert_dispatches_to_oot(layer)
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for bsz, seq, cu in ((1, 23, [0, 9, 23]), (3, 7, None)):
        shape_q = (bsz, seq, heads, head) if four_d else (bsz, seq, heads * head)
        shape_kv = (bsz, seq, kv_heads, head) if four_d else (bsz, seq, kv_heads * head)
        q = torch.randn(shape_q, dtype=dtype)
        k, v = torch.randn(shape_kv, dtype=dtype), torch.randn(shape_kv, dtype=dtype)
        cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        got = layer.forward_oot(q, k, v, cu_seqlens)
        want = layer._forward_sdpa(q, k, v, cu_seqlens)
        assert got.shape == q.shape
        torch.testing.assert_close(got, want.reshape(q.shape), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_layers_patch_embedding(dtype):
    """Qwen-VL's Conv3dLayer patch embedding and a 2-D patch conv (kernel =
    stride) run the patch_embedding op; a strided conv with overlap (kernel
    != stride) stays torch's. Each equals vLLM's own forward_native."""
    from vllm.model_executor.layers.conv import Conv2dLayer, Conv3dLayer

    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    cases = [
        (Conv3dLayer(3, 16, (2, 14, 14), (2, 14, 14), bias=False), (4, 3, 2, 14, 14)),
        (Conv2dLayer(8, 16, 2, 2), (2, 8, 6, 10)),
        (Conv2dLayer(8, 16, 3, 2, padding=1), (2, 8, 6, 10)),
    ]
    for layer, shape in cases:
        assert type(layer).__name__ == f"SUPA{type(layer).__mro__[2].__name__}"
        assert_dispatches_to_oot(layer)
        with torch.no_grad():
            layer.weight.normal_(0, 0.1)
            if layer.bias is not None:
                layer.bias.normal_()
        layer = layer.to(dtype)
        x = torch.randn(shape, dtype=dtype)
        with count_calls("patch_embedding") as calls:
            got = layer.forward_oot(x)
        assert calls["patch_embedding"] == int(layer.enable_linear)
        torch.testing.assert_close(got, layer.forward_native(x), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rotary_emb_layer(dtype):
    from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb

    for kwargs in ({}, {"is_neox_style": False, "enable_fp32_compute": True}):
        layer = ApplyRotaryEmb(enforce_enable=True, **kwargs)
        assert type(layer) is br_vision.SUPAApplyRotaryEmb
        assert_dispatches_to_oot(layer)
        x = torch.randn(2, 9, 3, 16, dtype=dtype)
        angles = torch.rand(9, 8) * 20
        got = layer.forward_oot(x, angles.cos(), angles.sin())
        same(got, layer.forward_native(x, angles.cos(), angles.sin()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_layers(dtype):
    """vLLM's LayerNorm and the plain torch.nn.LayerNorm the towers build
    (re-classed after loading) on the layer_norm op, equal to their own
    forward."""
    from torch import nn
    from vllm.model_executor.layers.layernorm import LayerNorm

    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    x = torch.randn(5, 64, dtype=dtype) * 3
    for weight_dtype in (dtype, torch.float32):
        layer = LayerNorm(64, eps=1e-6, dtype=weight_dtype)
        assert type(layer) is br_vision.SUPALayerNorm
        assert_dispatches_to_oot(layer)
        with torch.no_grad():
            layer.weight.normal_(1, 0.1)
            layer.bias.normal_(0, 0.1)
        torch.testing.assert_close(layer.forward_oot(x), layer.forward_native(x), **tol)

    tower = nn.Sequential(
        nn.LayerNorm(64, eps=1e-6), nn.Linear(64, 64), nn.LayerNorm(64, bias=False),
        nn.LayerNorm((4, 16)),  # over two dimensions: left to torch
    ).to(dtype)  # fmt: skip
    x4 = x.view(5, 4, 16)
    want = [tower[0](x), tower[2](x), tower[3](x4)]
    assert br_vision.adopt_torch_layer_norms(tower) == 2
    assert [type(m) for m in tower] == [
        br_vision.SUPATorchLayerNorm, nn.Linear, br_vision.SUPATorchLayerNorm,
        nn.LayerNorm,
    ]  # fmt: skip
    with count_calls("layer_norm") as calls:
        got = [tower[0](x), tower[2](x), tower[3](x4)]
    assert calls["layer_norm"] == 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tol)
    assert br_vision.adopt_torch_layer_norms(tower) == 0  # idempotent


# ---- embedding and logits ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_parallel_embedding_layer(dtype):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )

    emb = VocabParallelEmbedding(100, 16, params_dtype=dtype)
    assert type(emb) is br_emb.SUPAVocabParallelEmbedding
    emb.weight.data.normal_()
    ids = torch.randint(0, 100, (3, 5))
    same(emb(ids), F.embedding(ids, emb.weight))


def test_vocab_parallel_embedding_tp2(monkeypatch):
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe

    table = torch.randn(1010, 8)
    ids = torch.randint(0, 1010, (40,))
    total = torch.zeros(40, 8)
    monkeypatch.setattr(vpe, "get_tensor_model_parallel_world_size", lambda: 2)
    for rank in range(2):
        monkeypatch.setattr(vpe, "get_tensor_model_parallel_rank", lambda r=rank: r)
        emb = vpe.VocabParallelEmbedding(1010, 8, reduce_results=False)
        assert type(emb) is br_emb.SUPAVocabParallelEmbedding and emb.tp_size == 2
        emb.weight.data.zero_()
        emb.weight_loader(emb.weight, table)
        total += emb(ids)
    assert torch.equal(total, table[ids])


@pytest.mark.parametrize("soft_cap,scale", [(None, 1.0), (30.0, 0.5)])
def test_logits_processor_layer(soft_cap, scale):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    lm_head = ParallelLMHead(130, 24, disable_tp=True)
    lm_head.weight.data.normal_()
    lp = LogitsProcessor(130, soft_cap=soft_cap, scale=scale)
    assert type(lp) is br_emb.SUPALogitsProcessor
    hidden = torch.randn(6, 24)
    bias = torch.randn(lm_head.weight.shape[0])
    # the head projection: ours equals vLLM's
    same(
        lp._apply_head(lm_head, hidden, bias),
        LogitsProcessor._apply_head(lp, lm_head, hidden, bias),
    )
    logits = lp(lm_head, hidden)
    assert logits.shape == (6, 130)
    same(logits, LogitsProcessor.forward(lp, lm_head, hidden))
    expected = F.linear(hidden, lm_head.weight)[:, :130]
    if soft_cap is not None:
        expected = torch.tanh(expected / soft_cap) * soft_cap
    torch.testing.assert_close(logits, expected * scale, atol=1e-5, rtol=1.3e-6)
    assert torch.equal(lp.get_top_tokens(lm_head, hidden), logits.argmax(-1))


# ---- weight layout ----------------------------------------------------------------

PARTITIONS = [[12], [6, 6], [8, 4, 4], [2, 10]]


@pytest.mark.parametrize("layout", [NUMA, UMA])
@pytest.mark.parametrize("dies", [1, 2])
@pytest.mark.parametrize("sizes", PARTITIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_layout_round_trip(layout, dies, sizes, dtype):
    w = torch.randn(sum(sizes), 7, dtype=dtype)
    b = torch.randn(sum(sizes), dtype=dtype)
    for t in (w, b):
        dev = wl.to_device_layout(t, layout, dies, sizes)
        assert dev.shape == t.shape and dev.dtype == t.dtype
        assert torch.equal(wl.from_device_layout(dev, layout, dies, sizes), t)
        if layout == UMA or dies == 1 or len(sizes) == 1:
            assert torch.equal(dev, t)  # plain layout
    assert torch.equal(
        wl.from_device_layout(wl.to_device_layout(w, layout, dies), layout, dies), w
    )


def test_numa_layout_splits_every_partition_per_die():
    gate = torch.arange(8.0).unsqueeze(1).expand(8, 3)
    up = 100 + torch.arange(8.0).unsqueeze(1).expand(8, 3)
    w = torch.cat((gate, up))
    dev = wl.to_device_layout(w, NUMA, 2, [8, 8])
    # die 0: first half of gate, first half of up; die 1: the second halves
    assert torch.equal(dev[:8], torch.cat((gate[:4], up[:4])))
    assert torch.equal(dev[8:], torch.cat((gate[4:], up[4:])))
    assert not torch.equal(dev, w)


def test_weight_layout_rejects_bad_arguments():
    w = torch.randn(10, 4)
    with pytest.raises(ValueError):
        wl.to_device_layout(w, NUMA, 2, [5, 5])  # 5 rows do not split on 2 dies
    with pytest.raises(ValueError):
        wl.to_device_layout(w, NUMA, 2, [4, 4])  # does not add up to 10
    with pytest.raises(ValueError):
        wl.to_device_layout(w, "ROW", 2)
    assert DeviceLayout.make(NUMA, 2, [5, 5], w.device) is None  # falls back to plain
    assert DeviceLayout.make(NUMA, 2, [10], w.device) is None  # already per-die
    assert DeviceLayout.make(UMA, 2, [4, 6], w.device) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", [[6, 10], [16, 8, 8], [2, 2]], ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_op_is_unchanged_by_numa_layout(dtype, sizes, with_bias):
    x = torch.randn(7, 33, dtype=dtype)
    w = torch.randn(sum(sizes), 33, dtype=dtype)
    b = torch.randn(sum(sizes), dtype=dtype) if with_bias else None
    layout = DeviceLayout.make(NUMA, 2, sizes, w.device)
    assert layout is not None
    dev_w = wl.to_device_layout(w, NUMA, 2, sizes)
    same(linear_op.linear(x, dev_w, b, layout), F.linear(x, w, b))
    same(linear_op.linear(x, w, b, None), F.linear(x, w, b))


class _FakeSupaBackend:
    name = "supa"
    numa_weight_layout = True  # a card's capability (device/base.py)

    def __init__(self, dies):
        self.dies = dies

    def topology(self):
        from vllm_br.device.base import Topology

        return Topology(1, [[True]], [0], [32], dies_per_device=[self.dies])

    def fused_kernels(self):
        return {}


def test_current_layout_follows_backend_topology_and_env(monkeypatch):
    import vllm_br.device

    assert wl.current_layout() == (UMA, 1)  # cpu backend: always plain
    monkeypatch.setattr(vllm_br.device, "get_backend", lambda: _FakeSupaBackend(2))
    monkeypatch.delenv("VLLM_BR_WEIGHT_TYPE", raising=False)
    assert wl.current_layout() == (NUMA, 2)
    monkeypatch.setenv("VLLM_BR_WEIGHT_TYPE", "UMA")
    assert wl.current_layout() == (UMA, 2)
    monkeypatch.setattr(vllm_br.device, "get_backend", lambda: _FakeSupaBackend(1))
    monkeypatch.setenv("VLLM_BR_WEIGHT_TYPE", "NUMA")
    assert wl.current_layout() == (NUMA, 1)


def linear_layers():
    from vllm.model_executor.layers import linear as L

    return [
        ("replicated", lambda: L.ReplicatedLinear(33, 20, bias=True), [20]),
        ("column", lambda: L.ColumnParallelLinear(33, 20, bias=True), [20]),
        (
            "merged",
            lambda: L.MergedColumnParallelLinear(33, [12, 12], bias=True),
            [12, 12],
        ),
        ("qkv", lambda: L.QKVParallelLinear(33, 8, 4, 2, bias=True), [32, 16, 16]),
        ("row", lambda: L.RowParallelLinear(33, 20, bias=True), [20]),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dies", [1, 2])
@pytest.mark.parametrize(
    "name,make,sizes", linear_layers(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_linear_layers_with_device_layout(monkeypatch, dtype, dies, name, make, sizes):
    torch.set_default_dtype(dtype)
    try:
        layer = make()
    finally:
        torch.set_default_dtype(torch.float32)
    assert type(layer).__name__ == "SUPA" + type(layer).__mro__[2].__name__
    assert type(layer.quant_method) is br_linear.SUPAUnquantizedLinearMethod
    assert list(layer.output_partition_sizes) == sizes
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(7, 33, dtype=dtype)
    expected = F.linear(x, w, b)

    monkeypatch.setattr(wl, "current_layout", lambda: (NUMA, dies))
    layer.quant_method.process_weights_after_loading(layer)
    numa = dies == 2 and len(sizes) > 1
    assert (layer.br_weight_layout is not None) == numa
    assert torch.equal(layer.weight, w) != numa  # stored permuted iff NUMA applies
    assert torch.equal(br_linear.logical_weight(layer), w)
    out, out_bias = layer(x)
    assert out_bias is None
    same(out, expected)


def test_linear_skip_bias_add_returns_logical_bias(monkeypatch):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(16, [8, 8], bias=True, skip_bias_add=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    monkeypatch.setattr(wl, "current_layout", lambda: (NUMA, 2))
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.br_weight_layout is not None
    x = torch.randn(3, 16)
    out, out_bias = layer(x)
    same(out, F.linear(x, w))
    same(out_bias, b)


def test_linear_layers_keep_plain_layout_on_cpu_backend():
    from vllm.model_executor.layers.linear import QKVParallelLinear

    layer = QKVParallelLinear(16, 8, 2, 1, bias=False)
    layer.weight.data.normal_()
    w = layer.weight.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.br_weight_layout is None and torch.equal(layer.weight, w)
    x = torch.randn(5, 16)
    same(layer(x)[0], F.linear(x, w))


def test_moe_gate_linear_runs_the_linear_op():
    # GLM-4-MoE / DeepSeek build their router as a float32 GateLinear with
    # float32 logits; on bfloat16 activations it casts the input up and its
    # GEMM is the plugin's linear op (vLLM's own tiers are CUDA/ROCm only).
    from vllm.model_executor.layers.fused_moe import GateLinear

    layer = GateLinear(16, 8, out_dtype=torch.float32, params_dtype=torch.float32)
    assert type(layer) is br_linear.SUPAGateLinear
    assert type(layer.quant_method) is br_linear.SUPAUnquantizedLinearMethod
    layer.weight.data.normal_()
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    logits, _ = layer(x)
    assert logits.dtype == torch.float32
    same(logits, F.linear(x.float(), layer.weight))


def test_mla_kv_b_proj_keeps_plain_layout(monkeypatch):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(16, [8, 8], bias=False)
    layer._cpu_skip_gemm_dispatch = True  # vLLM's marker: raw weight read elsewhere
    layer.weight.data.normal_()
    w = layer.weight.detach().clone()
    monkeypatch.setattr(wl, "current_layout", lambda: (NUMA, 2))
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.br_weight_layout is None and torch.equal(layer.weight, w)


def test_pre_processed_weights_are_not_permuted_again(monkeypatch):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm.model_executor.utils import weights_already_processed

    layer = MergedColumnParallelLinear(16, [8, 8], bias=False)
    layer.weight.data.normal_()
    w = layer.weight.detach().clone()
    dev_w = wl.to_device_layout(w, NUMA, 2, [8, 8])
    layer.weight.data.copy_(dev_w)  # what the weight cache hands back
    monkeypatch.setattr(wl, "current_layout", lambda: (NUMA, 2))
    with weights_already_processed():
        layer.quant_method.process_weights_after_loading(layer)
    assert layer.br_weight_layout is not None and torch.equal(layer.weight, dev_w)
    x = torch.randn(3, 16)
    same(layer(x)[0], F.linear(x, w))


# ---- float32 GEMM copies of bfloat16 weights (hosts without fast bf16 matmul) -----


def _fp32_gemm(x, w, b=None):
    """A bf16 GEMM with float32 accumulation, one rounding: the reference."""
    bias = None if b is None else b.float()
    return F.linear(x.float(), w.float(), bias).to(x.dtype)


@pytest.mark.parametrize("layout_kind", [None, NUMA])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_op_with_matmul_weight(layout_kind, with_bias):
    sizes = [16, 8, 8]
    x = torch.randn(7, 33, dtype=torch.bfloat16)
    w = torch.randn(sum(sizes), 33, dtype=torch.bfloat16)
    b = torch.randn(sum(sizes), dtype=torch.bfloat16) if with_bias else None
    layout, dev_w = None, w
    if layout_kind is not None:
        layout = DeviceLayout.make(layout_kind, 2, sizes, w.device)
        dev_w = wl.to_device_layout(w, layout_kind, 2, sizes)
    out = linear_op.linear(x, dev_w, b, layout, dev_w.float())
    assert out.dtype == torch.bfloat16
    same(out, _fp32_gemm(x, w, b))
    # ... and agrees with torch's native bf16 GEMM up to summation order.
    torch.testing.assert_close(out, F.linear(x, w, b), atol=0.0625, rtol=1.6e-2)


def _bf16_model():
    from vllm.model_executor.layers import linear as L
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    torch.set_default_dtype(torch.bfloat16)
    try:
        model = torch.nn.ModuleDict(
            dict(
                qkv=L.QKVParallelLinear(32, 8, 4, 2, bias=True),
                row=L.RowParallelLinear(32, 16, bias=False),
                lm_head=ParallelLMHead(130, 32, disable_tp=True),
            )
        )
    finally:
        torch.set_default_dtype(torch.float32)
    for p in model.parameters():
        p.data.normal_()
    for name in ("qkv", "row"):
        model[name].quant_method.process_weights_after_loading(model[name])
    return model


def test_attach_matmul_weights_on_fp32_policy(monkeypatch):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from vllm_br.layers import matmul_weights

    monkeypatch.setenv("VLLM_BR_CPU_BF16_MATMUL", "fp32")
    model = _bf16_model()
    added = matmul_weights.attach(model)
    copies = {n: getattr(m, matmul_weights.MATMUL_WEIGHT) for n, m in model.items()}
    assert added == sum(c.numel() * 4 for c in copies.values())
    for name, copy in copies.items():
        assert copy.dtype == torch.float32
        assert torch.equal(copy, model[name].weight.float())
    # Not weights: they stay out of the state dict, and weight stays bf16.
    assert all("br_matmul_weight" not in k for k in model.state_dict())
    assert model["qkv"].weight.dtype == torch.bfloat16

    x = torch.randn(5, 32, dtype=torch.bfloat16)
    qkv = model["qkv"]
    same(qkv(x)[0], _fp32_gemm(x, qkv.weight, qkv.bias))
    lp = LogitsProcessor(130)
    same(lp(model["lm_head"], x), _fp32_gemm(x, model["lm_head"].weight)[:, :130])


def test_attach_matmul_weights_native_policy_adds_nothing(monkeypatch):
    from vllm_br.layers import matmul_weights

    monkeypatch.setenv("VLLM_BR_CPU_BF16_MATMUL", "native")
    model = _bf16_model()
    assert matmul_weights.attach(model) == 0
    assert not any(hasattr(m, matmul_weights.MATMUL_WEIGHT) for m in model.values())
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    same(model["row"](x)[0], F.linear(x, model["row"].weight))


@pytest.mark.parametrize("packed_gemm", ["1", "0"])
def test_prepare_packs_gemm_weights_where_bound(monkeypatch, packed_gemm):
    """After attach, prepare hands each GEMM weight without a float32 copy to
    the device's prepare_gemm_weight op: on a cpu host with fast bf16 that
    packs it for oneDNN (VLLM_BR_CPU_PACKED_GEMM=1), and the layers and the
    logits processor then multiply the packed weights; elsewhere nothing."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from vllm_br.device.cpu_kernels import packed_linear
    from vllm_br.layers import matmul_weights
    from vllm_br.ops import registry

    monkeypatch.setenv("VLLM_BR_CPU_BF16_MATMUL", "native")
    monkeypatch.setenv("VLLM_BR_CPU_PACKED_GEMM", packed_gemm)
    registry.clear_cache()
    packed_linear.clear()
    calls = []
    real = packed_linear._packed_mm
    monkeypatch.setattr(
        packed_linear, "_packed_mm", lambda *a: calls.append(1) or real(*a)
    )
    try:
        model = _bf16_model()
        assert matmul_weights.attach(model) == 0
        added = matmul_weights.prepare(model)
        packs = packed_gemm == "1" and packed_linear.host_supported()
        weights = [model[n].weight for n in ("qkv", "row", "lm_head")]
        assert added == (sum(w.numel() * 2 for w in weights) if packs else 0)
        assert all((packed_linear.lookup(w) is not None) is packs for w in weights)
        assert not any("packed" in k for k in model.state_dict())

        x = torch.randn(5, 32, dtype=torch.bfloat16)
        qkv, row = model["qkv"], model["row"]
        for out, ref in (
            (qkv(x)[0], F.linear(x, qkv.weight, qkv.bias)),
            (row(x)[0], F.linear(x, row.weight)),
            (
                LogitsProcessor(130)(model["lm_head"], x),
                F.linear(x, model["lm_head"].weight)[:, :130],
            ),
        ):
            # the packed GEMM: up to summation order (1 bf16 ulp)
            torch.testing.assert_close(out, ref, rtol=2**-7, atol=2**-8)
            if not packs:
                same(out, ref)
        assert len(calls) == (3 if packs else 0)
    finally:
        packed_linear.clear()
        registry.clear_cache()
