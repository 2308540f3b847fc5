"""bf16 GEMMs that may multiply a float32 copy of the weight, chosen per call
(the cpu backend on hosts without AVX512-BF16 or AMX).

Where the host multiplies bfloat16 slowly, ``vllm_br.layers.matmul_weights``
gives each GEMM weight a float32 copy (``CpuBackend.matmul_dtype``). The copy is the fast path for GEMMs of
many rows (torch's generic bf16 loop runs ~8 GFLOP/s on an AVX2 host, float32
~157), but a GEMM of a few rows is bound by reading the weight, and the copy
is twice the bytes: there the bf16 weight is faster. :func:`use_fp32_copy` is
the rule; :func:`gemm` applies it.

Both paths give what a bf16 GEMM with float32 accumulation gives (one
rounding to the input dtype, up to summation order). A float32 input (a
model that asks for float32 logits) always multiplies the copy, whose dtype it
matches: the output stays float32, as without copies.

The choice depends on the row count, a dynamic size under ``torch.compile``
(vLLM compiles one graph for all batch sizes and drops shape guards), so when
compiling :func:`gemm` emits one opaque op, ``vllm_br::bf16_gemm``, that
chooses when it runs; eager calls run the same function directly. The op also
reads ``VLLM_BR_CPU_BF16_MATMUL`` when it runs, not when it is traced: vLLM's
compile cache key does not include plugin variables, so a graph compiled under
``fp32`` is reused under ``auto`` (both have the copies).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from vllm_br import envs

# Native bf16 beats the float32 copy up to this many rows per torch thread
# (linear layers; the LM head's own constant below). Measured on the 2-core
# AVX2 host for SmolLM2-135M's GEMMs with cold weights, by
# ``.venv/bin/python benchmarks/kernels/bf16_gemm_rows.py --json-out
# benchmarks/results/bf16_gemm_rows.json``: native time grows with rows and
# shrinks with threads (compute-bound), the copy's barely moves (bound by
# reading the weight). Native/fp32 time, qkv / o / gate_up / down: 0.4-0.5 at
# 1 row and 0.6-0.8 at 4 with 2 threads (1.0-1.1 at 6); 0.7-0.9 at 1 row,
# 0.7-1.0 at 2 and 0.8-1.2 at 3 with 1 thread.
NATIVE_ROWS_PER_THREAD = 2
# The LM head (49152 x 576) crosses later: 0.6 at 3 rows, 1.1 at 4 with 1 thread;
# 0.5-0.7 at 6 rows, 0.8-1.0 at 8 with 2 threads.
LM_HEAD_NATIVE_ROWS_PER_THREAD = 3
# Threads measured (the host's cores); more are not extrapolated.
MEASURED_THREADS = 2


def use_fp32_copy(rows: int, mode: str, threads: int, lm_head: bool = False) -> bool:
    """Whether a bf16 GEMM of ``rows`` rows multiplies the float32 weight copy.

    ``mode`` is ``VLLM_BR_CPU_BF16_MATMUL``: ``fp32`` always, ``native`` never,
    ``auto`` above ``NATIVE_ROWS_PER_THREAD`` (``LM_HEAD_...`` for the LM
    head) rows per thread, ``threads`` being torch's intra-op threads, at most
    ``MEASURED_THREADS``."""
    if mode == "fp32":
        return True
    if mode == "native":
        return False
    per_thread = LM_HEAD_NATIVE_ROWS_PER_THREAD if lm_head else NATIVE_ROWS_PER_THREAD
    return rows > per_thread * min(max(1, threads), MEASURED_THREADS)


_MODE_VAR = "VLLM_BR_CPU_BF16_MATMUL"
_mode_seen: tuple[str | None, str] | None = None  # (raw value, parsed)


def _mode() -> str:
    """``VLLM_BR_CPU_BF16_MATMUL`` now, parsed again only when it changed
    (a GEMM must not pay the full parse, ~3 us, on every call)."""
    global _mode_seen
    raw = os.environ.get(_MODE_VAR)
    if _mode_seen is None or _mode_seen[0] != raw:
        _mode_seen = (raw, getattr(envs, _MODE_VAR))
    return _mode_seen[1]


def _bf16_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    matmul_weight: torch.Tensor,
    bias: torch.Tensor | None,
    lm_head: bool,
) -> torch.Tensor:
    rows = x.numel() // max(1, x.shape[-1])
    if x.dtype == weight.dtype and not use_fp32_copy(
        rows, _mode(), torch.get_num_threads(), lm_head
    ):
        return F.linear(x, weight, bias)
    dt = matmul_weight.dtype
    b = None if bias is None else bias.to(dt)
    return F.linear(x.to(dt), matmul_weight, b).to(x.dtype)


def _bf16_gemm_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    matmul_weight: torch.Tensor,
    bias: torch.Tensor | None,
    lm_head: bool,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_LIB = torch.library.Library("vllm_br", "FRAGMENT")
if not hasattr(torch.ops.vllm_br, "bf16_gemm"):
    _LIB.define(
        "bf16_gemm(Tensor x, Tensor weight, Tensor matmul_weight, Tensor? bias, "
        "bool lm_head) -> Tensor"
    )
    _LIB.impl("bf16_gemm", _bf16_gemm, "CompositeExplicitAutograd")
    torch.library.register_fake("vllm_br::bf16_gemm", _bf16_gemm_fake, lib=_LIB)


def gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    matmul_weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    lm_head: bool = False,
) -> torch.Tensor:
    """``x @ weight.T + bias`` in ``x``'s dtype; ``matmul_weight`` is
    ``weight`` in float32, multiplied instead where :func:`use_fp32_copy`
    says so (or where ``x`` is not in ``weight``'s dtype)."""
    if torch.compiler.is_compiling():
        return torch.ops.vllm_br.bf16_gemm(x, weight, matmul_weight, bias, lm_head)
    return _bf16_gemm(x, weight, matmul_weight, bias, lm_head)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    layout: Any = None,
    matmul_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``linear`` kernel for a weight with a float32 copy: :func:`gemm`
    chooses per call. Declines everything else (the reference runs): the cpu
    backend keeps weights in the plain layout."""
    if layout is not None or matmul_weight is None:
        return NotImplemented
    return gemm(x, weight, matmul_weight, bias)


def compute_logits(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    matmul_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``compute_logits`` kernel for an LM head with a float32 copy."""
    if matmul_weight is None:
        return NotImplemented
    return gemm(hidden_states, weight, matmul_weight, bias, lm_head=True)
