"""A multi-rank stand-in of SCCL (``libsuccl.so``) for tests on the host.

``build(out_dir)`` compiles ``succl_standin.c`` (next to this file) with the
system C compiler into ``out_dir/libsuccl.so``; point ``VLLM_SCCL_SO_PATH`` at
it. Ranks are processes of one host that meet in POSIX shared memory named
after the unique id; the source's header comment describes the transport, the
timeout (``SUCCL_STANDIN_TIMEOUT_S``, default 300 s) and the error messages.
``call_count(lib, name)`` reads the library's per-process call counter, so a
test can tell that SCCL (not gloo) carried a collective.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("succl_standin.c")
LIB_NAME = "libsuccl.so"
#: prefix of every shared-memory segment the library creates (in /dev/shm)
SEGMENT_PREFIX = "succl-standin-"


def build(out_dir: Path) -> Path:
    """Compile the stand-in into ``out_dir/libsuccl.so`` (kept when it is
    newer than the source) and return its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / LIB_NAME
    if out.exists() and out.stat().st_mtime >= SOURCE.stat().st_mtime:
        return out
    cc = os.environ.get("CC", "cc")
    fd, tmp = tempfile.mkstemp(prefix=".libsuccl-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        cmd = [cc, "-O2", "-shared", "-fPIC", "-std=gnu11", "-Wall", "-o", tmp]
        proc = subprocess.run(
            [*cmd, str(SOURCE), "-lpthread", "-lrt"], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"building the SCCL stand-in failed ({' '.join(cmd)}):\n{proc.stderr}"
            )
        os.replace(tmp, out)  # atomic: a concurrent loader sees old or new
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def call_count(lib_path: str | os.PathLike, name: str) -> int:
    """How often this process called the entry point ``name`` of the library
    at ``lib_path`` (-1: not an entry point). ``ctypes.CDLL`` of a loaded
    path returns the same library, so these are the binding's calls."""
    fn = ctypes.CDLL(str(lib_path)).succlStandinCallCount
    fn.argtypes = [ctypes.c_char_p]
    fn.restype = ctypes.c_int
    return int(fn(name.encode()))


def segment_prefix(unique_id: bytes) -> str:
    """Name prefix (in /dev/shm) of the segments of the communicator made
    from ``unique_id``."""
    return SEGMENT_PREFIX + unique_id[16:32].hex()
