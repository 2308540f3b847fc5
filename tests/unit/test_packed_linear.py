"""vllm_br.device.cpu_kernels.packed_linear: bf16 GEMMs on oneDNN-prepacked
weights (cpu backend, hosts with AVX512-BF16/AMX).

- Packed results against an fp64 reference of the same bf16 values, at row
  counts on both sides of the threshold, with and without bias; above the
  threshold, and wherever it falls back, bit for bit the reference op's.
- Fallbacks (run on every host): no packed entry, float32, a float32 weight
  copy (AVX2 hosts), a NUMA layout, VLLM_BR_CPU_PACKED_GEMM=0, a host without
  fast bf16, a weight written in place or freed after packing.
- Under torch.compile: one graph with the opaque op serves row counts on both
  sides without recompiling; opcheck of the op.

The one- and two-row GEMV kernel, which takes those rows first, is off here
(tests/unit/test_gemv.py covers it), so these rows reach the packed path.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from vllm_br.device import get_backend
from vllm_br.device.cpu_kernels import bf16_gemm, gemv
from vllm_br.device.cpu_kernels import packed_linear as pl
from vllm_br.ops import embedding
from vllm_br.ops import linear as linear_op
from vllm_br.ops import weight_layout as wl
from vllm_br.ops.registry import with_fallback
from vllm_br.ops.weight_layout import NUMA, DeviceLayout

# The kernels as the op registry binds them: a declined call runs the op's
# reference.
linear = with_fallback(pl.linear, linear_op.linear)
compute_logits = with_fallback(pl.compute_logits, embedding.compute_logits)

FAST = pl.host_supported()
needs_fast_bf16 = pytest.mark.skipif(
    not FAST, reason="host without AVX512-BF16/AMX (or oneDNN): nothing is packed"
)
ROWS = [1, 3, 64, pl.MAX_ROWS, pl.MAX_ROWS + 1, 2 * pl.MAX_ROWS + 3]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv("VLLM_BR_CPU_PACKED_GEMM", raising=False)  # 1
    monkeypatch.delenv("VLLM_BR_CPU_BF16_MATMUL", raising=False)  # auto
    monkeypatch.setattr(gemv, "MAX_ROWS", 0)
    pl.clear()
    yield
    pl.clear()


@pytest.fixture
def calls(monkeypatch):
    """Counts calls of the packed matmul."""
    n = [0]
    real = pl._packed_mm

    def counting(*args):
        n[0] += 1
        return real(*args)

    monkeypatch.setattr(pl, "_packed_mm", counting)
    return n


def _weights(out_f=160, in_f=576, bias=True, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype) if bias else None
    return w, b


def _x(rows, in_f=576, dtype=torch.bfloat16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_f, generator=g).to(dtype)


def _fp64(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def assert_bf16_gemm(out, x, w, b) -> None:
    """What a bf16 GEMM with float32 accumulation gives, against the exact
    (fp64) product of the same bf16 values: one rounding to bf16 (half an
    ulp: rtol 2^-8) plus float32 accumulation in a kernel-chosen order,
    which may round partial sums (atol 2^-8 of the largest output, half an
    ulp there). torch's own bf16 F.linear meets the same bound."""
    ref = _fp64(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    atol = 2**-8 * ref.abs().max().item()
    torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=atol)


# ---- packed, both sides of the threshold ---------------------------------------


@needs_fast_bf16
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", ROWS)
def test_packed_linear_bf16(rows, bias, calls):
    w, b = _weights(bias=bias)
    assert pl.pack(w) == w.numel() * 2
    x = _x(rows)
    out = linear(x, w, b)
    packed = rows <= pl.MAX_ROWS
    assert calls[0] == int(packed)
    assert_bf16_gemm(out, x, w, b)
    plain = F.linear(x, w, b)
    assert_bf16_gemm(plain, x, w, b)  # the bound is torch's own bf16 GEMM's
    if packed:
        # 1 bf16 ulp of the output (relative), as two summation orders differ.
        torch.testing.assert_close(out, plain, rtol=2**-7, atol=2**-8)
    else:
        assert torch.equal(out, plain)


@needs_fast_bf16
def test_packed_linear_leading_dims_and_strided_input(calls):
    w, b = _weights()
    pl.pack(w)
    x3 = _x(2 * 5).view(2, 5, -1)
    out = linear(x3, w, b)
    assert out.shape == (2, 5, w.shape[0]) and calls[0] == 1
    assert_bf16_gemm(out, x3, w, b)
    xt = _x(576, in_f=7).t()  # [7, 576], not contiguous
    assert_bf16_gemm(linear(xt, w, b), xt, w, b)
    assert calls[0] == 2


@needs_fast_bf16
@pytest.mark.parametrize("rows", [1, pl.LM_HEAD_MAX_ROWS, pl.LM_HEAD_MAX_ROWS + 1])
def test_packed_lm_head(rows, calls):
    w, _ = _weights(out_f=1000, bias=False)
    pl.pack(w, lm_head=True)
    x = _x(rows)
    out = compute_logits(x, w, None, None)
    assert calls[0] == int(rows <= pl.LM_HEAD_MAX_ROWS)
    assert_bf16_gemm(out, x, w, None)


@needs_fast_bf16
def test_tied_weight_is_packed_once():
    w, _ = _weights(bias=False)
    assert pl.pack(w, lm_head=True) > 0
    assert pl.pack(w) == 0
    assert len(pl._TABLE) == 1 and pl.packed_bytes() == w.numel() * 2


# ---- fallbacks (every host) ------------------------------------------------------


@pytest.mark.parametrize("rows", [1, pl.MAX_ROWS + 1])
def test_weight_without_entry_runs_the_reference(rows, calls):
    w, b = _weights()
    other, _ = _weights(seed=5)
    pl.pack(other)  # another weight's entry does not serve this one
    x = _x(rows)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(compute_logits(x, w, b), F.linear(x, w, b))
    assert calls[0] == 0


def test_float32_is_not_packed(calls):
    w, b = _weights(dtype=torch.float32)
    assert pl.pack(w) == 0
    x = _x(4, dtype=torch.float32)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert calls[0] == 0


@pytest.mark.parametrize("rows", [1, 32])
def test_float32_weight_copy_runs_matmul_gemm(rows, calls):
    """Where bf16 is slow (AVX2 hosts) GEMMs multiply float32 copies through
    bf16_gemm; given a copy, the kernel is bf16_gemm's exactly, even with a
    packed entry."""
    w, b = _weights()
    pl.pack(w)
    x = _x(rows)
    expect = bf16_gemm.gemm(x, w, w.float(), b)
    assert torch.equal(linear(x, w, b, None, w.float()), expect)
    logits = bf16_gemm.gemm(x, w, w.float(), None, lm_head=True)
    assert torch.equal(compute_logits(x, w, None, w.float()), logits)
    assert calls[0] == 0


def test_numa_layout_runs_the_reference(calls):
    sizes = [64, 32, 64]
    w, b = _weights(out_f=sum(sizes))
    layout = DeviceLayout.make(NUMA, 2, sizes, w.device)
    dev_w = wl.to_device_layout(w, NUMA, 2, sizes)
    pl.pack(dev_w)
    x = _x(3)
    assert torch.equal(linear(x, dev_w, b, layout), F.linear(x, w, b))
    assert calls[0] == 0


def test_setting_off_packs_nothing_and_multiplies_plainly(monkeypatch, calls):
    w, b = _weights()
    monkeypatch.setenv("VLLM_BR_CPU_PACKED_GEMM", "0")
    assert pl.pack(w) == 0 and not pl._TABLE
    monkeypatch.setenv("VLLM_BR_CPU_PACKED_GEMM", "1")
    packed = pl.pack(w) > 0
    assert packed is FAST
    monkeypatch.setenv("VLLM_BR_CPU_PACKED_GEMM", "0")  # read when the op runs
    x = _x(2)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert calls[0] == 0


def test_fp32_matmul_policy_packs_nothing(monkeypatch):
    """VLLM_BR_CPU_BF16_MATMUL=fp32 (and auto on an AVX2 host) multiplies
    float32 copies: nothing to pack."""
    monkeypatch.setenv("VLLM_BR_CPU_BF16_MATMUL", "fp32")
    assert get_backend().matmul_dtype(torch.bfloat16) == torch.float32
    assert pl.pack(_weights()[0]) == 0


def test_host_without_fast_bf16_packs_nothing(monkeypatch):
    monkeypatch.setattr(pl, "host_supported", lambda: False)
    assert pl.pack(_weights()[0]) == 0 and not pl._TABLE


def test_non_contiguous_weight_is_not_packed():
    w = _weights(out_f=576)[0].t()
    assert pl.pack(w) == 0 and not pl._TABLE


@needs_fast_bf16
def test_weight_written_in_place_falls_back(calls):
    w, b = _weights()
    pl.pack(w)
    with torch.no_grad():
        w.mul_(2)  # e.g. a weight reload: the packed copy is stale
    x = _x(2)
    assert pl.lookup(w) is None
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert calls[0] == 0


@needs_fast_bf16
def test_entry_goes_with_the_weight():
    w = torch.nn.Parameter(_weights(bias=False)[0], requires_grad=False)
    pl.pack(w)
    assert len(pl._TABLE) == 1
    del w
    gc.collect()
    assert not pl._TABLE


# ---- binding -------------------------------------------------------------------


def test_bound_where_the_host_has_fast_bf16(monkeypatch):
    from vllm_br.device import cpu_kernels

    kernels = cpu_kernels.fused_kernels()
    assert ("prepare_gemm_weight" in kernels) is FAST
    assert (kernels["linear"] is pl.linear) is FAST
    assert (kernels["compute_logits"] is pl.compute_logits) is FAST
    if not FAST:  # GEMMs on float32 weight copies, where there are copies
        assert kernels["linear"] is bf16_gemm.linear
    monkeypatch.setenv("VLLM_BR_CPU_KERNELS", "0")
    kernels = cpu_kernels.fused_kernels()
    assert "prepare_gemm_weight" not in kernels
    assert kernels["linear"] is bf16_gemm.linear
    assert kernels["compute_logits"] is bf16_gemm.compute_logits


# ---- torch.compile ---------------------------------------------------------------


class _Lin(torch.nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.bias = None if b is None else torch.nn.Parameter(b, requires_grad=False)

    def forward(self, x):
        return linear(x, self.weight, self.bias) * 2


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_graph_chooses_per_call(backend, calls):
    """vLLM compiles one graph for every batch size: the packed weight is
    looked up and the row threshold applied when the op runs. Compiled at 5
    rows, the same graph serves MAX_ROWS + 1 rows (plain) and 3 (packed)."""
    w, b = _weights()
    mod = _Lin(w, b)
    pl.pack(mod.weight)
    torch._dynamo.reset()
    compiled = torch.compile(mod, backend=backend, dynamic=True, fullgraph=True)
    x5, big, x3 = _x(5), _x(pl.MAX_ROWS + 1), _x(3)
    with torch.inference_mode():
        out5 = compiled(x5)
        with torch.compiler.set_stance("fail_on_recompile"):
            out_big = compiled(big)
            out3 = compiled(x3)
    assert calls[0] == (2 if FAST else 0)
    assert torch.equal(out_big, F.linear(big, w, b) * 2)
    for x, out in ((x5, out5), (x3, out3)):
        assert torch.equal(out, linear(x, w, b) * 2)
        assert_bf16_gemm(out / 2, x, w, b)
    torch._dynamo.reset()


@pytest.mark.parametrize("pack", [True, False])
def test_custom_op_schema_and_fake(pack):
    w, b = _weights()
    if pack:
        pl.pack(w)
    torch.library.opcheck(
        torch.ops.vllm_br.packed_linear.default,
        (_x(3), w, b, False),
        test_utils=("test_schema", "test_faketensor"),
    )
