"""Device topology of SUPA cards through BRML (``pybrml``).

Only the ``supa`` backend uses this module, and ``pybrml`` is imported lazily
inside the functions below, so importing this module imports no vendor SDK.

BRML is the Biren counterpart of NVML. Where the public facts stop, the calls
below follow the NVML conventions pybrml mirrors: handles come from
``brmlDeviceGetHandleByIndex``, ``brmlDeviceGetP2PStatus(h1, h2, caps_index)``
returns a status whose OK value is ``BRML_P2P_STATUS_OK`` (0 when pybrml does
not define it), ``brmlDeviceGetMemoryInfo`` returns an object with ``total``
and ``free``, ``brmlDeviceGetPciInfo`` one with ``busId``.

Device indices: torch_br applies ``SUPA_VISIBLE_DEVICES`` itself, so torch's
``supa:N`` is the N-th *visible* card and the backend never remaps torch
indices. BRML, like NVML, ignores the variable and numbers physical cards, so
BRML queries for visible device N go to physical card
``SUPA_VISIBLE_DEVICES[N]`` (identity when the variable is unset).

Without pybrml (or when ``brmlInit`` fails) P2P falls back to
``torch.supa.can_device_access_peer`` and every NUMA node is reported as -1.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Any

from vllm_br import envs
from vllm_br.device.base import Topology
from vllm_br.logger import init_logger

logger = init_logger(__name__)

#: SPCs per die: a card reporting more has two dies (two NUMA domains).
SPC_PER_DIE = 16


@dataclass(frozen=True)
class BrmlDevice:
    """What BRML reports about one visible card (for ``vllm-br info``)."""

    index: int
    physical_index: int
    uuid: str | None
    pci_bus_id: str | None
    memory_total: int | None
    numa_node: int


@dataclass(frozen=True)
class LinkInfo:
    """The BRML part of the topology: it does not change while a process runs."""

    p2p: list[list[bool]]
    numa_nodes: list[int]
    devices: list[BrmlDevice]
    #: "brml" or "torch" (the fallback without pybrml)
    source: str


def import_pybrml() -> Any | None:
    try:
        import pybrml
    except ImportError:
        return None
    return pybrml


def pybrml_version() -> str | None:
    mod = import_pybrml()
    if mod is None:
        return None
    version = getattr(mod, "__version__", None)
    if version is not None:
        return str(version)
    try:
        return importlib.metadata.version("pybrml")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def physical_indices(count: int) -> list[int]:
    """BRML index of each visible device (see the module docstring)."""
    visible = envs.SUPA_VISIBLE_DEVICES
    if visible is None or len(visible) < count:
        return list(range(count))
    return list(visible[:count])


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _query_brml(pybrml: Any, count: int) -> LinkInfo:
    phys = physical_indices(count)
    pybrml.brmlInit()
    try:
        n_phys = int(pybrml.brmlDeviceGetCount())
        if any(p >= n_phys for p in phys):
            raise RuntimeError(
                f"SUPA_VISIBLE_DEVICES names cards {phys} but BRML sees {n_phys}"
            )
        handles = [pybrml.brmlDeviceGetHandleByIndex(p) for p in phys]
        caps_index = getattr(pybrml, "BRML_P2P_CAPS_INDEX_READ", 0)
        status_ok = getattr(pybrml, "BRML_P2P_STATUS_OK", 0)
        p2p = [
            [
                i == j
                or pybrml.brmlDeviceGetP2PStatus(handles[i], handles[j], caps_index)
                == status_ok
                for j in range(count)
            ]
            for i in range(count)
        ]
        devices = []
        for i, h in enumerate(handles):
            mem = pybrml.brmlDeviceGetMemoryInfo(h)
            pci = pybrml.brmlDeviceGetPciInfo(h)
            devices.append(
                BrmlDevice(
                    index=i,
                    physical_index=phys[i],
                    uuid=_text(pybrml.brmlDeviceGetUUID(h)),
                    pci_bus_id=_text(getattr(pci, "busId", None)),
                    memory_total=getattr(mem, "total", None),
                    numa_node=int(pybrml.brmlDeviceGetNumaNode(h)),
                )
            )
    finally:
        pybrml.brmlShutdown()
    return LinkInfo(
        p2p=p2p,
        numa_nodes=[d.numa_node for d in devices],
        devices=devices,
        source="brml",
    )


def _query_torch(supa: Any, count: int) -> LinkInfo:
    p2p = [
        [i == j or bool(supa.can_device_access_peer(i, j)) for j in range(count)]
        for i in range(count)
    ]
    phys = physical_indices(count)
    devices = [BrmlDevice(i, phys[i], None, None, None, -1) for i in range(count)]
    return LinkInfo(p2p=p2p, numa_nodes=[-1] * count, devices=devices, source="torch")


def query_links(supa: Any) -> LinkInfo:
    """P2P matrix and NUMA nodes of the visible devices of ``torch.supa``."""
    count = int(supa.device_count())
    pybrml = import_pybrml()
    if pybrml is None:
        logger.info(
            "pybrml is not installed: SUPA P2P comes from "
            "torch.supa.can_device_access_peer and NUMA nodes are unknown (-1)."
        )
        return _query_torch(supa, count)
    try:
        return _query_brml(pybrml, count)
    except Exception as e:  # a BRML error must not stop the engine
        logger.warning(
            "BRML topology query failed (%s): SUPA P2P comes from "
            "torch.supa.can_device_access_peer and NUMA nodes are unknown (-1).",
            e,
        )
        return _query_torch(supa, count)


def spc_count(supa: Any, index: int) -> int:
    """SPCs of device ``index``; VLLM_BR_DEVICE_SPC_NUM overrides the card."""
    override = envs.VLLM_BR_DEVICE_SPC_NUM
    if override is not None:
        return override
    return int(supa.get_device_properties(index).multi_processor_count)


def dies_for(spc: int) -> int:
    return 2 if spc > SPC_PER_DIE else 1


def build_topology(supa: Any, links: LinkInfo) -> Topology:
    count = len(links.numa_nodes)
    spcs = [spc_count(supa, i) for i in range(count)]
    return Topology(
        device_count=count,
        p2p=[list(row) for row in links.p2p],
        numa_nodes=list(links.numa_nodes),
        spc_counts=spcs,
        dies_per_device=[dies_for(s) for s in spcs],
    )
