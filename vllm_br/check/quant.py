"""The quantized GEMMs of the ``ops`` group: ``quantize_int8``,
``int8_scaled_mm`` and ``weight_only_linear`` through ``get_op`` on the
device, in float32 and bfloat16, against float64 formulas written here.

Integer parts are exact: int8 x int8 products accumulate in int32 (checked
bit for bit with unit scales), and per-token quantization puts every value
within half a step of its input. Scaled outputs use the ``ops`` tolerances
(``vllm_br.check.ops``), and each op is checked with rows stored in the
two-die NUMA layout as well.
"""

from __future__ import annotations

import math

import torch

from vllm_br.check.base import OpCheck, d64, generator, op_measure, randn
from vllm_br.check.ops import TOL
from vllm_br.ops.quant import pack_int4
from vllm_br.ops.registry import get_op

PARTS = (64, 32, 32)  # a fused q/k/v weight


def _ints(ctx, g, *shape, low=-128, high=128):
    return torch.randint(low, high, shape, generator=g, dtype=torch.int8).to(ctx.device)


def _layout(ctx):
    from vllm_br.ops.weight_layout import DeviceLayout

    return DeviceLayout.make("NUMA", 2, PARTS, ctx.device)


def _check_quantize_int8(ctx, dtype, tol):
    m = op_measure(tol, "quantize_int8")
    g = generator(21)
    x = randn(ctx, g, 7, 96, dtype=dtype, scale=3.0)
    q, s, zp = get_op("quantize_int8")(x)
    xs = d64(x)
    s_ref = xs.abs().amax(dim=-1, keepdim=True) / 127
    m.close("per-token scale", s, s_ref)
    step = (d64(q) * s_ref - xs).abs() / s_ref
    m.close("within half a step", step.clamp(min=0.5), torch.full_like(step, 0.5))
    if zp is not None:
        m.failures.append("symmetric quantization returned a zero point")
    return m.outcome()


def _check_int8_scaled_mm(ctx, dtype, tol):
    m = op_measure(tol, "int8_scaled_mm")
    g = generator(22)
    op = get_op("int8_scaled_mm")
    n = sum(PARTS)
    w = _ints(ctx, g, n, 160)
    ones = torch.ones(n, device=ctx.device)
    for rows in (1, 33):
        xq = _ints(ctx, g, rows, 160)
        acc = xq.cpu().to(torch.int64) @ w.cpu().to(torch.int64).T
        one = torch.ones(rows, 1, device=ctx.device)
        got = op(xq, w, one, ones, torch.float32)
        m.exact(f"{rows} rows, int32 sums", got.cpu(), acc.to(torch.float32))
        xs = randn(ctx, g, rows, 1, dtype=torch.float32, scale=0.01).abs()
        ws = randn(ctx, g, n, dtype=torch.float32, scale=0.01).abs()
        b = randn(ctx, g, n, dtype=dtype)
        ref = d64(acc) * d64(xs) * d64(ws) + d64(b)
        m.close(f"{rows} rows, scales and bias", op(xq, w, xs, ws, dtype, None, b), ref)
        layout = _layout(ctx)
        w_dev, ws_dev = w[layout.to_device], ws[layout.to_device]
        got = op(xq, w_dev, xs, ws_dev, dtype, None, b, layout)
        m.close(f"{rows} rows, NUMA layout", got, ref)
    return m.outcome()


def _check_weight_only_linear(ctx, dtype, tol):
    m = op_measure(tol, "weight_only_linear")
    g = generator(23)
    op = get_op("weight_only_linear")
    n, k = sum(PARTS), 128
    for bits, group in ((8, k), (8, 32), (4, 32)):
        q = _ints(ctx, g, n, k, low=-(1 << (bits - 1)), high=1 << (bits - 1))
        # Weights of about 1 / sqrt(k), as in the linear check.
        scale = 1 / (math.sqrt(k) * (1 << (bits - 1)))
        s = randn(ctx, g, n, k // group, dtype=dtype, scale=scale).abs()
        z = _ints(ctx, g, n, k // group, low=-2, high=3)
        stored = pack_int4(q.cpu()).to(ctx.device) if bits == 4 else q
        w = (d64(q).view(n, -1, group) - d64(z).unsqueeze(-1)) * d64(s).unsqueeze(-1)
        w = w.view(n, k)
        x = randn(ctx, g, 5, k, dtype=dtype)
        label = f"int{bits}, group {group}"
        m.close(f"{label}, zero points", op(x, stored, s, z, bits), d64(x) @ w.T)
        layout = _layout(ctx)
        i = layout.to_device
        got = op(x, stored[i], s[i], z[i], bits, None, layout)
        m.close(f"{label}, NUMA layout", got, d64(x) @ w.T)
    return m.outcome()


CHECKS: list[OpCheck] = [
    OpCheck("quantize_int8", ("quantize_int8",), _check_quantize_int8, TOL),
    OpCheck("int8_scaled_mm", ("int8_scaled_mm",), _check_int8_scaled_mm, TOL),
    OpCheck(
        "weight_only_linear", ("weight_only_linear",), _check_weight_only_linear, TOL
    ),
]
