"""supa backend: a Biren card through torch_br.

``import torch_br`` registers the ``supa`` PrivateUse1 device and exposes
``torch.supa``, which mirrors ``torch.cuda``; every method below delegates to
it. torch_br is imported when the backend is constructed, never when this
module is imported.

Device visibility: torch_br reads ``SUPA_VISIBLE_DEVICES`` itself, so
``supa:N`` here is already the N-th visible card; this backend does not remap
torch device indices (only BRML queries, which number physical cards, are
mapped, see ``vllm_br.device.brml``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from vllm_br import envs
from vllm_br.device import brml
from vllm_br.device.base import DeviceBackend, DeviceProperties, Topology
from vllm_br.errors import SUPAConfigError
from vllm_br.logger import init_logger

logger = init_logger(__name__)


class SupaGraph:
    """A captured ``torch.supa.SUPAGraph`` with its static output buffers."""

    def __init__(self, graph: Any, output: Any, pool: Any) -> None:
        self.graph = graph
        self.output = output
        self.pool = pool
        #: replays so far (as the cpu backend's emulated graph counts them)
        self.replays = 0

    def replay(self) -> Any:
        self.graph.replay()
        self.replays += 1
        return self.output


def _import_torch_br() -> Any:
    try:
        import torch_br
    except ImportError as e:
        choice = envs.VLLM_BR_DEVICE
        chosen = (
            "VLLM_BR_DEVICE=supa"
            if choice == "supa"
            else (f"VLLM_BR_DEVICE={choice} selected the supa backend")
        )
        reason = str(e).rstrip(".") or type(e).__name__
        raise SUPAConfigError(
            f"{chosen} but torch_br cannot be imported ({reason}); install the "
            "Biren torch_br package or set VLLM_BR_DEVICE=cpu to use the host "
            "emulation."
        ) from e
    if getattr(torch, "supa", None) is None:
        raise SUPAConfigError(
            "VLLM_BR_DEVICE selected the supa backend but importing torch_br did "
            f"not register torch.supa; install the torch_br build made for torch "
            f"{torch.__version__} or set VLLM_BR_DEVICE=cpu to use the host "
            "emulation."
        )
    return torch_br


class SupaBackend(DeviceBackend):
    name = "supa"
    torch_device_type = "supa"
    dist_backend = "sccl"
    uses_sccl = True
    pinned_host_memory = True
    # On a card, vLLM's own default (graphs remove per-kernel launch cost).
    # Not measured here: no SUPA card is reachable from CI.
    default_graph_modes = ("VLLM_COMPILE", "FULL_AND_PIECEWISE")
    dispatch_key = "PrivateUse1"

    def __init__(self) -> None:
        self._torch_br = _import_torch_br()
        self._supa = torch.supa
        self.Stream = self._supa.Stream
        self.Event = self._supa.Event
        self._links: brml.LinkInfo | None = None

    # ---- devices ---------------------------------------------------------
    def device_count(self) -> int:
        return int(self._supa.device_count())

    def current_device(self) -> int:
        return int(self._supa.current_device())

    def set_device(self, index: int) -> None:
        count = self.device_count()
        if not 0 <= index < count:
            raise SUPAConfigError(
                f"Device supa:{index} does not exist; torch_br sees {count} "
                f"devices (SUPA_VISIBLE_DEVICES={envs.SUPA_VISIBLE_DEVICES})."
            )
        self._supa.set_device(index)

    def synchronize(self, index: int | None = None) -> None:
        self._supa.synchronize(index)

    def get_device_properties(self, index: int = 0) -> DeviceProperties:
        props = self._supa.get_device_properties(index)
        numa = self._link_info().numa_nodes
        return DeviceProperties(
            name=str(props.name),
            total_memory=int(props.total_memory),
            spc_count=brml.spc_count(self._supa, index),
            numa_node=numa[index] if 0 <= index < len(numa) else -1,
        )

    def is_bf16_supported(self) -> bool:
        return bool(self._supa.is_bf16_supported())

    def manual_seed_all(self, seed: int) -> None:
        self._supa.manual_seed_all(seed)

    # ---- memory ----------------------------------------------------------
    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        free, total = self._supa.mem_get_info(index)
        return int(free), int(total)

    def memory_stats(self, index: int | None = None) -> dict[str, Any]:
        return dict(self._supa.memory_stats(index))

    def memory_allocated(self, index: int | None = None) -> int:
        return int(self._supa.memory_allocated(index))

    def max_memory_allocated(self, index: int | None = None) -> int:
        return int(self._supa.max_memory_allocated(index))

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        self._supa.reset_peak_memory_stats(index)

    def empty_cache(self) -> None:
        self._supa.empty_cache()

    # ---- streams, events, graphs ----------------------------------------
    def current_stream(self, index: int | None = None) -> Any:
        return self._supa.current_stream(index)

    def stream(self, stream: Any) -> AbstractContextManager:
        return self._supa.stream(stream)

    def capture_graph(
        self, fn: Callable[..., Any], *args: Any, pool: Any = None
    ) -> SupaGraph:
        supa = self._supa
        # Warm up once on a side stream, as graph capture requires (lazy
        # initialisation and allocator work must not happen while capturing).
        side = supa.Stream()
        side.wait_stream(supa.current_stream())
        with supa.stream(side):
            fn(*args)
        supa.current_stream().wait_stream(side)
        supa.synchronize()

        graph = supa.SUPAGraph()
        with supa.graph(graph, pool=pool):
            output = fn(*args)
        return SupaGraph(graph, output, pool)

    def graph_pool_handle(self) -> Any:
        return self._supa.graph_pool_handle()

    def is_current_stream_capturing(self) -> bool:
        return bool(self._supa.is_current_stream_capturing())

    # ---- topology ----------------------------------------------------------
    def _link_info(self) -> brml.LinkInfo:
        # P2P links and NUMA placement are fixed for the process: query once.
        if self._links is None:
            self._links = brml.query_links(self._supa)
        return self._links

    def topology(self) -> Topology:
        # SPC counts are read on every call so VLLM_BR_DEVICE_SPC_NUM is seen.
        return brml.build_topology(self._supa, self._link_info())

    def devices(self) -> list[brml.BrmlDevice]:
        """What BRML reports about each visible card (for ``vllm-br info``)."""
        return list(self._link_info().devices)

    # ---- versions ----------------------------------------------------------
    def versions(self) -> dict[str, str | None]:
        version = getattr(self._torch_br, "__version__", None)
        return {
            "torch_br": None if version is None else str(version),
            "pybrml": brml.pybrml_version(),
        }

    # ---- fused vendor kernels ---------------------------------------------
    def fused_kernels(self) -> dict[str, Any]:
        # Vendor kernels are bound here, by op name, once their call contracts
        # are pinned down against a card: torch_br's ``suattention`` (paged
        # attention, block size 128), ``flashattn_infer`` (prefill flash
        # attention) and ``flash_mla`` (MLA decode). Until then every op runs
        # its reference implementation on the supa device.
        return {}
