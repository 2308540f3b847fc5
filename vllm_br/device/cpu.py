"""cpu backend: SUPA devices emulated on the host.

Tensors live on the PyTorch CPU device and kernels run their reference
implementation; every SUPA policy above this layer (block size, dtypes,
attention backend, worker, communicator) is the same as on a card. Memory of
one emulated device is ``VLLM_BR_CPU_MEMORY_GIB`` capped by the host's.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import resource
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch

from vllm_br import envs
from vllm_br.device import cpu_isa
from vllm_br.device.base import DeviceBackend, DeviceProperties, Topology
from vllm_br.logger import init_logger

logger = init_logger(__name__)

# An emulated card looks like a BR100: two dies of 16 SPCs each.
_EMULATED_SPC_COUNT = 32
_EMULATED_NAME = "Biren BR100 (cpu emulation)"


class EmulatedEvent:
    """torch.Event-compatible event; host work is synchronous, so an event is
    complete as soon as it is recorded."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **_: Any):
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: EmulatedEvent) -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time needs both events recorded first.")
        return (end._t - self._t) * 1000.0


class EmulatedStream:
    """torch.Stream-compatible stream; all host work runs in order on one."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any):
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: EmulatedEvent | None = None) -> EmulatedEvent:
        event = event or EmulatedEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EmulatedStream)

    def __hash__(self) -> int:
        return 0


_DEFAULT_STREAM = EmulatedStream()


class EmulatedGraph:
    """Keeps SUPA-graph semantics on the host.

    Capture runs ``fn`` once on the static input buffers and keeps its output
    tensors as the static output buffers. Replay runs ``fn`` again on the same
    input buffers and writes into the same output buffers, so a caller that
    forgets to copy new inputs into the static buffers gets stale results,
    exactly as on a card.
    """

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], pool: Any):
        self._fn = fn
        self._args = args
        self.pool = pool
        self.output = fn(*args)
        self.replays = 0

    def replay(self) -> Any:
        fresh = self._fn(*self._args)
        _copy_into(self.output, fresh)
        self.replays += 1
        return self.output


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src, strict=True):
            _copy_into(d, s)
    elif isinstance(dst, dict):
        for k in dst:
            _copy_into(dst[k], src[k])
    elif dst is not None and dst != src:
        raise RuntimeError("A captured graph's non-tensor output changed on replay.")


class EmulatedGraphPool:
    """One pool handle shared by every capture (the tests check sharing)."""

    def __init__(self) -> None:
        self.graphs: list[EmulatedGraph] = []


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# The largest mmap threshold glibc accepts on 64-bit hosts.
_MMAP_THRESHOLD_MAX = 32 << 20
_TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_host_memory() -> bool:
    """Make glibc keep freed memory for reuse, as a device's caching allocator
    does, instead of returning it to the kernel; True where it took effect.

    A prefill step allocates activations of tens of MB per layer; by default
    glibc maps the large ones fresh and gives them back on free (and trims
    the heap top), so every step pays page faults and zeroing for them. In W1
    that made the same 4096-token prefill step take 0.6 to 1.7 s; with the
    freed memory kept it took 0.59-0.67 s. Allocations up to 32 MB (glibc's
    limit) then come from the heap, and up to 1 GiB of free heap top stays
    mapped; the emulated device's memory use (RSS) includes it, like a
    card's reserved pool."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False  # not glibc: its allocator's defaults stay
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
    if not ok:
        logger.warning("glibc refused the cpu backend's malloc settings (mallopt).")
    return ok


# vLLM's CPU platform settings for inductor's C++ code generation
# (vllm/platforms/cpu.py): no runtime shape/NaN asserts in the generated code,
# and an OpenMP thread count read at run time (the worker sets it after load).
CPU_INDUCTOR_CONFIG: dict[str, Any] = {
    "dce": True,
    "size_asserts": False,
    "nan_asserts": False,
    "epilogue_fusion": True,
    "cpp.dynamic_threads": True,
}


class CpuBackend(DeviceBackend):
    name = "cpu"
    torch_device_type = "cpu"
    dist_backend = "gloo"
    dispatch_key = "CPU"

    # The host is the device: tensors, memory and execution are the host's.
    host_memory_is_device_memory = True
    synchronous_execution = True
    # One memory domain: the per-die weight layout has nothing to split.
    numa_weight_layout = False
    memory_setting = "VLLM_BR_CPU_MEMORY_GIB"
    # Inductor's fused C++ code beats eager by 1.13-1.24x at batch 1/8/32 on
    # SmolLM2-135M bf16, the fastest of the six configurations not slower
    # than eager anywhere; graphs add nothing on top, since an emulated
    # replay re-runs the same host work (benchmarks/graph_modes.py,
    # 2026-12-02, docs/graphs.md).
    default_graph_modes = ("VLLM_COMPILE", "NONE")

    def __init__(self) -> None:
        self._current = 0
        self._peak_floor = 0
        self._peak_mark = 0

    # ---- devices ---------------------------------------------------------
    def device_count(self) -> int:
        return envs.VLLM_BR_CPU_NUM_DEVICES

    def current_device(self) -> int:
        return self._current

    def set_device(self, index: int) -> None:
        count = self.device_count()
        if not 0 <= index < count:
            from vllm_br.errors import SUPAConfigError

            raise SUPAConfigError(
                f"Device supa:{index} does not exist; the cpu backend emulates "
                f"{count} devices (VLLM_BR_CPU_NUM_DEVICES={count})."
            )
        self._current = index
        # The worker's process now holds this emulated device's memory.
        keep_freed_host_memory()

    def synchronize(self, index: int | None = None) -> None:
        pass

    @staticmethod
    def host_threads(workers_on_host: int = 1) -> int:
        """Intra-op threads for one emulated device: the cores this process
        may run on, shared by the workers on this host."""
        return max(1, len(os.sched_getaffinity(0)) // max(1, workers_on_host))

    def worker_threads(self, workers_on_host: int) -> int:
        # The host *is* the device: each worker gets its share of the cores.
        return self.host_threads(workers_on_host)

    def install_torch_accelerator(self) -> None:
        from vllm_br.device import cpu_accelerator

        cpu_accelerator.install(self)

    def inductor_config(self) -> dict[str, Any]:
        return dict(CPU_INDUCTOR_CONFIG)

    def get_device_properties(self, index: int = 0) -> DeviceProperties:
        spc = envs.VLLM_BR_DEVICE_SPC_NUM or _EMULATED_SPC_COUNT
        return DeviceProperties(
            name=_EMULATED_NAME,
            total_memory=self._total_memory(),
            spc_count=spc,
            numa_node=0,
        )

    def is_bf16_supported(self) -> bool:
        return True

    def matmul_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if dtype != torch.bfloat16:
            return dtype
        mode = envs.VLLM_BR_CPU_BF16_MATMUL
        if mode == "auto":
            # Without AVX512-BF16 or AMX, torch's bf16 GEMM falls back to a
            # slow generic loop (measured 8 GFLOP/s against 157 in fp32 on a
            # 2-core AVX2 host).
            mode = "native" if cpu_isa.host_isa().fast_bf16 else "fp32"
        return torch.bfloat16 if mode == "native" else torch.float32

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    # ---- memory ----------------------------------------------------------
    def _total_memory(self) -> int:
        cap = int(envs.VLLM_BR_CPU_MEMORY_GIB * (1 << 30))
        return min(cap, psutil.virtual_memory().total)

    @staticmethod
    def _rss() -> int:
        return psutil.Process(os.getpid()).memory_info().rss

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        total = self._total_memory()
        free = min(total - self._rss(), psutil.virtual_memory().available)
        return max(free, 0), total

    def memory_stats(self, index: int | None = None) -> dict[str, Any]:
        return {
            "allocated_bytes.all.current": self.memory_allocated(),
            "allocated_bytes.all.peak": self.max_memory_allocated(),
        }

    def memory_allocated(self, index: int | None = None) -> int:
        # The host has no device allocator: the process's resident memory is
        # what this emulated device holds.
        return self._rss()

    def max_memory_allocated(self, index: int | None = None) -> int:
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak_kb * 1024
        if peak <= self._peak_mark:
            # No new process-wide peak since the reset: the current RSS bounds it.
            return max(self._rss(), self._peak_floor)
        return peak

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        self._peak_floor = self._rss()
        self._peak_mark = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def empty_cache(self) -> None:
        pass

    # ---- streams, events, graphs ----------------------------------------
    Stream = EmulatedStream
    Event = EmulatedEvent

    def current_stream(self, index: int | None = None) -> EmulatedStream:
        return _DEFAULT_STREAM

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(stream)

    def capture_graph(
        self, fn: Callable[..., Any], *args: Any, pool: Any = None
    ) -> EmulatedGraph:
        graph = EmulatedGraph(fn, args, pool)
        if isinstance(pool, EmulatedGraphPool):
            pool.graphs.append(graph)
        return graph

    def graph_pool_handle(self) -> EmulatedGraphPool:
        return EmulatedGraphPool()

    def is_current_stream_capturing(self) -> bool:
        return False

    # ---- topology ----------------------------------------------------------
    def topology(self) -> Topology:
        n = self.device_count()
        spc = self.get_device_properties().spc_count
        return Topology(
            device_count=n,
            p2p=[[True] * n for _ in range(n)],
            numa_nodes=[0] * n,
            spc_counts=[spc] * n,
            dies_per_device=[2 if spc > 16 else 1] * n,
        )

    def versions(self) -> dict[str, str | None]:
        return {"torch_br": None}

    def fused_kernels(self) -> dict[str, Any]:
        # The host kernels compiled from vllm_br/device/cpu_kernels (empty
        # when they cannot be built; the references run then), and greedy
        # sampling (the C++ argmax, else max()).
        from vllm_br.device import cpu_kernels

        return {"greedy_sample": greedy_sample, **cpu_kernels.fused_kernels()}


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """The ``greedy_sample`` op on the host: the C++ argmax where it applies
    (float32 logits, as vLLM's sampler passes them); else ``max``, since
    torch's CPU ``argmax`` reduction is ~3x slower than ``max`` on
    ``[64, 49152]`` float32 logits. All return the index of the first
    maximum."""
    from vllm_br.device.cpu_kernels import sampling

    ids = sampling.argmax(logits) if envs.VLLM_BR_CPU_KERNELS else None
    if ids is not None:
        return ids
    return logits.max(dim=-1).indices.view(-1)
