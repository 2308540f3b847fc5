"""The ``memory`` group: the device's memory accounting, which sizes the KV
cache (``determine_available_memory`` reads the peak after a profile run and
the free memory).

Each check allocates ``SIZE`` bytes on the device and writes them (so that a
host-backed device commits the pages), then frees them:

- ``memory_allocated``: grows by at least ``SIZE`` and comes back to within
  ``SLACK`` of where it was;
- ``memory_stats``: the same for ``allocated_bytes.all.current`` (vLLM reads
  the ``allocated_bytes.all.*`` keys);
- ``max_memory_allocated``: after ``reset_peak_memory_stats``, an
  allocation freed again still shows in the peak (at least ``SIZE`` above
  the level at the reset);
- ``mem_get_info``: free memory drops by at least ``SIZE`` while allocated
  (after ``empty_cache``, so the allocator's cache cannot hide it) and comes
  back after ``empty_cache``.

A counter that does not grow by ``SIZE`` is "not tracked", a failure.

On a backend whose device memory is host memory
(``host_memory_is_device_memory``: the ``cpu`` emulation) every counter is
the process's resident memory (RSS), which does not see an allocation that
glibc serves from memory the process already holds (freed earlier and kept
mapped, as the backend asks it to). Whether a 64 MiB allocation shows there
depends on what ran before, so these checks are SKIPPED there, "not
tracked", with what was measured; they neither pass nor fail.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import torch

from vllm_br.check.base import CheckContext
from vllm_br.check.result import Outcome

SIZE = 64 << 20
SLACK = 16 << 20
_MIB = 1 << 20


def _mib(n: float) -> str:
    return f"{n / _MIB:.1f} MiB"


def _allocate(ctx: CheckContext) -> torch.Tensor:
    t = torch.ones(SIZE // 4, dtype=torch.float32, device=ctx.device)
    ctx.backend.synchronize()
    return t


def _release(ctx: CheckContext, t: list[torch.Tensor]) -> None:
    t.clear()
    gc.collect()
    ctx.backend.synchronize()


def _finish(ctx: CheckContext, outcome: Outcome, facts: str) -> Outcome:
    """On a host-memory backend the result is "not tracked" (see the module
    doc), whatever this run measured."""
    if ctx.backend.host_memory_is_device_memory:
        outcome.passed = None
        outcome.detail = (
            "not tracked: the backend's device memory is host memory "
            "(host_memory_is_device_memory), counted as the process's resident "
            "memory, which misses allocations served from memory the process "
            f"already holds; measured: {facts}"
        )
    return outcome


def _growth(ctx: CheckContext, name: str, read: Callable[[], int]) -> Outcome:
    """``read()`` grows by SIZE while SIZE bytes are held, and comes back."""
    before = read()
    held = [_allocate(ctx)]
    during = read()
    _release(ctx, held)
    after = read()
    grew, left = during - before, after - before
    tracked = grew >= SIZE
    returned = left <= SLACK
    facts = (
        f"{name} {_mib(before)} before, {_mib(during)} holding {_mib(SIZE)}, "
        f"{_mib(after)} after freeing"
    )
    if not tracked:
        detail = f"not tracked: {name} grew {_mib(grew)} for {_mib(SIZE)}; {facts}"
    elif not returned:
        detail = f"not returned: {name} kept {_mib(left)} after freeing; {facts}"
    else:
        detail = facts
    outcome = Outcome(
        passed=tracked and returned,
        error=float(grew),
        tolerance=float(SIZE),
        metric="grew_bytes",
        shown=f"grew {_mib(grew)} (needs >= {_mib(SIZE)}), {_mib(left)} left after free",
        detail=detail,
    )
    return _finish(ctx, outcome, facts)


def _check_allocated(ctx: CheckContext) -> Outcome:
    return _growth(ctx, "memory_allocated", ctx.backend.memory_allocated)


def _check_stats(ctx: CheckContext) -> Outcome:
    key = "allocated_bytes.all.current"
    stats = ctx.backend.memory_stats()
    if key not in stats:
        return Outcome(
            passed=False,
            metric="grew_bytes",
            detail=f"memory_stats() has no {key!r} (keys: {sorted(stats)[:8]})",
        )
    return _growth(
        ctx, f"memory_stats()[{key!r}]", lambda: ctx.backend.memory_stats()[key]
    )


def _check_peak(ctx: CheckContext) -> Outcome:
    backend = ctx.backend
    backend.reset_peak_memory_stats()
    base = backend.memory_allocated()
    held = [_allocate(ctx)]
    _release(ctx, held)
    peak = backend.max_memory_allocated()
    over = peak - base
    tracked = over >= SIZE
    facts = (
        f"memory_allocated {_mib(base)} at the reset, max_memory_allocated "
        f"{_mib(peak)} after holding and freeing {_mib(SIZE)}"
    )
    outcome = Outcome(
        passed=tracked,
        error=float(over),
        tolerance=float(SIZE),
        metric="peak_over_bytes",
        shown=f"peak {_mib(over)} above the reset (needs >= {_mib(SIZE)})",
        detail=facts if tracked else f"not tracked: {facts}",
    )
    return _finish(ctx, outcome, facts)


def _check_mem_get_info(ctx: CheckContext) -> Outcome:
    backend = ctx.backend
    backend.empty_cache()
    free0, total = backend.mem_get_info()
    held = [_allocate(ctx)]
    free1, _ = backend.mem_get_info()
    _release(ctx, held)
    backend.empty_cache()
    free2, _ = backend.mem_get_info()
    dropped, back = free0 - free1, free0 - free2
    tracked = dropped >= SIZE
    returned = back <= SLACK
    facts = (
        f"free {_mib(free0)} of {_mib(total)}, {_mib(free1)} holding "
        f"{_mib(SIZE)}, {_mib(free2)} after freeing"
    )
    if not tracked:
        detail = f"not tracked: free memory dropped {_mib(dropped)}; {facts}"
    elif not returned:
        detail = f"not returned: {_mib(back)} still missing; {facts}"
    else:
        detail = facts
    outcome = Outcome(
        passed=tracked and returned,
        error=float(dropped),
        tolerance=float(SIZE),
        metric="free_dropped_bytes",
        shown=f"free dropped {_mib(dropped)} (needs >= {_mib(SIZE)}), "
        f"{_mib(back)} short after free",
        detail=detail,
    )
    return _finish(ctx, outcome, facts)


def checks(ctx: CheckContext) -> Iterator[tuple[str, Callable[[], Outcome]]]:
    yield "memory_allocated", lambda: _check_allocated(ctx)
    yield "memory_stats", lambda: _check_stats(ctx)
    yield "max_memory_allocated", lambda: _check_peak(ctx)
    yield "mem_get_info", lambda: _check_mem_get_info(ctx)
