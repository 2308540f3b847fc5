"""The SCCL ctypes binding (vllm_br.device.sccl): load failures stop with one
sentence naming the path and VLLM_SCCL_SO_PATH, and the arguments reach the
C functions as intended (checked against the fake libsuccl.so in
tests/fakes/sccl_fake.py, built with gcc)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch.distributed import ReduceOp

from tests.fakes.sccl_fake import (
    SOURCE,
    FakeSCCLState,
    build_fake_sccl,
    gcc_available,
)
from vllm_br.device import sccl
from vllm_br.errors import SUPAConfigError

needs_gcc = pytest.mark.skipif(
    not gcc_available(), reason="gcc builds the fake libsuccl.so"
)


@pytest.fixture(scope="module")
def fake_so(tmp_path_factory):
    if not gcc_available():
        pytest.skip("gcc builds the fake libsuccl.so")
    return build_fake_sccl(tmp_path_factory.mktemp("sccl"))


@pytest.fixture
def lib(fake_so):
    return sccl.SCCLLibrary(str(fake_so))


@pytest.fixture
def state(fake_so):
    return FakeSCCLState(fake_so)


@pytest.fixture
def comm(lib):
    return sccl.SCCLComm(lib, 1, 0, lib.unique_id())


def _one_sentence(msg: str) -> bool:
    return msg.count(". ") == 0 and msg.endswith(".")


def test_missing_library_names_path_and_variable(tmp_path, monkeypatch):
    path = tmp_path / "nowhere" / "libsuccl.so"
    monkeypatch.setenv("VLLM_SCCL_SO_PATH", str(path))
    with pytest.raises(SUPAConfigError) as e:
        sccl.load()
    msg = str(e.value)
    assert str(path) in msg and "VLLM_SCCL_SO_PATH" in msg and _one_sentence(msg)


def test_default_path_is_the_sdk_one(monkeypatch):
    monkeypatch.delenv("VLLM_SCCL_SO_PATH", raising=False)
    with pytest.raises(
        SUPAConfigError,
        match="/usr/local/birensupa/base/latest/succl/lib/x86_64-linux-gnu/libsuccl.so",
    ):
        sccl.load()


def test_unloadable_library(tmp_path):
    bad = tmp_path / "libsuccl.so"
    bad.write_text("not an ELF file")
    with pytest.raises(SUPAConfigError) as e:
        sccl.load(str(bad))
    msg = str(e.value)
    assert "cannot be loaded" in msg and str(bad) in msg and "VLLM_SCCL_SO_PATH" in msg
    assert msg.endswith(".")


@needs_gcc
def test_library_without_sccl_symbols(tmp_path):
    other = build_fake_sccl(
        tmp_path, source="int unrelated(void) { return 0; }\n", name="libother.so"
    )
    with pytest.raises(
        SUPAConfigError,
        match="is not an SCCL library .*succlGetErrorString.*VLLM_SCCL_SO_PATH",
    ):
        sccl.load(str(other))


def test_load_once_per_path(fake_so):
    assert sccl.load(str(fake_so)) is sccl.load(str(fake_so))


def test_unique_id_and_init(lib, state):
    uid = lib.unique_id()
    assert len(uid) == sccl.SCCL_UNIQUE_ID_BYTES and uid.startswith(b"fake-succl")
    c = sccl.SCCLComm(lib, 1, 0, uid)
    assert state.last.fn == b"succlCommInitRank"
    assert (state.last.nranks, state.last.rank) == (1, 0)
    assert c.handle.value is not None
    c.destroy()
    assert state.last.fn == b"succlCommDestroy"
    assert c.handle is None
    c.destroy()  # twice is harmless


def test_init_error_carries_the_library_message(lib):
    # the fake accepts only one rank: rank 1 of 2 is refused
    with pytest.raises(
        RuntimeError, match="succlCommInitRank failed with code 4: invalid argument"
    ):
        sccl.SCCLComm(lib, 2, 1, lib.unique_id())
    with pytest.raises(ValueError, match="128 bytes"):
        sccl.SCCLComm(lib, 1, 0, b"short")


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int32, torch.int8, torch.uint8]
)
def test_all_reduce_marshalling(comm, state, dtype):
    x = (torch.arange(7 * 3) % 5).to(dtype).reshape(7, 3)
    out = torch.empty_like(x)
    comm.all_reduce(out, x, op=ReduceOp.MAX)
    last = state.last
    assert last.fn == b"succlAllReduce"
    assert (last.send, last.recv) == (x.data_ptr(), out.data_ptr())
    assert last.count == 21
    assert last.dtype == sccl.dtype_code(dtype)
    assert last.op == sccl.op_code(ReduceOp.MAX) == 2
    assert last.comm == comm.handle.value
    assert last.stream is None  # the default stream
    assert torch.equal(out, x)  # one rank: the sum is the input


def test_dtype_and_op_codes():
    assert [
        sccl.dtype_code(d)
        for d in (torch.int8, torch.uint8, torch.int32, torch.float32, torch.bfloat16)
    ] == [0, 1, 2, 7, 9]
    assert [
        sccl.op_code(o)
        for o in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX, ReduceOp.MIN)
    ] == [0, 1, 2, 3]
    assert not sccl.supports(torch.int64) and not sccl.supports(torch.float64)
    with pytest.raises(TypeError, match="no data type"):
        sccl.dtype_code(torch.int64)
    with pytest.raises(TypeError, match="no reduce op"):
        sccl.op_code(ReduceOp.AVG)


def test_other_collectives_marshalling(comm, state):
    x = torch.randn(5, 3).to(torch.bfloat16)
    out = torch.empty(5, 3, dtype=torch.bfloat16)
    comm.all_gather(out, x)
    assert (state.last.fn, state.last.count, state.last.dtype) == (
        b"succlAllGather",
        15,
        9,
    )
    assert torch.equal(out, x)

    comm.reduce_scatter(out, x)
    assert (state.last.fn, state.last.count, state.last.op) == (
        b"succlReduceScatter",
        15,
        0,
    )

    y = torch.ones(4)
    comm.broadcast(y, root=0)
    assert (state.last.fn, state.last.root, state.last.send, state.last.recv) == (
        b"succlBroadcast", 0, y.data_ptr(), y.data_ptr(),
    )  # fmt: skip

    comm.send(y, peer=0)
    assert (state.last.fn, state.last.peer, state.last.count, state.last.send) == (
        b"succlSend",
        0,
        4,
        y.data_ptr(),
    )
    comm.recv(y, peer=0)
    assert (state.last.fn, state.last.recv) == (b"succlRecv", y.data_ptr())


def test_stream_handle_is_passed(comm, state):
    class Stream:  # what torch.supa.Stream exposes, by torch.cuda's convention
        supa_stream = 0x1234

    x = torch.ones(3)
    comm.all_reduce(x, x, stream=Stream())
    assert state.last.stream == 0x1234
    assert sccl.stream_handle(None) is None
    assert sccl.stream_handle(object()) is None


def test_non_contiguous_refused_before_the_call(comm, state):
    x = torch.ones(4, 3).t()
    comm.all_reduce(torch.ones(1), torch.ones(1))
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(x, x)
    assert state.last.count == 1  # the library was not called again


def test_library_error_raises(comm, state):
    state.fail_next(5)
    with pytest.raises(
        RuntimeError, match="succlAllReduce failed with code 5: fake error"
    ):
        comm.all_reduce(torch.ones(2), torch.ones(2))


def test_fake_source_declares_what_the_binding_binds():
    # keep the one fake in step with the binding
    for fn in sccl._FUNCTIONS:
        assert fn.name + "(" in SOURCE, fn.name
    assert ctypes.sizeof(sccl.SucclUniqueId) == 128
