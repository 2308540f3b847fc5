"""vllm_br.device.cpu_kernels.gemv: the C++ bf16 GEMM of one or two rows
(hosts whose compiler targets AVX512-BF16; elsewhere it declines every
call).

- Against an fp64 reference of the same bf16 values with the bound a bf16
  GEMM with float32 sums meets (the packed tests' ``assert_bf16_gemm``):
  rows 1 and 2, with and without bias, output widths that are not a multiple
  of the 4 rows read together, reduction widths with a masked tail, leading
  dims and a strided input.
- Where it does not apply it returns None: more rows, float32, a transposed
  weight, a float32 bias.
- Through the ``linear`` / ``compute_logits`` ops of the cpu backend: one or
  two rows run it, more rows the packed or plain GEMM, with the same results.
"""

from __future__ import annotations

import pytest
import torch
from test_packed_linear import _weights, _x, assert_bf16_gemm

from vllm_br.device.cpu_kernels import gemv
from vllm_br.device.cpu_kernels import packed_linear as pl
from vllm_br.ops import embedding
from vllm_br.ops import linear as linear_op
from vllm_br.ops.registry import with_fallback

linear = with_fallback(pl.linear, linear_op.linear)
compute_logits = with_fallback(pl.compute_logits, embedding.compute_logits)

needs_kernel = pytest.mark.skipif(
    not gemv.available(),
    reason="no AVX512-BF16 here: test_kernel_where_the_host_has_avx512_bf16 "
    "checks that every call falls back",
)


def test_kernel_where_the_host_has_avx512_bf16():
    """The kernel is built where the host (capped by ONEDNN_MAX_CPU_ISA) has
    AVX512-BF16; elsewhere it declines every call and the ``linear`` op runs
    the packed or plain GEMM (test_linear_op_takes_few_rows)."""
    from vllm_br.device import cpu_isa
    from vllm_br.device.cpu_kernels import load_library

    assert load_library() is not None  # CI has a compiler
    assert gemv.available() == cpu_isa.host_isa().avx512_bf16
    if not gemv.available():
        w, b = _weights()
        assert gemv.gemv(_x(1), w, b) is None


@pytest.fixture
def calls(monkeypatch):
    """Counts calls of the C++ kernel that ran."""
    n = [0]
    real = gemv.gemv

    def counting(*args):
        out = real(*args)
        n[0] += out is not None
        return out

    monkeypatch.setattr(gemv, "gemv", counting)
    return n


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out_f,in_f", [(160, 576), (7, 576), (13, 1536), (5, 45)])
def test_gemv_against_fp64(rows, bias, out_f, in_f):
    w, b = _weights(out_f=out_f, in_f=in_f, bias=bias)
    x = _x(rows, in_f=in_f)
    out = gemv.gemv(x, w, b)
    assert out is not None
    assert_bf16_gemm(out, x, w, b)


@needs_kernel
def test_gemv_leading_dims_and_strided_input():
    w, b = _weights()
    x3 = _x(2).view(2, 1, -1)
    out = gemv.gemv(x3, w, b)
    assert out.shape == (2, 1, w.shape[0])
    assert_bf16_gemm(out.view(2, -1), x3.view(2, -1), w, b)
    wide = _x(2, in_f=2 * 576)[:, ::2]  # rows of 576 values, stride 2
    assert_bf16_gemm(gemv.gemv(wide, w, b), wide, w, b)


def test_gemv_does_not_apply():
    w, b = _weights()
    assert gemv.gemv(_x(gemv.MAX_ROWS + 1), w, b) is None
    assert gemv.gemv(_x(0), w, b) is None
    assert gemv.gemv(_x(1, dtype=torch.float32), w.float(), b.float()) is None
    wt = _weights(out_f=576, in_f=160)[0].t()  # [160, 576] with stride(1) 160
    assert gemv.gemv(_x(1), wt, None) is None
    assert gemv.gemv(_x(1), w, b.float()) is None


@pytest.mark.parametrize("rows", [1, 2, 3, 64])
def test_linear_op_takes_few_rows(rows, calls, monkeypatch):
    monkeypatch.delenv("VLLM_BR_CPU_PACKED_GEMM", raising=False)
    pl.clear()
    w, b = _weights()
    pl.pack(w)
    x = _x(rows)
    out = linear(x, w, b)
    ran = int(rows <= gemv.MAX_ROWS and gemv.available())
    assert calls[0] == ran
    assert_bf16_gemm(out, x, w, b)
    logits = compute_logits(x, w, None, None)
    assert calls[0] == 2 * ran
    assert_bf16_gemm(logits, x, w, None)
    pl.clear()
