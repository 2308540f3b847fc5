"""Greedy sampling: the cpu backend's op against vLLM's formula (argmax)."""

from __future__ import annotations

import pytest
import torch

from vllm_br.device.cpu import CpuBackend
from vllm_br.device.cpu import greedy_sample as cpu_greedy_sample
from vllm_br.ops.sampling import greedy_sample


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_cpu_greedy_sample_equals_argmax(dtype, rows):
    fast = CpuBackend().fused_kernels()["greedy_sample"]
    assert fast is cpu_greedy_sample
    g = torch.Generator().manual_seed(rows)
    # Few distinct values, so most rows hold ties for the maximum; the first
    # maximum must win, as with argmax.
    logits = torch.randint(-3, 4, (rows, 49152), generator=g).to(dtype)
    logits[0, :7] = float("-inf")
    if rows > 2:
        logits[1] = float("-inf")  # all -inf: index 0, like argmax
        logits[2, 100] = float("nan")  # NaN propagates to its index
    got = fast(logits)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, greedy_sample(logits))
    assert torch.equal(got, logits.argmax(dim=-1))


@pytest.mark.parametrize("cols", [1, 15, 16, 49152, 49157])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_cpu_argmax_kernel_equals_argmax(rows, cols):
    """The C++ argmax (float32, what vLLM's sampler passes) on rows with ties,
    -inf, NaN, a maximum in the vector tail, and a row stride past the row."""
    from vllm_br.device.cpu_kernels import load_library, sampling

    if load_library() is None:
        pytest.skip("no C++ compiler: the cpu backend runs max()")
    g = torch.Generator().manual_seed(rows * 100003 + cols)
    padded = torch.randint(-3, 4, (rows, cols + 3), generator=g).float()
    logits = padded[:, :cols]  # stride(0) = cols + 3
    if rows > 1:
        logits[1] = float("-inf")
    if rows > 2:
        logits[2, cols // 2] = float("nan")
        logits[2, -1] = float("nan")
    if rows > 3:
        logits[3, -1] = 10.0  # the maximum in the scalar tail
    if rows > 4:
        logits[4, 0] = float("inf")
        logits[4, -1] = float("inf")
    got = sampling.argmax(logits)
    assert got is not None and got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert torch.equal(cpu_greedy_sample(logits), got)


def test_cpu_argmax_kernel_declines_what_it_does_not_serve():
    from vllm_br.device.cpu_kernels import sampling

    x = torch.randn(4, 64)
    assert sampling.argmax(x.bfloat16()) is None
    assert sampling.argmax(x.t()) is None  # columns not contiguous
    assert sampling.argmax(x[:, :0]) is None
    assert sampling.argmax(x[0]) is None
