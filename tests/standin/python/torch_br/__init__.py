"""Stand-in for Biren's torch_br (test-only; see tests/standin/README.md).

``import torch_br`` here does what the real package does: it registers the
PrivateUse1 device as ``supa`` (kernels, allocator, guard and hooks come from
the C++ extension built by tests/standin/build.py) and exposes
``torch.supa``. The device count, memory and SPCs follow the topology the
pybrml stand-in reads from ``SUPA_STANDIN_TOPOLOGY``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from pathlib import Path

import torch

__version__ = "0.0.0+standin"


def _load_extension():
    build = os.environ.get("SUPA_STANDIN_BUILD_DIR")
    if not build:
        raise ImportError(
            "the torch_br stand-in is not built here: run "
            "`python tests/standin/build.py` and use its --env output"
        )
    path = Path(build) / "_C.so"
    if not path.exists():
        raise ImportError(f"{path} is missing: run `python tests/standin/build.py`")
    loader = importlib.machinery.ExtensionFileLoader("torch_br._C", str(path))
    spec = importlib.util.spec_from_loader("torch_br._C", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_C = _load_extension()

if torch._C._get_privateuse1_backend_name() != "supa":
    torch.utils.rename_privateuse1_backend("supa")

from torch_br import supa as _supa  # noqa: E402  (needs _C loaded)

_supa._configure()
if not hasattr(torch, "supa"):
    torch._register_device_module("supa", _supa)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
