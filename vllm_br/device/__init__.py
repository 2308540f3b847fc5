"""Device layer: the only code that imports torch_br, pybrml or SCCL.

``get_backend()`` returns the backend chosen by ``VLLM_BR_DEVICE``:

- ``supa``: a Biren card through torch_br (``vllm_br.device.supa``)
- ``cpu``: SUPA devices emulated on the host (``vllm_br.device.cpu``)
- ``auto``: ``supa`` when a card is present, else ``cpu``

Choosing a backend imports nothing from the vendor stack: ``supa_present()``
only looks for the torch_br package and the device nodes.
"""

from __future__ import annotations

import functools
import glob
import importlib.util

from vllm_br import envs
from vllm_br.device.base import DeviceBackend, DeviceProperties, Topology

__all__ = [
    "DeviceBackend",
    "DeviceProperties",
    "Topology",
    "backend_name",
    "get_backend",
    "supa_present",
]


def supa_present() -> bool:
    """A SUPA card is usable here: torch_br is installed and a device node exists."""
    if importlib.util.find_spec("torch_br") is None:
        return False
    return bool(glob.glob("/dev/biren/card*"))


def backend_name() -> str:
    """'supa' or 'cpu', resolving 'auto'. Raises SUPAConfigError on a bad value."""
    choice = envs.VLLM_BR_DEVICE
    if choice == "auto":
        return "supa" if supa_present() else "cpu"
    return choice


@functools.cache
def _make_backend(name: str) -> DeviceBackend:
    if name == "supa":
        from vllm_br.device.supa import SupaBackend

        return SupaBackend()
    from vllm_br.device.cpu import CpuBackend

    return CpuBackend()


def get_backend() -> DeviceBackend:
    return _make_backend(backend_name())
