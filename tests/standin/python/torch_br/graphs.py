"""SUPA graphs of the stand-in: capture records, replay re-runs the record.

While ``torch.supa.graph(g)`` is open, every operator that reaches the
dispatcher is run and recorded with the tensors it read and wrote. ``replay``
runs the same operators on the same tensors and writes each result into the
buffer the capture produced, so a replay reads whatever the captured input
buffers hold now and leaves its results in the captured outputs: the
capture-replay contract of a card's graph (host values decided during capture,
Python ints and shapes, stay as captured). A host synchronisation inside a
capture (``.item()``, a blocking copy to the host) raises, as on a card.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torch_br import _C

#: captures and replays in this process (tests read them)
stats = {"captures": 0, "replays": 0}


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: list[tuple[Any, tuple, dict, Any]]) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.tape.append((func, args, kwargs, out))
        return out


def _write_back(captured: Any, fresh: Any) -> None:
    old, _ = tree_flatten(captured)
    new, _ = tree_flatten(fresh)
    for a, b in zip(old, new, strict=True):
        if not isinstance(a, torch.Tensor) or a is b:
            continue
        if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
            continue  # a view recomputed on the same memory
        a.copy_(b)


class _Pool:
    """A graph memory pool: tensors a capture allocates stay alive with it."""


def graph_pool_handle() -> _Pool:
    return _Pool()


class SUPAGraph:
    def __init__(self, keep_graph: bool = False) -> None:
        self._tape: list[tuple[Any, tuple, dict, Any]] | None = None
        self._recorder: _Recorder | None = None
        self._pool: Any = None

    def capture_begin(
        self, pool: Any = None, capture_error_mode: str = "global"
    ) -> None:
        if _C.is_capturing():
            raise RuntimeError("a SUPA graph capture is already in progress")
        self._pool = pool if pool is not None else _Pool()
        self._tape = []
        self._recorder = _Recorder(self._tape)
        _C.set_capturing(True)
        self._recorder.__enter__()

    def capture_end(self) -> None:
        assert self._recorder is not None, "capture_end() without capture_begin()"
        try:
            self._recorder.__exit__(None, None, None)
        finally:
            _C.set_capturing(False)
            self._recorder = None
        stats["captures"] += 1

    def replay(self) -> None:
        if self._tape is None or self._recorder is not None:
            raise RuntimeError("replay() of a SUPA graph that has not been captured")
        for func, args, kwargs, out in self._tape:
            _write_back(out, func(*args, **kwargs))
        stats["replays"] += 1

    def reset(self) -> None:
        self._tape = None

    def pool(self) -> Any:
        return self._pool

    @property
    def num_recorded_ops(self) -> int:
        return 0 if self._tape is None else len(self._tape)


class graph:
    """``with torch.supa.graph(g, pool=...):`` captures into ``g``."""

    def __init__(
        self,
        supa_graph: SUPAGraph,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
    ) -> None:
        self.graph = supa_graph
        self.pool = pool

    def __enter__(self) -> None:
        self.graph.capture_begin(self.pool)

    def __exit__(self, *exc: Any) -> None:
        self.graph.capture_end()


def is_current_stream_capturing() -> bool:
    return bool(_C.is_capturing())
