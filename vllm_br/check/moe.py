"""The ``ops`` group, mixture-of-experts part: routing (``fused_topk``,
``grouped_topk``) and the routed experts (``fused_experts``) through
``get_op`` on the device in float32 and bfloat16 against float64 formulas
(see ``ops.py`` for the inputs and the error).

Routing: the chosen experts must be a top-k of the float64 scores (an
expert within ``1e-5`` of the k-th best may stand in for it: float32 scores
round at ~1e-7), inside the float64 top groups for ``grouped_topk``; their
weights are compared with the float64 scores of the experts chosen.
Tolerances as ``ops.py``, except the routed experts in bfloat16, ``3e-2``:
two GEMMs and the activation each round to bfloat16 before the float32 sum
over experts.
"""

from __future__ import annotations

import math

import torch

from vllm_br.check.base import (
    BFLOAT16,
    FLOAT32,
    OpCheck,
    d64,
    generator,
    op_measure,
    randn,
)
from vllm_br.check.formulas import gelu_tanh, halves, sigmoid
from vllm_br.check.ops import TOL
from vllm_br.ops.registry import get_op

TOL_EXPERTS = {FLOAT32: 1e-5, BFLOAT16: 3e-2}
_TIE = 1e-5


def _scores64(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "softmax":
        e = torch.exp(logits - logits.max(-1, keepdim=True).values)
        return e / e.sum(-1, keepdim=True)
    return sigmoid(logits)


def _check_topk_choice(m, label, ids, choice, allowed, k):
    """``ids`` [N, k] must be k distinct experts among ``allowed`` whose
    float64 ``choice`` is each within _TIE of the k-th best allowed one."""
    bad = 0
    for row in range(ids.shape[0]):
        picked = ids[row].tolist()
        c = choice[row].masked_fill(~allowed[row], -math.inf)
        kth = torch.topk(c, k).values[-1]
        ok = (
            len(set(picked)) == k
            and all(0 <= e < c.numel() for e in picked)
            and all(bool(allowed[row, e]) and c[e] >= kth - _TIE for e in picked)
        )
        bad += not ok
    m.require(
        f"{label} ids", bad == 0, f"{bad} of {ids.shape[0]} rows chose other experts"
    )


def _ref_weights(scores, ids, renorm, scale):
    w = scores.gather(1, ids.long())
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    return w * scale


def _check_fused_topk(ctx, dtype, tol):
    m = op_measure(tol, "fused_topk")
    g = generator(15)
    op = get_op("fused_topk")
    n, e = 24, 16
    logits = randn(ctx, g, n, e, dtype=dtype, scale=2.0)
    bias = randn(ctx, g, e, dtype=torch.float32, scale=0.3)
    everything = torch.ones(n, e, dtype=torch.bool)
    for label, k, renorm, scoring, with_bias, scale in (
        ("softmax top-2 renormalised", 2, True, "softmax", False, 1.0),
        ("softmax top-3", 3, False, "softmax", False, 1.0),
        ("sigmoid top-4 with bias", 4, True, "sigmoid", True, 2.5),
    ):
        b = bias if with_bias else None
        weights, ids = op(logits, k, renorm, scoring, b, scale)
        m.require(
            f"{label} dtypes",
            weights.dtype == torch.float32 and ids.dtype == torch.int32,
            f"got {weights.dtype}, {ids.dtype}",
        )
        scores = _scores64(d64(logits), scoring)
        choice = scores + (d64(b) if with_bias else 0.0)
        ids_cpu = ids.cpu().long()
        _check_topk_choice(m, label, ids_cpu, choice, everything, k)
        m.close(
            f"{label} weights", weights, _ref_weights(scores, ids_cpu, renorm, scale)
        )
    return m.outcome()


def _grouped_allowed(choice, groups, topk_group, biased):
    """Experts in the float64 top ``topk_group`` groups; rows where the
    group choice is within _TIE of a tie allow every group in the tie."""
    n, e = choice.shape
    per = e // groups
    grouped = choice.view(n, groups, per)
    if biased:
        gs = grouped.topk(min(2, per), dim=-1).values.sum(-1)
    else:
        gs = grouped.amax(-1)
    kth = torch.topk(gs, topk_group, dim=-1).values[:, -1:]
    ok_group = gs >= kth - _TIE
    return ok_group[:, :, None].expand(n, groups, per).reshape(n, e)


def _check_grouped_topk(ctx, dtype, tol):
    m = op_measure(tol, "grouped_topk")
    g = generator(16)
    op = get_op("grouped_topk")
    n, e, groups, topk_group, k = 24, 16, 4, 2, 4
    logits = randn(ctx, g, n, e, dtype=dtype, scale=2.0)
    bias = randn(ctx, g, e, dtype=torch.float32, scale=0.3)
    for label, scoring, with_bias, renorm, scale in (
        ("DeepSeek V2 softmax", "softmax", False, False, 1.0),
        ("DeepSeek V3 sigmoid with bias", "sigmoid", True, True, 2.5),
    ):
        b = bias if with_bias else None
        weights, ids = op(logits, k, renorm, groups, topk_group, scoring, b, scale)
        scores = _scores64(d64(logits), scoring)
        choice = scores + (d64(b) if with_bias else 0.0)
        allowed = _grouped_allowed(choice, groups, topk_group, with_bias)
        ids_cpu = ids.cpu().long()
        _check_topk_choice(m, label, ids_cpu, choice, allowed, k)
        used = [len({int(x) // (e // groups) for x in row}) for row in ids_cpu]
        m.require(
            f"{label} groups",
            max(used) <= topk_group,
            f"a row used {max(used)} groups, at most {topk_group} allowed",
        )
        m.close(
            f"{label} weights", weights, _ref_weights(scores, ids_cpu, renorm, scale)
        )
    return m.outcome()


_ACT64 = {
    "silu": lambda h: (lambda a, b: a * sigmoid(a) * b)(*halves(h)),
    "gelu_tanh": lambda h: (lambda a, b: gelu_tanh(a) * b)(*halves(h)),
    "relu2_no_mul": lambda h: torch.relu(h) ** 2,
}


def _experts_ref(x, w13, w2, weights, ids, act, expert_map=None, on_input=False):
    """Per token and slot, in float64: ``sum_k w_k * w2[e] @ act(w13[e] @ x)``."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if expert_map is not None and e >= 0:
                e = int(expert_map[e])
            if not 0 <= e < w13.shape[0]:
                continue
            w = float(weights[t, s])
            xt = x[t] * w if on_input else x[t]
            y = w2[e] @ _ACT64[act](w13[e] @ xt)
            out[t] += y if on_input else w * y
    return out


def _check_fused_experts(ctx, dtype, tol):
    m = op_measure(tol, "fused_experts")
    g = generator(17)
    op = get_op("fused_experts")
    e, h, i = 8, 64, 32
    w13 = randn(ctx, g, e, 2 * i, h, dtype=dtype, scale=1 / math.sqrt(h))
    w13_no_mul = randn(ctx, g, e, i, h, dtype=dtype, scale=1 / math.sqrt(h))
    w2 = randn(ctx, g, e, h, i, dtype=dtype, scale=1 / math.sqrt(i))

    def routing(n, k, num_experts):
        ids = torch.stack(
            [torch.randperm(num_experts, generator=g)[:k] for _ in range(n)]
        )
        w = torch.softmax(torch.randn(n, k, generator=g), -1)
        return w.to(ctx.device), ids.to(torch.int32).to(ctx.device)

    # (label, tokens, top-k, activation, static_max_tokens, w13, a -1 slot)
    for label, n, k, act, static, up, pad in (
        ("static gather", 2, 2, "silu", None, w13, False),
        ("static dense", 6, 2, "silu", None, w13, True),
        ("dynamic", 6, 2, "gelu_tanh", 0, w13, True),
        ("static dense relu2", 6, 2, "relu2_no_mul", None, w13_no_mul, False),
    ):
        x = randn(ctx, g, n, h, dtype=dtype)
        weights, ids = routing(n, k, e)
        ids_cpu = ids.cpu()
        if pad:
            ids_cpu[0, 1] = -1  # a padding slot adds nothing
            ids = ids_cpu.to(ctx.device)
        got = op(x, up, w2, weights, ids, act, static_max_tokens=static)
        ref = _experts_ref(d64(x), d64(up), d64(w2), weights.cpu(), ids_cpu, act)
        m.close(label, got, ref)

    # Expert parallelism: 16 global experts, this rank holds the odd ones.
    expert_map = torch.full((16,), -1, dtype=torch.int32)
    expert_map[1::2] = torch.arange(8, dtype=torch.int32)
    for label, static in (("expert map, static", None), ("expert map, dynamic", 0)):
        x = randn(ctx, g, 5, h, dtype=dtype)
        weights, ids = routing(5, 3, 16)
        got = op(
            x, w13, w2, weights, ids, "silu",
            expert_map=expert_map.to(ctx.device), static_max_tokens=static,
        )  # fmt: skip
        ref = _experts_ref(
            d64(x), d64(w13), d64(w2), weights.cpu(), ids.cpu(), "silu", expert_map
        )
        m.close(label, got, ref)

    x = randn(ctx, g, 4, h, dtype=dtype)
    weights, ids = routing(4, 1, e)
    got = op(x, w13, w2, weights, ids, "silu", apply_router_weight_on_input=True)
    # The op scales the input and rounds it to the dtype first.
    x_scaled = (x.float() * weights).to(dtype)
    ref = _experts_ref(
        d64(x_scaled), d64(w13), d64(w2), torch.ones(4, 1), ids.cpu(), "silu"
    )
    m.close("router weight on input", got, ref)
    return m.outcome()


CHECKS: list[OpCheck] = [
    OpCheck("fused_topk", ("fused_topk",), _check_fused_topk, TOL),
    OpCheck("grouped_topk", ("grouped_topk",), _check_grouped_topk, TOL),
    OpCheck("fused_experts", ("fused_experts",), _check_fused_experts, TOL_EXPERTS),
]
