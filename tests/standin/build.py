"""Build the stand-in SUPA stack once and say how to put it in place.

    python tests/standin/build.py          build (cached), print the build dir
    python tests/standin/build.py --env    print `export` lines that put the
                                           stand-in in place (scripts use it)

The build goes to ``$VLLM_BR_STANDIN_CACHE`` (default
``~/.cache/vllm-br/standin``) under a key made of the torch version, the
Python version and the sources, so a new torch or a changed source rebuilds
and an unchanged one is reused. scripts/setup.sh runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON_DIR = HERE / "python"
CPP_SOURCE = HERE / "csrc" / "supa_standin.cpp"
SUCCL_SOURCE_DIR = HERE / "succl"
EXTENSION = "_C.so"
DEFAULT_TOPOLOGY = '{"cards": 2, "dies_per_card": 2, "p2p": true, "memory_gib": 2}'


def _sources() -> list[Path]:
    return [CPP_SOURCE, *sorted(SUCCL_SOURCE_DIR.glob("*.c"))]


def build_dir() -> Path:
    import torch

    digest = hashlib.sha256()
    digest.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    for src in _sources():
        digest.update(src.read_bytes())
    root = os.environ.get("VLLM_BR_STANDIN_CACHE") or str(
        Path.home() / ".cache" / "vllm-br" / "standin"
    )
    return Path(root) / f"torch-{torch.__version__}-{digest.hexdigest()[:12]}"


def _compile_extension(out: Path) -> None:
    import torch
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libdir = cpp_extension.library_paths()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [
        os.environ.get("CXX", "g++"),
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-DTORCH_EXTENSION_NAME=_C",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *[f"-I{p}" for p in includes],
        str(CPP_SOURCE),
        "-o",
        str(out),
        f"-L{libdir}",
        f"-Wl,-rpath,{libdir}",
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
        "-l:libgomp.so.1",
    ]
    subprocess.run(cmd, check=True)


def build() -> Path:
    """Build what is missing; return the build directory."""
    target = build_dir()
    target.mkdir(parents=True, exist_ok=True)
    ext = target / EXTENSION
    if not ext.exists():
        fd, tmp = tempfile.mkstemp(dir=target, suffix=".so")
        os.close(fd)
        try:
            _compile_extension(Path(tmp))
            os.replace(tmp, ext)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    if SUCCL_SOURCE_DIR.is_dir():
        _load_succl_builder().build(target)
    return target


def _load_succl_builder():
    # By path: tests/ is not a package, so `import tests.standin` is not safe.
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "succl_standin_build", SUCCL_SOURCE_DIR / "__init__.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env(build: Path) -> dict[str, str]:
    """The variables that put the stand-in in place of torch_br, pybrml and
    libsuccl.so, and select the supa backend."""
    path = os.environ.get("PYTHONPATH", "")
    values = {
        "PYTHONPATH": f"{PYTHON_DIR}{os.pathsep}{path}" if path else str(PYTHON_DIR),
        "SUPA_STANDIN_BUILD_DIR": str(build),
        "VLLM_BR_DEVICE": "supa",
        # Two two-die cards with P2P: tensor parallelism and the NUMA weight
        # layout both have something to do (the stand-in alone defaults to
        # eight one-die cards).
        "SUPA_STANDIN_TOPOLOGY": os.environ.get(
            "SUPA_STANDIN_TOPOLOGY", DEFAULT_TOPOLOGY
        ),
    }
    succl_lib = build / "libsuccl.so"
    if succl_lib.exists():
        values["VLLM_SCCL_SO_PATH"] = str(succl_lib)
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", action="store_true", help="print export lines")
    args = parser.parse_args(argv)
    target = build()
    if args.env:
        for key, value in env(target).items():
            print(f"export {key}={shlex.quote(value)}")
    else:
        print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
