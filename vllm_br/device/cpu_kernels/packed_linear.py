"""bf16 GEMMs on oneDNN-prepacked weights (cpu backend, hosts with fast bf16).

On a host with AVX512-BF16 or AMX, ``F.linear`` in bfloat16 hands oneDNN a
plain ``[out, in]`` weight, which the matmul reorders into its blocked format
on every call. Packing each weight once into that format (what vLLM's own
CPU backend does with ``onednn_mm``; here torch's
``mkldnn._reorder_linear_weight``) and multiplying it with
``mkldnn._linear_pointwise`` is 1.3-1.8x faster for the GEMMs of decode and
small prefills; for many rows oneDNN's plain path catches up and at some
shapes overtakes it, so the packed weight is used up to :data:`MAX_ROWS`
rows (LM head: :data:`LM_HEAD_MAX_ROWS`), measured by
``benchmarks/kernels/packed_gemm_rows.py``. float32 weights are not packed: a
packed float32 GEMM measured 1.1-1.4x slower than ``F.linear`` (MKL) at 1 row
for every shape, and mixed from 8 to 256 rows (``--dtype float32``). Both compute the same dot products with
float32 accumulation and one rounding to bf16 (results agree to summation
order).

The packed tensors are opaque (MKLDNN layout), so they are not module
parameters or buffers (``torch.compile``'s fake tensors, state dicts and
``.to()`` cannot handle them): :func:`pack` keeps them in a side table keyed
by the weight's address, and :func:`linear` / :func:`compute_logits` look the
weight up when they run. An entry holds the weight's storage, so no other
tensor can take that address while it exists, and is used only while the
weight's shape, strides, dtype and version counter (bumped by in-place
writes, e.g. a weight reload) are those it was packed from; otherwise, and
wherever nothing was packed, the ops run their references. The entry goes
when the weight tensor is freed.

vLLM compiles one graph for every batch size, and the row count is a dynamic
size there, so under ``torch.compile`` the ops emit one opaque custom op,
``vllm_br::packed_linear``, that looks up and chooses when it runs.
``VLLM_BR_CPU_PACKED_GEMM`` is read when packing (0: nothing is packed) and
again when the op runs (0: the plain GEMM), so a compiled graph serves
either setting.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vllm_br import envs
from vllm_br.device import cpu_isa
from vllm_br.device.cpu_kernels import bf16_gemm, gemv

# Measured on the 2-core AMX host for SmolLM2-135M's GEMMs with cold weights,
# 2 threads, by ``.venv/bin/python benchmarks/kernels/packed_gemm_rows.py --rows
# 1,8,64,128,256,384,512,1024 --hints 1,64,128,256,none --calls 15 --json-out
# benchmarks/results/packed_gemm_rows.json``. Packed (hint 128) / plain
# F.linear time, median of 15 calls:
#   rows       1     8    64   128   256   384   512  1024
#   qkv      0.60  0.64  0.54  0.64  0.65  0.81  0.87  1.53
#   o_proj   0.62  0.56  0.58  0.55  0.70  1.08  1.24  0.49
#   gate_up  0.79  0.91  0.62  0.67  0.69  0.82  0.87  0.92
#   down     0.59  0.56  0.63  0.60  0.75  1.26  1.39  0.93
#   lm_head  0.61  0.56  0.59  0.63  0.66  0.96  0.97  0.99
# Every linear shape gains up to 256 rows and o_proj / down_proj lose from 384
# (oneDNN's plain path amortises its weight reorder over many rows): packed up
# to 256 rows, F.linear above (prefill chunks).
MAX_ROWS = 256
# The LM head (49152 x 576; logits only for the sampled rows) gains up to 256
# rows and is even with F.linear from 384 to 1024: the same 256.
LM_HEAD_MAX_ROWS = 256
# The batch-size hint oneDNN packs for: 64, 128, 256 and none measure alike
# (within 5%); 1 is up to 1.5x slower than those at 1-128 rows (gate_up: 1.19x
# plain at 1 row).
BATCH_HINT = 128

_VAR = "VLLM_BR_CPU_PACKED_GEMM"


@dataclass(frozen=True, eq=False)
class _Entry:
    packed: torch.Tensor
    storage: torch.UntypedStorage  # keeps the address from being reused
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    version: int | None  # None: an inference tensor (no version counter)


_TABLE: dict[int, _Entry] = {}


@functools.cache
def host_supported() -> bool:
    """Whether this host multiplies bf16 fast (AVX512-BF16 or AMX) and torch
    has oneDNN's linear-weight packing."""
    return (
        cpu_isa.host_isa().fast_bf16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


_enabled_seen: tuple[str | None, bool] | None = None  # (raw value, parsed)


def _enabled() -> bool:
    """``VLLM_BR_CPU_PACKED_GEMM`` now, parsed again only when it changed."""
    global _enabled_seen
    raw = os.environ.get(_VAR)
    if _enabled_seen is None or _enabled_seen[0] != raw:
        _enabled_seen = (raw, getattr(envs, _VAR))
    return _enabled_seen[1]


def _packable(weight: torch.Tensor) -> bool:
    from vllm_br.device import get_backend

    return (
        weight.ndim == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.is_contiguous()
        and weight.numel() > 0
        # bf16 GEMMs run natively (not on float32 copies, VLLM_BR_CPU_BF16_MATMUL)
        and get_backend().matmul_dtype(torch.bfloat16) == torch.bfloat16
    )


def _drop(key: int, entry: _Entry) -> None:
    if _TABLE.get(key) is entry:
        del _TABLE[key]


def pack(weight: torch.Tensor, lm_head: bool = False) -> int:
    """Pack ``weight`` (``[out, in]``, bf16) for the ops below; returns the
    bytes added (0 where it is not packed: setting off, host without fast
    bf16, another dtype, already packed). ``lm_head`` is unused: every GEMM
    weight is packed alike. The ``prepare_gemm_weight`` op on this backend."""
    del lm_head
    if not (_enabled() and host_supported() and _packable(weight)):
        return 0
    if lookup(weight) is not None:
        return 0  # tied weights (embedding and LM head) are packed once
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
    key = weight.data_ptr()
    entry = _Entry(
        packed=packed,
        storage=weight.untyped_storage(),
        shape=weight.shape,
        stride=weight.stride(),
        dtype=weight.dtype,
        version=None if weight.is_inference() else weight._version,
    )
    _TABLE[key] = entry
    weakref.finalize(weight, _drop, key, entry)
    return weight.numel() * weight.element_size()


def lookup(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed form of ``weight`` as it is now, or None."""
    entry = _TABLE.get(weight.data_ptr())
    if (
        entry is None
        or entry.shape != weight.shape
        or entry.dtype != weight.dtype
        or entry.stride != weight.stride()
        or (entry.version is not None and entry.version != weight._version)
    ):
        return None
    return entry.packed


def packed_bytes() -> int:
    """Bytes of all packed weights held now."""
    return sum(e.packed.numel() * e.packed.element_size() for e in _TABLE.values())


def clear() -> None:
    """Forget every packed weight (tests)."""
    _TABLE.clear()


def max_rows(lm_head: bool) -> int:
    return LM_HEAD_MAX_ROWS if lm_head else MAX_ROWS


def _packed_mm(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lm_head: bool
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on the packed weight where that is
    faster and there is one."""
    rows = x.numel() // max(1, x.shape[-1])
    if rows <= gemv.MAX_ROWS:
        out = gemv.gemv(x, weight, bias)  # faster than packed at these rows
        if out is not None:
            return out
    if 0 < rows <= max_rows(lm_head) and _enabled():
        packed = lookup(weight)
        if packed is not None:
            return _packed_mm(x, packed, bias)
    return F.linear(x, weight, bias)


def _gemm_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lm_head: bool
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_LIB = torch.library.Library("vllm_br", "FRAGMENT")
if not hasattr(torch.ops.vllm_br, "packed_linear"):
    _LIB.define(
        "packed_linear(Tensor x, Tensor weight, Tensor? bias, bool lm_head) -> Tensor"
    )
    _LIB.impl("packed_linear", _gemm, "CompositeExplicitAutograd")
    torch.library.register_fake("vllm_br::packed_linear", _gemm_fake, lib=_LIB)


def _may_pack(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a packed weight could serve this call (static properties only:
    under torch.compile they are guarded, so this is decided when tracing)."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.ndim == 2
        and x.ndim >= 1
        and (bias is None or (bias.dtype == x.dtype and bias.device.type == "cpu"))
    )


def _dispatch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lm_head: bool
) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return torch.ops.vllm_br.packed_linear(x, weight, bias, lm_head)
    return _gemm(x, weight, bias, lm_head)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    layout: Any = None,
    matmul_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``linear`` kernel (``vllm_br.ops.linear.linear``) where weights
    are packed: the packed weight for a plain-layout bf16 GEMM without a
    float32 copy; a weight with a copy as :mod:`bf16_gemm` does; the
    reference for the rest (declined)."""
    if layout is None and matmul_weight is None and _may_pack(x, weight, bias):
        return _dispatch(x, weight, bias, lm_head=False)
    return bf16_gemm.linear(x, weight, bias, layout, matmul_weight)


def compute_logits(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    matmul_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``compute_logits`` kernel (``vllm_br.ops.embedding``) on the
    packed LM head where there is one."""
    if matmul_weight is None and _may_pack(hidden_states, weight, bias):
        return _dispatch(hidden_states, weight, bias, lm_head=True)
    return bf16_gemm.compute_logits(hidden_states, weight, bias, matmul_weight)
