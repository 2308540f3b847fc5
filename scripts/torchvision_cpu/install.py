"""Make the installed torchvision wheel load beside the CPU torch wheel.

    python scripts/torchvision_cpu/install.py     (scripts/setup.sh runs it)

PyPI's torchvision wheel is a CUDA build whose operator library (``_C.so``)
needs libtorch_cuda.so, so beside torch's CPU wheel ``import torchvision``
fails ("operator torchvision::nms does not exist") and with it every
transformers / vLLM vision-language processor. This builds ``ops.cpp`` (the
operator schemas, nms on CPU) with torch's own extension builder, once per
torch version and source, into ``~/.cache/vllm-br/torchvision``, and puts it
in the installed package as ``_C.so``. The wheel's Python code (transforms,
io) is used as it is. A card's torch_br stack brings its own torchvision and
does not run this.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "ops.cpp"


def _cache_dir() -> Path:
    import torch

    digest = hashlib.sha256(f"{torch.__version__} {sys.version_info[:2]}".encode())
    digest.update(SOURCE.read_bytes())
    return Path.home() / ".cache" / "vllm-br" / "torchvision" / digest.hexdigest()[:16]


def _package_dir() -> Path:
    from importlib.util import find_spec

    spec = find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("torchvision is not installed; scripts/setup.sh installs it")
    return Path(next(iter(spec.submodule_search_locations)))


def build() -> Path:
    """Compile ops.cpp (cached) and return the library's path."""
    from torch.utils import cpp_extension

    out = _cache_dir()
    lib = out / "torchvision_cpu_ops.so"
    if not lib.exists():
        out.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name="torchvision_cpu_ops",
            sources=[str(SOURCE)],
            build_directory=str(out),
            extra_cflags=["-O2"],
            is_python_module=False,
            verbose=False,
        )
    return lib


def main() -> int:
    package = _package_dir()
    lib = build()
    target = package / "_C.so"
    if not target.exists() or target.read_bytes() != lib.read_bytes():
        shutil.copyfile(lib, target)
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
