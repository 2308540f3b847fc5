"""vllm_br.ops.quant and the cpu kernel of ``int8_scaled_mm``: each op against
a plain-PyTorch formula written here (integer sums in int64, float results in
float64), never against the op's own helpers.

Tolerances: int32 parts (unit scales) are exact. float32 outputs: atol 1e-5 /
rtol 1.3e-6 (a few float32 roundings on outputs of magnitude ~1). bfloat16
outputs of ``int8_scaled_mm``: atol 1e-5 / rtol 4e-3 (the float32 result is
rounded once to bf16, relative error <= 2^-9). The cpu kernel against the
reference: int32 parts bitwise, scaled outputs to 1e-6 relative. The C++
int8 GEMVs: int32 sums bitwise; the bf16 GEMV against the float64 formula at
2^-8 relative (float32 sums, one rounding to bf16) plus atol 1e-2 for sums
that cancel.
"""

from __future__ import annotations

import pytest
import torch

from vllm_br.device import cpu_isa
from vllm_br.device.cpu_kernels import int8_gemm, int8_gemv
from vllm_br.ops import quant, reference_op
from vllm_br.ops.weight_layout import NUMA, DeviceLayout, to_device_layout

DTYPES = [torch.float32, torch.bfloat16]
FP32_TOL = {"atol": 1e-5, "rtol": 1.3e-6}
MM_BF16_TOL = {"atol": 1e-5, "rtol": 4e-3}
# weight_only_linear rounds the dequantized weight to bf16 once (2^-9 relative
# per element, summed over K=128) and the output once more: bf16 needs more.
WOL_BF16_TOL = {"atol": 2e-2, "rtol": 1.6e-2}
SHAPES = [(m, k, n) for m in (1, 3, 17) for k, n in ((40, 37), (100, 96))]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def i8(*shape: int, lo: int = -128, hi: int = 127) -> torch.Tensor:
    return torch.randint(lo, hi + 1, shape, dtype=torch.int8)


def scales(*shape: int, base: float) -> torch.Tensor:
    return (torch.rand(shape) + 0.5) * base


def cpu_kernel(*args, **kwargs):
    """The cpu backend's ``int8_scaled_mm`` kernel: it serves every call
    without an activation zero point, on hosts with and without VNNI."""
    out = int8_gemm.int8_scaled_mm(*args, **kwargs)
    assert out is not NotImplemented
    return out


def exact_mm(x_q, w, zp=None) -> torch.Tensor:
    x = x_q.to(torch.int64) - (0 if zp is None else zp.to(torch.int64))
    return x @ w.to(torch.int64).T


# ---- int8_scaled_mm ------------------------------------------------------


@pytest.mark.parametrize("fn", [quant.int8_scaled_mm, cpu_kernel])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int8_mm_unit_scales_is_exact(fn, m, k, n):
    # |sum| <= K * 128^2 <= 1.7e6 < 2^24: float32 holds every sum exactly.
    x_q, w = i8(m, k), i8(n, k)
    out = fn(x_q, w, torch.ones(m, 1), torch.ones(n), torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, exact_mm(x_q, w).float())


@pytest.mark.parametrize("fn", [quant.int8_scaled_mm, cpu_kernel])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int8_mm_scales_and_bias(fn, dtype, m, k, n):
    x_q, w = i8(m, k), i8(n, k)
    xs, ws, bias = scales(m, 1, base=1e-2), scales(n, base=1e-3), torch.randn(n)
    out = fn(x_q, w, xs, ws, dtype, bias=bias.to(dtype))
    expected = exact_mm(x_q, w).double() * xs.double() * ws.double()
    expected = expected + bias.to(dtype).double()
    assert out.dtype == dtype
    tol = FP32_TOL if dtype == torch.float32 else MM_BF16_TOL
    torch.testing.assert_close(out.double(), expected, **tol)


def test_int8_mm_per_tensor_scale():
    x_q, w, ws = i8(5, 64), i8(24, 64), scales(24, base=1e-3)
    out = quant.int8_scaled_mm(x_q, w, torch.tensor(0.02), ws, torch.float32)
    expected = exact_mm(x_q, w).double() * 0.02 * ws.double()
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int8_mm_activation_zero_point(m, k, n):
    x_q, w = i8(m, k), i8(n, k)
    zp = torch.randint(-20, 21, (m, 1), dtype=torch.int32)
    # Unit scales: exact ((x - zp) @ w.T, |sum| < 2^24).
    out = quant.int8_scaled_mm(
        x_q, w, torch.ones(m, 1), torch.ones(n), torch.float32, x_zero_point=zp
    )
    assert torch.equal(out.to(torch.int64), exact_mm(x_q, w, zp))
    xs, ws = scales(m, 1, base=1e-2), scales(n, base=1e-3)
    out = quant.int8_scaled_mm(x_q, w, xs, ws, torch.float32, x_zero_point=zp)
    expected = exact_mm(x_q, w, zp).double() * xs.double() * ws.double()
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_kernel_matches_reference(dtype):
    assert reference_op("int8_scaled_mm") is quant.int8_scaled_mm
    x_q, w = i8(17, 100), i8(96, 100)
    ones = (torch.ones(17, 1), torch.ones(96))
    kernel = cpu_kernel(x_q, w, *ones, torch.float32)
    assert torch.equal(kernel, quant.int8_scaled_mm(x_q, w, *ones, torch.float32))
    args = (x_q, w, scales(17, 1, base=1e-2), scales(96, base=1e-3), dtype)
    bias = torch.randn(96, dtype=dtype)
    kernel = cpu_kernel(*args, bias=bias)
    torch.testing.assert_close(
        kernel, quant.int8_scaled_mm(*args, bias=bias), atol=0, rtol=1e-6
    )


@pytest.mark.parametrize("vnni", [False, True])
@pytest.mark.parametrize("m", [1, 4, 5, 33])
def test_cpu_kernel_is_exact_for_full_range_int8(monkeypatch, vnni, m):
    """Sums that saturate int16 pair sums (every product 128 * 128) and pass
    float32's 2^24 over K = 2500 come out exact on every path: the C++ GEMV
    (up to 4 rows), ``torch._int_mm`` with VNNI, and the float32 GEMM over
    K slices without it (``ONEDNN_MAX_CPU_ISA=AVX2`` hosts, AVX2-only CPUs)."""
    if vnni and not cpu_isa.host_isa().avx512_vnni:
        pytest.skip("torch._int_mm is exact only with AVX512-VNNI")
    isa = cpu_isa.HostISA(avx512=False, avx512_bf16=False, amx_bf16=False)
    if not vnni:
        monkeypatch.setattr(cpu_isa, "host_isa", lambda: isa)
    k, n = 2500, 37
    x_q = torch.full((m, k), -128, dtype=torch.int8)
    w = torch.full((n, k), -128, dtype=torch.int8)
    w[1::2] = i8(n // 2, k)
    x_q[:, ::3] = i8(m, len(range(0, k, 3)))
    out = int8_gemm._int8_mm(x_q, w)
    assert out.dtype == torch.int32
    assert torch.equal(out.to(torch.int64), exact_mm(x_q, w))
    assert exact_mm(x_q, w).abs().max() > 2**24


def test_cpu_kernel_declines_activation_zero_point():
    x_q, w = i8(3, 40), i8(37, 40)
    zp = torch.zeros(3, 1, dtype=torch.int32)
    out = int8_gemm.int8_scaled_mm(
        x_q, w, torch.ones(3, 1), torch.ones(37), torch.float32, x_zero_point=zp
    )
    assert out is NotImplemented


# ---- quantize_int8 -------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_dynamic_symmetric(dtype):
    x = torch.randn(17, 100, dtype=dtype) * 3
    x[5] = 0  # an all-zero row quantizes to zeros, not NaN
    q, s, zp = quant.quantize_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and zp is None
    expected_s = x.float().abs().amax(dim=-1, keepdim=True) / 127
    nonzero = torch.arange(17) != 5
    torch.testing.assert_close(s[nonzero], expected_s[nonzero], atol=0, rtol=1e-6)
    assert torch.equal(q[5], torch.zeros(100, dtype=torch.int8))
    assert (q[nonzero].abs().amax(dim=-1) == 127).all()  # the row max maps to 127
    err = (q.double() * s.double() - x.double()).abs()
    assert (err <= s.double() * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero", [None, 5])
def test_quantize_static(dtype, zero):
    s = torch.tensor(0.0625)  # a power of two: x / s is exact in every dtype
    x = (torch.randn(9, 64) * 6).to(dtype)  # |x / s| reaches past 128: clamped
    zp = None if zero is None else torch.tensor(zero, dtype=torch.int32)
    q, s_out, zp_out = quant.quantize_int8(x, scale=s, zero_point=zp)
    expected = torch.round(x.double() / 0.0625) + (zero or 0)
    assert q.dtype == torch.int8
    assert torch.equal(q, expected.clamp(-128, 127).to(torch.int8))
    assert (q == 127).any() and (q == -128).any()
    assert s_out.item() == 0.0625
    assert zp_out is None if zero is None else zp_out.item() == zero


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_dynamic_asymmetric(dtype):
    x = (torch.randn(17, 100) + torch.linspace(-2, 2, 17)[:, None]).to(dtype)
    q, s, zp = quant.quantize_int8(x, symmetric=False)
    assert q.dtype == torch.int8 and zp.dtype == torch.int32 and zp.shape == (17, 1)
    xd = x.double()
    lo = xd.amin(-1, keepdim=True).clamp(max=0)  # the range always holds 0
    hi = xd.amax(-1, keepdim=True).clamp(min=0)
    torch.testing.assert_close(s.double(), (hi - lo) / 255, atol=0, rtol=1e-6)
    err = ((q.double() - zp.double()) * s.double() - xd).abs()
    assert (err <= s.double() * (0.5 + 1e-4)).all()


# ---- weight_only_linear --------------------------------------------------

K, N, M = 128, 48, 5


def wol_case(bits: int, group: int, asym: bool):
    """(packed or int8 weight, scales, zeros, float64 weight [N, K])."""
    lo, hi = (-8, 7) if bits == 4 else (-128, 127)
    q = i8(N, K, lo=lo, hi=hi)
    groups = 1 if group == -1 else K // group
    s = scales(N, groups, base=1e-3 if bits == 8 else 2e-2)
    z = i8(N, groups, lo=lo // 2, hi=hi // 2) if asym else None
    per_group = K // groups  # expand [N, groups] to [N, K]: column k is group k // g
    zk = 0 if z is None else z.double().repeat_interleave(per_group, dim=1)
    w = (q.double() - zk) * s.double().repeat_interleave(per_group, dim=1)
    stored = quant.pack_int4(q) if bits == 4 else q
    return stored, (s.view(N) if group == -1 else s), z, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("bits,group", [(8, -1), (8, 32), (4, 32), (4, -1)])
def test_weight_only_linear(dtype, asym, bits, group):
    stored, s, z, w = wol_case(bits, group, asym)
    x, bias = torch.randn(M, K, dtype=dtype), torch.randn(N, dtype=dtype)
    out = quant.weight_only_linear(x, stored, s, z, bits=bits, bias=bias)
    expected = x.double() @ w.T + bias.double()
    assert out.dtype == dtype and out.shape == (M, N)
    tol = FP32_TOL if dtype == torch.float32 else WOL_BF16_TOL
    torch.testing.assert_close(out.double(), expected, **tol)


@pytest.mark.parametrize("group", [-1, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "rows",
    [1, 4, 5, int8_gemm.INT8PACK_MAX_ROWS, int8_gemm.INT8PACK_MAX_ROWS + 1],
)
def test_cpu_weight_only_kernel_matches_formula(group, dtype, rows):
    """The cpu kernel for symmetric int8 weights with scales per channel or
    per group, on each side of its row thresholds (the C++ GEMV for bf16,
    int8pack GEMM for per-channel scales, then dequantize + GEMM), with bias
    and the NUMA layout, against the float64 formula at the bf16 tolerance."""
    stored, s, _, w = wol_case(8, group, asym=False)
    x, bias = torch.randn(rows, K, dtype=dtype), torch.randn(N, dtype=dtype)
    expected = x.double() @ w.T + bias.double()
    out = int8_gemm.weight_only_linear(x, stored, s.to(dtype), None, 8, bias)
    assert out is not NotImplemented and out.dtype == dtype and out.shape == (rows, N)
    torch.testing.assert_close(out.double(), expected, **WOL_BF16_TOL)
    layout = DeviceLayout.make(NUMA, 2, [16, 16, 16], torch.device("cpu"))
    dev_w = to_device_layout(stored, NUMA, 2, [16, 16, 16])
    dev_s = to_device_layout(s.to(dtype), NUMA, 2, [16, 16, 16])
    got = int8_gemm.weight_only_linear(x, dev_w, dev_s, None, 8, bias, layout)
    torch.testing.assert_close(got.double(), expected, **WOL_BF16_TOL)


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_cpu_weight_only_dequantized_gemm_on_either_host(monkeypatch, fast_bf16):
    """Above the GEMV and int8pack rows the weight is dequantized per call:
    multiplied in 16 bits where the host has fast bf16, else in float32 (one
    rounding of the output); both equal the formula at the bf16 tolerance."""
    isa = cpu_isa.HostISA(avx512=fast_bf16, avx512_bf16=fast_bf16, amx_bf16=False)
    monkeypatch.setattr(cpu_isa, "host_isa", lambda: isa)
    stored, s, _, w = wol_case(8, 32, asym=False)
    x = torch.randn(int8_gemm.INT8PACK_MAX_ROWS + 1, K, dtype=torch.bfloat16)
    out = int8_gemm.weight_only_linear(x, stored, s.bfloat16(), None, 8)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), x.double() @ w.T, **WOL_BF16_TOL)


@pytest.mark.parametrize(
    "case",
    ["float32", "int4", "zero points"],
)
def test_cpu_weight_only_kernel_declines_what_it_does_not_serve(case):
    bits, group, asym = {"int4": (4, -1, False), "zero points": (8, -1, True)}.get(
        case, (8, -1, False)
    )
    stored, s, z, _ = wol_case(bits, group, asym)
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    x = torch.randn(2, K, dtype=dtype)
    out = int8_gemm.weight_only_linear(x, stored, s.to(dtype), z, bits)
    assert out is NotImplemented


# ---- the C++ int8 GEMVs (int8_gemv.cpp) ------------------------------------


def test_int8_gemv_is_built_with_avx2():
    """Every host the backend supports has AVX2, so with a compiler the GEMVs
    serve up to 4 rows; without one (the references run) they serve none."""
    from vllm_br.device.cpu_kernels import load_library

    has_avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    expected = 4 if load_library() is not None and has_avx2 else 0
    assert int8_gemv.max_rows() == expected


needs_gemv = pytest.mark.skipif(
    int8_gemv.max_rows() == 0, reason="no C++ int8 GEMV on this host"
)


@needs_gemv
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [7, 64, 100, 1536])
def test_i8i8_gemv_is_exact(m, k):
    # K = 7 and 100: vector steps (16 / 32 int8) plus a scalar tail.
    x_q, w = i8(m, k), i8(45, k)
    x_q[0, :] = -128
    w[0, :] = -128
    out = int8_gemv.i8i8(x_q, w)
    assert torch.equal(out.to(torch.int64), exact_mm(x_q, w))


@needs_gemv
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [7, 100, 576])
def test_w8_bf16_gemv_matches_formula(scale_dtype, m, k):
    n = 45  # not a multiple of the 4-row steps nor of 2 threads' shares
    q = i8(n, k)
    s = scales(n, base=1e-2).to(scale_dtype)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    expected = x.double() @ (q.double() * s.double()[:, None]).T + bias.double()
    out = int8_gemv.w8_bf16(x, q, s, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=2**-8)
    no_bias = int8_gemv.w8_bf16(x, q, s, None)
    torch.testing.assert_close(
        no_bias.double(), expected - bias.double(), atol=1e-2, rtol=2**-8
    )


@needs_gemv
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("group", [16, 32, 128])
def test_w8_bf16_gemv_grouped_scales_match_formula(m, group):
    """Scales per group of inputs (llmcompressor's W8A16 preset: groups of
    128), each group's sum scaled once."""
    k, n = 256, 45
    q = i8(n, k)
    s = scales(n, k // group, base=1e-2)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = q.double() * s.double().repeat_interleave(group, dim=1)
    out = int8_gemv.w8_bf16(x, q, s, None)
    torch.testing.assert_close(out.double(), x.double() @ w.T, atol=1e-2, rtol=2**-8)


@needs_gemv
def test_int8_gemvs_decline_what_they_do_not_serve():
    q, s = i8(8, 64), scales(8, base=1e-2)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert (
        int8_gemv.w8_bf16(torch.randn(5, 64, dtype=torch.bfloat16), q, s, None) is None
    )
    assert int8_gemv.w8_bf16(x.half(), q, s, None) is None
    assert int8_gemv.w8_bf16(x, q, s.half(), None) is None
    assert int8_gemv.w8_bf16(x, q.t().contiguous().t(), s, None) is None
    # groups of 4 inputs (not a multiple of the vector width), 3 groups of 64
    assert int8_gemv.w8_bf16(x, q, scales(8, 16, base=1e-2), None) is None
    assert int8_gemv.w8_bf16(x, q, scales(8, 3, base=1e-2), None) is None
    assert int8_gemv.i8i8(i8(5, 64), q) is None
    assert int8_gemv.i8i8(i8(2, 63), q) is None


# ---- int4 packing --------------------------------------------------------


def test_unpack_int4_every_byte():
    packed = torch.arange(256, dtype=torch.uint8).view(1, 256)
    q = quant.unpack_int4(packed)
    assert q.dtype == torch.int8 and q.shape == (1, 512)
    assert q[0, 0::2].tolist() == [b % 16 - 8 for b in range(256)]  # low nibble
    assert q[0, 1::2].tolist() == [b // 16 - 8 for b in range(256)]  # high nibble


def test_pack_int4_round_trip_odd_rows():
    values = torch.arange(-8, 8, dtype=torch.int8)
    q = torch.stack([values, values.flip(0), values[torch.randperm(16)]])  # 3 rows
    packed = quant.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)
    expected = (q[:, 0::2].int() + 8) | ((q[:, 1::2].int() + 8) << 4)
    assert torch.equal(packed.int(), expected)  # the even column in the low nibble
    assert torch.equal(quant.unpack_int4(packed), q)


# ---- group size refusals -------------------------------------------------


def test_check_group_size_refuses_non_divisor():
    with pytest.raises(ValueError) as err:
        quant.check_group_size(100, 64)
    msg = str(err.value)
    assert "100 input channels" in msg and "group size 64" in msg
    assert msg.endswith(".") and "\n" not in msg and ". " not in msg
    quant.check_group_size(128, 64)
    quant.check_group_size(100, -1)


def test_dequantize_weight_refuses_groups_not_dividing_k():
    with pytest.raises(ValueError, match="128 input channels has 3 scale groups"):
        quant.dequantize_weight(i8(4, 128), torch.ones(4, 3), None, bits=8)


# ---- NUMA device layout --------------------------------------------------

SIZES = [64, 32, 32]  # e.g. q | k | v, each split over two dies


def dev(t: torch.Tensor) -> torch.Tensor:
    return to_device_layout(t, NUMA, 2, SIZES)


def numa_layout() -> DeviceLayout:
    layout = DeviceLayout.make(NUMA, 2, SIZES, torch.device("cpu"))
    assert layout is not None  # not the identity: the test would prove nothing
    return layout


@pytest.mark.parametrize("fn", [quant.int8_scaled_mm, cpu_kernel])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_mm_numa_layout_is_exact(fn, dtype):
    n = sum(SIZES)
    x_q, w, xs, ws = i8(7, 64), i8(n, 64), scales(7, 1, base=1e-2), scales(n, base=1e-3)
    bias = torch.randn(n, dtype=dtype)
    plain = fn(x_q, w, xs, ws, dtype, bias=bias)
    numa = fn(x_q, dev(w), xs, dev(ws), dtype, bias=bias, layout=numa_layout())
    assert torch.equal(numa, plain)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_linear_numa_layout_is_exact(dtype, bits):
    n, k = sum(SIZES), 64
    lo, hi = (-8, 7) if bits == 4 else (-128, 127)
    q, s, z = i8(n, k, lo=lo, hi=hi), scales(n, 2, base=1e-2), i8(n, 2, lo=-4, hi=4)
    stored = quant.pack_int4(q) if bits == 4 else q
    x, bias = torch.randn(5, k, dtype=dtype), torch.randn(n, dtype=dtype)
    plain = quant.weight_only_linear(x, stored, s, z, bits=bits, bias=bias)
    numa = quant.weight_only_linear(
        x, dev(stored), dev(s), dev(z), bits=bits, bias=bias, layout=numa_layout()
    )
    assert torch.equal(numa, plain)
