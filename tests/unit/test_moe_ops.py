"""vllm_br.ops.moe against per-token loops written here (float64), and the
routing also against vLLM's own plain-torch CPU router.

Tolerances: routing weights are computed in float32 from the logits, so
they match the float64 loop to atol 1e-6 / rtol 1e-5 in both input dtypes.
Experts: float32 atol 1e-5 / rtol 1e-5 against the float64 loop; bfloat16
atol 3e-2 / rtol 2e-2 (the GEMMs and the activation round to bfloat16 on
the way; outputs are O(1)). The static and dynamic paths agree to the same
tolerances; routing ids must be identical.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_br.ops import get_op, moe

WEIGHT_TOL = {"atol": 1e-6, "rtol": 1e-5}
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---- per-token references ------------------------------------------------


def _ref_scores(logits_row: torch.Tensor, scoring_func: str) -> torch.Tensor:
    row = logits_row.double()
    if scoring_func == "softmax":
        return row.exp() / row.exp().sum()
    return 1.0 / (1.0 + (-row).exp())


def _ref_topk(logits, top_k, renormalize, scoring_func, bias=None, scale=1.0):
    """Plain top-k of the (biased) scores, token by token."""
    weights, ids = [], []
    for row in logits:
        scores = _ref_scores(row, scoring_func)
        choice = scores if bias is None else scores + bias.double()
        chosen = sorted(range(len(row)), key=lambda e: -choice[e].item())[:top_k]
        w = scores[chosen]
        if renormalize:
            w = w / w.sum()
        weights.append(w * scale)
        ids.append(chosen)
    return torch.stack(weights), torch.tensor(ids)


def _ref_grouped(logits, top_k, renormalize, groups, topk_group, scoring_func,
                 bias=None, scale=1.0):  # fmt: skip
    """DeepSeek V3's routing as its paper/model code describes it."""
    num_experts = logits.shape[1]
    size = num_experts // groups
    weights, ids = [], []
    for row in logits:
        scores = _ref_scores(row, scoring_func)
        choice = scores if bias is None else scores + bias.double()

        group_scores = []
        for g in range(groups):
            members = sorted(choice[g * size : (g + 1) * size].tolist(), reverse=True)
            group_scores.append(members[0] if bias is None else sum(members[:2]))
        kept = sorted(range(groups), key=lambda g: -group_scores[g])[:topk_group]
        candidates = [e for e in range(num_experts) if e // size in kept]
        chosen = sorted(candidates, key=lambda e: -choice[e].item())[:top_k]
        w = scores[chosen]
        if renormalize:
            w = w / w.sum()
        weights.append(w * scale)
        ids.append(chosen)
    return torch.stack(weights), torch.tensor(ids)


def _ref_act(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        gate, up = h.chunk(2)
        return gate * torch.sigmoid(gate) * up
    if activation == "gelu":
        gate, up = h.chunk(2)
        return F.gelu(gate) * up
    if activation == "relu2_no_mul":
        return h.clamp(min=0) ** 2
    raise AssertionError(activation)


def _ref_experts(x, w13, w2, weights, ids, activation="silu"):
    """sum_k w_k * w2[e_k] @ act(w13[e_k] @ x), token by token, in float64;
    ids outside [0, E) contribute nothing."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            h = w13[e].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (w2[e].double() @ _ref_act(h, activation))
    return out


def _by_id(weights, ids):
    """Per token, (ids, weights) in ascending id order: top-k order is free."""
    order = ids.long().argsort(dim=-1)
    return ids.long().gather(1, order), weights.double().gather(1, order)


def _assert_routing(got, expected):
    got_ids, got_w = _by_id(*got)
    exp_ids, exp_w = _by_id(*expected)
    assert torch.equal(got_ids, exp_ids)
    torch.testing.assert_close(got_w, exp_w, **WEIGHT_TOL)


# ---- fused_topk ------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_topk(dtype, scoring_func, renormalize):
    logits = torch.randn(11, 7, dtype=dtype)  # 7 experts: odd on purpose
    weights, ids = get_op("fused_topk")(logits, 3, renormalize, scoring_func)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (11, 3)
    _assert_routing((weights, ids), _ref_topk(logits, 3, renormalize, scoring_func))


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
def test_fused_topk_bias_chooses_and_unbiased_scores_weigh(scoring_func):
    logits = torch.randn(9, 8)
    bias = torch.randn(8)
    got = get_op("fused_topk")(logits, 2, True, scoring_func, bias, 2.5)
    _assert_routing(got, _ref_topk(logits, 2, True, scoring_func, bias, 2.5))
    # The bias changes the choice for some tokens (else this proves nothing).
    plain = get_op("fused_topk")(logits, 2, True, scoring_func)
    assert not torch.equal(_by_id(*got)[0], _by_id(*plain)[0])


def test_fused_topk_matches_vllm_cpu_router():
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk

    logits = torch.randn(17, 12)
    for renormalize in (True, False):
        _assert_routing(
            get_op("fused_topk")(logits, 4, renormalize),
            _softmax_topk(logits, 4, renormalize),
        )


# ---- grouped_topk ----------------------------------------------------------


GROUPED_CASES = [  # experts, groups, topk_group, top_k
    (16, 4, 2, 3),
    (12, 3, 1, 2),
    (8, 8, 3, 2),  # one expert per group
]


@pytest.mark.parametrize("case", GROUPED_CASES)
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_topk(case, scoring_func, with_bias, dtype):
    experts, groups, topk_group, top_k = case
    logits = torch.randn(13, experts, dtype=dtype)
    bias = torch.randn(experts) * 0.3 if with_bias else None
    for renormalize, scale in ((True, 1.0), (False, 2.5), (True, 16.0)):
        got = get_op("grouped_topk")(
            logits, top_k, renormalize, groups, topk_group, scoring_func, bias, scale
        )
        assert got[0].dtype == torch.float32 and got[1].dtype == torch.int32
        expected = _ref_grouped(
            logits, top_k, renormalize, groups, topk_group, scoring_func, bias, scale
        )
        _assert_routing(got, expected)


@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_topk_matches_vllm_cpu_router(with_bias):
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _grouped_topk

    logits = torch.randn(21, 32)
    bias = torch.randn(32) * 0.1 if with_bias else None
    for scoring_func in ("softmax", "sigmoid"):
        args = (logits, 4, True, 8, 3, scoring_func)
        _assert_routing(
            get_op("grouped_topk")(*args, bias, 2.5),
            _grouped_topk(
                *args, routed_scaling_factor=2.5, e_score_correction_bias=bias
            ),
        )


def test_grouped_topk_restricts_to_the_best_groups():
    # Group 1 holds the single best expert but group 0 the best pair: with a
    # bias (groups score their top two) group 0 wins, without it group 1.
    logits = torch.tensor([[4.5, 4.4, 5.0, -5.0]])
    zero_bias = torch.zeros(4)
    _, ids = get_op("grouped_topk")(logits, 1, False, 2, 1, "softmax")
    assert ids.tolist() == [[2]]
    _, ids = get_op("grouped_topk")(logits, 1, False, 2, 1, "softmax", zero_bias)
    assert ids.tolist() == [[0]]


def test_grouped_topk_refuses_uneven_groups():
    with pytest.raises(ValueError, match="do not split"):
        get_op("grouped_topk")(torch.randn(2, 10), 2, True, 3, 1)


# ---- fused_experts -----------------------------------------------------------

E, H, INTER = 7, 48, 20  # odd sizes: 7 experts, intermediate 20


def _weights(dtype, experts=E, gated=True):
    w13 = torch.randn(experts, (2 if gated else 1) * INTER, H) / H**0.5
    w2 = torch.randn(experts, H, INTER) / INTER**0.5
    return w13.to(dtype), w2.to(dtype)


def _routing(n, top_k=2, experts=E):
    logits = torch.randn(n, experts)
    return get_op("fused_topk")(logits, top_k, True)


def _run(x, w13, w2, weights, ids, static_max_tokens, **kw):
    return get_op("fused_experts")(
        x, w13, w2, weights, ids, static_max_tokens=static_max_tokens, **kw
    )


STATIC, DYNAMIC = 1 << 30, 0


# N*k <= E takes the static gather, N*k > E the static dense formulation.
@pytest.mark.parametrize("n", [1, 3, 4, 33])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu", "relu2_no_mul"])
def test_fused_experts_static_and_dynamic_match_reference(n, dtype, activation):
    w13, w2 = _weights(dtype, gated=activation != "relu2_no_mul")
    x = torch.randn(n, H).to(dtype)
    weights, ids = _routing(n)
    expected = _ref_experts(x, w13, w2, weights, ids, activation)
    static = _run(x, w13, w2, weights, ids, STATIC, activation=activation)
    dynamic = _run(x, w13, w2, weights, ids, DYNAMIC, activation=activation)
    assert static.dtype == dynamic.dtype == dtype and static.shape == (n, H)
    torch.testing.assert_close(static, expected.to(dtype), **TOL[dtype])
    torch.testing.assert_close(dynamic, expected.to(dtype), **TOL[dtype])
    torch.testing.assert_close(static, dynamic, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_dynamic_boundary(monkeypatch, dtype):
    """VLLM_BR_STATIC_MOE_DECODER_MAX_LEN tokens take the static path, one
    more the dynamic one; both equal the reference."""
    monkeypatch.setenv("VLLM_BR_STATIC_MOE_DECODER_MAX_LEN", "8")
    w13, w2 = _weights(dtype)
    act = moe.ACTIVATIONS["silu"]
    for n, path in ((8, moe._static_dense), (9, None)):
        x = torch.randn(n, H).to(dtype)
        weights, ids = _routing(n)
        got = get_op("fused_experts")(x, w13, w2, weights, ids)
        e13, e2 = moe._Experts(w13, None, dtype), moe._Experts(w2, None, dtype)
        if path is None:
            valid = torch.ones_like(ids, dtype=torch.bool)
            direct = moe._dynamic(
                x, e13, e2, weights, ids.long(), act, valid, moe._same
            )
        else:
            direct = path(x, e13, e2, weights, ids.long(), act, moe._same)
        assert torch.equal(got, direct.to(dtype)), f"N={n} took the other path"
        expected = _ref_experts(x, w13, w2, weights, ids)
        torch.testing.assert_close(got, expected.to(dtype), **TOL[dtype])


def test_default_static_limit_is_the_env_default(monkeypatch):
    from vllm_br import envs

    monkeypatch.delenv("VLLM_BR_STATIC_MOE_DECODER_MAX_LEN", raising=False)
    assert envs.VLLM_BR_STATIC_MOE_DECODER_MAX_LEN == 256


@pytest.mark.parametrize("static", [STATIC, DYNAMIC])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dropped_slots_and_tokens_routed_nowhere(static, dtype):
    """-1 ids (padding rows, experts on another EP rank) add nothing; a token
    with no expert at all gets zeros; an expert nobody picked is skipped."""
    w13, w2 = _weights(dtype)
    x = torch.randn(6, H).to(dtype)
    ids = torch.tensor([[0, 3], [-1, 3], [-1, -1], [6, 0], [3, -1], [-1, -1]])
    weights = torch.rand(6, 2)
    got = _run(x, w13, w2, weights, ids.int(), static)
    torch.testing.assert_close(
        got, _ref_experts(x, w13, w2, weights, ids).to(dtype), **TOL[dtype]
    )
    assert torch.count_nonzero(got[2]) == 0 and torch.count_nonzero(got[5]) == 0
    none = torch.full((6, 2), -1)
    assert torch.count_nonzero(_run(x, w13, w2, weights, none, static)) == 0


@pytest.mark.parametrize("static", [STATIC, DYNAMIC])
def test_expert_map_and_router_weight_on_input(static):
    # 8 global experts, 4 on this rank (global 2, 3, 5, 7 -> local 0..3).
    w13, w2 = _weights(torch.float32, experts=4)
    expert_map = torch.tensor([-1, -1, 0, 1, -1, 2, 3, -1], dtype=torch.int32)
    x = torch.randn(10, H)
    weights, ids = _routing(10, top_k=3, experts=8)
    local = expert_map[ids.long()]
    got = _run(x, w13, w2, weights, ids, static, expert_map=expert_map)
    torch.testing.assert_close(
        got, _ref_experts(x, w13, w2, weights, local).float(), **TOL[torch.float32]
    )

    # Llama 4 style: top-1, the weight scales the expert's input instead.
    w1, i1 = _routing(10, top_k=1, experts=4)
    got = _run(x, w13, w2, w1, i1, static, apply_router_weight_on_input=True)
    expected = _ref_experts(x * w1, w13, w2, torch.ones_like(w1), i1)
    torch.testing.assert_close(got, expected.float(), **TOL[torch.float32])


def test_empty_batch_and_errors():
    w13, w2 = _weights(torch.float32)
    for limit in (STATIC, DYNAMIC):
        out = _run(
            torch.empty(0, H),
            w13,
            w2,
            torch.empty(0, 2),
            torch.empty(0, 2, dtype=torch.int32),
            limit,
        )
        assert out.shape == (0, H)
    weights, ids = _routing(3)
    with pytest.raises(ValueError, match="activation"):
        _run(torch.randn(3, H), w13, w2, weights, ids, STATIC, activation="swigluoai")
    with pytest.raises(ValueError, match="top_k == 1"):
        _run(
            torch.randn(3, H),
            w13,
            w2,
            weights,
            ids,
            STATIC,
            apply_router_weight_on_input=True,
        )


def test_registered_as_ops():
    from vllm_br.ops import registered_ops

    assert {"fused_topk", "grouped_topk", "fused_experts"} <= set(registered_ops())
    # The cpu backend binds no vendor kernels: the references serve.
    assert get_op("fused_experts") is moe.fused_experts


def _int8_experts(experts=E):
    """int8 expert weights of about the same scale as ``_weights``, with
    per-output-channel scales (``q * s``)."""
    w13q = torch.randint(-127, 128, (experts, 2 * INTER, H), dtype=torch.int8)
    w2q = torch.randint(-127, 128, (experts, H, INTER), dtype=torch.int8)
    s13 = torch.rand(experts, 2 * INTER) / (127 * H**0.5)
    s2 = torch.rand(experts, H) / (127 * INTER**0.5)
    return w13q, w2q, s13, s2


def _qdq_rows(v):
    """A row quantized to int8 with scale max|v| / 127 and back (float64)."""
    s = v.abs().amax(dim=-1, keepdim=True) / 127
    return torch.round(v / s).clamp(-128, 127) * s


@pytest.mark.parametrize("quantize_activations", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("n", [3, 9, 40])  # static gather, static dense, dynamic
def test_int8_experts_match_the_dequantized_formula(
    quantize_activations, n, monkeypatch
):
    """int8 experts: each expert weight is ``q * scale`` per output channel;
    with W8A8 each GEMM input row is quantized to int8 per token first.
    Against a float64 loop written here, on all three paths (float32)."""
    monkeypatch.setenv("VLLM_BR_STATIC_MOE_DECODER_MAX_LEN", "16")
    w13q, w2q, s13, s2 = _int8_experts()
    x = torch.randn(n, H)
    weights, ids = _routing(n)
    got = get_op("fused_experts")(
        x, w13q, w2q, weights, ids, w13_scale=s13, w2_scale=s2,
        quantize_activations=quantize_activations,
    )  # fmt: skip
    d13 = w13q.double() * s13.double().unsqueeze(-1)
    d2 = w2q.double() * s2.double().unsqueeze(-1)
    pre = _qdq_rows if quantize_activations else (lambda v: v)
    expected = torch.zeros(n, H, dtype=torch.float64)
    for t in range(n):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = d13[e] @ pre(x[t].double())
            a = _ref_act(h, "silu")
            expected[t] += float(weights[t, j]) * (d2[e] @ pre(a))
    # W8A8: an input within float32 rounding of a half step may round to the
    # other int8 on another host (its GEMM sums in another order): one step
    # (max|row| / 127) of one input, times a weight of about 1 / sqrt(I).
    tol = {"atol": 2e-3, "rtol": 1e-3} if quantize_activations else TOL[torch.float32]
    torch.testing.assert_close(got.double(), expected, **tol)


# Weight-only experts: H = 48 and INTER = 20 split into groups of 16 and 4.
GROUPS_13, GROUPS_2 = H // 16, INTER // 4


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("zero_points", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("n", [3, 9, 40])  # static gather, static dense, dynamic
@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_only_experts_match_the_dequantized_formula(
    bits, zero_points, n, dtype, monkeypatch
):
    """Weight-only experts (W8A16 / W4A16 / GPTQ): each weight is ``(q -
    zero) * scale`` per group of input channels, int4 packed two per byte
    (``pack_int4``). Against a float64 loop over the unpacked integers
    written here, on all three paths, in float32 and bfloat16."""
    from vllm_br.ops.quant import pack_int4

    monkeypatch.setenv("VLLM_BR_STATIC_MOE_DECODER_MAX_LEN", "16")
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    q13 = torch.randint(lo, hi, (E, 2 * INTER, H), dtype=torch.int8)
    q2 = torch.randint(lo, hi, (E, H, INTER), dtype=torch.int8)
    s13 = torch.rand(E, 2 * INTER, GROUPS_13) / (hi * H**0.5)
    s2 = torch.rand(E, H, GROUPS_2) / (hi * INTER**0.5)
    z13 = z2 = None
    if zero_points:
        z13 = torch.randint(lo, hi, (E, 2 * INTER, GROUPS_13), dtype=torch.int8)
        z2 = torch.randint(lo, hi, (E, H, GROUPS_2), dtype=torch.int8)
    x = torch.randn(n, H).to(dtype)
    weights, ids = _routing(n)
    stored = (pack_int4(q13), pack_int4(q2)) if bits == 4 else (q13, q2)
    got = get_op("fused_experts")(
        x, *stored, weights, ids, w13_scale=s13.to(dtype), w2_scale=s2.to(dtype),
        w13_zero_point=z13, w2_zero_point=z2, weight_bits=bits,
    )  # fmt: skip

    def dequantized(q, s, z):  # float64 [E, rows, cols], one group at a time
        size = q.shape[-1] // s.shape[-1]
        w = q.double().clone()
        for g in range(s.shape[-1]):
            cols = slice(g * size, (g + 1) * size)
            zero = 0 if z is None else z[..., g : g + 1].double()
            w[..., cols] = (w[..., cols] - zero) * s.to(dtype)[..., g : g + 1].double()
        return w

    expected = _ref_experts(
        x, dequantized(q13, s13, z13), dequantized(q2, s2, z2), weights, ids
    )
    assert got.dtype == dtype and got.shape == (n, H)
    # Outputs are O(1) as for the float experts; zero points shift the
    # integers (up to twice their range), so bfloat16 rounds more on the way.
    tol = TOL[dtype] if dtype == torch.float32 else {"atol": 6e-2, "rtol": 4e-2}
    torch.testing.assert_close(got.double(), expected, **tol)
