"""What every check gets (:class:`CheckContext`), the shape of an op check
(:class:`OpCheck`), and the helpers they share: seeded inputs built on the
host and moved to the device, the float64 host copy a reference reads, and
which implementation of an op the registry runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_br.check.measure import Measure
from vllm_br.check.result import Outcome
from vllm_br.device.base import DeviceBackend
from vllm_br.ops.registry import get_op

FLOAT32, BFLOAT16 = torch.float32, torch.bfloat16
DTYPES = (FLOAT32, BFLOAT16)


@dataclass
class CheckContext:
    backend: DeviceBackend
    #: the device single-device checks run on
    device: torch.device
    #: processes (one per device) of the collectives group
    devices: int
    dtypes: tuple[torch.dtype, ...] = DTYPES


@dataclass(frozen=True)
class OpCheck:
    """A check of one or more registered ops, run once per dtype.

    ``fn(ctx, dtype, tolerance)`` returns the outcome; ``tolerance`` is
    ``tolerances[dtype]`` (the bound on :func:`vllm_br.check.measure.
    max_error` against the float64 reference; exact comparisons ignore it).
    """

    name: str
    ops: tuple[str, ...]
    fn: Callable[[CheckContext, torch.dtype, float], Outcome]
    tolerances: dict[torch.dtype, float]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def generator(seed: int) -> torch.Generator:
    """A host generator: the same inputs on every device."""
    return torch.Generator().manual_seed(seed)


def randn(
    ctx: CheckContext,
    g: torch.Generator,
    *shape: int,
    dtype: torch.dtype,
    scale: float = 1.0,
    offset: float = 0.0,
) -> torch.Tensor:
    """Seeded normal values, rounded to ``dtype`` on the host, on the device."""
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset
    return x.to(dtype).to(ctx.device)


def d64(t: torch.Tensor) -> torch.Tensor:
    """The exact float64 host copy of a device tensor (references read it)."""
    return t.detach().to("cpu", torch.float64)


def implementation(name: str) -> str:
    """Which implementation the registry runs for op ``name``."""
    op = get_op(name)
    if getattr(op, "kernel", None) is not None:
        return "backend kernel (reference where it declines)"
    return "reference"


def op_measure(tolerance: float, *names: str) -> Measure:
    """A :class:`Measure` noting which implementation each op runs."""
    m = Measure(tolerance)
    m.note("runs: " + ", ".join(f"{n} {implementation(n)}" for n in names))
    return m
