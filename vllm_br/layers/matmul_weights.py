"""Wider copies of GEMM weights for devices whose matmul is slow in the model dtype.

The cpu backend on a host without AVX512-BF16 or AMX multiplies bfloat16
about 20x slower than float32 (torch falls back to a generic loop), so there
``get_backend().matmul_dtype(torch.bfloat16)`` is float32. After loading,
:func:`attach` stores a float32 copy of each unquantized linear weight (in its
device layout) and of the LM head as the module's ``br_matmul_weight``
buffer; the ``linear`` and ``compute_logits`` ops multiply in it and round the
result to bfloat16, which is what a bf16 GEMM with float32 accumulation
computes. The bfloat16 weights stay (embedding lookups and anything else
that reads ``weight`` see the model dtype), and GEMMs of few rows (decode)
multiply them instead: reading the weight bounds those, and the copy is twice
the bytes (``vllm_br.device.cpu_kernels.bf16_gemm.use_fp32_copy``, the measured threshold). A
card keeps its native dtype, and so nothing is attached.

:func:`prepare` then hands every GEMM weight that has no such copy to the
device's ``prepare_gemm_weight`` op: on the cpu backend on a host with fast
bf16 that packs it for oneDNN (``vllm_br.device.cpu_kernels.packed_linear``,
``VLLM_BR_CPU_PACKED_GEMM``); the reference does nothing.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
)

from vllm_br.device import get_backend
from vllm_br.logger import init_logger
from vllm_br.ops import get_op

logger = init_logger(__name__)

MATMUL_WEIGHT = "br_matmul_weight"


def _gemm_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The weight a plain GEMM of this module reads, if we run that GEMM."""
    from vllm_br.layers.linear import SUPAUnquantizedLinearMethod

    quant = getattr(module, "quant_method", None)
    if isinstance(module, LinearBase) and type(quant) is SUPAUnquantizedLinearMethod:
        if getattr(module, "_cpu_skip_gemm_dispatch", False):
            return None  # its raw weight is read by other code
        return module.weight
    if isinstance(module, ParallelLMHead) and type(quant) is UnquantizedEmbeddingMethod:
        return module.weight
    return None


def attach(model: torch.nn.Module) -> int:
    """Give every GEMM weight whose dtype the device multiplies slowly a copy
    in the dtype it multiplies fast; returns the bytes added."""
    backend = get_backend()
    added = 0
    for module in model.modules():
        weight = _gemm_weight(module)
        if weight is None or weight.ndim != 2:
            continue
        dtype = backend.matmul_dtype(weight.dtype)
        if dtype == weight.dtype:
            continue
        copy = weight.detach().to(dtype)
        module.register_buffer(MATMUL_WEIGHT, copy, persistent=False)
        added += copy.numel() * copy.element_size()
    if added:
        logger.info(
            "GEMMs run in float32 on bfloat16 weights (VLLM_BR_CPU_BF16_MATMUL; this "
            "host has no fast bf16 matmul): %.1f MiB of float32 weight copies.",
            added / 2**20,
        )
    return added


def prepare(model: torch.nn.Module) -> int:
    """Let the device prepare every GEMM weight multiplied as it is (no wider
    copy from :func:`attach`) for its matmul; returns the bytes added. Called
    after :func:`attach` and before the profile run, so the bytes are counted
    before the KV cache is sized."""
    prepare_weight = get_op("prepare_gemm_weight")
    added = count = 0
    for module in model.modules():
        weight = _gemm_weight(module)
        if weight is None or hasattr(module, MATMUL_WEIGHT):
            continue
        n = prepare_weight(weight, isinstance(module, ParallelLMHead))
        added += n
        count += n > 0
    if added:
        logger.info(
            "Prepacked %d GEMM weights for the device's matmul "
            "(VLLM_BR_CPU_PACKED_GEMM): %.1f MiB.",
            count,
            added / 2**20,
        )
    return added
