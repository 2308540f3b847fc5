"""The interface every device backend implements.

The rest of the plugin talks to a SUPA device only through this interface
(``vllm_br.device.get_backend()``). Two backends implement it: ``supa``
(torch_br on a Biren card) and ``cpu`` (the same SUPA policies emulated on
the host).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class DeviceProperties:
    name: str
    total_memory: int
    spc_count: int
    numa_node: int


@dataclass(frozen=True)
class Topology:
    """What the allreduce strategy and weight layout need to know."""

    device_count: int
    # p2p[i][j]: devices i and j can reach each other directly (B-Link / PCIe P2P)
    p2p: list[list[bool]]
    numa_nodes: list[int]
    spc_counts: list[int]
    # Dies per card: a card with more than 16 SPCs has two dies (two NUMA domains)
    dies_per_device: list[int] = field(default_factory=list)


class CapturedGraph(Protocol):
    """A captured graph: static inputs in, static output buffers out."""

    output: Any

    def replay(self) -> Any: ...


class DeviceBackend(ABC):
    #: backend name as VLLM_BR_DEVICE spells it
    name: str
    #: torch device type of tensors on this backend ("supa" or "cpu")
    torch_device_type: str
    #: torch.distributed backend for the device process group
    dist_backend: str
    #: PyTorch dispatch key of the device
    dispatch_key: str

    # ---- capabilities: what the layers above ask instead of the name ------
    #: device tensors are host tensors (the runner's device buffers can alias
    #: its host buffers)
    host_memory_is_device_memory: bool = False
    #: every op finishes before it returns (nothing for async scheduling to
    #: overlap)
    synchronous_execution: bool = False
    #: weights can be laid out per die (VLLM_BR_WEIGHT_TYPE=NUMA)
    numa_weight_layout: bool = True
    #: collectives go through SCCL (else torch.distributed's dist_backend)
    uses_sccl: bool = False
    #: host memory can be pinned for this device (``pin_memory=True``), so
    #: host-to-device input copies are non-blocking
    pinned_host_memory: bool = False
    #: the setting that sizes the device's memory, where the user sets it
    memory_setting: str | None = None
    #: (compilation mode, cudagraph mode) names used where the user chose
    #: none: the fastest correct configuration measured on this device
    #: (vllm_br/compilation/defaults.py applies them)
    default_graph_modes: tuple[str, str] = ("VLLM_COMPILE", "FULL_AND_PIECEWISE")

    def worker_threads(self, workers_on_host: int) -> int | None:
        """Intra-op threads a worker should run with, or None for vLLM's
        choice (one: on a card host threads only schedule work)."""
        return None

    def install_torch_accelerator(self) -> None:
        """Make ``torch.accelerator`` answer for this device in this process,
        where torch does not already (vLLM code asks it). torch_br does it
        on a card."""
        return None

    def has_inductor_codegen(self) -> bool:
        """Inductor can generate code for this device (on a card, torch_br
        registers a device code generator; the cpu backend uses inductor's
        C++ one)."""
        if self.torch_device_type == "cpu":
            return True
        from torch._inductor.codegen.common import (
            get_scheduling_for_device,
            init_backend_registration,
        )

        init_backend_registration()
        return get_scheduling_for_device(self.torch_device_type) is not None

    def inductor_config(self) -> dict[str, Any]:
        """Inductor options this device's compiled code needs (defaults: the
        user's compile config wins)."""
        return {}

    # ---- devices ---------------------------------------------------------
    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def current_device(self) -> int: ...

    @abstractmethod
    def set_device(self, index: int) -> None: ...

    def torch_device(self, index: int | None = None) -> torch.device:
        """The torch.device tensors of device ``index`` live on."""
        if self.torch_device_type == "cpu":
            return torch.device("cpu")
        return torch.device(
            self.torch_device_type, self.current_device() if index is None else index
        )

    @abstractmethod
    def synchronize(self, index: int | None = None) -> None: ...

    @abstractmethod
    def get_device_properties(self, index: int = 0) -> DeviceProperties: ...

    @abstractmethod
    def is_bf16_supported(self) -> bool: ...

    def matmul_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype GEMMs on ``dtype`` weights should compute in (the layers
        keep a copy of the weights in it when it differs)."""
        return dtype

    @abstractmethod
    def manual_seed_all(self, seed: int) -> None: ...

    # ---- memory ----------------------------------------------------------
    @abstractmethod
    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        """(free bytes, total bytes) of the device."""

    @abstractmethod
    def memory_stats(self, index: int | None = None) -> dict[str, Any]: ...

    @abstractmethod
    def memory_allocated(self, index: int | None = None) -> int: ...

    @abstractmethod
    def max_memory_allocated(self, index: int | None = None) -> int: ...

    @abstractmethod
    def reset_peak_memory_stats(self, index: int | None = None) -> None: ...

    @abstractmethod
    def empty_cache(self) -> None: ...

    # ---- streams, events, graphs ----------------------------------------
    #: the device's stream and event classes (torch.supa.Stream / Event on a
    #: card). Classes, not factories: vLLM code does isinstance() on them.
    Stream: type
    Event: type

    @abstractmethod
    def current_stream(self, index: int | None = None) -> Any: ...

    @abstractmethod
    def stream(self, stream: Any) -> AbstractContextManager: ...

    @abstractmethod
    def capture_graph(
        self, fn: Callable[..., Any], *args: Any, pool: Any = None
    ) -> CapturedGraph:
        """Capture ``fn(*args)`` once into a graph (torch.supa.SUPAGraph on a
        card). ``args`` are the static input buffers: callers copy new inputs
        into them before ``replay()``; the result lives in ``.output``."""

    @abstractmethod
    def graph_pool_handle(self) -> Any: ...

    @abstractmethod
    def is_current_stream_capturing(self) -> bool: ...

    # ---- topology ----------------------------------------------------------
    @abstractmethod
    def topology(self) -> Topology: ...

    # ---- versions (for `vllm-br info`) ---------------------------------------
    def versions(self) -> dict[str, str | None]:
        return {}

    # ---- fused vendor kernels ---------------------------------------------
    def fused_kernels(self) -> dict[str, Any]:
        """Vendor kernels bound by this backend, by op name. Ops not listed
        run their reference implementation."""
        return {}
