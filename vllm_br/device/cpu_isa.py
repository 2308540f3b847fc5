"""The instruction sets the cpu backend may use on this host.

torch reports what the CPU has. ``ONEDNN_MAX_CPU_ISA``, oneDNN's own cap on
the instruction sets it dispatches to (torch's bf16 and packed GEMMs go
through oneDNN), caps what the backend uses too: its bf16 GEMM policy, the
packed GEMMs and the compiler flags of its C++ kernels. So one variable,
with ``ATEN_CPU_CAPABILITY`` for torch's own kernels, makes a process behave
as on an older host, e.g. ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``
for an AVX2-only one (how the test suite is run as on the slowest CI hosts).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from vllm_br.logger import init_logger

logger = init_logger(__name__)

# oneDNN's ISA names, oldest first (its documented ONEDNN_MAX_CPU_ISA values;
# the AVX10 names are its newer spellings of the AVX-512 ones).
_ONEDNN_ISAS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX512_CORE_FP16",
    "AVX10_1_512",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
)
_RANK = {name: i for i, name in enumerate(_ONEDNN_ISAS)}


@dataclass(frozen=True)
class HostISA:
    avx512: bool  # AVX-512 F/BW/VL (the kernels' 16-float vectors)
    avx512_bf16: bool  # bf16 dot products: bf16 GEMMs run natively
    amx_bf16: bool  # AMX tiles with bf16
    # int8 dot products summed exactly in int32 (VNNI). Without it oneDNN's
    # int8 GEMMs pair products in saturating int16 (vpmaddubsw), so
    # torch._int_mm is wrong for full-range int8 (seen under
    # ONEDNN_MAX_CPU_ISA=AVX2 and AVX512_CORE).
    avx512_vnni: bool = False

    @property
    def fast_bf16(self) -> bool:
        """bf16 GEMMs are native (oneDNN's AVX512-BF16 or AMX kernels)."""
        return self.avx512_bf16 or self.amx_bf16

    def compiler_flags(self) -> tuple[str, ...]:
        """What ``-march=native`` must leave out under the cap."""
        if not self.avx512:
            return ("-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
        flags = () if self.avx512_bf16 else ("-mno-avx512bf16",)
        if not self.amx_bf16:
            flags += ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
        return flags


def _cap_rank() -> int | None:
    """``ONEDNN_MAX_CPU_ISA`` as a rank in :data:`_ONEDNN_ISAS`; None for no
    cap (unset, oneDNN's ``ALL`` / ``DEFAULT``, or a name newer than this
    list, which caps nothing the backend uses)."""
    raw = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if raw in ("", "ALL", "DEFAULT"):
        return None
    if raw not in _RANK:
        logger.warning(
            "ONEDNN_MAX_CPU_ISA=%s is not an instruction set the cpu backend "
            "knows, so it caps none of the backend's kernels.",
            raw,
        )
        return None
    return _RANK[raw]


@functools.cache
def host_isa() -> HostISA:
    """What the CPU has (torch's cpuinfo), capped by ``ONEDNN_MAX_CPU_ISA``.
    Read once per process, like oneDNN reads its variable."""
    cap = _cap_rank()

    def allowed(isa: str) -> bool:
        return cap is None or cap >= _RANK[isa]

    avx512 = torch.cpu._is_avx512_supported() and allowed("AVX512_CORE")
    return HostISA(
        avx512=avx512,
        avx512_bf16=avx512
        and torch.cpu._is_avx512_bf16_supported()
        and allowed("AVX512_CORE_BF16"),
        amx_bf16=avx512
        and torch.cpu._is_amx_tile_supported()
        and allowed("AVX512_CORE_AMX"),
        avx512_vnni=avx512
        and torch.cpu._is_vnni_supported()
        and allowed("AVX512_CORE_VNNI"),
    )
