"""Device layer: the only code that imports torch_br, pybrml or SCCL.

``get_backend()`` returns the backend chosen by ``VLLM_BR_DEVICE``:

- ``supa``: a Biren card through torch_br (``vllm_br.device.supa``)
- ``cpu``: SUPA devices emulated on the host (``vllm_br.device.cpu``)
- ``auto``: ``supa`` when a card is present, else ``cpu``

Choosing a backend imports nothing from the vendor stack where no card is
present. Where a card's device node exists, ``auto`` imports torch_br to
choose ``supa``, and stops with one sentence when that fails: a card
owner's broken torch_br must not silently become the host emulation.
"""

from __future__ import annotations

import functools
import glob
import importlib

from vllm_br import envs
from vllm_br.device.base import DeviceBackend, DeviceProperties, Topology
from vllm_br.errors import SUPAConfigError

__all__ = [
    "DeviceBackend",
    "DeviceProperties",
    "Topology",
    "backend_name",
    "card_nodes",
    "get_backend",
    "supa_present",
]


#: where a Biren card's device nodes appear
CARD_NODES = "/dev/biren/card*"


def card_nodes() -> list[str]:
    return sorted(glob.glob(CARD_NODES))


def supa_present() -> bool:
    """A SUPA card's device node exists here."""
    return bool(card_nodes())


def _require_torch_br(nodes: list[str]) -> None:
    try:
        importlib.import_module("torch_br")
    except Exception as e:  # ImportError, or torch_br failing to load
        reason = str(e).rstrip(".") or type(e).__name__
        raise SUPAConfigError(
            f"VLLM_BR_DEVICE=auto found a SUPA card ({nodes[0]}) but torch_br "
            f"cannot be imported ({reason}); install the Biren torch_br package "
            "built for this torch, or set VLLM_BR_DEVICE=cpu to emulate SUPA on "
            "the host."
        ) from e


def backend_name() -> str:
    """'supa' or 'cpu', resolving 'auto'. Raises SUPAConfigError on a bad
    value, or where a card is present but torch_br cannot be imported."""
    choice = envs.VLLM_BR_DEVICE
    if choice == "auto":
        nodes = card_nodes()
        if not nodes:
            return "cpu"
        _require_torch_br(nodes)
        return "supa"
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
