"""The ``ops`` group: each op of ``vllm_br.ops`` other than attention (see
``attention.py``, ``mla.py``) and mixture of experts (``moe.py``) through ``get_op`` on the device, in float32 and
bfloat16, against a float64 reference written here from the formula (never
the op's own reference, which may be what is broken).

Inputs are seeded on the host, rounded to the dtype, and moved to the
device; the reference reads the same rounded values in float64. Index
inputs (token ids, expert ids, positions) come from the same seeded
generators. Tolerances bound :func:`vllm_br.check.measure.max_error`:

- float32 ``1e-5``: a few float32 roundings; a device doing float32 GEMMs in
  TF32 (about ``5e-4``) fails, as it would change greedy tokens.
- bfloat16 ``1.6e-2`` (four units in the last place of bfloat16, ``2**-8``
  each): the op rounds its inputs' products and its output to bfloat16
  (the GEMMs, rotary and RMSNorm two or three times).
- bfloat16 ``3e-2`` for ``gelu_and_mul_sparse``, whose sparsity threshold (mean + 1.645 std of the
  gate) is rounded to bfloat16 before it is subtracted (as vLLM computes it).

Copies (embeddings) and indices (greedy sampling) are exact.
"""

from __future__ import annotations

import math

import torch

from vllm_br.check.base import (
    BFLOAT16,
    FLOAT32,
    CheckContext,
    OpCheck,
    d64,
    generator,
    op_measure,
    randn,
)
from vllm_br.check.formulas import gelu_erf, gelu_tanh, halves, sigmoid
from vllm_br.check.result import Outcome
from vllm_br.ops.registry import get_op

TOL = {FLOAT32: 1e-5, BFLOAT16: 1.6e-2}
TOL_SPARSE = {FLOAT32: 1e-5, BFLOAT16: 3e-2}


# --------------------------------------------------------------------------- #
# Activations
# --------------------------------------------------------------------------- #


_UNARY = {
    "gelu": gelu_erf,
    "gelu_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "quick_gelu": lambda x: x * sigmoid(1.702 * x),
}


def _unary_check(name: str):
    def run(ctx: CheckContext, dtype: torch.dtype, tol: float) -> Outcome:
        m = op_measure(tol, name)
        g = generator(1)
        for shape in ((7, 96), (2, 3, 40)):
            x = randn(ctx, g, *shape, dtype=dtype, scale=3.0)
            m.close(f"{list(shape)}", get_op(name)(x), _UNARY[name](d64(x)))
        return m.outcome()

    return run


def _check_silu_and_mul(ctx, dtype, tol):
    m = op_measure(tol, "silu_and_mul")
    g = generator(2)
    for shape in ((7, 2 * 96), (2, 3, 2 * 40)):
        x = randn(ctx, g, *shape, dtype=dtype, scale=3.0)
        a, b = halves(d64(x))
        m.close(f"{list(shape)}", get_op("silu_and_mul")(x), a * sigmoid(a) * b)
    return m.outcome()


def _check_gelu_and_mul(ctx, dtype, tol):
    m = op_measure(tol, "gelu_and_mul")
    g = generator(3)
    x = randn(ctx, g, 9, 2 * 80, dtype=dtype, scale=3.0)
    a, b = halves(d64(x))
    m.close("erf", get_op("gelu_and_mul")(x), gelu_erf(a) * b)
    m.close("tanh", get_op("gelu_and_mul")(x, "tanh"), gelu_tanh(a) * b)
    return m.outcome()


def _check_gelu_and_mul_sparse(ctx, dtype, tol):
    # Gemma3n: std_multiplier is the normal 0.95 quantile. The op computes
    # the threshold (mean + 1.645 std, ~1.6 here) in the input dtype, as
    # vLLM does: in bfloat16 its rounding (up to 0.004 here, growing with the
    # gate's scale) passes through the subtraction into the output.
    m = op_measure(tol, "gelu_and_mul_sparse")
    g = generator(4)
    x = randn(ctx, g, 9, 2 * 80, dtype=dtype)
    a, b = halves(d64(x))
    k = 1.6448536269514722
    sparse = torch.relu(a - (a.mean(-1, keepdim=True) + _pop_std(a) * k))
    op = get_op("gelu_and_mul_sparse")
    m.close("erf", op(x, k), gelu_erf(sparse) * b)
    m.close("tanh", op(x, k, "tanh"), gelu_tanh(sparse) * b)
    return m.outcome()


def _pop_std(a: torch.Tensor) -> torch.Tensor:
    """Population standard deviation over the last dimension."""
    mean = a.mean(-1, keepdim=True)
    return ((a - mean) ** 2).mean(-1, keepdim=True).sqrt()


# --------------------------------------------------------------------------- #
# RMSNorm and LayerNorm
# --------------------------------------------------------------------------- #


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float, vs: int | None):
    stats = x if vs is None else x[..., :vs]
    y = x / torch.sqrt((stats**2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _check_rms_norm(ctx, dtype, tol):
    m = op_measure(tol, "rms_norm")
    g = generator(5)
    x = randn(ctx, g, 9, 256, dtype=dtype, scale=2.0, offset=0.3)
    w = randn(ctx, g, 256, dtype=dtype, scale=0.1, offset=1.0)
    op = get_op("rms_norm")
    eps = 1e-6
    m.close("weight", op(x, w, eps), _rms(d64(x), d64(w), eps, None))
    m.close("no weight", op(x, None, eps), _rms(d64(x), None, eps, None))
    m.close("variance_size 128", op(x, w, eps, 128), _rms(d64(x), d64(w), eps, 128))
    return m.outcome()


def _check_fused_add_rms_norm(ctx, dtype, tol):
    m = op_measure(tol, "fused_add_rms_norm")
    g = generator(6)
    x = randn(ctx, g, 9, 256, dtype=dtype, scale=2.0)
    r = randn(ctx, g, 9, 256, dtype=dtype, scale=2.0)
    w = randn(ctx, g, 256, dtype=dtype, scale=0.1, offset=1.0)
    x0, r0 = x.clone(), r.clone()
    op = get_op("fused_add_rms_norm")
    s = d64(x) + d64(r)
    for label, weight, vs in (("weight", w, None), ("variance_size 64", w, 64)):
        out, residual = op(x, r, weight, 1e-6, vs)
        ref_w = None if weight is None else d64(weight)
        m.close(f"{label} output", out, _rms(s, ref_w, 1e-6, vs))
        m.close(f"{label} residual", residual, s)
    m.exact("input x unchanged", x, x0)
    m.exact("input residual unchanged", r, r0)
    return m.outcome()


def _check_layer_norm(ctx, dtype, tol):
    m = op_measure(tol, "layer_norm")
    g = generator(18)
    x = randn(ctx, g, 9, 256, dtype=dtype, scale=2.0, offset=0.3)
    w = randn(ctx, g, 256, dtype=dtype, scale=0.1, offset=1.0)
    b = randn(ctx, g, 256, dtype=dtype, scale=0.1)
    op = get_op("layer_norm")
    x64 = d64(x)
    centred = x64 - x64.mean(-1, keepdim=True)
    normed = centred / torch.sqrt((centred**2).mean(-1, keepdim=True) + 1e-6)
    m.close("weight and bias", op(x, w, b, 1e-6), normed * d64(w) + d64(b))
    m.close("weight only", op(x, w, None, 1e-6), normed * d64(w))
    m.close("no affine", op(x, None, None, 1e-6), normed)
    # vLLM's LayerNorm(dtype=float32) on a bfloat16 input: float32 weights.
    m.close(
        "float32 weight", op(x, w.float(), b.float(), 1e-6), normed * d64(w) + d64(b)
    )
    return m.outcome()


# --------------------------------------------------------------------------- #
# Rotary embedding
# --------------------------------------------------------------------------- #


def _cos_sin_cache(max_pos: int, rotary_dim: int, base: float) -> torch.Tensor:
    inv = 1.0 / base ** (
        torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    )
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _rope_ref(positions, x, head_size, rotary_dim, cache, neox):
    """x ``[T, H * D]`` or ``[T, H, D]`` float64; cache float64."""
    half = rotary_dim // 2
    cos = cache[positions, :half][:, None, :]
    sin = cache[positions, half:][:, None, :]
    return _rotate64(x, head_size, rotary_dim, cos, sin, neox)


def _rotate64(x, head_size, rotary_dim, cos, sin, neox):
    """Rotate the first ``rotary_dim`` channels of each head of x ``[T, ...]``
    by per-token ``cos`` / ``sin`` ``[T, 1, rotary_dim // 2]``."""
    t = x.shape[0]
    xs = x.reshape(t, -1, head_size)
    half = rotary_dim // 2
    rot = xs[..., :rotary_dim]
    if neox:
        x1, x2 = rot[..., :half], rot[..., half:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out = xs.clone()
    if neox:
        out[..., :half], out[..., half:rotary_dim] = o1, o2
    else:
        out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2] = o1, o2
    return out.reshape(x.shape)


def _check_rotary(ctx, dtype, tol):
    m = op_measure(tol, "rotary_embedding")
    g = generator(7)
    op = get_op("rotary_embedding")
    max_pos, t = 4096, 11
    positions = torch.randint(0, max_pos, (t,), generator=g).to(ctx.device)
    pos64 = positions.cpu()
    # (label, head_size, rotary_dim, neox, 3-D inputs, with key)
    for label, hd, rd, neox, three_d, with_key in (
        ("neox", 64, 64, True, False, True),
        ("gptj partial", 64, 32, False, True, True),
        ("neox partial, no key", 128, 64, True, False, False),
    ):
        cache = _cos_sin_cache(max_pos, rd, 10000.0).to(dtype).to(ctx.device)
        qshape = (t, 4, hd) if three_d else (t, 4 * hd)
        kshape = (t, 2, hd) if three_d else (t, 2 * hd)
        q = randn(ctx, g, *qshape, dtype=dtype)
        k = randn(ctx, g, *kshape, dtype=dtype) if with_key else None
        q0 = q.clone()
        oq, ok = op(positions, q, k, hd, rd, cache, neox)
        c64 = d64(cache)
        m.close(f"{label} query", oq, _rope_ref(pos64, d64(q), hd, rd, c64, neox))
        if with_key:
            m.close(f"{label} key", ok, _rope_ref(pos64, d64(k), hd, rd, c64, neox))
        else:
            m.require(f"{label} key", ok is None, "a key came back for key=None")
        m.exact(f"{label} query unchanged", q, q0)
    return m.outcome()


def _mrope_streams(half: int, section: list[int], interleaved: bool) -> list[int]:
    """Which position row (t, h, w) each frequency takes, from the M-RoPE
    formula: sections in order, or t h w repeating within each section."""
    if interleaved:
        return [
            1 if j % 3 == 1 and j < 3 * section[1]
            else 2 if j % 3 == 2 and j < 3 * section[2]
            else 0
            for j in range(half)
        ]  # fmt: skip
    return [0] * section[0] + [1] * section[1] + [2] * section[2]


def _mrope_ref(positions, x, head_size, rotary_dim, cache, neox, section, interleaved):
    """float64 M-RoPE: frequency j of token i at ``positions[stream_j, i]``."""
    half = rotary_dim // 2
    streams = _mrope_streams(half, section, interleaved)
    cols = torch.arange(half)
    # [T, half]: each frequency's cos / sin at its own row's position
    pos = positions[torch.tensor(streams)].T
    cos = cache[pos, cols][:, None, :]
    sin = cache[pos, cols + half][:, None, :]
    return _rotate64(x, head_size, rotary_dim, cos, sin, neox)


def _check_mrope(ctx, dtype, tol):
    m = op_measure(tol, "mrope_rotary_embedding")
    g = generator(17)
    op = get_op("mrope_rotary_embedding")
    max_pos, t = 2048, 13
    # Image tokens share t and differ in h / w; text tokens have t == h == w.
    positions = torch.randint(0, max_pos, (3, t), generator=g)
    positions[:, 9:] = positions[0, 9:]
    # (label, head_size, rotary_dim, section, interleaved): Qwen2-VL's
    # sections, Qwen3-VL's interleaving, GLM-4V's half-head rotary
    for label, hd, rd, section, interleaved in (
        ("sectioned", 128, 128, [16, 24, 24], False),
        ("interleaved", 128, 128, [24, 20, 20], True),
        ("partial", 128, 64, [8, 12, 12], False),
    ):
        cache = _cos_sin_cache(max_pos, rd, 10000.0).to(dtype).to(ctx.device)
        q = randn(ctx, g, t, 4 * hd, dtype=dtype)
        k = randn(ctx, g, t, 2 * hd, dtype=dtype)
        oq, ok = op(
            positions.to(ctx.device), q, k, hd, rd, cache, True, section, interleaved
        )
        c64 = d64(cache)
        args = (hd, rd, c64, True, section, interleaved)
        m.close(f"{label} query", oq, _mrope_ref(positions, d64(q), *args))
        m.close(f"{label} key", ok, _mrope_ref(positions, d64(k), *args))
    return m.outcome()


def _check_apply_rotary_emb(ctx, dtype, tol):
    """The vision towers' rotary: per-token angles given as cos / sin."""
    m = op_measure(tol, "apply_rotary_emb")
    g = generator(19)
    op = get_op("apply_rotary_emb")
    t, hd = 15, 64
    angles = torch.rand(t, hd // 2, generator=g, dtype=torch.float64) * 40.0
    cos = angles.cos().to(torch.float32).to(ctx.device)
    sin = angles.sin().to(torch.float32).to(ctx.device)
    c64, s64 = d64(cos)[:, None, :], d64(sin)[:, None, :]
    for label, neox, batched, fp32 in (
        ("neox", True, False, False),
        ("gptj, batched", False, True, False),
        ("neox, fp32 compute", True, True, True),
    ):
        shape = (2, t, 4, hd) if batched else (t, 4, hd)
        x = randn(ctx, g, *shape, dtype=dtype)
        flat = d64(x).reshape(-1, t, 4, hd)
        ref = torch.stack([_rotate64(r, hd, hd, c64, s64, neox) for r in flat])
        m.close(label, op(x, cos, sin, neox, fp32), ref.reshape(shape))
    return m.outcome()


# --------------------------------------------------------------------------- #
# Patch embedding
# --------------------------------------------------------------------------- #


def _check_patch_embedding(ctx, dtype, tol):
    """A convolution with stride = kernel: each output is one patch's dot
    product with each filter (sums over channels and kernel positions)."""
    m = op_measure(tol, "patch_embedding")
    g = generator(20)
    op = get_op("patch_embedding")
    # (label, input [B, C, *spatial], kernel): Qwen-VL's temporal patch of 2
    # frames, and a 2-D patch embedding / GLM-4V's downsample.
    for label, shape, kernel in (
        ("3-D", (5, 3, 2, 8, 8), (2, 4, 4)),
        ("2-D", (2, 4, 8, 12), (4, 4)),
    ):
        k = shape[1] * math.prod(kernel)
        x = randn(ctx, g, *shape, dtype=dtype)
        w = randn(ctx, g, 24, shape[1], *kernel, dtype=dtype, scale=1 / math.sqrt(k))
        b = randn(ctx, g, 24, dtype=dtype)
        # [B, C, G1, K1, G2, K2, ...]: grid index and offset within a patch
        split = [shape[0], shape[1]]
        for size, kk in zip(shape[2:], kernel, strict=True):
            split += [size // kk, kk]
        x64 = d64(x).reshape(split)
        nd = len(kernel)
        grid = "ghi"[:nd]
        inner = "pqr"[:nd]
        xs = "bc" + "".join(a + b for a, b in zip(grid, inner, strict=True))
        eq = f"{xs},oc{inner}->bo{grid}"
        ref = torch.einsum(eq, x64, d64(w))
        m.close(f"{label}, no bias", op(x, w, None), ref)
        m.close(f"{label}, bias", op(x, w, b), ref + d64(b).view(-1, *[1] * nd))
    return m.outcome()


# --------------------------------------------------------------------------- #
# Embedding, logits, sampling
# --------------------------------------------------------------------------- #


def _check_embedding(ctx, dtype, tol):
    m = op_measure(tol, "embedding")
    g = generator(8)
    weight = randn(ctx, g, 300, 64, dtype=dtype)
    ids = torch.randint(0, 300, (2, 13), generator=g)
    for id_dtype in (torch.int64, torch.int32):
        got = get_op("embedding")(ids.to(id_dtype).to(ctx.device), weight)
        m.exact(f"ids {id_dtype}", got, weight.cpu()[ids])
    return m.outcome()


def _check_vocab_parallel_embedding(ctx, dtype, tol):
    # Rank 1 of 3 over a base vocabulary of 300: rows for ids [100, 200),
    # 4 padding rows, then the 10 added ids [300, 310).
    m = op_measure(tol, "vocab_parallel_embedding")
    g = generator(9)
    start, end, pad, a_start, a_end = 100, 200, 4, 300, 310
    weight = randn(ctx, g, (end - start) + pad + (a_end - a_start), 32, dtype=dtype)
    ids = torch.randint(0, 320, (37,), generator=g)
    ids[:4] = torch.tensor([100, 199, 300, 309])  # the shard's edges
    w = weight.cpu()
    expected = torch.zeros(37, 32, dtype=dtype)
    for i, t in enumerate(ids.tolist()):
        if start <= t < end:
            expected[i] = w[t - start]
        elif a_start <= t < a_end:
            expected[i] = w[(end - start) + pad + (t - a_start)]
    got = get_op("vocab_parallel_embedding")(
        ids.to(ctx.device), weight, start, end, pad, a_start, a_end
    )
    m.exact("rank 1 of 3 with added vocab", got, expected)
    return m.outcome()


def _check_compute_logits(ctx, dtype, tol):
    m = op_measure(tol, "compute_logits")
    g = generator(10)
    op = get_op("compute_logits")
    w = randn(ctx, g, 300, 128, dtype=dtype, scale=1 / math.sqrt(128))
    b = randn(ctx, g, 300, dtype=dtype)
    for rows in (1, 9):
        x = randn(ctx, g, rows, 128, dtype=dtype)
        ref = d64(x) @ d64(w).T
        m.close(f"{rows} rows", op(x, w), ref)
        m.close(f"{rows} rows, bias", op(x, w, b), ref + d64(b))
        m.close(f"{rows} rows, float32 copy", op(x, w, None, w.float()), ref)
    return m.outcome()


def _check_logits_soft_cap_and_scale(ctx, dtype, tol):
    m = op_measure(tol, "logits_soft_cap_and_scale")
    g = generator(11)
    x = randn(ctx, g, 4, 300, dtype=dtype, scale=20.0)
    x0 = x.clone()
    op = get_op("logits_soft_cap_and_scale")
    for cap, scale in ((30.0, 1.0), (None, 0.5), (50.0, 2.0), (None, 1.0)):
        ref = d64(x0)
        if cap is not None:
            ref = torch.tanh(ref / cap) * cap
        m.close(f"cap {cap} scale {scale}", op(x.clone(), cap, scale), ref * scale)
    return m.outcome()


def _check_greedy_sample(ctx, dtype, tol):
    m = op_measure(tol, "greedy_sample")
    m.metric = "mismatches"
    g = generator(12)
    x = randn(ctx, g, 6, 1000, dtype=dtype, scale=3.0).cpu()
    # Ties: the first maximal index wins.
    x[0, 10] = x[0, 500] = 20.0
    x[1, -1] = 20.0
    x[2, :] = 1.0
    logits = x.to(ctx.device)
    cols = torch.arange(x.shape[1]).expand_as(x)
    is_max = x == x.max(dim=-1, keepdim=True).values
    expected = torch.where(is_max, cols, x.shape[1]).min(dim=-1).values
    m.exact("first maximum per row", get_op("greedy_sample")(logits), expected)
    if dtype != torch.float32:  # the sampler hands the op float32 logits
        m.exact("float32 logits", get_op("greedy_sample")(logits.float()), expected)
    return m.outcome()


# --------------------------------------------------------------------------- #
# Linear layers
# --------------------------------------------------------------------------- #


def _check_linear(ctx, dtype, tol):
    from vllm_br.ops.weight_layout import DeviceLayout

    m = op_measure(tol, "linear")
    g = generator(13)
    op = get_op("linear")
    parts = (64, 32, 32)  # a fused q/k/v weight
    w = randn(ctx, g, sum(parts), 128, dtype=dtype, scale=1 / math.sqrt(128))
    b = randn(ctx, g, sum(parts), dtype=dtype)
    layout = DeviceLayout.make("NUMA", 2, parts, ctx.device)
    w_dev = w.index_select(0, layout.to_device)  # stored per die
    for rows in (1, 40):
        x = randn(ctx, g, rows, 128, dtype=dtype)
        ref = d64(x) @ d64(w).T
        m.close(f"{rows} rows", op(x, w), ref)
        m.close(f"{rows} rows, bias", op(x, w, b), ref + d64(b))
        m.close(
            f"{rows} rows, float32 copy", op(x, w, b, None, w.float()), ref + d64(b)
        )
        m.close(f"{rows} rows, NUMA layout", op(x, w_dev, b, layout), ref + d64(b))
    x3 = randn(ctx, g, 2, 5, 128, dtype=dtype)
    m.close("3-D input", op(x3, w), d64(x3) @ d64(w).T)
    return m.outcome()


def _check_prepare_gemm_weight(ctx, dtype, tol):
    m = op_measure(tol, "prepare_gemm_weight")
    g = generator(14)
    w = randn(ctx, g, 256, 128, dtype=dtype, scale=1 / math.sqrt(128))
    head = randn(ctx, g, 512, 128, dtype=dtype, scale=1 / math.sqrt(128))
    prepare = get_op("prepare_gemm_weight")
    added = prepare(w)
    added_head = prepare(head, lm_head=True)
    for label, n in (("weight", added), ("lm head", added_head)):
        m.require(f"{label} bytes", isinstance(n, int) and n >= 0, f"returned {n!r}")
    m.note(f"bytes added {added} + {added_head}")
    for rows in (1, 40):
        x = randn(ctx, g, rows, 128, dtype=dtype)
        m.close(f"linear {rows} rows", get_op("linear")(x, w), d64(x) @ d64(w).T)
        m.close(
            f"logits {rows} rows",
            get_op("compute_logits")(x, head),
            d64(x) @ d64(head).T,
        )
    return m.outcome()


CHECKS: list[OpCheck] = [
    OpCheck("silu_and_mul", ("silu_and_mul",), _check_silu_and_mul, TOL),
    OpCheck("gelu_and_mul", ("gelu_and_mul",), _check_gelu_and_mul, TOL),
    OpCheck(
        "gelu_and_mul_sparse",
        ("gelu_and_mul_sparse",),
        _check_gelu_and_mul_sparse,
        TOL_SPARSE,
    ),
    *(OpCheck(name, (name,), _unary_check(name), TOL) for name in _UNARY),
    OpCheck("rms_norm", ("rms_norm",), _check_rms_norm, TOL),
    OpCheck(
        "fused_add_rms_norm", ("fused_add_rms_norm",), _check_fused_add_rms_norm, TOL
    ),
    OpCheck("layer_norm", ("layer_norm",), _check_layer_norm, TOL),
    OpCheck("rotary_embedding", ("rotary_embedding",), _check_rotary, TOL),
    OpCheck("mrope_rotary_embedding", ("mrope_rotary_embedding",), _check_mrope, TOL),
    OpCheck("apply_rotary_emb", ("apply_rotary_emb",), _check_apply_rotary_emb, TOL),
    OpCheck("patch_embedding", ("patch_embedding",), _check_patch_embedding, TOL),
    OpCheck("embedding", ("embedding",), _check_embedding, TOL),
    OpCheck(
        "vocab_parallel_embedding",
        ("vocab_parallel_embedding",),
        _check_vocab_parallel_embedding,
        TOL,
    ),
    OpCheck("compute_logits", ("compute_logits",), _check_compute_logits, TOL),
    OpCheck(
        "logits_soft_cap_and_scale",
        ("logits_soft_cap_and_scale",),
        _check_logits_soft_cap_and_scale,
        TOL,
    ),
    OpCheck("greedy_sample", ("greedy_sample",), _check_greedy_sample, TOL),
    OpCheck("linear", ("linear",), _check_linear, TOL),
    OpCheck(
        "prepare_gemm_weight",
        ("prepare_gemm_weight", "linear", "compute_logits"),
        _check_prepare_gemm_weight,
        TOL,
    ),
]
