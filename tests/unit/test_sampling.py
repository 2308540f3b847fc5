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
