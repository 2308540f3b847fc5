"""The one fake of SCCL (libsuccl.so) the unit tests use: a tiny C library
built with gcc into a test's tmpdir.

It implements the entry points ``vllm_br.device.sccl`` binds, for a
communicator of one rank (a collective copies send to receive, as a real one
would with one rank), and records the arguments of the last call in the
exported ``fake_last`` struct so a test can check the ctypes marshalling.
Setting ``fake_fail_next`` makes the next call return that error code.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

SOURCE = r"""
#include <stddef.h>
#include <string.h>

typedef struct { char internal[128]; } succlUniqueId;

typedef struct {
    char fn[32];
    const void* send; void* recv; size_t count;
    int dtype; int op; int root; int peer; int nranks; int rank;
    void* comm; void* stream;
} fake_call_t;

fake_call_t fake_last;
int fake_fail_next = 0;
static int fake_comm_storage;

static size_t elem(int dt) {
    switch (dt) { case 0: case 1: return 1; case 2: case 3: case 7: return 4;
                  case 4: case 5: case 8: return 8; case 6: case 9: return 2; }
    return 0;
}
static int begin(const char* fn) {
    memset(&fake_last, 0, sizeof fake_last);
    strncpy(fake_last.fn, fn, sizeof fake_last.fn - 1);
    int r = fake_fail_next; fake_fail_next = 0; return r;
}
static int copy(const void* s, void* r, size_t count, int dt) {
    if (!elem(dt)) return 4;
    if (s != r) memmove(r, s, count * elem(dt));
    return 0;
}

const char* succlGetErrorString(int r) { return r == 4 ? "invalid argument (fake)" : "fake error"; }

int succlGetUniqueId(succlUniqueId* id) {
    int f = begin("succlGetUniqueId"); if (f) return f;
    memset(id, 0, sizeof *id); memcpy(id->internal, "fake-succl", 10); return 0;
}
int succlCommInitRank(void** comm, int nranks, succlUniqueId id, int rank) {
    int f = begin("succlCommInitRank"); if (f) return f;
    fake_last.nranks = nranks; fake_last.rank = rank;
    if (nranks != 1 || rank != 0 || memcmp(id.internal, "fake-succl", 10)) return 4;
    *comm = &fake_comm_storage; return 0;
}
int succlCommDestroy(void* comm) {
    int f = begin("succlCommDestroy"); fake_last.comm = comm; return f;
}
int succlAllReduce(const void* s, void* r, size_t n, int dt, int op, void* comm, void* st) {
    int f = begin("succlAllReduce"); if (f) return f;
    fake_last.send = s; fake_last.recv = r; fake_last.count = n; fake_last.dtype = dt;
    fake_last.op = op; fake_last.comm = comm; fake_last.stream = st;
    return copy(s, r, n, dt);
}
int succlAllGather(const void* s, void* r, size_t n, int dt, void* comm, void* st) {
    int f = begin("succlAllGather"); if (f) return f;
    fake_last.send = s; fake_last.recv = r; fake_last.count = n; fake_last.dtype = dt;
    fake_last.comm = comm; fake_last.stream = st;
    return copy(s, r, n, dt);
}
int succlReduceScatter(const void* s, void* r, size_t n, int dt, int op, void* comm, void* st) {
    int f = begin("succlReduceScatter"); if (f) return f;
    fake_last.send = s; fake_last.recv = r; fake_last.count = n; fake_last.dtype = dt;
    fake_last.op = op; fake_last.comm = comm; fake_last.stream = st;
    return copy(s, r, n, dt);
}
int succlBroadcast(const void* s, void* r, size_t n, int dt, int root, void* comm, void* st) {
    int f = begin("succlBroadcast"); if (f) return f;
    fake_last.send = s; fake_last.recv = r; fake_last.count = n; fake_last.dtype = dt;
    fake_last.root = root; fake_last.comm = comm; fake_last.stream = st;
    return copy(s, r, n, dt);
}
int succlSend(const void* s, size_t n, int dt, int peer, void* comm, void* st) {
    int f = begin("succlSend"); if (f) return f;
    fake_last.send = s; fake_last.count = n; fake_last.dtype = dt; fake_last.peer = peer;
    fake_last.comm = comm; fake_last.stream = st; return 0;
}
int succlRecv(void* r, size_t n, int dt, int peer, void* comm, void* st) {
    int f = begin("succlRecv"); if (f) return f;
    fake_last.recv = r; fake_last.count = n; fake_last.dtype = dt; fake_last.peer = peer;
    fake_last.comm = comm; fake_last.stream = st; return 0;
}
"""


class FakeCall(ctypes.Structure):
    _fields_ = [
        ("fn", ctypes.c_char * 32),
        ("send", ctypes.c_void_p),
        ("recv", ctypes.c_void_p),
        ("count", ctypes.c_size_t),
        ("dtype", ctypes.c_int),
        ("op", ctypes.c_int),
        ("root", ctypes.c_int),
        ("peer", ctypes.c_int),
        ("nranks", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("comm", ctypes.c_void_p),
        ("stream", ctypes.c_void_p),
    ]


def gcc_available() -> bool:
    return shutil.which("gcc") is not None


def build_fake_sccl(
    folder: Path, source: str = SOURCE, name: str = "libsuccl.so"
) -> Path:
    """Compile ``source`` into ``folder/name`` and return its path."""
    src = folder / (name + ".c")
    src.write_text(source)
    out = folder / name
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-o", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    return out


class FakeSCCLState:
    """The fake library's recorded state, read through its exported symbols
    (the same process-wide handle ``ctypes.CDLL`` returns for the path)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self.last = FakeCall.in_dll(lib, "fake_last")
        self._fail = ctypes.c_int.in_dll(lib, "fake_fail_next")

    def fail_next(self, code: int) -> None:
        self._fail.value = code
