"""The ``graphs`` group: capture and replay through ``backend.capture_graph``
with SUPA-graph semantics (what vLLM's graph wrapper relies on).

A small decoder-layer-like function (a GEMM, the plugin's ``rms_norm`` and
``silu_and_mul`` ops) is captured on static input buffers from the device's
graph pool and replayed once (on a card, capturing only records). Then new
values are copied into the static inputs in place and
the graph replayed: its output buffer (the same tensor as at capture) must
equal, bit for bit, a fresh eager run on the new inputs, and differ from the
output of the first inputs. A second graph captured into the same pool must
replay independently of the first.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from vllm_br.check.base import CheckContext, dtype_name, generator, randn
from vllm_br.check.measure import Measure
from vllm_br.check.result import Outcome
from vllm_br.ops.registry import get_op


def _layer(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    h = get_op("rms_norm")(x @ w, norm, 1e-6)
    return get_op("silu_and_mul")(h)


def _capture_replay(ctx: CheckContext, dtype: torch.dtype) -> Outcome:
    backend = ctx.backend
    m = Measure(0.0, metric="max_abs_diff")
    g = generator(40)
    x = randn(ctx, g, 16, 64, dtype=dtype)
    w = randn(ctx, g, 64, 256, dtype=dtype, scale=0.125)
    norm = randn(ctx, g, 256, dtype=dtype, scale=0.1, offset=1.0)
    pool = backend.graph_pool_handle()
    t0 = time.perf_counter()
    graph = backend.capture_graph(_layer, x, w, norm, pool=pool)
    backend.synchronize()
    capture_s = time.perf_counter() - t0
    # On a card capturing records without running: replay fills the output.
    graph.replay()
    backend.synchronize()
    first = graph.output.clone()
    m.exact("replay on the captured inputs equals eager", first, _layer(x, w, norm))

    x.copy_(randn(ctx, g, 16, 64, dtype=dtype))  # new inputs, in place
    t0 = time.perf_counter()
    replayed = graph.replay()
    backend.synchronize()
    replay_s = time.perf_counter() - t0
    m.require(
        "static output",
        replayed is None or replayed is graph.output,
        "replay returned a new tensor, not the captured output buffer",
    )
    m.exact("replay on new inputs equals eager", graph.output, _layer(x, w, norm))
    m.require(
        "replay recomputes",
        not torch.equal(graph.output, first),
        "the output did not change after new inputs were copied in",
    )

    # A second graph in the same pool keeps its own buffers.
    y = randn(ctx, g, 8, 64, dtype=dtype)
    other = backend.capture_graph(_layer, y, w, norm, pool=pool)
    other.replay()
    y.copy_(randn(ctx, g, 8, 64, dtype=dtype))
    other.replay()
    graph.replay()
    backend.synchronize()
    m.exact("second graph in the pool", other.output, _layer(y, w, norm))
    m.exact("first graph after the second", graph.output, _layer(x, w, norm))
    m.note(f"capture {capture_s * 1e3:.1f} ms, replay {replay_s * 1e3:.2f} ms")
    return m.outcome()


def checks(ctx: CheckContext) -> Iterator[tuple[str, object]]:
    for dtype in ctx.dtypes:
        yield (
            f"capture_replay[{dtype_name(dtype)}]",
            lambda dtype=dtype: _capture_replay(ctx, dtype),
        )
