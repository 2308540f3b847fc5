"""``torch.supa`` of the stand-in: the API the plugin's supa backend uses
(../shared/notes/biren-supa-facts.md), mirroring ``torch.cuda``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torch_br import _C
from torch_br.graphs import (  # noqa: F401  (part of the torch.supa API)
    SUPAGraph,
    graph,
    graph_pool_handle,
    is_current_stream_capturing,
)

#: SPCs per die, as on BR100 (two dies) and BR104 (one)
SPC_PER_DIE = 16


@dataclass(frozen=True)
class _SUPADeviceProperties:
    name: str
    total_memory: int
    multi_processor_count: int
    major: int = 1
    minor: int = 0


_TOPOLOGY: Any = None
_VISIBLE: list[int] = []


def _configure() -> None:
    """Device count and memory from the topology description, applying
    SUPA_VISIBLE_DEVICES as torch_br does."""
    global _TOPOLOGY, _VISIBLE
    import pybrml

    _TOPOLOGY = pybrml.topology()
    cards = _TOPOLOGY.cards
    visible = os.environ.get("SUPA_VISIBLE_DEVICES")
    if visible:
        _VISIBLE = [int(v) for v in visible.split(",") if v.strip()]
        bad = [v for v in _VISIBLE if not 0 <= v < cards]
        if bad:
            raise RuntimeError(
                f"SUPA_VISIBLE_DEVICES={visible} names cards {bad} but the "
                f"stand-in has {cards}"
            )
    else:
        _VISIBLE = list(range(cards))
    _C.configure(len(_VISIBLE), _memory_bytes())


def _memory_bytes() -> int:
    return int(float(_TOPOLOGY.memory_gib) * (1 << 30))


def _index(device: Any = None) -> int:
    if device is None:
        return _C.current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        return _C.current_device() if device.index is None else device.index
    raise TypeError(f"not a device: {device!r}")


# ---- devices ---------------------------------------------------------------
def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def init() -> None:
    return None


def device_count() -> int:
    return _C.device_count()


def current_device() -> int:
    return _C.current_device()


def set_device(device: Any) -> None:
    _C.set_device(_index(device))


class device:
    """Context manager that selects a device, as torch.cuda.device."""

    def __init__(self, dev: Any) -> None:
        self.idx = _index(dev)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = _C.current_device()
        _C.set_device(self.idx)

    def __exit__(self, *exc: Any) -> None:
        _C.set_device(self.prev)


def synchronize(device: Any = None) -> None:
    _index(device)  # validates; work is complete when issued


def get_device_properties(device: Any = None) -> _SUPADeviceProperties:
    i = _index(device)
    if not 0 <= i < device_count():
        raise RuntimeError(f"invalid device ordinal supa:{i}")
    dies = _TOPOLOGY.dies_per_card
    return _SUPADeviceProperties(
        name=f"{'BR100' if dies == 2 else 'BR104'} (stand-in)",
        total_memory=_memory_bytes(),
        multi_processor_count=SPC_PER_DIE * dies,
    )


def get_device_name(device: Any = None) -> str:
    return get_device_properties(device).name


def get_device_capability(device: Any = None) -> tuple[int, int]:
    props = get_device_properties(device)
    return props.major, props.minor


def can_device_access_peer(device: int, peer: int) -> bool:
    return device == peer or bool(_TOPOLOGY.p2p)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# ---- memory ------------------------------------------------------------------
def memory_stats(device: Any = None) -> dict[str, int]:
    return dict(_C.memory_stats(_index(device)))


def memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device: Any = None) -> int:
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device: Any = None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: Any = None) -> None:
    _C.reset_peak_memory_stats(_index(device))


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the device: its capacity less what is allocated."""
    stats = memory_stats(device)
    total = stats["capacity_bytes"]
    return total - stats["allocated_bytes.all.current"], total


def empty_cache() -> None:
    return None  # no cache: freed blocks go back at once


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")


# ---- random ------------------------------------------------------------------
def manual_seed(seed: int) -> None:
    _C.manual_seed(current_device(), int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        _C.manual_seed(i, int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def _is_in_bad_fork() -> bool:
    return False


def initial_seed() -> int:
    return _C.initial_seed(current_device())


# ---- streams and events ----------------------------------------------------
class Stream(torch.Stream):
    """A supa stream. Work completes when issued, so a stream only orders."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        if "stream_id" in kwargs:
            return super().__new__(cls, **kwargs)
        dev = torch.device("supa", _index(device))
        return super().__new__(cls, device=dev, priority=priority)

    @property
    def supa_stream(self) -> int:
        return int(self.stream_id)

    def wait_stream(self, stream: torch.Stream) -> None:
        self.wait_event(stream.record_event())


# Bound at import: the plugin points torch.Event at this module's Event.
_TorchEvent = torch.Event


class Event:
    """A supa event (wraps ``torch.Event``, whose ``elapsed_time`` takes
    only its own exact type)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **_: Any):
        self._event = _TorchEvent(
            device=torch.device("supa", current_device()),
            enable_timing=enable_timing,
            blocking=blocking,
        )

    def record(self, stream: torch.Stream | None = None) -> None:
        self._event.record(stream)

    def wait(self, stream: torch.Stream | None = None) -> None:
        self._event.wait(stream)

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()

    def elapsed_time(self, end: Event) -> float:
        return self._event.elapsed_time(end._event)


def _wrap(s: torch.Stream) -> Stream:
    return Stream(
        stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type
    )


def current_stream(device: Any = None) -> Stream:
    return _wrap(torch._C._accelerator_getStream(_index(device)))


def default_stream(device: Any = None) -> Stream:
    return Stream(
        stream_id=0,
        device_index=_index(device),
        device_type=torch._C._autograd._kPrivateUse1
        if hasattr(torch._C._autograd, "_kPrivateUse1")
        else current_stream(device).device_type,
    )


@contextlib.contextmanager
def stream(s: torch.Stream | None) -> Iterator[torch.Stream | None]:
    if s is None:
        yield s
        return
    prev = torch._C._accelerator_getStream(s.device_index)
    torch._C._accelerator_setStream(s)
    try:
        yield s
    finally:
        torch._C._accelerator_setStream(prev)


def set_stream(s: torch.Stream) -> None:
    torch._C._accelerator_setStream(s)


# ---- stand-in only ---------------------------------------------------------
def standin_counts() -> dict[str, int]:
    """Copies by direction and ops run by the CPU fallback, since the last reset."""
    return dict(_C.counts())


def reset_standin_counts() -> None:
    _C.reset_counts()


def standin_device_threads() -> int:
    """The threads the device computes with (SUPA_STANDIN_THREADS, else
    OMP_NUM_THREADS, else the cores this process may use)."""
    return _C.device_threads()


def standin_kernel_threads() -> int:
    """The intra-op threads a device kernel runs with, whatever the host's."""
    return _C.kernel_threads()
