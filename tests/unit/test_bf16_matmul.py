"""vllm_br.device.cpu_kernels.bf16_gemm: which weight a bf16 GEMM with a float32 weight copy
multiplies (the bf16 weight for few rows, the copy for many; the
VLLM_BR_CPU_BF16_MATMUL settings), and that either gives a bf16 GEMM's result:
checked bit for bit against the plain PyTorch op of the path taken, and within
bf16 tolerance of a float32 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_br.device.cpu_kernels import bf16_gemm as matmul
from vllm_br.device.cpu_kernels.bf16_gemm import compute_logits
from vllm_br.ops import weight_layout as wl
from vllm_br.ops.linear import linear as reference_linear
from vllm_br.ops.weight_layout import NUMA, DeviceLayout

THREADS = 2  # what the tests pin torch.get_num_threads() to
LINEAR_MAX = matmul.NATIVE_ROWS_PER_THREAD * THREADS  # native up to here (4)
LM_HEAD_MAX = matmul.LM_HEAD_NATIVE_ROWS_PER_THREAD * THREADS  # (6)


@pytest.fixture(autouse=True)
def two_threads(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: THREADS)
    monkeypatch.delenv("VLLM_BR_CPU_BF16_MATMUL", raising=False)  # auto


def _weights(out_f=96, in_f=576, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(torch.bfloat16)
    b = torch.randn(out_f, generator=g).to(torch.bfloat16) if bias else None
    return w, b


def _x(rows, in_f=576, dtype=torch.bfloat16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_f, generator=g).to(dtype)


def _reference(x, w, b):
    """Plain PyTorch in float32: the exact product of the (bf16) values."""
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def _native(x, w, b):
    return F.linear(x, w, b)


def _via_copy(x, w, b):
    out = F.linear(x.float(), w.float(), None if b is None else b.float())
    return out.to(x.dtype)


def assert_bf16_close(out, ref, native: bool) -> None:
    """Tolerances against the float32 reference. bf16 has 8 significant bits,
    so one rounding is within half an ulp, 2^-8 relative.

    - float32 copy: the float32 product rounded once: rtol 2^-8, atol 1e-6
      (float32 summation order).
    - native: torch's bf16 GEMM accumulates in float32 but may round partial
      sums over blocks of the inner dimension: rtol 2^-7 (one ulp), plus
      atol 2^-8 * max |ref| (half an ulp of the largest output)."""
    assert out.dtype == torch.bfloat16
    if native:
        rtol, atol = 2**-7, 2**-8 * ref.abs().max().item()
    else:
        rtol, atol = 2**-8, 1e-6
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=atol)


# ---- the rule ---------------------------------------------------------------


@pytest.mark.parametrize(
    "rows,mode,threads,lm_head,expect",
    [
        (1, "fp32", 2, False, True),  # fp32 forces the copy ...
        (1, "fp32", 2, True, True),
        (10_000, "native", 2, False, False),  # ... native forces bf16
        (10_000, "native", 2, True, False),
        (2, "auto", 1, False, False),  # 2 rows per thread: native
        (3, "auto", 1, False, True),
        (4, "auto", 2, False, False),
        (5, "auto", 2, False, True),
        (3, "auto", 1, True, False),  # LM head: 3 rows per thread
        (4, "auto", 1, True, True),
        (6, "auto", 2, True, False),
        (7, "auto", 2, True, True),
        (4, "auto", 16, False, False),  # threads beyond the measured 2 ...
        (5, "auto", 16, False, True),  # ... are not extrapolated
        (2, "auto", 0, False, False),  # 0 threads counts as 1
        (3, "auto", 0, False, True),
        (0, "auto", 2, False, False),
    ],
)
def test_use_fp32_copy(rows, mode, threads, lm_head, expect):
    assert matmul.use_fp32_copy(rows, mode, threads, lm_head) is expect


def test_threshold_constants_are_the_measured_ones():
    # benchmarks/results/bf16_gemm_rows.json (benchmarks/kernels/bf16_gemm_rows.py)
    assert matmul.NATIVE_ROWS_PER_THREAD == 2
    assert matmul.LM_HEAD_NATIVE_ROWS_PER_THREAD == 3
    assert matmul.MEASURED_THREADS == 2


# ---- the GEMM, both sides of the threshold -------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mode", ["auto", "native", "fp32"])
@pytest.mark.parametrize("rows", [1, LINEAR_MAX, LINEAR_MAX + 1, 32])
def test_gemm_bf16_input(monkeypatch, rows, mode, bias):
    monkeypatch.setenv("VLLM_BR_CPU_BF16_MATMUL", mode)
    w, b = _weights(bias=bias)
    x = _x(rows)
    out = matmul.gemm(x, w, w.float(), b)
    copy = matmul.use_fp32_copy(rows, mode, THREADS)
    assert copy is (mode == "fp32" or (mode == "auto" and rows > LINEAR_MAX))
    assert torch.equal(out, (_via_copy if copy else _native)(x, w, b))
    assert_bf16_close(out, _reference(x, w, b), native=not copy)


@pytest.mark.parametrize("rows", [1, 32])
def test_gemm_counts_rows_over_leading_dims(rows):
    w, b = _weights()
    x = _x(rows * 2).view(2, rows, -1)  # 2 rows at rows=1: still native
    out = matmul.gemm(x, w, w.float(), b)
    copy = rows * 2 > LINEAR_MAX
    assert out.shape == (2, rows, w.shape[0])
    assert torch.equal(out, (_via_copy if copy else _native)(x, w, b))


@pytest.mark.parametrize("mode", ["auto", "native", "fp32"])
@pytest.mark.parametrize("rows", [1, 32])
def test_gemm_fp32_input_multiplies_the_copy(monkeypatch, rows, mode):
    """A float32 input (float32 logits, a gate run in float32) cannot multiply
    the bf16 weight: it multiplies the copy and stays float32, unrounded."""
    monkeypatch.setenv("VLLM_BR_CPU_BF16_MATMUL", mode)
    w, b = _weights()
    x = _x(rows, dtype=torch.float32)
    out = matmul.gemm(x, w, w.float(), b)
    assert out.dtype == torch.float32
    assert torch.equal(out, F.linear(x, w.float(), b.float()))
    torch.testing.assert_close(out, _reference(x, w, b), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("rows", [1, LINEAR_MAX + 1])
def test_linear_with_device_layout_and_copy(rows):
    """A weight in a NUMA layout (which the cpu backend never makes) is
    declined by the kernel, and the ``linear`` op's reference multiplies the
    copy; outputs come back in logical order, bit for bit the plain weight's
    GEMM in the copy."""
    sizes = [32, 32, 32]
    w, b = _weights(out_f=sum(sizes))
    layout = DeviceLayout.make(NUMA, 2, sizes, w.device)
    dev_w = wl.to_device_layout(w, NUMA, 2, sizes)
    x = _x(rows)
    assert matmul.linear(x, dev_w, b, layout, dev_w.float()) is NotImplemented
    out = reference_linear(x, dev_w, b, layout, dev_w.float())
    assert torch.equal(out, _via_copy(x, w, b))
    assert_bf16_close(out, _reference(x, w, b), native=False)


@pytest.mark.parametrize("rows", [1, LINEAR_MAX + 1])
def test_linear_kernel_plain_layout_both_sides(rows):
    w, b = _weights()
    x = _x(rows)
    out = matmul.linear(x, w, b, None, w.float())
    copy = rows > LINEAR_MAX
    assert torch.equal(out, (_via_copy if copy else _native)(x, w, b))
    assert_bf16_close(out, _reference(x, w, b), native=not copy)
    # Without a copy the kernel declines: the reference's F.linear runs.
    assert matmul.linear(x, w, b) is NotImplemented
    assert matmul.compute_logits(x, w, None) is NotImplemented


@pytest.mark.parametrize("rows", [1, LINEAR_MAX + 1, LM_HEAD_MAX, LM_HEAD_MAX + 1])
def test_compute_logits_uses_the_lm_head_threshold(rows):
    w, _ = _weights(out_f=512, bias=False)
    x = _x(rows)
    out = compute_logits(x, w, None, w.float())
    copy = rows > LM_HEAD_MAX  # LINEAR_MAX + 1 rows: still native for the head
    assert torch.equal(out, (_via_copy if copy else _native)(x, w, None))
    assert_bf16_close(out, _reference(x, w, None), native=not copy)


# ---- under torch.compile ------------------------------------------------------


def test_compiled_graph_chooses_per_call(monkeypatch):
    """vLLM compiles one graph for every batch size and drops shape guards, so
    the choice must not be traced: one graph, compiled at 32 rows, serves 2 rows
    natively without recompiling (dynamo itself specializes sizes 0 and 1)."""
    w, b = _weights()
    w32 = w.float()

    def fn(x):
        return matmul.linear(x, w, b, None, w32)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    x32, x2 = _x(32), _x(2)
    assert torch.equal(compiled(x32), _via_copy(x32, w, b))
    with torch.compiler.set_stance("fail_on_recompile"):
        assert torch.equal(compiled(x2), _native(x2, w, b))
        assert torch.equal(compiled(x32), _via_copy(x32, w, b))
        # The setting is read when the op runs: a graph compiled under auto
        # (or cached from it) follows a later fp32 or native setting.
        monkeypatch.setenv("VLLM_BR_CPU_BF16_MATMUL", "fp32")
        assert torch.equal(compiled(x2), _via_copy(x2, w, b))
        monkeypatch.setenv("VLLM_BR_CPU_BF16_MATMUL", "native")
        assert torch.equal(compiled(x32), _native(x32, w, b))
    torch._dynamo.reset()


def test_custom_op_schema_and_fake():
    w, b = _weights()
    torch.library.opcheck(
        torch.ops.vllm_br.bf16_gemm.default,
        (_x(3), w, w.float(), b, False),
        test_utils=("test_schema", "test_faketensor"),
    )
