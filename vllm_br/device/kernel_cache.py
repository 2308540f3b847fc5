"""A cache of compiled host libraries that no other user can plant code in.

The cpu backend loads its C++ kernels from ``VLLM_BR_KERNEL_CACHE`` by file
name, so whoever can write a file there could run code inside the server.
Here a library is loaded only when

- the cache folder is this user's and no one else can write it (it is created
  that way; an existing one of ours that is group- or world-writable is made
  private);
- the library is a regular file this user owns that no one else can write;
- its SHA-256 equals the one recorded beside it (``<library>.sha256``, under
  the same rules) when it was built.

Otherwise the caller rebuilds it, after one log line that says why. The file
is loaded through the descriptor it was checked on (``/proc/self/fd``), so a
file swapped in after the check is not the one loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path

from vllm_br.logger import init_logger

logger = init_logger(__name__)

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
# Descriptors of the libraries loaded: dlopen finds an earlier load by its
# name first, so a /proc/self/fd/N name must never be reused for another file.
_held_fds: list[int] = []


class UntrustedLibrary(Exception):
    """A cached library that must not be loaded; the message says why."""


def private_dir(path: Path) -> Path:
    """``path``, created private to this user (0700) if missing. An existing
    folder of another user is refused (OSError naming the setting)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise OSError(
            f"VLLM_BR_KERNEL_CACHE={str(path)!r} belongs to another user; set it "
            "to a folder of yours"
        )
    if st.st_mode & _OTHERS_WRITE:
        logger.info("Made the kernel cache %s private to this user (0700).", path)
        path.chmod(0o700)
    return path


def _sidecar(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(fd: int) -> str:
    h = hashlib.sha256()
    with os.fdopen(os.dup(fd), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_owner_and_mode(fd: int, what: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedLibrary(f"{what} is not a regular file")
    if st.st_uid != os.geteuid():
        raise UntrustedLibrary(f"{what} is owned by uid {st.st_uid}, not this user")
    if st.st_mode & _OTHERS_WRITE:
        raise UntrustedLibrary(f"{what} is writable by other users")


def _open(path: Path, what: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise UntrustedLibrary(f"{what} is missing") from None
    except OSError as e:  # ELOOP: a symbolic link
        raise UntrustedLibrary(f"{what} cannot be opened safely ({e.strerror})") from e


def _recorded_hash(library: Path) -> str:
    fd = _open(_sidecar(library), "its recorded hash")
    try:
        _check_owner_and_mode(fd, "its recorded hash")
        with os.fdopen(os.dup(fd), "r") as f:
            return f.read().strip()
    finally:
        os.close(fd)


def load_trusted(library: Path) -> ctypes.CDLL:
    """``library`` loaded, if it passes every check; else UntrustedLibrary."""
    fd = _open(library, "the library")
    try:
        _check_owner_and_mode(fd, "the library")
        if _sha256(fd) != _recorded_hash(library):
            raise UntrustedLibrary(
                "the library's content differs from the hash recorded when it was built"
            )
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
    except BaseException:
        os.close(fd)
        raise
    _held_fds.append(fd)
    return lib


def install(built: Path, library: Path) -> None:
    """Move a freshly built ``built`` to ``library``, private to this user,
    with its hash recorded beside it. Each lands by rename, so a concurrent
    reader never sees half a file; one that reads between the two renames
    sees a hash that does not match and rebuilds (one warning)."""
    built.chmod(0o700)
    fd = os.open(built, os.O_RDONLY)
    try:
        digest = _sha256(fd)
    finally:
        os.close(fd)
    tmp_hash = built.with_name(built.name + ".sha256")
    tmp_hash.write_text(digest + "\n")
    tmp_hash.chmod(0o600)
    os.replace(tmp_hash, _sidecar(library))
    os.replace(built, library)


def load_or_build(
    library: Path,
    build: Callable[[Path], None],
    declare: Callable[[ctypes.CDLL], None],
) -> ctypes.CDLL:
    """The cached ``library`` if it is trusted and ``declare`` finds every
    kernel in it; otherwise ``build(library)`` (which must :func:`install`)
    and load that. RuntimeError if the fresh build fails the same way."""
    private_dir(library.parent)
    if not os.path.lexists(library):
        build(library)
        logger.info("Built the cpu backend's kernels into %s.", library)
    for attempt in (1, 2):
        try:
            lib = load_trusted(library)
            declare(lib)  # AttributeError: a kernel is missing
            return lib
        except UntrustedLibrary as e:
            reason = str(e)
        except AttributeError as e:
            reason = f"the library lacks a kernel ({e})"
        if attempt == 2:
            raise RuntimeError(f"the freshly built {library} failed: {reason}")
        logger.warning(
            "Rebuilding the cpu backend's kernels in %s: %s.", library, reason
        )
        build(library)
    raise AssertionError("unreachable")
