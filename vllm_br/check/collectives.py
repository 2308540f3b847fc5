"""The ``collectives`` group: the plugin's communicator across devices.

One process per device (``--devices``), started with ``spawn`` as vLLM
starts workers. Each sets its device, lets vLLM build the distributed state
as a worker does (``init_distributed_environment`` on the platform's
``dist_backend``, then one tensor-parallel group over every process), and
runs the collectives on the group's device communicator
(``SUPACommunicator``: SCCL on a card, gloo on the host emulation): every
process knows every process's seeded input, so each checks its own result
against a torch reference without communicating.

- ``all_gather``, ``broadcast`` (from the last rank), ``send_recv`` (a ring):
  data movement, exact.
- ``all_reduce`` and ``reduce_scatter``: sums of positive inputs (no
  cancellation) against float64; tolerance float32 ``1e-5``, bfloat16 one
  unit in the last place (``2**-8``) per rank, as each partial sum may round.
- ``all_reduce_32MiB``: a float32 all-reduce of 32 MiB, its time and bus
  bandwidth (exact against the float64 sum within the float32 tolerance).

A check passes when it passes on every rank.
"""

from __future__ import annotations

import datetime
import math
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Iterator

import torch

from vllm_br.check.base import BFLOAT16, FLOAT32, CheckContext, dtype_name
from vllm_br.check.result import Outcome

_TIMEOUT_S = 300.0
_BIG = 32 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tol(dtype: torch.dtype, world: int) -> float:
    return 1e-5 if dtype == FLOAT32 else world * 2.0**-8


def _inputs(world: int, shape, dtype, salt: int, positive: bool) -> list[torch.Tensor]:
    """Every rank's input, the same in every process."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(1000 * salt + r)
        if positive:
            x = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
        else:
            x = torch.randn(shape, generator=g, dtype=torch.float64)
        out.append(x.to(dtype))
    return out


def _on(device, t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the device (``.to`` aliases on a host device, and
    the collectives write in place)."""
    return t.to(device).clone()


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    from vllm_br.check.measure import max_error

    if tuple(got.shape) != tuple(ref.shape):
        return math.inf
    return max_error(got, ref)


def _exact(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.cpu(), ref.cpu()
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return math.inf
    return float(
        torch.nan_to_num((got.double() - ref.double()).abs(), nan=math.inf).max()
    )


def _run_collectives(comm, rank: int, world: int, device) -> dict[str, dict]:
    """name -> {error, tolerance, seconds, detail} on this rank."""
    results: dict[str, dict] = {}

    def timed(name: str, tol: float, fn: Callable[[], tuple[float, str]]) -> None:
        t0 = time.perf_counter()
        try:
            err, detail = fn()
        except Exception as e:
            err, detail = math.inf, f"{type(e).__name__}: {e}"
        results[name] = {
            "error": err,
            "tolerance": tol,
            "seconds": time.perf_counter() - t0,
            "detail": detail,
        }

    for dtype in (FLOAT32, BFLOAT16):
        dn = dtype_name(dtype)
        tol = _tol(dtype, world)

        def all_reduce(dtype=dtype):
            xs = _inputs(world, (3, 1000), dtype, 1, positive=True)
            out = comm.all_reduce(_on(device, xs[rank]))
            ref = sum(t.double() for t in xs)
            return _err(out, ref), ""

        def all_gather(dtype=dtype):
            worst = 0.0
            for salt, shape, dim in ((2, (3, 5), 0), (3, (2, 3, 7), -1), (4, (9,), 0)):
                xs = _inputs(world, shape, dtype, salt, positive=False)
                out = comm.all_gather(_on(device, xs[rank]), dim)
                worst = max(worst, _exact(out, torch.cat(xs, dim=dim)))
            return worst, ""

        def reduce_scatter(dtype=dtype):
            worst = 0.0
            for salt, dim in ((5, 0), (6, -1)):
                shape = (world * 3, 4) if dim == 0 else (4, world * 3)
                xs = _inputs(world, shape, dtype, salt, positive=True)
                out = comm.reduce_scatter(_on(device, xs[rank]), dim)
                ref = sum(t.double() for t in xs).chunk(world, dim=dim)[rank]
                worst = max(worst, _err(out, ref))
            return worst, ""

        def broadcast(dtype=dtype):
            src = world - 1
            xs = _inputs(world, (5, 33), dtype, 7, positive=False)
            out = comm.broadcast(_on(device, xs[rank]), src)
            return _exact(out, xs[src]), f"from rank {src}"

        def send_recv(dtype=dtype):
            xs = _inputs(world, (4, 17), dtype, 8, positive=False)
            nxt, prev = (rank + 1) % world, (rank - 1) % world
            if rank % 2 == 0:
                comm.send(_on(device, xs[rank]), nxt)
                got = comm.recv(xs[prev].shape, dtype, prev)
            else:
                got = comm.recv(xs[prev].shape, dtype, prev)
                comm.send(_on(device, xs[rank]), nxt)
            return _exact(got, xs[prev]), "ring"

        # Data movement is exact; sums get the dtype's tolerance.
        timed(f"all_reduce[{dn}]", tol, all_reduce)
        timed(f"all_gather[{dn}]", 0.0, all_gather)
        timed(f"reduce_scatter[{dn}]", tol, reduce_scatter)
        timed(f"broadcast[{dn}]", 0.0, broadcast)
        timed(f"send_recv[{dn}]", 0.0, send_recv)

    def big_all_reduce():
        n = _BIG // 4
        g = torch.Generator().manual_seed(99)
        base = torch.rand(n, generator=g) + 0.5
        x = _on(device, base * (rank + 1))
        comm.all_reduce(x.clone())  # warm-up
        from vllm_br.device import get_backend

        backend = get_backend()
        backend.synchronize()
        t0 = time.perf_counter()
        out = comm.all_reduce(x)
        backend.synchronize()
        secs = time.perf_counter() - t0
        ref = base.double() * (world * (world + 1) / 2)
        busbw = 2 * (world - 1) / world * _BIG / secs / 1e9
        return _err(out, ref), f"{secs * 1e3:.1f} ms, bus bandwidth {busbw:.2f} GB/s"

    timed("all_reduce_32MiB", 1e-5, big_all_reduce)
    return results


def _child(rank: int, world: int, port: int) -> dict[str, dict]:
    t0 = time.perf_counter()
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        get_tp_group,
        init_distributed_environment,
    )
    from vllm.platforms import current_platform

    from vllm_br.device import get_backend

    backend = get_backend()
    backend.set_device(rank)
    backend.install_torch_accelerator()
    device = backend.torch_device(rank)
    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=world))
    with set_current_vllm_config(config):
        init_distributed_environment(
            world,
            rank,
            f"tcp://127.0.0.1:{port}",
            rank,
            current_platform.dist_backend,
            datetime.timedelta(seconds=_TIMEOUT_S),
        )
        ensure_model_parallel_initialized(world, 1)
        comm = get_tp_group().device_communicator
        init = {
            "error": 0.0,
            "tolerance": 0.0,
            "seconds": time.perf_counter() - t0,
            "detail": (
                f"platform {type(current_platform).__name__}, dist backend "
                f"{current_platform.dist_backend}, communicator "
                f"{type(comm).__name__}"
                + (" over SCCL" if getattr(comm, "sccl", None) is not None else "")
            ),
        }
        if type(comm).__name__ != "SUPACommunicator":
            init["error"] = math.inf
            init["detail"] += " (expected SUPACommunicator)"
            return {"init": init}
        results = {"init": init, **_run_collectives(comm, rank, world, device)}
        destroy_model_parallel()
        destroy_distributed_environment()
    return results


def _worker(rank: int, world: int, port: int, queue) -> None:
    try:
        results = _child(rank, world, port)
    except BaseException as e:  # reported by the parent
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        results = {
            "init": {
                "error": math.inf,
                "tolerance": 0.0,
                "seconds": 0.0,
                "detail": f"rank {rank}: {type(e).__name__}: {e}{where}",
            }
        }
    queue.put((rank, results))


def _spawn(world: int) -> tuple[dict[int, dict], list[str]]:
    """Per rank results, and what went wrong with the processes."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    problems: list[str] = []
    deadline = time.monotonic() + _TIMEOUT_S
    while len(got) < world:
        left = deadline - time.monotonic()
        if left <= 0:
            problems.append(f"timed out after {_TIMEOUT_S:.0f} s")
            break
        try:
            rank, results = q.get(timeout=min(left, 1.0))
            got[rank] = results
        except queue_mod.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead and len(got) < world:
                codes = ", ".join(
                    f"rank {procs.index(p)} exit {p.exitcode}" for p in dead
                )
                problems.append(f"a process died ({codes})")
                break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
    return got, problems


def checks(ctx: CheckContext) -> Iterator[tuple[str, Callable[[], Outcome]]]:
    world = ctx.devices
    if world < 2:
        yield (
            "init",
            lambda: Outcome(
                passed=None,
                detail=f"not run: {world} device (--devices); collectives need 2 or more",
            ),
        )
        return
    state: dict = {}

    def init() -> Outcome:
        t0 = time.perf_counter()
        got, problems = _spawn(world)
        state["got"] = got
        entries = [r.get("init") for r in got.values()]
        bad = [e["detail"] for e in entries if e and e["error"] != 0.0]
        bad += problems
        missing = sorted(set(range(world)) - set(got))
        if missing:
            bad.append(f"no result from ranks {missing}")
        first = entries[0]["detail"] if entries and entries[0] else ""
        return Outcome(
            passed=not bad,
            metric="seconds",
            error=time.perf_counter() - t0,
            shown=f"{world} processes, {time.perf_counter() - t0:.1f} s with start-up",
            detail="; ".join(bad) if bad else f"{world} processes: {first}",
        )

    yield "init", init
    names = [n for n in (state.get("got") or {0: {}}).get(0, {}) if n != "init"]
    for name in names:
        yield name, lambda name=name: _merge(name, state["got"], world)


def _merge(name: str, got: dict[int, dict], world: int) -> Outcome:
    per_rank = [got[r].get(name) for r in range(world) if r in got]
    if len(per_rank) < world or any(e is None for e in per_rank):
        return Outcome(passed=False, detail="not every rank reported it")
    worst = max(per_rank, key=lambda e: e["error"])
    failed = [
        f"rank {r}: error {e['error']:.3g} > {e['tolerance']:.3g} {e['detail']}".rstrip()
        for r, e in enumerate(per_rank)
        if not e["error"] <= e["tolerance"]
    ]
    detail = per_rank[0]["detail"]
    metric = "max_err" if worst["tolerance"] else "max_abs_diff"
    shown = f"{metric} {worst['error']:.3g} (tol {worst['tolerance']:.3g})"
    return Outcome(
        passed=not failed,
        error=worst["error"],
        tolerance=worst["tolerance"],
        metric=metric,
        shown=f"{shown}, {detail}" if detail else shown,
        detail="; ".join(failed) if failed else detail,
        seconds=max(e["seconds"] for e in per_rank),
    )
