"""SUPA graphs of the stand-in: capture records, replay re-runs the record.

While ``torch.supa.graph(g)`` is open, every operator that reaches the
dispatcher is run and recorded with the tensors it read and wrote. ``replay``
runs the same operators: on the same input tensors (those that existed
before the capture), writing each result that outlived the capture into the
buffer the capture produced, and making the capture's intermediates afresh
(they are freed as they die, as in a graph pool). So a replay reads whatever
the captured input buffers hold now and leaves its results in the captured
outputs: the capture-replay contract of a card's graph (host values decided
during capture, Python ints and shapes, stay as captured). A host
synchronisation inside a capture (``.item()``, a blocking copy to the host)
raises, as on a card.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from torch_br import _C

#: captures and replays in this process (tests read them)
stats = {"captures": 0, "replays": 0}


class _Recorder(TorchDispatchMode):
    """Runs each operator and records it with its tensors as tokens: a tensor
    that existed before the capture is an input (held), one an operator made
    is held only weakly, so what the capture drops is freed as it would be in
    a graph pool."""

    def __init__(self) -> None:
        super().__init__()
        self.tape: list[tuple[Any, Any, Any, Any]] = []
        self.tokens = WeakIdKeyDictionary()
        self.inputs: dict[int, torch.Tensor] = {}
        self.made: dict[int, Any] = {}  # token -> weakref of a tensor made here
        self.counter = itertools.count()

    def _token(self, t: torch.Tensor, made: bool) -> int:
        token = self.tokens.get(t)
        if token is None:
            token = next(self.counter)
            self.tokens[t] = token
            if made:
                self.made[token] = weakref.ref(t)
            else:
                self.inputs[token] = t
        return token

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = tree_map_only(
            torch.Tensor, lambda t: _Ref(self._token(t, False)), (args, kwargs)
        )
        out = func(*args, **kwargs)
        out_spec = tree_map_only(
            torch.Tensor, lambda t: _Ref(self._token(t, True)), out
        )
        self.tape.append((func, spec, out_spec, None))
        return out


class _Ref:
    __slots__ = ("token",)

    def __init__(self, token: int) -> None:
        self.token = token


def _write_back(captured: torch.Tensor, fresh: torch.Tensor) -> None:
    if captured is fresh:
        return
    if captured.data_ptr() == fresh.data_ptr() and captured.stride() == fresh.stride():
        return  # a view recomputed on the same memory
    captured.copy_(fresh)


class _Pool:
    """A graph memory pool: tensors a capture allocates stay alive with it."""


def graph_pool_handle() -> _Pool:
    return _Pool()


class SUPAGraph:
    def __init__(self, keep_graph: bool = False) -> None:
        self._tape: list[tuple[Any, Any, Any, Any]] | None = None
        self._recorder: _Recorder | None = None
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool: Any = None

    def capture_begin(
        self, pool: Any = None, capture_error_mode: str = "global"
    ) -> None:
        if _C.is_capturing():
            raise RuntimeError("a SUPA graph capture is already in progress")
        self._pool = pool if pool is not None else _Pool()
        self._recorder = _Recorder()
        _C.set_capturing(True)
        self._recorder.__enter__()

    def capture_end(self) -> None:
        recorder = self._recorder
        assert recorder is not None, "capture_end() without capture_begin()"
        try:
            recorder.__exit__(None, None, None)
        finally:
            _C.set_capturing(False)
            self._recorder = None
        gc.collect()
        # What is still alive is an output of the graph: replays write into
        # it. The rest were intermediates, made again on every replay.
        self._outputs = {
            token: ref() for token, ref in recorder.made.items() if ref() is not None
        }
        self._inputs = recorder.inputs
        self._tape = recorder.tape
        stats["captures"] += 1

    def replay(self) -> None:
        if self._tape is None:
            raise RuntimeError("replay() of a SUPA graph that has not been captured")
        env: dict[int, torch.Tensor] = {}

        def resolve(ref: _Ref) -> torch.Tensor:
            token = ref.token
            if token in env:
                return env[token]
            if token in self._inputs:
                return self._inputs[token]
            return self._outputs[token]

        for func, spec, out_spec, _ in self._tape:
            args, kwargs = tree_map_only(_Ref, resolve, spec)
            fresh = func(*args, **kwargs)
            refs, _ = tree_flatten(out_spec)
            values, _ = tree_flatten(fresh)
            for ref, value in zip(refs, values, strict=True):
                if not isinstance(ref, _Ref):
                    continue
                captured = self._outputs.get(ref.token)
                if captured is not None:
                    _write_back(captured, value)
                    env[ref.token] = captured
                else:
                    env[ref.token] = value
        stats["replays"] += 1

    def reset(self) -> None:
        self._tape = None
        self._inputs, self._outputs = {}, {}

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
