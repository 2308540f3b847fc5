"""Host kernels of the cpu backend, built from C++ with the system compiler.

The cpu backend runs the ops' PyTorch references, except where a profile
showed a reference far from what the host can do; those ops get a small C++
kernel here, checked against the reference by the unit tests. The library is
compiled once per source, compiler and CPU (``-march=native``, less what
``ONEDNN_MAX_CPU_ISA`` caps: ``vllm_br.device.cpu_isa``) into
``VLLM_BR_KERNEL_CACHE`` and loaded with ctypes, only from a cache entry no
other user could have planted (``vllm_br.device.kernel_cache``). It links the process's
libgomp (the one torch loaded), so its OpenMP threads are torch's.

Without a compiler the C++ ops run their references and a warning says
why; with ``VLLM_BR_CPU_KERNELS=0`` every op does. The packed GEMMs
(``packed_linear``) use torch's own oneDNN and need no compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from vllm_br import envs
from vllm_br.device import cpu_isa, kernel_cache
from vllm_br.logger import init_logger

logger = init_logger(__name__)

_SOURCES = ("paged_attention.cpp", "gemv.cpp", "int8_gemv.cpp", "argmax.cpp")
# Included by the sources, so part of the library's cache key.
_HEADERS = ("bf16.h",)
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17")


def _flags() -> tuple[str, ...]:
    """The compiler flags: native code, less what ONEDNN_MAX_CPU_ISA caps."""
    return _FLAGS + cpu_isa.host_isa().compiler_flags()


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _library_path(compiler: str) -> Path:
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        h.update((here / name).read_bytes())
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    for part in (version, " ".join(_flags()), _cpu_signature()):
        h.update(part.encode())
    return (
        Path(envs.VLLM_BR_KERNEL_CACHE).expanduser()
        / f"libvllm_br_cpu_kernels-{h.hexdigest()[:16]}.so"
    )


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _compile(compiler: str, output: Path) -> None:
    here = Path(__file__).resolve().parent
    cmd = [compiler, *_flags(), "-o", str(output), *(str(here / s) for s in _SOURCES)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip()[-2000:])


def _build(compiler: str, target: Path) -> None:
    # Build into a temporary file and install it by rename: workers of one
    # engine may build at the same time, and a reader must never see a
    # half-written library.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        _compile(compiler, Path(tmp))
        kernel_cache.install(Path(tmp), target)
    finally:
        for leftover in (tmp, tmp + ".sha256"):
            if os.path.exists(leftover):
                os.unlink(leftover)


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (then the references run). Loaded only
    from a trusted cache entry (``vllm_br.device.kernel_cache``)."""
    if not envs.VLLM_BR_CPU_KERNELS:
        logger.info("VLLM_BR_CPU_KERNELS=0: the cpu backend runs reference ops only.")
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning(
            "No C++ compiler (g++/c++ or $CXX) was found, so the cpu backend runs "
            "its slower reference kernels; install g++ to get the fast ones."
        )
        return None
    try:
        torch.ops  # noqa: B018 - torch (and its libgomp) is loaded first
        return kernel_cache.load_or_build(
            _library_path(compiler),
            functools.partial(_build, compiler),
            _declare,
        )
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning(
            "Building the cpu backend's kernels failed, so it runs the slower "
            "reference kernels (set VLLM_BR_CPU_KERNELS=0 to skip the build): %s",
            e,
        )
        return None


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    fn = lib.vllm_br_paged_attention
    fn.argtypes = [ptr]  # const Args* (paged_attention.AttentionArgs)
    fn.restype = ctypes.c_int
    fn = lib.vllm_br_attention_args_layout
    fn.argtypes = [ptr, i32]
    fn.restype = i32
    lib.vllm_br_attention_has_amx.argtypes = []
    lib.vllm_br_attention_has_amx.restype = ctypes.c_int
    fn = lib.vllm_br_reshape_and_cache
    fn.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr, i64, i64, i64]
    fn.argtypes += [i32] * 4 + [i64]
    fn.restype = ctypes.c_int
    lib.vllm_br_gemv_max_rows.argtypes = []
    lib.vllm_br_gemv_max_rows.restype = ctypes.c_int
    fn = lib.vllm_br_gemv_bf16
    fn.argtypes = [ptr, i64, i32, ptr, i64, i32, i32, ptr, ptr, i64, i32]
    fn.restype = ctypes.c_int
    lib.vllm_br_gemv_w8_max_rows.argtypes = []
    lib.vllm_br_gemv_w8_max_rows.restype = ctypes.c_int
    lib.vllm_br_gemv_w8_group_multiple.argtypes = []
    lib.vllm_br_gemv_w8_group_multiple.restype = ctypes.c_int
    fn = lib.vllm_br_gemv_w8_bf16
    fn.argtypes = [ptr, i64, i32, ptr, i64, i32, i32, ptr, i32, i32, ptr, ptr, i64, i32]
    fn.restype = ctypes.c_int
    fn = lib.vllm_br_gemv_i8i8
    fn.argtypes = [ptr, i64, i32, ptr, i64, i32, i32, ptr, i64, i32]
    fn.restype = ctypes.c_int
    fn = lib.vllm_br_argmax_f32
    fn.argtypes = [ptr, i64, i64, i64, ptr, i32]
    fn.restype = ctypes.c_int


def fused_kernels() -> dict[str, object]:
    """The ops the cpu backend accelerates, by op name: this library's C++
    kernels (none without it), the GEMMs on oneDNN-prepacked weights on hosts
    with fast bf16 (``packed_linear``: torch's own oneDNN, so bound without a
    compiler too), and GEMMs on float32 weight copies chosen per call
    (``bf16_gemm``, where the host has no fast bf16), and int8 GEMMs on
    torch's ``_int_mm`` / ``_weight_int8pack_mm`` (``int8_gemm``). ``VLLM_BR_CPU_KERNELS=0`` binds
    neither the C++ kernels nor the packed or int8 GEMMs. Each kernel declines
    what it does not handle (the reference runs)."""
    from vllm_br.device.cpu_kernels import bf16_gemm

    kernels: dict[str, object] = {
        "linear": bf16_gemm.linear,
        "compute_logits": bf16_gemm.compute_logits,
    }
    if load_library() is not None:
        from vllm_br.device.cpu_kernels import paged_attention

        kernels["paged_attention_decode"] = paged_attention.decode
        kernels["paged_attention_prefill"] = paged_attention.prefill
        kernels["reshape_and_cache"] = paged_attention.reshape_and_cache
    if envs.VLLM_BR_CPU_KERNELS:
        from vllm_br.device.cpu_kernels import int8_gemm, packed_linear

        kernels["int8_scaled_mm"] = int8_gemm.int8_scaled_mm
        kernels["weight_only_linear"] = int8_gemm.weight_only_linear

        if packed_linear.host_supported():
            kernels["linear"] = packed_linear.linear
            kernels["compute_logits"] = packed_linear.compute_logits
            kernels["prepare_gemm_weight"] = packed_linear.pack
    return kernels
