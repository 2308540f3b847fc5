"""VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE wired into vLLM's group creation
(ledger patch supernode-tp-groups, vllm_br/distributed/supernode_groups.py).

The pure parts (ids, the wrapper's scoped torch.arange) run in this process;
the real thing runs in 4 gloo processes (torch.multiprocessing spawn) through
vLLM's own init_distributed_environment / ensure_model_parallel_initialized,
each process with its own VLLM_BR_SUPERNODE_ID. A failed check raises in the
child and mp.spawn re-raises it here with the child's traceback.
"""

from __future__ import annotations

import datetime
import inspect
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from vllm_br.distributed import supernode_groups
from vllm_br.errors import SUPAConfigError

ENABLE = "VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE"
SUPERNODE = "VLLM_BR_SUPERNODE_ID"
REFUSAL = "needs every supernode to hold a multiple of --tensor-parallel-size 2"


# ---- ids --------------------------------------------------------------------
def test_supernode_ids_become_ints_in_first_seen_order():
    ids = ["b", "a", "b", "c", "a"]
    assert supernode_groups.supernode_indices(ids) == [0, 1, 0, 2, 1]
    assert supernode_groups.supernode_indices([]) == []
    assert supernode_groups.supernode_indices(["x"] * 3) == [0, 0, 0]


def test_supernode_id_is_the_variable_else_the_host(monkeypatch):
    monkeypatch.setenv(SUPERNODE, "  rack-7  ")
    assert supernode_groups.supernode_id() == "rack-7"
    for unset in ("", "   "):
        monkeypatch.setenv(SUPERNODE, unset)
        own = supernode_groups.supernode_id()
        assert socket.gethostname() in own
    monkeypatch.delenv(SUPERNODE)
    assert supernode_groups.supernode_id() == own


def test_layout_of_ids():
    # hosts in supernode order: vLLM's layout
    assert supernode_groups.layout(list("aabb"), tp_size=2) == [0, 1, 2, 3]
    assert supernode_groups.layout(["h"] * 4, tp_size=4) == [0, 1, 2, 3]
    # interleaved: TP groups [0, 2] and [1, 3]
    assert supernode_groups.layout(list("abab"), tp_size=2) == [0, 2, 1, 3]
    # with PP 2 the stage holding the executor's output rank (2) goes last
    assert supernode_groups.layout(list("abab"), tp_size=2, pp_size=2) == [
        1,
        3,
        0,
        2,
    ]
    with pytest.raises(SUPAConfigError, match=REFUSAL):
        supernode_groups.layout(list("abbb"), tp_size=2)


# ---- the wrapper, without processes -------------------------------------------
def _fake_vllm(body):
    """Stands in for vLLM's initialize_model_parallel (same signature); runs
    ``body(torch_of_the_module)``."""
    from vllm.distributed import parallel_state

    def initialize_model_parallel(
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        prefill_context_model_parallel_size: int = 1,
        decode_context_model_parallel_size: int | None = 1,
        backend: str | None = None,
    ) -> None:
        body(parallel_state.torch)

    return initialize_model_parallel


def _recorder(calls: list):
    """A fake vLLM that records what the module's torch.arange gives."""

    def body(t) -> None:
        calls.append(
            {
                "torch_is_torch": t is torch,
                "first": t.arange(4).tolist(),
                "again": t.arange(4).tolist(),
                "other": t.arange(2).tolist(),
                "tensor": t.Tensor is torch.Tensor,
            }
        )

    return _fake_vllm(body)


@pytest.fixture
def fake_world(monkeypatch):
    """A 4-rank world whose supernode ids the test sets, and a current config."""
    import vllm.config
    from vllm.distributed import parallel_state

    state = SimpleNamespace(
        ids=["a"] * 4,
        elastic=False,
        dp=1,
        world=SimpleNamespace(rank=0, cpu_group=None),
    )
    monkeypatch.setattr(
        supernode_groups, "gather_supernode_ids", lambda group: list(state.ids)
    )
    monkeypatch.setattr(parallel_state, "get_world_group", lambda: state.world)
    monkeypatch.setattr(
        vllm.config,
        "get_current_vllm_config",
        lambda: SimpleNamespace(
            parallel_config=SimpleNamespace(
                enable_elastic_ep=state.elastic, data_parallel_size=state.dp
            )
        ),
    )
    monkeypatch.setenv(ENABLE, "1")
    return state


def test_wrapper_keeps_vllms_signature():
    from vllm.distributed import parallel_state

    original = parallel_state.initialize_model_parallel
    original = getattr(original, "__wrapped__", original)
    wrapped = supernode_groups.wrap(original)
    assert inspect.signature(wrapped) == inspect.signature(original)
    assert wrapped.__wrapped__ is original


def test_order_equal_to_range_changes_nothing(fake_world):
    from vllm.distributed import parallel_state

    calls: list = []
    fake_world.ids = ["a", "a", "b", "b"]
    supernode_groups.wrap(_recorder(calls))(2)
    assert calls == [
        {
            "torch_is_torch": True,
            "first": [0, 1, 2, 3],
            "again": [0, 1, 2, 3],
            "other": [0, 1],
            "tensor": True,
        }
    ]
    assert parallel_state.torch is torch


def test_variable_unset_calls_vllm_only(fake_world, monkeypatch):
    calls: list = []
    fake_world.ids = ["a", "b", "a", "b"]
    monkeypatch.delenv(ENABLE)
    monkeypatch.setattr(
        supernode_groups, "gather_supernode_ids", lambda group: pytest.fail("gathered")
    )
    supernode_groups.wrap(_recorder(calls))(2)
    assert calls[0]["torch_is_torch"] and calls[0]["first"] == [0, 1, 2, 3]


def test_other_order_replaces_only_the_first_arange_of_world_size(fake_world):
    from vllm.distributed import parallel_state

    calls: list = []
    fake_world.ids = ["a", "b", "a", "b"]
    supernode_groups.wrap(_recorder(calls))(tensor_model_parallel_size=2)
    assert calls == [
        {
            "torch_is_torch": False,
            "first": [0, 2, 1, 3],
            "again": [0, 1, 2, 3],
            "other": [0, 1],
            "tensor": True,
        }
    ]
    assert parallel_state.torch is torch


def test_module_torch_is_put_back_when_vllm_raises(fake_world):
    from vllm.distributed import parallel_state

    def body(t) -> None:
        t.arange(4)
        raise KeyError("vllm failed")

    fake_world.ids = ["a", "b", "a", "b"]
    with pytest.raises(KeyError):
        supernode_groups.wrap(_fake_vllm(body))(2)
    assert parallel_state.torch is torch


def test_vllm_without_the_arange_is_an_error_not_a_silent_layout(fake_world):
    fake_world.ids = ["a", "b", "a", "b"]
    with pytest.raises(RuntimeError, match="torch.arange"):
        supernode_groups.wrap(_fake_vllm(lambda t: None))(2)


def test_elastic_ep_is_refused_in_one_sentence(fake_world):
    fake_world.elastic = True
    with pytest.raises(SUPAConfigError) as e:
        supernode_groups.wrap(_recorder([]))(2)
    msg = str(e.value)
    assert "--enable-elastic-ep" in msg and ENABLE in msg
    assert msg.endswith(".") and ". " not in msg


def test_install_is_idempotent_and_undone():
    from vllm.distributed import parallel_state

    before = parallel_state.initialize_model_parallel
    supernode_groups.install()
    try:
        installed = parallel_state.initialize_model_parallel
        assert getattr(installed, "_vllm_br", False)
        supernode_groups.install()
        assert parallel_state.initialize_model_parallel is installed
    finally:
        supernode_groups.uninstall()
    assert not getattr(parallel_state.initialize_model_parallel, "_vllm_br", False)
    if getattr(before, "_vllm_br", False):  # the session had it installed
        supernode_groups.install()


# ---- 4 gloo processes through vLLM's own group creation ----------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, nprocs: int) -> None:
    # The config is built once here: in each child it would cost seconds.
    from vllm.config import VllmConfig

    config = VllmConfig()
    mp.spawn(fn, args=(nprocs, _free_port(), config), nprocs=nprocs, join=True)


def _groups(tp: int, pp: int = 1, supernode: str | None = None, on: bool = True):
    """vLLM's groups for this process, built through the patched path."""
    from vllm.distributed import parallel_state as ps

    os.environ[ENABLE] = "1" if on else "0"
    if supernode is None:
        os.environ.pop(SUPERNODE, None)
    else:
        os.environ[SUPERNODE] = supernode
    ps.ensure_model_parallel_initialized(tp, pp)
    return ps.get_tp_group(), ps.get_pp_group()


def _main(proc: int, nprocs: int, port: int, config) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    supernode_groups.install()
    with set_current_vllm_config(config):
        ps.init_distributed_environment(
            world_size=nprocs,
            rank=proc,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=proc,
            backend="gloo",
            timeout=datetime.timedelta(seconds=60),
        )
        try:
            _scenarios(proc, ps)
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


def _scenarios(rank: int, ps) -> None:
    half = "a" if rank % 2 == 0 else "b"  # ranks 0, 2 -> a; 1, 3 -> b

    # TP 2, supernodes {0, 2} {1, 3}: TP groups inside them
    tp, pp = _groups(2, supernode=half)
    expected = [0, 2] if rank in (0, 2) else [1, 3]
    assert tp.ranks == expected, (rank, tp.ranks)
    assert pp.ranks == [rank], pp.ranks  # PP 1: every rank its own stage
    # the TP allreduce sums over exactly those ranks
    got = tp.all_reduce(torch.tensor([float(10**rank)]))
    assert got.item() == sum(10**r for r in expected), (rank, got)
    assert ps.get_dp_group().ranks == [rank]
    assert ps.get_world_group().ranks == [0, 1, 2, 3]
    ps.destroy_model_parallel()

    # TP 2 x PP 2: same TP groups; the stage holding rank 2 (the executor's
    # output rank, world - TP) is the last stage
    tp, pp = _groups(2, pp=2, supernode=half)
    assert tp.ranks == expected, (rank, tp.ranks)
    assert pp.ranks == ([1, 0] if rank in (0, 1) else [3, 2]), (rank, pp.ranks)
    assert pp.is_last_rank == (rank in (0, 2)), (rank, pp.ranks)
    got = pp.broadcast_object(f"from {pp.ranks[0]}" if pp.is_first_rank else None)
    assert got == f"from {pp.ranks[0]}", (rank, got)
    ps.destroy_model_parallel()

    # VLLM_BR_SUPERNODE_ID unset: one host, one supernode -> vLLM's layout
    tp, _ = _groups(2)
    assert tp.ranks == ([0, 1] if rank < 2 else [2, 3]), (rank, tp.ranks)
    ps.destroy_model_parallel()

    # the feature off: vLLM's layout whatever the ids say
    tp, _ = _groups(2, supernode=half, on=False)
    assert tp.ranks == ([0, 1] if rank < 2 else [2, 3]), (rank, tp.ranks)
    ps.destroy_model_parallel()

    # a supernode of one rank with TP 2: the same sentence on every rank, no
    # groups left behind
    try:
        _groups(2, supernode="solo" if rank == 0 else "rest")
    except SUPAConfigError as e:
        msg = str(e)
        assert REFUSAL in msg and "supernode 0 holds 1" in msg, msg
        assert ENABLE in msg and msg.endswith(".") and ". " not in msg, msg
    else:
        raise AssertionError(f"rank {rank}: a 1-rank supernode was not refused")
    assert not ps.model_parallel_is_initialized()


@pytest.mark.timeout(120)
def test_tp_groups_inside_supernodes_on_4_gloo_processes(monkeypatch):
    monkeypatch.setenv("VLLM_BR_DEVICE", "cpu")
    _spawn(_main, 4)
