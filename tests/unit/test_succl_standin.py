"""The multi-rank SCCL stand-in (tests/standin/succl) under the real binding.

2 and 3 spawned processes each build a ``vllm_br.device.sccl.SCCLComm`` over
the stand-in ``libsuccl.so`` (``VLLM_SCCL_SO_PATH``), rank 0's unique id
reaching the others through a queue, run every collective and send/recv, and
send their outputs back; the checks here compare them with plain torch
references built from the same seeded inputs. CPU tensors stand in for device
tensors (the stand-in's device pointers are host pointers).

Tolerances: integer and max/min results and all data movement are exact.
Sums and products are exact too, because the reference does what the library
promises: float32 operations in rank order (x0 + x1 + x2), and for bfloat16
accumulation in float32 rounded once to bfloat16 (round to nearest even, as
torch's conversion): the bfloat16 sum equals that reference bit for bit, and
is within a relative 2**-8 (one bfloat16 ulp at most) of the exact sum.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
import traceback
from pathlib import Path

import pytest
import torch
from torch.distributed import ReduceOp

from tests.standin import succl as standin

TIMEOUT_S = 60  # children give up on a peer after this (SUCCL_STANDIN_TIMEOUT_S)
SHORT_S = 1.0  # the timeout the timeout checks use

ENTRY_POINTS = (
    "succlGetUniqueId", "succlCommInitRank", "succlCommDestroy", "succlAllReduce",
    "succlAllGather", "succlReduceScatter", "succlBroadcast", "succlSend", "succlRecv",
)  # fmt: skip

# (name, dtype, op) of the all-reduces each rank runs
ALL_REDUCES = [
    ("f32_sum", torch.float32, ReduceOp.SUM),
    ("f32_max", torch.float32, ReduceOp.MAX),
    ("bf16_sum", torch.bfloat16, ReduceOp.SUM),
    ("bf16_max", torch.bfloat16, ReduceOp.MAX),
    ("f32_min", torch.float32, ReduceOp.MIN),
    ("f32_prod", torch.float32, ReduceOp.PRODUCT),
    ("i8_sum", torch.int8, ReduceOp.SUM),  # wraps
    ("u8_max", torch.uint8, ReduceOp.MAX),
    ("i32_prod", torch.int32, ReduceOp.PRODUCT),
    ("i32_min", torch.int32, ReduceOp.MIN),
]


def _data(rank: int, salt: int, shape, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype in (torch.int8, torch.uint8, torch.int32):
        lo, hi = {torch.int8: (-128, 128), torch.uint8: (0, 256)}.get(dtype, (-4, 5))
        return torch.randint(lo, hi, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _fold(xs: list[torch.Tensor], op) -> torch.Tensor:
    """The library's reduction: rank order, floats in float32, ints wrap."""
    if xs[0].is_floating_point():
        acc = xs[0].float()
        for x in xs[1:]:
            x = x.float()
            if op == ReduceOp.SUM:
                acc = acc + x
            elif op == ReduceOp.PRODUCT:
                acc = acc * x
            elif op == ReduceOp.MAX:
                acc = torch.maximum(acc, x)
            else:
                acc = torch.minimum(acc, x)
        return acc.to(xs[0].dtype)
    acc = xs[0].long()
    for x in xs[1:]:
        x = x.long()
        if op == ReduceOp.SUM:
            acc = acc + x
        elif op == ReduceOp.PRODUCT:
            acc = acc * x
        elif op == ReduceOp.MAX:
            acc = torch.maximum(acc, x)
        else:
            acc = torch.minimum(acc, x)
    bits = 8 if xs[0].dtype in (torch.int8, torch.uint8) else 32
    acc = acc & ((1 << bits) - 1)  # wrap to the width...
    if xs[0].dtype != torch.uint8:  # ...and back to signed
        acc = torch.where(acc >= 1 << (bits - 1), acc - (1 << bits), acc)
    return acc.to(xs[0].dtype)


# ---- what each rank runs (in a spawned process) -----------------------------


def _rank(rank: int, world: int, uid_q, res_q, go_q) -> None:
    try:
        # plain pickle: the queue's pickler would share tensors through
        # torch's shared memory, gone once this process exits
        res = pickle.dumps(_run_rank(rank, world, uid_q, go_q))
        res_q.put((world, rank, None, res))
    except BaseException:
        res_q.put((world, rank, traceback.format_exc(), None))


def _run_rank(rank: int, world: int, uid_q, go_q) -> dict:
    from vllm_br.device import sccl

    lib = sccl.load()  # from VLLM_SCCL_SO_PATH
    if rank == 0:
        uid = lib.unique_id()
        for _ in range(world - 1):
            uid_q.put(uid)
    else:
        uid = uid_q.get(timeout=TIMEOUT_S)
    comm = sccl.SCCLComm(lib, world, rank, uid)
    out: dict = {"uid": uid}

    for i, (name, dtype, op) in enumerate(ALL_REDUCES):
        x = _data(rank, i, (7, 3), dtype)
        y = torch.empty_like(x)
        comm.all_reduce(y, x, op=op)
        out[name] = y
    big = _data(rank, 50, (50_000,), torch.float32)  # outgrows the first staging
    comm.all_reduce(big, big)  # in place, as the communicator calls it
    out["big_in_place"] = big

    x = _data(rank, 60, (5, 3), torch.bfloat16)
    y = torch.empty(world * 5, 3, dtype=torch.bfloat16)
    comm.all_gather(y, x)
    out["all_gather"] = y

    x = _data(rank, 61, (world * 4, 3), torch.float32)
    y = torch.empty(4, 3)
    comm.reduce_scatter(y, x)
    out["reduce_scatter"] = y

    root = world - 1
    x = _data(rank, 62, (6,), torch.bfloat16)
    comm.broadcast(x, root=root)
    out["broadcast"] = x

    nxt, prev = (rank + 1) % world, (rank - 1) % world
    comm.send(_data(rank, 70, (4,), torch.float32), nxt)
    comm.send(_data(rank, 71, (2, 5), torch.int32), nxt)  # in order per pair
    a, b = torch.empty(4), torch.empty(2, 5, dtype=torch.int32)
    comm.recv(a, prev)
    comm.recv(b, prev)
    out["recv"] = (a, b)

    out["counts"] = {n: standin.call_count(lib.path, n) for n in ENTRY_POINTS}
    out["unknown_count"] = standin.call_count(lib.path, "gloo_all_reduce")

    if world == 2:
        out["timeouts"] = _timeouts(comm, rank, go_q)
    comm.destroy()
    out["destroyed"] = standin.call_count(lib.path, "succlCommDestroy")
    return out


def _error(fn) -> str | None:
    t0 = time.monotonic()
    try:
        fn()
    except RuntimeError as e:
        return f"{time.monotonic() - t0:.2f} {e}"
    return None


def _timeouts(comm, rank: int, go_q) -> dict:
    """Rank 0 waits for rank 1, which never comes: a receive, then an
    all-reduce; rank 1 waits until rank 0 is done."""
    if rank == 1:
        go_q.get(timeout=TIMEOUT_S)
        return {}
    os.environ["SUCCL_STANDIN_TIMEOUT_S"] = str(SHORT_S)  # read at each wait
    x = torch.ones(3)
    found = {
        "recv": _error(lambda: comm.recv(x, 1)),
        "all_reduce": _error(lambda: comm.all_reduce(x, x)),
        "after": _error(lambda: comm.all_reduce(x, x)),
    }
    go_q.put("done")
    return found


# ---- the checks ---------------------------------------------------------------


def _spawn(worlds: list[int], lib: Path) -> dict[int, list[dict] | str]:
    """Run one group of ``world`` processes per entry of ``worlds``, all at
    once; each group's ranks' results, or the failure text."""
    ctx = multiprocessing.get_context("spawn")
    res_q = ctx.Queue()
    saved = {
        k: os.environ.get(k) for k in ("VLLM_SCCL_SO_PATH", "SUCCL_STANDIN_TIMEOUT_S")
    }
    os.environ.update(
        VLLM_SCCL_SO_PATH=str(lib), SUCCL_STANDIN_TIMEOUT_S=str(TIMEOUT_S)
    )
    procs, queues = [], []  # the queues must outlive start()
    try:
        for world in worlds:
            uid_q, go_q = ctx.Queue(), ctx.Queue()
            queues += [uid_q, go_q]
            for r in range(world):
                args = (r, world, uid_q, res_q, go_q)
                procs.append(ctx.Process(target=_rank, args=args))
                procs[-1].start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict[int, dict] = {w: {} for w in worlds}
    errors: dict[int, list[str]] = {w: [] for w in worlds}
    try:
        deadline = time.monotonic() + 2 * TIMEOUT_S
        answered = 0
        while answered < len(procs) and time.monotonic() < deadline:
            try:
                world, rank, err, res = res_q.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break  # one died without an answer
                continue
            answered += 1
            if err:
                errors[world].append(f"rank {rank} of {world}:\n{err}")
            else:
                results[world][rank] = pickle.loads(res)
        for p in procs:
            p.join(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    out: dict[int, list[dict] | str] = {}
    for w in worlds:
        if errors[w]:
            out[w] = "\n".join(errors[w])
        elif len(results[w]) < w:
            out[w] = f"{w} ranks: only ranks {sorted(results[w])} answered"
        else:
            out[w] = [results[w][r] for r in range(w)]
    return out


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> Path:
    return standin.build(tmp_path_factory.mktemp("succl_standin"))


@pytest.fixture(scope="module")
def runs(lib):
    """world -> each rank's results; both groups run once, concurrently."""
    cache: dict[int, list[dict] | str] = {}

    def run(world: int) -> list[dict]:
        if not cache:
            cache.update(_spawn([2, 3], lib))
        if isinstance(cache[world], str):
            pytest.fail(cache[world])
        return cache[world]

    return run


WORLDS = pytest.mark.parametrize("world", [2, 3])


@WORLDS
def test_all_reduce(runs, world):
    ranks = runs(world)
    for i, (name, dtype, op) in enumerate(ALL_REDUCES):
        ref = _fold([_data(r, i, (7, 3), dtype) for r in range(world)], op)
        for rank, res in enumerate(ranks):
            assert res[name].dtype == dtype
            assert torch.equal(res[name], ref), (name, rank, res[name], ref)
    big = _fold(
        [_data(r, 50, (50_000,), torch.float32) for r in range(world)], ReduceOp.SUM
    )
    for res in ranks:
        assert torch.equal(res["big_in_place"], big)


def test_bf16_sum_rounds_once(runs):
    # the float32 sum in rank order, rounded once: within 2**-8 of the exact sum
    ranks = runs(3)
    xs = [_data(r, 2, (7, 3), torch.bfloat16) for r in range(3)]
    once = ((xs[0].float() + xs[1].float()) + xs[2].float()).to(torch.bfloat16)
    assert torch.equal(ranks[0]["bf16_sum"], once)
    exact = sum(x.double() for x in xs)
    err = (ranks[0]["bf16_sum"].double() - exact).abs()
    assert bool((err <= exact.abs() * 2.0**-8 + 1e-30).all())


@WORLDS
def test_all_gather_reduce_scatter_broadcast(runs, world):
    ranks = runs(world)
    gathered = torch.cat([_data(r, 60, (5, 3), torch.bfloat16) for r in range(world)])
    summed = _fold(
        [_data(r, 61, (world * 4, 3), torch.float32) for r in range(world)],
        ReduceOp.SUM,
    )
    root = _data(world - 1, 62, (6,), torch.bfloat16)
    for rank, res in enumerate(ranks):
        assert torch.equal(res["all_gather"], gathered)
        assert torch.equal(res["reduce_scatter"], summed[4 * rank : 4 * rank + 4])
        assert torch.equal(res["broadcast"], root)


@WORLDS
def test_send_recv_in_order(runs, world):
    for rank, res in enumerate(runs(world)):
        prev = (rank - 1) % world
        a, b = res["recv"]
        assert torch.equal(a, _data(prev, 70, (4,), torch.float32))
        assert torch.equal(b, _data(prev, 71, (2, 5), torch.int32))


@WORLDS
def test_call_counts(runs, world):
    for rank, res in enumerate(runs(world)):
        assert res["counts"] == {
            "succlGetUniqueId": 1 if rank == 0 else 0,
            "succlCommInitRank": 1,
            "succlCommDestroy": 0,
            "succlAllReduce": len(ALL_REDUCES) + 1,
            "succlAllGather": 1,
            "succlReduceScatter": 1,
            "succlBroadcast": 1,
            "succlSend": 2,
            "succlRecv": 2,
        }
        assert res["unknown_count"] == -1
        assert res["destroyed"] == 1


@WORLDS
def test_no_segments_left(runs, world):
    prefix = standin.segment_prefix(runs(world)[0]["uid"])
    assert prefix.startswith(standin.SEGMENT_PREFIX) and len(prefix) > 20
    left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    assert left == []


def test_peer_that_never_comes(runs):
    """A receive and a collective waiting for an absent peer fail after
    SUCCL_STANDIN_TIMEOUT_S with the reason; the collective leaves the
    communicator unusable."""
    found = runs(2)[0]["timeouts"]
    for what, waited in (
        ("recv", "message #2 from rank 1"),
        ("all_reduce", "every rank"),
    ):
        assert found[what] is not None, what
        seconds, msg = found[what].split(" ", 1)
        assert SHORT_S <= float(seconds) < SHORT_S + 5, found[what]
        assert "failed with code 6" in msg and f"timed out after {SHORT_S:g} s" in msg
        assert waited in msg and "SUCCL_STANDIN_TIMEOUT_S" in msg
    assert "code 5" in found["after"] and "failed earlier" in found["after"]


def test_init_without_peers_times_out(lib, monkeypatch):
    from vllm_br.device import sccl

    monkeypatch.setenv("SUCCL_STANDIN_TIMEOUT_S", "0.3")
    lib_ = sccl.load(str(lib))
    uid = lib_.unique_id()
    t0 = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=r"succlCommInitRank failed with code 6: .*rank 0 of 2 timed out after "
        r"0\.3 s waiting for every rank to join \(SUCCL_STANDIN_TIMEOUT_S\)",
    ):
        sccl.SCCLComm(lib_, 2, 0, uid)
    assert time.monotonic() - t0 < 5
    prefix = standin.segment_prefix(uid)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def test_one_rank_and_bad_arguments(lib):
    from vllm_br.device import sccl

    lib_ = sccl.load(str(lib))
    comm = sccl.SCCLComm(lib_, 1, 0, lib_.unique_id())
    x = torch.arange(6, dtype=torch.float32)
    y = torch.empty(6)
    comm.all_reduce(y, x, op=ReduceOp.MAX)
    assert torch.equal(y, x)
    with pytest.raises(RuntimeError, match="code 4: invalid argument: .*peer 1"):
        comm.send(x, 1)
    with pytest.raises(RuntimeError, match="code 4: .*data type 4 is not supported"):
        lib_.call(
            "succlAllReduce", x.data_ptr(), y.data_ptr(), 6, 4, 0, comm.handle, None
        )
    comm.destroy()
    with pytest.raises(RuntimeError, match="code 4: .*not made by this library"):
        sccl.SCCLComm(lib_, 1, 0, bytes(sccl.SCCL_UNIQUE_ID_BYTES))


def test_build_is_cached(lib):
    before = lib.stat().st_mtime_ns
    assert standin.build(lib.parent) == lib
    assert lib.stat().st_mtime_ns == before
