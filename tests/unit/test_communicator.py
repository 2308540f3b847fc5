"""SUPACommunicator on the cpu backend: every collective in real gloo process
groups (torch.multiprocessing spawn), odd shapes, bfloat16 and float32,
against the obvious single-process result computed from every rank's input.

Each rank builds every rank's input from the same seeds, so it knows the
expected result without communicating. A failed check raises in the child and
mp.spawn re-raises it here with the child's traceback.
"""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

DTYPES = (torch.float32, torch.bfloat16)
# odd sizes, 1-D to 3-D, and the dimension collectives work along
SHAPES = [
    ((7,), 0),
    ((3, 5), 0),
    ((3, 5), 1),
    ((3, 5), -1),
    ((2, 3, 5), 1),
    ((2, 3, 5), 2),
    ((1, 1), 0),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, nprocs: int, env: dict[str, str] | None = None) -> None:
    port = _free_port()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        mp.spawn(fn, args=(nprocs, port), nprocs=nprocs, join=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _data(rank: int, shape, dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _init(proc: int, nprocs: int, port: int) -> None:
    import torch.distributed as dist

    os.environ["VLLM_BR_DEVICE"] = "cpu"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=proc,
        world_size=nprocs,
        timeout=datetime.timedelta(seconds=60),
    )


def _group(ranks: list[int]):
    """A factory of communicators over ``ranks`` (None outside them). Every
    process takes part in creating the groups, as in vLLM's GroupCoordinator:
    a device group and a gloo cpu group."""
    import torch.distributed as dist

    device_group = dist.new_group(ranks, backend="gloo")
    cpu_group = dist.new_group(ranks, backend="gloo")
    if dist.get_rank() not in ranks:
        return None
    return lambda: _new_comm(cpu_group, device_group)


def _new_comm(cpu_group, device_group):
    from vllm_br.distributed import allreduce
    from vllm_br.distributed.communicator import SUPACommunicator

    allreduce.startup_decision.cache_clear()  # each scenario's settings
    rank = cpu_group.rank()
    return SUPACommunicator(
        cpu_group, torch.device(f"cpu:{rank}"), device_group, unique_name="tp:0"
    )


def _exact(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} != {expected.dtype}"
    assert got.shape == expected.shape, (
        f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    )
    assert torch.equal(got, expected), (
        f"{what}: values differ by {(got.float() - expected.float()).abs().max()}"
    )


def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    # gloo adds in the tensor's dtype; with two ranks that is one rounding
    out = parts[0].clone()
    for p in parts[1:]:
        out = out + p
    return out


def _all_collectives(rank: int, world: int, new_comm, global_ranks: list[int]) -> None:
    for name in (
        "VLLM_BR_USE_FP32_ALL_REDUCE",
        "VLLM_BR_USE_CPU_ALL_REDUCE",
        "VLLM_BR_USE_FUSED_ALLREDUCE",
    ):
        os.environ.pop(name, None)
    comm = new_comm()
    assert comm.world_size == world and comm.rank_in_group == rank
    assert comm.ranks == global_ranks
    assert comm.device == torch.device("cpu")
    assert comm.sccl is None  # the cpu backend never loads SCCL
    other = 1 - rank

    for dtype in DTYPES:
        for shape, dim in SHAPES:
            what = f"{dtype} {shape} dim {dim}"
            inputs = [_data(r, shape, dtype) for r in range(world)]
            mine = inputs[rank]
            d = dim % len(shape)

            # all_reduce: in place and returned
            x = mine.clone()
            out = comm.all_reduce(x)
            assert out is x
            _exact(out, _sum(inputs), f"all_reduce {what}")

            _exact(
                comm.all_gather(mine.clone(), dim),
                torch.cat(inputs, dim=d),
                f"all_gather {what}",
            )

            # reduce_scatter: every rank holds a full tensor of world x the chunk
            big = [
                _data(
                    r, shape[:d] + (shape[d] * world,) + shape[d + 1 :], dtype, salt=1
                )
                for r in range(world)
            ]
            chunk = _sum(big).chunk(world, dim=d)[rank].contiguous()
            _exact(
                comm.reduce_scatter(big[rank].clone(), dim),
                chunk,
                f"reduce_scatter {what}",
            )

            got = comm.gather(mine.clone(), dst=0, dim=dim)
            if rank == 0:
                _exact(got, torch.cat(inputs, dim=d), f"gather {what}")
            else:
                assert got is None

            b = mine.clone()
            _exact(comm.broadcast(b, src=1), inputs[1], f"broadcast {what}")

            # send/recv in both directions, default and explicit peers
            if rank == 0:
                comm.send(mine)
                _exact(
                    comm.recv(mine.shape, dtype, src=other),
                    inputs[other],
                    f"recv {what}",
                )
            else:
                _exact(comm.recv(mine.shape, dtype), inputs[other], f"recv {what}")
                comm.send(mine, dst=other)

        # non-contiguous input (a transposed view)
        inputs = [_data(r, (5, 3), dtype, salt=2).t() for r in range(world)]
        x = inputs[rank].clone(memory_format=torch.preserve_format)
        assert not x.is_contiguous()
        _exact(comm.all_reduce(x), _sum(inputs), f"all_reduce non-contiguous {dtype}")
        _exact(
            comm.all_gather(inputs[rank], 0),
            torch.cat(inputs, 0),
            f"all_gather non-contiguous {dtype}",
        )

        # variable sizes per rank (vLLM's DP/EP path), odd and unequal
        sizes = [3, 5]
        parts = [_data(r, (sizes[r], 7), dtype, salt=3) for r in range(world)]
        _exact(
            comm.all_gatherv(parts[rank], 0, sizes),
            torch.cat(parts),
            f"all_gatherv {dtype}",
        )
        pair = [
            [
                _data(r, (sizes[r], 2), dtype, salt=4),
                _data(r, (sizes[r],), dtype, salt=5),
            ]
            for r in range(world)
        ]
        got = comm.all_gatherv(pair[rank], 0, sizes)
        for i in range(2):
            _exact(
                got[i], torch.cat([p[i] for p in pair]), f"all_gatherv list {i} {dtype}"
            )
        full = [_data(r, (sum(sizes), 7), dtype, salt=6) for r in range(world)]
        mine_rows = _sum(full).split(sizes)[rank].contiguous()
        _exact(
            comm.reduce_scatterv(full[rank].clone(), 0, sizes),
            mine_rows,
            f"reduce_scatterv {dtype}",
        )
        equal = [_data(r, (4, 3), dtype, salt=7) for r in range(world)]
        _exact(
            comm.reduce_scatterv(equal[rank].clone(), 0, [2, 2]),
            _sum(equal)[2 * rank : 2 * rank + 2],
            "rsv equal",
        )

    # without expert parallelism dispatch/combine pass tensors through
    h, w_, ids = (
        torch.ones(2, 3),
        torch.ones(2, 1),
        torch.zeros(2, 1, dtype=torch.int64),
    )
    assert comm.dispatch(h, w_, ids) == (h, w_, ids)
    assert comm.combine(h) is h
    comm.destroy()


def _check_allreduce_options(rank: int, world: int, new_comm) -> None:
    """The allreduce strategy's settings, applied by the communicator."""
    inputs = [_data(r, (257, 3), torch.bfloat16, salt=8) for r in range(world)]
    exact = sum(p.double() for p in inputs)  # bf16 inputs: exact in float64

    os.environ.pop("VLLM_BR_USE_CPU_ALL_REDUCE", None)
    os.environ.pop("VLLM_BR_USE_FP32_ALL_REDUCE", None)
    plain = new_comm()
    assert not plain.strategy.fp32_reduce
    in_bf16 = plain.all_reduce(inputs[rank].clone())

    os.environ["VLLM_BR_USE_FP32_ALL_REDUCE"] = "1"
    fp32 = new_comm()
    assert fp32.strategy.fp32_reduce
    x = inputs[rank].clone()
    in_fp32 = fp32.all_reduce(x)
    assert in_fp32 is x and in_fp32.dtype == torch.bfloat16  # cast back in place
    # reduced in float32, rounded once
    _exact(in_fp32, exact.to(torch.float32).to(torch.bfloat16), "fp32 all_reduce")
    f = _data(rank, (5,), torch.float32)
    f_all = [_data(r, (5,), torch.float32) for r in range(world)]
    f_got = fp32.all_reduce(f.clone())  # float32 is reduced as is
    torch.testing.assert_close(
        f_got,
        _sum(f_all),
        rtol=0 if world == 2 else 1e-6,
        atol=0 if world == 2 else 1e-6,
    )
    if world > 2:
        # with three or more partials bf16 rounds at every step, float32 once
        err_bf16 = (in_bf16.double() - exact).abs().sum()
        err_fp32 = (in_fp32.double() - exact).abs().sum()
        assert err_fp32 < err_bf16, (err_fp32, err_bf16)

    os.environ["VLLM_BR_USE_CPU_ALL_REDUCE"] = "1"
    host = new_comm()
    assert host.strategy.host_reduce and host.strategy.fp32_reduce
    _exact(host.all_reduce(inputs[rank].clone()), in_fp32, "host all_reduce in fp32")
    os.environ.pop("VLLM_BR_USE_FP32_ALL_REDUCE")
    host = new_comm()
    # gloo's summation order is its own with three ranks: compare with the device path
    _exact(
        host.all_reduce(inputs[rank].clone()),
        _sum(inputs) if world == 2 else in_bf16,
        "host all_reduce",
    )


# The pair's group ranks (0, 1) are not its global ranks (1, 2): src/dst
# translation is exercised.
PAIR = [1, 2]


def _main(proc: int, nprocs: int, port: int) -> None:
    _init(proc, nprocs, port)
    pair = _group(PAIR)
    everyone = _group(list(range(nprocs)))
    if pair is not None:
        _all_collectives(PAIR.index(proc), 2, pair, PAIR)
        _check_allreduce_options(PAIR.index(proc), 2, pair)
    # three partials: where reducing bf16 in float32 shows
    _check_allreduce_options(proc, nprocs, everyone)
    _finish()


def _finish() -> None:
    """Every rank done before any tears gloo down: a rank that exits while
    another still talks to it can abort in gloo's threads ("terminate called
    without an active exception", SIGABRT; seen once in CI)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(150)
def test_collectives_on_gloo():
    """Every collective on a 2-process group, the allreduce options on it and
    on all three processes (one spawn: starting processes is the slow part)."""
    _spawn(_main, 3, {"VLLM_BR_DEVICE": "cpu"})


def test_platform_names_the_communicator():
    from vllm_br.platform import SUPAPlatform

    path = SUPAPlatform.get_device_communicator_cls()
    assert path == "vllm_br.distributed.communicator.SUPACommunicator"
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from vllm_br.distributed.communicator import SUPACommunicator

    assert resolve_obj_by_qualname(path) is SUPACommunicator
