"""Stand-in for Biren's ``pybrml`` (BRML, the NVML of SUPA cards), test-only.

Pure Python: the cards it reports come from the description in the
environment variable ``SUPA_STANDIN_TOPOLOGY``, a small JSON object (or the
path of a file holding one), read by :func:`topology`::

    {"cards": 2, "dies_per_card": 2, "p2p": true, "memory_gib": 4}

======================  =========================================  =========
key                     meaning                                    default
======================  =========================================  =========
``cards``               physical cards (BRML numbers all of them)  8
``dies_per_card``       dies per card, 1 or 2; a card has 16 SPCs  1
                        per die (the torch_br stand-in reports
                        ``multi_processor_count = 16 * dies``)
``p2p``                 P2P between every pair of cards, or none   true
``memory_gib``          memory of each card, GiB                   4
``numa_nodes``          host NUMA nodes the cards are spread over  2 (1 for
                                                                   one card)
======================  =========================================  =========

NUMA: card ``i`` sits on host node ``i * numa_nodes // cards``, so with the
default of two nodes the first half of the cards is on node 0 and the second
half on node 1 (8 cards: 0,0,0,0,1,1,1,1; 2 cards: 0,1).

The calls follow the NVML conventions ``vllm_br.device.brml`` relies on:
``brmlInit``/``brmlShutdown`` (counted; a device call outside them raises
:class:`BRMLError_Uninitialized`; the description is read at the first
``brmlInit``), handles from ``brmlDeviceGetHandleByIndex``,
``brmlDeviceGetP2PStatus(h1, h2, caps_index)`` returning
``BRML_P2P_STATUS_OK`` (0) or ``BRML_P2P_STATUS_NOT_SUPPORTED``,
``brmlDeviceGetMemoryInfo`` (``.total``, ``.free``, ``.used``; nothing is
used), ``brmlDeviceGetPciInfo`` (``.busId`` ``"0000:<0x10 + i>:00.0"``),
``brmlDeviceGetUUID`` (``"SUPA-STANDIN-0000-..."``, the card index in hex) and
``brmlDeviceGetNumaNode``. Like BRML it ignores ``SUPA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__version__ = "0.0.0+standin"

#: the variable holding the description
ENV = "SUPA_STANDIN_TOPOLOGY"
#: SPCs per die (the torch_br stand-in's multi_processor_count is this times
#: dies_per_card)
SPC_PER_DIE = 16

BRML_SUCCESS = 0
BRML_ERROR_UNINITIALIZED = 1
BRML_ERROR_INVALID_ARGUMENT = 2
BRML_ERROR_NOT_SUPPORTED = 3

BRML_P2P_CAPS_INDEX_READ = 0
BRML_P2P_CAPS_INDEX_WRITE = 1
BRML_P2P_CAPS_INDEX_ATOMICS = 3
BRML_P2P_STATUS_OK = 0
BRML_P2P_STATUS_NOT_SUPPORTED = 5


@dataclass(frozen=True)
class Topology:
    """The stand-in's cards (the parsed ``SUPA_STANDIN_TOPOLOGY``)."""

    cards: int = 8
    dies_per_card: int = 1
    p2p: bool = True
    memory_gib: float = 4.0
    numa_nodes: int = 2

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * (1 << 30))

    @property
    def spc_per_card(self) -> int:
        return SPC_PER_DIE * self.dies_per_card

    def numa_node(self, card: int) -> int:
        return card * self.numa_nodes // self.cards

    def peer_ok(self, card: int, peer: int) -> bool:
        return card == peer or self.p2p


def topology(raw: str | None = None) -> Topology:
    """Parse a description (default: ``$SUPA_STANDIN_TOPOLOGY``; unset or
    empty gives the defaults). A bad one raises ValueError naming the
    variable and the key."""
    if raw is None:
        raw = os.environ.get(ENV, "")
    raw = raw.strip()
    if not raw:
        return Topology()
    if not raw.startswith(("{", "[")):  # a file
        try:
            raw = Path(raw).read_text()
        except OSError as e:
            raise ValueError(f"{ENV}={raw!r} is neither JSON nor a file: {e}") from e
    try:
        desc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV} is not valid JSON ({e}): {raw!r}") from e
    if not isinstance(desc, dict):
        raise ValueError(f"{ENV} must be a JSON object, got {raw!r}")
    unknown = sorted(
        set(desc) - {"cards", "dies_per_card", "p2p", "memory_gib", "numa_nodes"}
    )
    if unknown:
        raise ValueError(f"{ENV} has unknown keys {unknown}")

    def number(key: str, default: Any, kind: type, minimum: float) -> Any:
        value = desc.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{ENV}: {key} must be a number, got {value!r}")
        if kind is int and value != int(value):
            raise ValueError(f"{ENV}: {key} must be an integer, got {value!r}")
        if value < minimum:
            raise ValueError(f"{ENV}: {key} must be at least {minimum}, got {value!r}")
        return kind(value)

    cards = number("cards", 8, int, 1)
    dies = number("dies_per_card", 1, int, 1)
    if dies > 2:
        raise ValueError(f"{ENV}: dies_per_card must be 1 or 2, got {dies}")
    p2p = desc.get("p2p", True)
    if not isinstance(p2p, bool):
        raise ValueError(f"{ENV}: p2p must be true or false, got {p2p!r}")
    memory = number("memory_gib", 4.0, float, 0)
    if memory <= 0:
        raise ValueError(f"{ENV}: memory_gib must be positive, got {memory}")
    numa = number("numa_nodes", 2 if cards > 1 else 1, int, 1)
    return Topology(cards, dies, p2p, memory, min(numa, cards))


# ---- errors ---------------------------------------------------------------


class BRMLError(Exception):
    """A BRML call failed (``value``: the BRML_ERROR_* code)."""

    value = BRML_ERROR_INVALID_ARGUMENT

    def __init__(self, message: str) -> None:
        super().__init__(message)


class BRMLError_Uninitialized(BRMLError):
    value = BRML_ERROR_UNINITIALIZED


class BRMLError_InvalidArgument(BRMLError):
    value = BRML_ERROR_INVALID_ARGUMENT


# ---- what the calls return ------------------------------------------------


@dataclass(frozen=True)
class c_brmlDevice_t:
    """A device handle (types named as pynvml's ``c_nvmlDevice_t``)."""

    index: int


@dataclass(frozen=True)
class c_brmlMemory_t:
    total: int
    free: int
    used: int


@dataclass(frozen=True)
class c_brmlPciInfo_t:
    busId: str
    domain: int
    bus: int
    device: int


# ---- state ----------------------------------------------------------------

_init_count = 0
_topology: Topology | None = None


def init_count() -> int:
    """``brmlInit`` calls not yet balanced by ``brmlShutdown`` (for tests)."""
    return _init_count


def brmlInit() -> None:
    global _init_count, _topology
    if _init_count == 0:
        _topology = topology()
    _init_count += 1


def brmlShutdown() -> None:
    global _init_count, _topology
    if _init_count == 0:
        raise BRMLError_Uninitialized("brmlShutdown without brmlInit")
    _init_count -= 1
    if _init_count == 0:
        _topology = None


def _topo(call: str) -> Topology:
    if _init_count == 0 or _topology is None:
        raise BRMLError_Uninitialized(f"{call} before brmlInit")
    return _topology


def _card(call: str, handle: Any) -> int:
    topo = _topo(call)
    if not isinstance(handle, c_brmlDevice_t) or not 0 <= handle.index < topo.cards:
        raise BRMLError_InvalidArgument(f"{call}: not a device handle: {handle!r}")
    return handle.index


def brmlSystemGetDriverVersion() -> str:
    _topo("brmlSystemGetDriverVersion")
    return __version__


def brmlDeviceGetCount() -> int:
    return _topo("brmlDeviceGetCount").cards


def brmlDeviceGetHandleByIndex(index: int) -> c_brmlDevice_t:
    topo = _topo("brmlDeviceGetHandleByIndex")
    if isinstance(index, bool) or not isinstance(index, int):
        raise BRMLError_InvalidArgument(f"brmlDeviceGetHandleByIndex({index!r})")
    if not 0 <= index < topo.cards:
        raise BRMLError_InvalidArgument(
            f"brmlDeviceGetHandleByIndex: no card {index} (the stand-in has {topo.cards})"
        )
    return c_brmlDevice_t(index)


def brmlDeviceGetIndex(handle: c_brmlDevice_t) -> int:
    return _card("brmlDeviceGetIndex", handle)


def brmlDeviceGetName(handle: c_brmlDevice_t) -> str:
    _card("brmlDeviceGetName", handle)
    dies = _topo("brmlDeviceGetName").dies_per_card
    return f"Biren SUPA stand-in ({dies} die{'s' if dies > 1 else ''})"


def brmlDeviceGetUUID(handle: c_brmlDevice_t) -> str:
    i = _card("brmlDeviceGetUUID", handle)
    return f"SUPA-STANDIN-{i:04x}-0000-0000-{i:012x}"


def brmlDeviceGetPciInfo(handle: c_brmlDevice_t) -> c_brmlPciInfo_t:
    i = _card("brmlDeviceGetPciInfo", handle)
    bus = 0x10 + i
    return c_brmlPciInfo_t(busId=f"0000:{bus:02x}:00.0", domain=0, bus=bus, device=0)


def brmlDeviceGetMemoryInfo(handle: c_brmlDevice_t) -> c_brmlMemory_t:
    _card("brmlDeviceGetMemoryInfo", handle)
    total = _topo("brmlDeviceGetMemoryInfo").memory_bytes
    return c_brmlMemory_t(total=total, free=total, used=0)


def brmlDeviceGetNumaNode(handle: c_brmlDevice_t) -> int:
    i = _card("brmlDeviceGetNumaNode", handle)
    return _topo("brmlDeviceGetNumaNode").numa_node(i)


def brmlDeviceGetP2PStatus(
    handle1: c_brmlDevice_t, handle2: c_brmlDevice_t, caps_index: int
) -> int:
    i = _card("brmlDeviceGetP2PStatus", handle1)
    j = _card("brmlDeviceGetP2PStatus", handle2)
    if caps_index not in (
        BRML_P2P_CAPS_INDEX_READ,
        BRML_P2P_CAPS_INDEX_WRITE,
        BRML_P2P_CAPS_INDEX_ATOMICS,
    ):
        raise BRMLError_InvalidArgument(
            f"brmlDeviceGetP2PStatus: caps index {caps_index!r}"
        )
    ok = _topo("brmlDeviceGetP2PStatus").peer_ok(i, j)
    return BRML_P2P_STATUS_OK if ok else BRML_P2P_STATUS_NOT_SUPPORTED
