"""The cpu backend's kernel cache (vllm_br.device.kernel_cache): a library is
loaded only when this user owns it, no one else can write it and its hash is
the one recorded at build; anything else planted in the cache is rebuilt with
one log line, and a library without an expected kernel is rebuilt instead of
stopping start-up.

The compiler is replaced by a copy of the library the suite already built
(the checks are the point, not g++); planted libraries are copies of it too,
so without the checks they would load and nothing would be rebuilt."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from vllm_br.device import cpu_kernels, kernel_cache


@pytest.fixture(scope="module")
def built_library() -> Path:
    assert cpu_kernels.load_library() is not None, "the C++ kernels must build"
    return cpu_kernels._library_path(cpu_kernels._compiler())


@pytest.fixture
def cache(tmp_path, monkeypatch, built_library):
    """A fresh cache folder; ``cache.compiles`` counts the builds."""
    folder = tmp_path / "kernels"
    monkeypatch.setenv("VLLM_BR_KERNEL_CACHE", str(folder))
    compiles = []

    def fake_compile(compiler, output):
        compiles.append(output)
        shutil.copyfile(built_library, output)

    monkeypatch.setattr(cpu_kernels, "_compile", fake_compile)

    class Cache:
        path = folder
        library = cpu_kernels._library_path(cpu_kernels._compiler())

        @staticmethod
        def load():
            return cpu_kernels.load_library.__wrapped__()

    Cache.compiles = compiles
    return Cache


def _rebuild_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "Rebuilding" in r.getMessage()]


def _assert_trusted(library: Path) -> None:
    st = library.stat()
    assert st.st_uid == os.geteuid()
    assert not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    recorded = library.with_name(library.name + ".sha256").read_text().strip()
    assert hashlib.sha256(library.read_bytes()).hexdigest() == recorded


def _plant(cache) -> Path:
    """A copy of a good library with a correct recorded hash: what a first
    build leaves."""
    assert cache.load() is not None
    assert len(cache.compiles) == 1
    cache.compiles.clear()
    return cache.library


def test_first_build_is_private_and_recorded_then_reused(cache, caplog):
    assert cache.load() is not None
    assert stat.S_IMODE(cache.path.stat().st_mode) == 0o700
    _assert_trusted(cache.library)
    assert len(cache.compiles) == 1
    # A trusted entry is loaded as it is.
    with caplog.at_level(logging.INFO, logger="vllm"):
        assert cache.load().vllm_br_paged_attention is not None
    assert len(cache.compiles) == 1
    assert _rebuild_lines(caplog) == []


def test_existing_group_writable_folder_of_ours_is_made_private(cache):
    cache.path.mkdir(mode=0o777)
    cache.path.chmod(0o777)
    assert cache.load() is not None
    assert stat.S_IMODE(cache.path.stat().st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root")
def test_foreign_library_is_rebuilt(cache, caplog):
    library = _plant(cache)
    os.chown(library, 65534, 65534)  # nobody
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert cache.load() is not None
    assert len(cache.compiles) == 1
    assert len(_rebuild_lines(caplog)) == 1
    assert "owned by uid 65534" in _rebuild_lines(caplog)[0]
    _assert_trusted(library)


def test_world_writable_library_is_rebuilt(cache, caplog):
    library = _plant(cache)
    library.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert cache.load() is not None
    assert len(cache.compiles) == 1
    assert ["writable by other users" in m for m in _rebuild_lines(caplog)] == [True]
    _assert_trusted(library)


def test_library_whose_content_changed_is_rebuilt(cache, caplog):
    library = _plant(cache)
    with open(library, "ab") as f:
        f.write(b"\0planted")
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert cache.load() is not None
    assert len(cache.compiles) == 1
    assert ["differs from the hash" in m for m in _rebuild_lines(caplog)] == [True]
    _assert_trusted(library)


def test_library_without_recorded_hash_is_rebuilt(cache, caplog):
    library = _plant(cache)
    library.with_name(library.name + ".sha256").unlink()
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert cache.load() is not None
    assert len(cache.compiles) == 1
    assert ["recorded hash is missing" in m for m in _rebuild_lines(caplog)] == [True]
    _assert_trusted(library)


def test_symbolic_link_is_rebuilt(cache, caplog):
    library = _plant(cache)
    elsewhere = cache.path.parent / "elsewhere.so"
    shutil.copyfile(library, elsewhere)
    library.unlink()
    library.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert cache.load() is not None
    assert len(cache.compiles) == 1
    assert not library.is_symlink()
    _assert_trusted(library)


def test_library_missing_a_kernel_is_rebuilt_not_fatal(cache, tmp_path, caplog):
    """A trusted library (ours, private, hash recorded) that lacks a kernel,
    as an older build would: rebuilt, and the start-up goes on."""
    source = tmp_path / "partial.cpp"
    source.write_text('extern "C" int vllm_br_argmax_f32() { return 0; }\n')
    partial = tmp_path / "partial.so"
    compiler = cpu_kernels._compiler()
    subprocess.run([compiler, "-shared", "-fPIC", "-o", partial, source], check=True)
    kernel_cache.private_dir(cache.path)
    kernel_cache.install(partial, cache.library)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        lib = cache.load()
    assert lib is not None and lib.vllm_br_paged_attention is not None
    assert len(cache.compiles) == 1
    lines = _rebuild_lines(caplog)
    assert len(lines) == 1 and "lacks a kernel" in lines[0], lines
    assert "vllm_br_paged_attention" in lines[0] or "undefined symbol" in lines[0]


def test_rebuild_that_stays_untrusted_falls_back_to_the_references(
    cache, monkeypatch, caplog
):
    """If even a fresh build cannot be trusted, the references run and a
    warning says why; start-up goes on."""
    real_install = kernel_cache.install

    def install_world_writable(built, library):
        real_install(built, library)
        library.chmod(0o777)

    monkeypatch.setattr(kernel_cache, "install", install_world_writable)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert cache.load() is None
    assert len(cache.compiles) == 2
    assert any("reference kernels" in r.getMessage() for r in caplog.records)


def test_folder_of_another_user_is_refused(cache, caplog):
    if os.geteuid() != 0:
        pytest.skip("planting another user's folder needs root")
    cache.path.mkdir(mode=0o700)
    os.chown(cache.path, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert cache.load() is None
    assert cache.compiles == []
    assert any("VLLM_BR_KERNEL_CACHE=" in r.getMessage() for r in caplog.records)
