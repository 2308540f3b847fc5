"""The one fake of torch_br and pybrml the unit tests use (no card exists here).

``installed_fake_torch_br(...)`` puts a fake ``torch_br`` and ``pybrml`` into
``sys.modules`` and a fake ``torch.supa`` namespace on ``torch``, all backed
by plain host state, and restores everything on exit.

The fake SUPA graph cannot record the work inside ``with torch.supa.graph(g)``
(a context manager sees no callable), so that code runs once, eagerly, and
``SUPAGraph.replay()`` only counts replays: a test checks ``replays`` and the
identity of the static output, not recomputed values.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

FAKE_TORCH_BR_VERSION = "0.0.0+fake"
FAKE_PYBRML_VERSION = "0.0.0+fake"
_MISSING = object()


class FakeEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, **_: Any):
        self.enable_timing = enable_timing
        self.recorded_on: Any = None

    def record(self, stream: Any = None) -> None:
        self.recorded_on = stream

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1.5


class FakeStream:
    def __init__(self, device: Any = None, priority: int = 0, **_: Any):
        self.device = device
        self.priority = priority
        self.waited_on: list[Any] = []

    def wait_stream(self, other: Any) -> None:
        self.waited_on.append(other)

    def wait_event(self, event: Any) -> None:
        self.waited_on.append(event)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeSUPAGraph:
    def __init__(self) -> None:
        self.pool: Any = None
        self.captured = False
        self.replays = 0

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("replay() before capture")
        self.replays += 1


@dataclass
class FakeProps:
    name: str
    total_memory: int
    multi_processor_count: int


@dataclass
class FakeSupaState:
    """The host state behind the fake ``torch.supa``; tests read and set it."""

    device_count: int
    spc: int
    p2p: list[list[bool]]
    numa: list[int]
    free: int
    total: int
    current: int = 0
    allocated: int = 0
    peak: int = 0
    capturing: bool = False
    seeds: list[int] = field(default_factory=list)
    synchronized: list[Any] = field(default_factory=list)
    empty_cache_calls: int = 0
    default_stream: FakeStream = field(default_factory=FakeStream)
    current_stream: FakeStream | None = None


def _make_supa(state: FakeSupaState) -> types.SimpleNamespace:
    def check(index: Any) -> None:
        i = state.current if index is None else int(index)
        if not 0 <= i < state.device_count:
            raise RuntimeError(f"invalid device ordinal {i}")

    def set_device(index: int) -> None:
        check(index)
        state.current = int(index)

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        check(device)
        return state.free, state.total

    def memory_stats(device: Any = None) -> dict[str, Any]:
        return {
            "allocated_bytes.all.current": state.allocated,
            "allocated_bytes.all.peak": state.peak,
        }

    def reset_peak_memory_stats(device: Any = None) -> None:
        state.peak = state.allocated

    def empty_cache() -> None:
        state.empty_cache_calls += 1

    def current_stream(device: Any = None) -> FakeStream:
        return state.current_stream or state.default_stream

    @contextlib.contextmanager
    def stream(s: FakeStream) -> Iterator[FakeStream]:
        prev, state.current_stream = state.current_stream, s
        try:
            yield s
        finally:
            state.current_stream = prev

    @contextlib.contextmanager
    def graph(g: FakeSUPAGraph, pool: Any = None, stream: Any = None, **_: Any):
        g.pool = pool
        state.capturing = True
        try:
            yield g
        finally:
            state.capturing = False
        g.captured = True

    def get_device_properties(device: Any = None) -> FakeProps:
        check(device)
        return FakeProps("Biren BR100 (fake)", state.total, state.spc)

    return types.SimpleNamespace(
        device_count=lambda: state.device_count,
        current_device=lambda: state.current,
        set_device=set_device,
        synchronize=lambda device=None: state.synchronized.append(device),
        get_device_properties=get_device_properties,
        get_device_name=lambda device=None: get_device_properties(device).name,
        can_device_access_peer=lambda i, j: state.p2p[i][j],
        is_bf16_supported=lambda: True,
        manual_seed_all=state.seeds.append,
        mem_get_info=mem_get_info,
        memory_stats=memory_stats,
        memory_allocated=lambda device=None: state.allocated,
        max_memory_allocated=lambda device=None: state.peak,
        reset_peak_memory_stats=reset_peak_memory_stats,
        empty_cache=empty_cache,
        Stream=FakeStream,
        Event=FakeEvent,
        current_stream=current_stream,
        stream=stream,
        SUPAGraph=FakeSUPAGraph,
        graph=graph,
        graph_pool_handle=lambda: ("fake-pool", object()),
        is_current_stream_capturing=lambda: state.capturing,
        state=state,
    )


def _make_pybrml(state: FakeSupaState) -> types.ModuleType:
    mod = types.ModuleType("pybrml")
    mod.__version__ = FAKE_PYBRML_VERSION
    mod.BRML_P2P_CAPS_INDEX_READ = 0
    mod.BRML_P2P_STATUS_OK = 0
    mod.BRML_P2P_STATUS_NOT_SUPPORTED = 5
    mod.initialized = 0  # brmlInit minus brmlShutdown calls

    def init() -> None:
        mod.initialized += 1

    def shutdown() -> None:
        mod.initialized -= 1

    def handle(index: int) -> int:
        if not 0 <= index < state.device_count:
            raise RuntimeError(f"BRML: no device {index}")
        return 1000 + index

    def p2p_status(h1: int, h2: int, caps_index: int) -> int:
        ok = state.p2p[h1 - 1000][h2 - 1000]
        return mod.BRML_P2P_STATUS_OK if ok else mod.BRML_P2P_STATUS_NOT_SUPPORTED

    mod.brmlInit = init
    mod.brmlShutdown = shutdown
    mod.brmlDeviceGetCount = lambda: state.device_count
    mod.brmlDeviceGetHandleByIndex = handle
    mod.brmlDeviceGetP2PStatus = p2p_status
    mod.brmlDeviceGetNumaNode = lambda h: state.numa[h - 1000]
    mod.brmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=state.total, free=state.free, used=state.total - state.free
    )
    mod.brmlDeviceGetUUID = lambda h: f"BR-fake-{h - 1000}".encode()
    mod.brmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(
        busId=f"0000:{h - 1000 + 0x10:02x}:00.0"
    )
    return mod


@dataclass
class FakeStack:
    """What ``installed_fake_torch_br`` yields."""

    supa: types.SimpleNamespace
    state: FakeSupaState
    torch_br: types.ModuleType
    pybrml: types.ModuleType | None


@contextlib.contextmanager
def installed_fake_torch_br(
    device_count: int = 2,
    spc: int = 32,
    p2p: list[list[bool]] | None = None,
    numa: list[int] | None = None,
    free: int = 60 << 30,
    total: int = 64 << 30,
    with_pybrml: bool = True,
) -> Iterator[FakeStack]:
    """Install fake ``torch_br``/``pybrml`` modules and ``torch.supa``.

    ``p2p`` defaults to all-to-all, ``numa`` to ``[0, 1, 0, 1, ...]``.
    ``with_pybrml=False`` leaves pybrml unimportable (the fallback path).
    """
    from vllm_br.device import _make_backend

    if p2p is None:
        p2p = [[True] * device_count for _ in range(device_count)]
    if numa is None:
        numa = [i % 2 for i in range(device_count)]
    state = FakeSupaState(device_count, spc, p2p, list(numa), free, total)
    supa = _make_supa(state)
    torch_br = types.ModuleType("torch_br")
    torch_br.__version__ = FAKE_TORCH_BR_VERSION
    torch_br.supa = supa
    pybrml = _make_pybrml(state) if with_pybrml else None

    saved_modules = {k: sys.modules.get(k, _MISSING) for k in ("torch_br", "pybrml")}
    saved_supa = getattr(torch, "supa", _MISSING)
    sys.modules["torch_br"] = torch_br
    # None in sys.modules makes ``import pybrml`` raise ImportError.
    sys.modules["pybrml"] = pybrml  # type: ignore[assignment]
    torch.supa = supa
    _make_backend.cache_clear()
    try:
        yield FakeStack(supa, state, torch_br, pybrml)
    finally:
        for k, v in saved_modules.items():
            if v is _MISSING:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        if saved_supa is _MISSING:
            if hasattr(torch, "supa"):
                del torch.supa
        else:
            torch.supa = saved_supa
        _make_backend.cache_clear()
