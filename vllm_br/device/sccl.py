"""ctypes binding of SCCL (SUCCL, ``libsuccl.so``), Biren's collective library.

Only the ``supa`` backend's communicator uses it; the library is loaded here,
in the device layer, from ``VLLM_SCCL_SO_PATH`` when a communicator is built,
never when this module is imported. A missing or unloadable library stops with
one sentence naming the path and the variable (:class:`SUPAConfigError`).

The C API is NCCL-shaped (names as Biren's own adapters call them):
``succlGetUniqueId``, ``succlCommInitRank(comm*, nranks, id, rank)``,
``succlCommDestroy``, ``succlAllReduce(send, recv, count, dtype, op, comm,
stream)``, ``succlAllGather``, ``succlReduceScatter``, ``succlBroadcast``,
``succlSend``, ``succlRecv``, ``succlGetErrorString``. Not public, so taken
from NCCL, and to be checked against ``succl.h`` on a card: the numeric values
of the dtype and reduce-op enums and the 128-byte unique id.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ReduceOp

from vllm_br import envs
from vllm_br.errors import SUPAConfigError

#: sizeof(succlUniqueId), as NCCL_UNIQUE_ID_BYTES
SCCL_UNIQUE_ID_BYTES = 128

_result_t = ctypes.c_int
_comm_t = ctypes.c_void_p
_stream_t = ctypes.c_void_p
_dtype_t = ctypes.c_int
_op_t = ctypes.c_int


class SucclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * SCCL_UNIQUE_ID_BYTES)]


# succlDataType_t (NCCL numbering). SCCL has no 64-bit integers: callers
# reduce those through torch.distributed instead (see supports()).
_DTYPES: dict[torch.dtype, int] = {
    torch.int8: 0,  # succlInt8
    torch.uint8: 1,  # succlUint8
    torch.int32: 2,  # succlInt32
    torch.float32: 7,  # succlFloat
    torch.bfloat16: 9,  # succlBfloat16
}

# succlRedOp_t (NCCL numbering)
_OPS: dict[Any, int] = {
    ReduceOp.SUM: 0,
    ReduceOp.PRODUCT: 1,
    ReduceOp.MAX: 2,
    ReduceOp.MIN: 3,
}


@dataclass(frozen=True)
class _Fn:
    name: str
    restype: Any
    argtypes: list[Any]


_FUNCTIONS = [
    _Fn("succlGetErrorString", ctypes.c_char_p, [_result_t]),
    _Fn("succlGetUniqueId", _result_t, [ctypes.POINTER(SucclUniqueId)]),
    _Fn(
        "succlCommInitRank",
        _result_t,
        [ctypes.POINTER(_comm_t), ctypes.c_int, SucclUniqueId, ctypes.c_int],
    ),
    _Fn("succlCommDestroy", _result_t, [_comm_t]),
    _Fn(
        "succlAllReduce",
        _result_t,
        [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            _dtype_t,
            _op_t,
            _comm_t,
            _stream_t,
        ],
    ),
    _Fn(
        "succlAllGather",
        _result_t,
        [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            _dtype_t,
            _comm_t,
            _stream_t,
        ],
    ),
    _Fn(
        "succlReduceScatter",
        _result_t,
        [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            _dtype_t,
            _op_t,
            _comm_t,
            _stream_t,
        ],
    ),
    _Fn(
        "succlBroadcast",
        _result_t,
        [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            _dtype_t,
            ctypes.c_int,
            _comm_t,
            _stream_t,
        ],
    ),
    _Fn(
        "succlSend",
        _result_t,
        [ctypes.c_void_p, ctypes.c_size_t, _dtype_t, ctypes.c_int, _comm_t, _stream_t],
    ),
    _Fn(
        "succlRecv",
        _result_t,
        [ctypes.c_void_p, ctypes.c_size_t, _dtype_t, ctypes.c_int, _comm_t, _stream_t],
    ),
]


def supports(dtype: torch.dtype) -> bool:
    """SCCL can reduce/move tensors of ``dtype`` natively."""
    return dtype in _DTYPES


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError(f"SCCL has no data type for {dtype}") from None


def op_code(op: Any) -> int:
    try:
        return _OPS[op]
    except (KeyError, TypeError):
        raise TypeError(f"SCCL has no reduce op for {op}") from None


def stream_handle(stream: Any) -> int | None:
    """The raw stream pointer of a torch.supa.Stream (None: the default
    stream). The attribute name mirrors torch.cuda's ``cuda_stream``."""
    if stream is None:
        return None
    for attr in ("supa_stream", "cuda_stream"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value or None
    return None


class SCCLLibrary:
    """The loaded library with typed entry points."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = _open(path)
        self._fns: dict[str, Any] = {}
        for fn in _FUNCTIONS:
            try:
                f = getattr(lib, fn.name)
            except AttributeError:
                raise SUPAConfigError(
                    f"{path} is not an SCCL library (it has no {fn.name}); set "
                    "VLLM_SCCL_SO_PATH to the path of libsuccl.so."
                ) from None
            f.restype = fn.restype
            f.argtypes = fn.argtypes
            self._fns[fn.name] = f

    def call(self, name: str, *args: Any) -> None:
        """Call ``name``; a non-zero succlResult_t raises RuntimeError."""
        result = self._fns[name](*args)
        if result != 0:
            text = self._fns["succlGetErrorString"](result)
            reason = text.decode(errors="replace") if text else "unknown error"
            raise RuntimeError(f"SCCL {name} failed with code {result}: {reason}")

    def unique_id(self) -> bytes:
        uid = SucclUniqueId()
        self.call("succlGetUniqueId", ctypes.byref(uid))
        return bytes(uid.internal)


def _open(path: str) -> ctypes.CDLL:
    if not os.path.isfile(path):
        raise SUPAConfigError(
            f"The SCCL library {path} does not exist; install SCCL or set "
            "VLLM_SCCL_SO_PATH to the path of libsuccl.so."
        )
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        reason = str(e).rstrip(".") or type(e).__name__
        raise SUPAConfigError(
            f"The SCCL library {path} cannot be loaded ({reason}); set "
            "VLLM_SCCL_SO_PATH to a working libsuccl.so."
        ) from e


_LOADED: dict[str, SCCLLibrary] = {}


def load(path: str | None = None) -> SCCLLibrary:
    """The SCCL library at ``path`` (default ``VLLM_SCCL_SO_PATH``), loaded
    once per process."""
    path = path or envs.VLLM_SCCL_SO_PATH
    if path not in _LOADED:
        _LOADED[path] = SCCLLibrary(path)
    return _LOADED[path]


class SCCLComm:
    """One SCCL communicator (one rank of a group). Tensors must be
    contiguous and on this rank's device; counts are in elements."""

    def __init__(
        self, lib: SCCLLibrary, nranks: int, rank: int, unique_id: bytes
    ) -> None:
        if len(unique_id) != SCCL_UNIQUE_ID_BYTES:
            raise ValueError(
                f"an SCCL unique id has {SCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}"
            )
        self.lib = lib
        self.nranks = nranks
        self.rank = rank
        uid = SucclUniqueId()
        ctypes.memmove(uid.internal, unique_id, SCCL_UNIQUE_ID_BYTES)
        comm = _comm_t()
        lib.call("succlCommInitRank", ctypes.byref(comm), nranks, uid, rank)
        self.handle = comm

    @staticmethod
    def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
        if not t.is_contiguous():
            raise ValueError("SCCL needs contiguous tensors")
        return ctypes.c_void_p(t.data_ptr())

    @staticmethod
    def _stream(stream: Any) -> ctypes.c_void_p:
        return ctypes.c_void_p(stream_handle(stream))

    def all_reduce(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        op: Any = ReduceOp.SUM,
        stream: Any = None,
    ) -> None:
        self.lib.call(
            "succlAllReduce", self._ptr(inp), self._ptr(out), inp.numel(),
            dtype_code(inp.dtype), op_code(op), self.handle, self._stream(stream),
        )  # fmt: skip

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, stream: Any = None
    ) -> None:
        # count: elements each rank sends
        self.lib.call(
            "succlAllGather", self._ptr(inp), self._ptr(out), inp.numel(),
            dtype_code(inp.dtype), self.handle, self._stream(stream),
        )  # fmt: skip

    def reduce_scatter(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        op: Any = ReduceOp.SUM,
        stream: Any = None,
    ) -> None:
        # count: elements each rank receives
        self.lib.call(
            "succlReduceScatter", self._ptr(inp), self._ptr(out), out.numel(),
            dtype_code(inp.dtype), op_code(op), self.handle, self._stream(stream),
        )  # fmt: skip

    def broadcast(self, tensor: torch.Tensor, root: int, stream: Any = None) -> None:
        ptr = self._ptr(tensor)
        self.lib.call(
            "succlBroadcast", ptr, ptr, tensor.numel(), dtype_code(tensor.dtype),
            root, self.handle, self._stream(stream),
        )  # fmt: skip

    def send(self, tensor: torch.Tensor, peer: int, stream: Any = None) -> None:
        self.lib.call(
            "succlSend", self._ptr(tensor), tensor.numel(), dtype_code(tensor.dtype),
            peer, self.handle, self._stream(stream),
        )  # fmt: skip

    def recv(self, tensor: torch.Tensor, peer: int, stream: Any = None) -> None:
        self.lib.call(
            "succlRecv", self._ptr(tensor), tensor.numel(), dtype_code(tensor.dtype),
            peer, self.handle, self._stream(stream),
        )  # fmt: skip

    def destroy(self) -> None:
        if self.handle is not None and self.handle.value is not None:
            self.lib.call("succlCommDestroy", self.handle)
        self.handle = None
